"""Streaming loader: split over (rank, worker), equal batch counts, reshuffling, exact resume,
evaluation stream, targets. Shards whose label is the sample id let targets show what was read."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

from data_pipeline.errors import DataError
from data_pipeline.loading.loader import build_loader
from data_pipeline.loading.loader_state import LoaderState
from pretrain.config import AugmentConfig, DataConfig


def _cfg(shards, **kw) -> DataConfig:
    aug = kw.pop("augment", AugmentConfig())
    return DataConfig(train_shards=str(shards), val_shards=str(shards), workers=kw.pop("workers", 2),
                      shuffle_buffer=kw.pop("shuffle_buffer", 20), augment=aug, **kw)


def _epoch_ids(cfg, world_size, batch_size, epoch=0):
    """Sample ids each rank yields in one epoch (labels are ids), and the loaders."""
    per_rank, loaders = [], []
    for rank in range(world_size):
        loader = build_loader(cfg, rank=rank, world_size=world_size, batch_size=batch_size, seed=3,
                              img_size=16, epoch=epoch)
        it = iter(loader)
        ids = [int(t) for _ in range(loader.batches_per_epoch) for t in next(it)[1]]
        assert loader.epoch == epoch + 1 and loader.state().batch == 0
        per_rank.append(ids)
        loaders.append(loader)
    return per_rank, loaders


def test_two_ranks_two_workers_read_every_sample_once(balanced_ids):
    per_rank, loaders = _epoch_ids(_cfg(balanced_ids), world_size=2, batch_size=6)
    assert [ld.batches_per_epoch for ld in loaders] == [16, 16]  # 4 slots x 48 samples / 6
    everything = per_rank[0] + per_rank[1]
    assert sorted(everything) == list(range(192))  # every shard read, none twice, nothing dropped
    assert all(ld.counters == {"samples": 96} for ld in loaders)


def test_unbalanced_shards_equal_batches_and_drops_are_counted(tmp_path, shard_kit):
    counts = [12, 12, 12, 12, 12, 7, 30]  # 7 shards over 2 ranks x 2 workers
    root = shard_kit.id_shards(tmp_path / "s", counts)
    per_rank, loaders = _epoch_ids(_cfg(root), world_size=2, batch_size=5)
    # 97 samples // (2 ranks x 5) = 9 batches per rank (workers yield 5 and 4); 7 < 2 x 5 dropped.
    assert [ld.batches_per_epoch for ld in loaders] == [9, 9] and [len(x) for x in per_rank] == [45, 45]
    seen = per_rank[0] + per_rank[1]
    assert len(seen) == len(set(seen))
    assert loaders[0].counters["dropped_for_balance"] == 7 and "dropped_for_balance" not in loaders[1].counters
    assert 7 + len(seen) == sum(counts)


def test_epochs_reshuffle_and_seed_changes_order(balanced_ids):
    cfg = _cfg(balanced_ids, workers=0)
    loader = build_loader(cfg, batch_size=8, seed=0, img_size=16)
    it = iter(loader)
    e0 = [int(t) for _ in range(24) for t in next(it)[1]]
    e1 = [int(t) for _ in range(24) for t in next(it)[1]]
    assert sorted(e0) == sorted(e1) == list(range(192)) and e0 != e1
    other = build_loader(cfg, batch_size=8, seed=1, img_size=16)
    assert [int(t) for t in next(iter(other))[1]] != e0[:8]


def test_each_epoch_seeds_the_shuffle_buffer_afresh(tmp_path, shard_kit):
    """One shard, one slot: the epoch's shard permutation changes nothing, so only the shuffle
    buffer's seed (seed, epoch, slot) can reorder the second epoch; a resume inside it on the same
    layout reads that order again."""
    cfg = _cfg(shard_kit.id_shards(tmp_path / "s", [24]), workers=0, shuffle_buffer=20)
    loader = build_loader(cfg, batch_size=8, seed=0, img_size=16)
    it = iter(loader)
    e0 = [int(t) for _ in range(3) for t in next(it)[1]]
    e1 = [int(t) for t in next(it)[1]]
    state = loader.state()
    e1 += [int(t) for _ in range(2) for t in next(it)[1]]
    assert sorted(e0) == sorted(e1) == list(range(24)) and e0 != e1, (e0, e1)
    again = build_loader(cfg, batch_size=8, seed=0, img_size=16)
    again.resume([state])
    it = iter(again)
    assert [int(t) for _ in range(2) for t in next(it)[1]] == e1[8:]


@pytest.mark.parametrize("workers, cuts, deit", [(2, [1, 5, 8, 11], False), (0, [3, 8], False), (2, [3, 8], True)],
                         ids=["workers", "in-process", "repeats-3augment"])
def test_exact_resume_bit_identical(demo_train, workers, cuts, deit):
    """Cut anywhere, the next batches are those of the uninterrupted run; ``deit``: with DeiT's data
    pieces (data.repeat_augment 3, 3-Augment), whose copies and ops replay from the same state."""
    aug = AugmentConfig(randaugment_ops=0 if deit else 2, three_augment=deit, mixup_alpha=0.8, cutmix_alpha=1.0)
    cfg = _cfg(demo_train, workers=workers, augment=aug, repeat_augment=3 if deit else 1)

    def make():
        return build_loader(cfg, rank=1, world_size=2, batch_size=24, seed=5, img_size=32)

    ref_loader = make()
    assert ref_loader.batches_per_epoch == 8  # 192 samples per rank / 24
    total = max(cuts) + 4  # runs into the second epoch; cut 8 is the epoch boundary
    ref, states = [], []
    it = iter(ref_loader)
    for _ in range(total):
        ref.append(next(it))
        states.append(json.dumps(ref_loader.state().to_dict()))  # as a checkpoint stores it
    assert json.loads(states[-1])["epoch"] == 1
    assert ref[0][1].dtype == torch.float32 and ref[0][1].shape == (24, 10)  # mixup/cutmix: soft targets
    for cut in cuts:
        loader = make()
        loader.resume([LoaderState.from_dict(json.loads(states[cut - 1]))])  # this rank's alone
        it = iter(loader)
        for k in range(cut, min(cut + 4, total)):
            x, y = next(it)
            assert torch.equal(x, ref[k][0]) and torch.equal(y, ref[k][1]), f"cut {cut}, batch {k}"
        assert loader.counters["samples"] == min(cut + 4, total) * 24


def test_workers0_leaves_global_rng_alone(demo_train):
    loader = build_loader(_cfg(demo_train, workers=0), batch_size=4, img_size=16)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    next(iter(loader))
    assert torch.equal(torch.rand(3), expected)


STORED_KEYS = ["version", "epoch", "batch", "emitted", "rank", "world_size", "workers", "batch_size", "seed",
               "shuffle_buffer", "data", "rest", "counters", "epoch_bad_by_shard", "repeats"]  # a checkpoint's "loader"


def test_state_keeps_the_checkpoint_layout_and_refuses_version_1(balanced_ids):
    """A state stored as a checkpoint's JSON keeps version 2's layout (checkpoints written earlier
    load) and reads back as the same state; a version-1 state (the shard-level plan) or one missing a
    field is refused in one line."""
    loader = build_loader(_cfg(balanced_ids, workers=0), rank=1, world_size=2, batch_size=6, seed=3, img_size=16)
    it = iter(loader)
    next(it), next(it)
    stored = json.loads(json.dumps(loader.state().to_dict()))
    assert list(stored) == STORED_KEYS and stored["version"] == 2 and stored["batch"] == 2
    assert LoaderState.from_dict(stored) == loader.state()
    assert LoaderState.from_dict({k: v for k, v in stored.items() if k != "repeats"}) == loader.state()  # earlier
    with pytest.raises(DataError, match=r"^data loader state version 1 .*: start a new run") as e:
        LoaderState.from_dict({**stored, "version": 1})
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="lacks 'emitted'"):
        LoaderState.from_dict({k: v for k, v in stored.items() if k != "emitted"})


@pytest.mark.parametrize("world_size", [1, 3])
def test_eval_stream_every_sample_once_deterministic(balanced_ids, world_size):
    """Every sample once over the ranks, each rank a manifest-order run, and each sample's position
    in manifest order (here its label) carried beside it through the workers' interleaving."""
    cfg = _cfg(balanced_ids)
    seen = []
    for rank in range(world_size):
        loader = build_loader(cfg, rank=rank, world_size=world_size, batch_size=7, img_size=16, train=False)
        batches, positions = [], []
        for x, y in loader:
            batches.append((x, y))
            positions += loader.last_positions
        assert len(batches) <= loader.batches_per_epoch and len(batches) >= loader.batches_per_epoch - 2
        again = list(loader)  # one pass per iteration, same content
        assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again)) and len(again) == len(batches)
        ids = [int(t) for _, y in batches for t in y]
        assert positions == ids
        assert sorted(ids) == list(range(rank * 192 // world_size, (rank + 1) * 192 // world_size))
        seen += ids
    assert sorted(seen) == list(range(192))


def test_eval_transform_is_center_crop(tmp_path, shard_kit):
    import io

    import numpy as np
    from PIL import Image

    img = np.zeros((40, 80, 3), np.uint8)
    img[:, 20:60] = 255  # white centre square, black sides
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "PNG")
    root = shard_kit.make_shards(tmp_path / "s", [[("a", {"png": buf.getvalue(), "cls": b"0"})]], ["x"])
    aug = AugmentConfig(eval_crop_pct=1.0, mean=[0, 0, 0], std=[1, 1, 1])
    x, y = next(iter(build_loader(_cfg(root, augment=aug, workers=0), batch_size=1, img_size=20, train=False)))
    assert x.shape == (1, 3, 20, 20) and y.tolist() == [0]
    assert x.mean() > 0.95 and x[..., 2:-2].min() > 0.99  # a left or right crop would be half black


def test_multilabel_targets(tmp_path, shard_kit):
    samples = []
    for i in range(24):
        labels = [i % 5, (i + 2) % 5] if i % 3 else []
        samples.append((f"{i:04d}", {"jpg": shard_kit.image_bytes(16, 16, seed=i), "cls": str(i % 5).encode(),
                                     "json": ('{"labels": %s}' % labels).encode()}))
    root = shard_kit.make_shards(tmp_path / "s", [samples[:12], samples[12:]], list("abcde"), multi_label=True)
    loader = build_loader(_cfg(root, multi_label=True, workers=0), batch_size=6, img_size=16)
    assert loader.num_classes == 5
    seen = 0
    for _, (x, y) in zip(range(4), loader):
        assert y.dtype == torch.float32 and y.shape == (6, 5)
        assert set(y.unique().tolist()) <= {0.0, 1.0}
        seen += int((y.sum(1) == 2).sum())
    assert 0 < seen < 24  # a mix of two-label and empty label sets
    mixed = build_loader(_cfg(root, multi_label=True, workers=0, augment=AugmentConfig(mixup_alpha=0.4)),
                         batch_size=6, img_size=16)
    _, y = next(iter(mixed))
    assert y.min() >= 0 and y.max() <= 1 and not set(y.unique().tolist()) <= {0.0, 1.0}


def test_single_label_mixup_targets_sum_to_one(demo_train):
    cfg = _cfg(demo_train, workers=0, augment=AugmentConfig(cutmix_alpha=1.0))
    x, y = next(iter(build_loader(cfg, batch_size=8, img_size=32)))
    assert y.shape == (8, 10) and torch.allclose(y.sum(1), torch.ones(8))
    plain = build_loader(dataclasses.replace(cfg, augment=AugmentConfig()), batch_size=8, img_size=32)
    x, y = next(iter(plain))
    assert y.dtype == torch.int64 and x.dtype == torch.float32 and x.shape == (8, 3, 32, 32)
    assert -1.0 <= x.min() < -0.5 and 0.5 < x.max() <= 1.0  # mean/std 0.5 map pixels to [-1, 1]
    assert Counter(y.tolist()).most_common(1)[0][1] < 8


def test_layout_that_cannot_feed_every_slot_is_a_data_error(balanced_ids):
    # 192 samples: 8 ranks x 4 workers x 6 fits although the 32 slots outnumber the 16 shards
    assert build_loader(_cfg(balanced_ids, workers=4), rank=0, world_size=8, batch_size=6).batches_per_epoch == 4
    with pytest.raises(DataError, match=r"32 reader slots \(8 rank.* x 4 worker.*fewer than batch_size=7.*224 needed"):
        build_loader(_cfg(balanced_ids, workers=4), rank=0, world_size=8, batch_size=7)
    with pytest.raises(DataError, match="fewer than batch_size=100"):
        build_loader(_cfg(balanced_ids), rank=0, world_size=2, batch_size=100)


# ------------------------------------------------------------- keys, full epochs, elastic resume
def _ids_and_states(cfg, world, batch, n, states=None, seed=3):
    """Each rank of a ``world``-rank layout (after ``resume(states)`` when given) yields
    ``n`` batches (None: the rest of the current epoch); returns (ids per rank, new states, loaders)."""
    ids, out, loaders = [], [], []
    for rank in range(world):
        loader = build_loader(cfg, rank=rank, world_size=world, batch_size=batch, seed=seed, img_size=16)
        if states is not None:
            loader.resume(states)
        count = loader.batches_this_epoch - loader.state().batch if n is None else n
        mine, it = [], iter(loader)
        for _ in range(count):
            epoch = loader.epoch
            _, y = next(it)
            assert [int(k) for k in loader.last_keys] == y.tolist() and loader.last_epoch == epoch
            assert all(s.startswith("train-") for s in loader.last_shards)
            mine += y.tolist()
        ids.append(mine)
        out.append(loader.state())
        loaders.append(loader)
    return ids, out, loaders


COUNTS = [12, 12, 12, 12, 12, 7, 30, 9, 21]  # 127 samples, uneven shards


@pytest.fixture(scope="module")
def uneven_ids(tmp_path_factory, shard_kit):
    return shard_kit.id_shards(tmp_path_factory.mktemp("uneven") / "s", COUNTS)


@pytest.mark.parametrize("workers", [0, 2])
def test_full_epochs_cover_every_sample_once(uneven_ids, workers):
    cfg = _cfg(uneven_ids, workers=workers)
    ids, _, loaders = _ids_and_states(cfg, 2, 4, 2 * 15)  # 127 // 8 = 15 batches per rank, 2 epochs
    assert [ld.batches_per_epoch for ld in loaders] == [15, 15] and all(ld.epoch == 2 for ld in loaders)
    for e in range(2):
        seen = [i for r in ids for i in r[e * 60:(e + 1) * 60]]
        assert len(seen) == len(set(seen)) == 120 and set(seen) <= set(range(127))  # 7 < 2 x 4 dropped
    assert loaders[0].counters["dropped_for_balance"] == 14


@pytest.mark.parametrize("old, new", [((2, 2), (1, 2)), ((1, 2), (2, 2)), ((2, 2), (2, 1)), ((2, 0), (3, 2)),
                                      ((1, 0), (2, 0))])
def test_elastic_resume_reads_the_rest_of_the_epoch_once(uneven_ids, old, new):
    """(world, workers) old -> new: samples consumed before the cut plus those read by the new
    layout for the rest of the epoch are every sample once (minus < one global batch of the new
    layout); every new rank yields the same count; the next epoch is complete."""
    (w0, k0), (w1, k1) = old, new
    batch = 4
    before, states, _ = _ids_and_states(_cfg(uneven_ids, workers=k0), w0, batch, 5)
    after, states1, loaders = _ids_and_states(_cfg(uneven_ids, workers=k1), w1, batch, None, states)
    assert len({len(a) for a in after}) == 1 and all(ld.epoch == 1 for ld in loaders)
    seen = [i for r in before + after for i in r]
    assert len(seen) == len(set(seen))
    assert 0 <= 127 - len(seen) < w1 * batch
    assert sum(ld.counters.get("dropped_for_balance", 0) for ld in loaders) == 127 - len(seen)
    assert sum(ld.counters["samples"] for ld in loaders) == len(seen)  # old counters carried (rank 0)
    nxt, _, _ = _ids_and_states(_cfg(uneven_ids, workers=k1), w1, batch, 127 // (w1 * batch), states1)
    seen = [i for r in nxt for i in r]
    assert len(seen) == len(set(seen)) > 127 - w1 * batch


def test_elastic_twice_in_one_epoch_and_exact_resume_inside_the_rest(uneven_ids):
    """2 ranks x 2 workers -> 1 x 1 (cut again after 3 batches) -> 2 x 2: still each sample once;
    a same-layout resume inside a rest-epoch is bit-exact."""
    batch = 4
    before, s0, _ = _ids_and_states(_cfg(uneven_ids, workers=2), 2, batch, 4)
    mid, s1, _ = _ids_and_states(_cfg(uneven_ids, workers=0), 1, batch, 3, s0)
    assert s1[0].rest["world_size"] == 2
    rest_a, s2, _ = _ids_and_states(_cfg(uneven_ids, workers=0), 1, batch, 2, s1)  # same layout: exact
    rest_b, _, _ = _ids_and_states(_cfg(uneven_ids, workers=0), 1, batch, 2, s1)
    assert rest_a == rest_b
    cont, _, _ = _ids_and_states(_cfg(uneven_ids, workers=0), 1, batch, 2, [s1[0]])
    assert cont == rest_a
    after, _, loaders = _ids_and_states(_cfg(uneven_ids, workers=2), 2, batch, None, s1)
    seen = [i for r in before + mid + after for i in r]
    assert len(seen) == len(set(seen)) and 0 <= 127 - len(seen) < 2 * batch
    assert all(ld.epoch == 1 for ld in loaders)


def test_epochs_done_counts_every_layouts_samples(uneven_ids):
    """2 ranks x 2 workers read 5 batches of 4 each, then 1 rank x 1 reads the rest of the epoch:
    the position is the epoch's samples consumed by all ranks of both layouts over the 127 of the
    data, and whole where the loader's epoch moves on (the last 3 are dropped for balance)."""
    _, states, old = _ids_and_states(_cfg(uneven_ids, workers=2), 2, 4, 5)
    assert [ld.epochs_done for ld in old] == [40 / 127] * 2
    loader = build_loader(_cfg(uneven_ids, workers=0), batch_size=4, seed=3, img_size=16)
    loader.resume(states)
    assert loader.epochs_done == 40 / 127 and loader.batches_this_epoch == 21  # 87 left: 21 x 4 + 3
    it, done = iter(loader), []
    for _ in range(22):
        next(it)
        done.append((loader.last_epoch, loader.epoch, loader.epochs_done))
    assert done[:20] == [(0, 0, (40 + 4 * n) / 127) for n in range(1, 21)]
    assert done[20:] == [(0, 1, 1.0), (1, 1, 1 + 4 / 127)]  # epoch 1: the plan of the new layout


def test_elastic_states_must_be_complete_and_agree(uneven_ids):
    _, states, _ = _ids_and_states(_cfg(uneven_ids), 2, 4, 1)
    loader = build_loader(_cfg(uneven_ids), rank=0, world_size=1, batch_size=4, seed=3, img_size=16)
    with pytest.raises(DataError, match=r"need one state per old rank 0..1, got ranks \[1\]"):
        loader.resume(states[1:])
    with pytest.raises(DataError, match="disagree on batch"):
        loader.resume([states[0], dataclasses.replace(states[1], batch=7)])
    with pytest.raises(DataError, match="saved with train.seed=3, now 4: resume with train.seed=3"):
        build_loader(_cfg(uneven_ids), batch_size=4, seed=4, img_size=16).resume(states)
    fewer = _cfg(f"{uneven_ids}/train-{{000000..000002}}.tar")  # three of the shards: another data position
    with pytest.raises(DataError, match=rf"is for other shards than {uneven_ids}/manifest.json \(their names and "
                                        r"sample counts: \w+ saved, \w+ now\): resume on the shards"):
        build_loader(fewer, batch_size=4, seed=3, img_size=16).resume(states)


# ------------------------------------------------------------------ repeated augmentation
def _pool(loader, epoch: int, dropped: bool = False) -> Counter:
    """The ids an epoch of ``loader``'s plan draws over all ranks: its pool, without the tail it
    drops for balance (or with it)."""
    plan = loader.plan
    starts = [0]
    for sh in plan.shardset.shards:
        starts.append(starts[-1] + sh.samples)
    pieces = plan.pieces(epoch, [(0, plan.total if dropped else plan.used())])
    return Counter(starts[p.shard.index] + i for p in pieces for i in range(p.lo, p.hi))


@pytest.mark.parametrize("workers", [0, 2])
def test_repeated_copies_land_on_distinct_ranks(uneven_ids, workers):
    """data.repeat_augment 3 on 3 ranks: an epoch keeps its batches per rank; it draws the first
    ceil(127 / 3) samples of its sequence, each 3 times on 3 distinct ranks (but those whose last
    copy fell into the dropped tail)."""
    cfg = _cfg(uneven_ids, workers=workers, repeat_augment=3)
    ids, _, loaders = _ids_and_states(cfg, 3, 4, 127 // 12)
    assert [ld.batches_per_epoch for ld in loaders] == [127 // 12] * 3 and all(ld.epoch == 1 for ld in loaders)
    drawn = Counter(i for r in ids for i in r)
    assert drawn == _pool(loaders[0], 0) and len(drawn) == 43 and max(drawn.values()) == 3
    assert sum(1 for k in drawn.values() if k < 3) == 7 + 2  # dropped (127 - 10 x 12) + past N (3 x 43 - 127)
    for i in drawn:
        ranks = [r for r in range(3) if i in ids[r]]
        assert len(ranks) == drawn[i] and all(ids[r].count(i) == 1 for r in ranks), (i, ranks)


def test_repeated_copies_are_augmented_afresh(demo_train):
    """A sample's copies draw their own crop, flip and 3-Augment: their pixels differ."""
    cfg = _cfg(demo_train, workers=0, repeat_augment=2, augment=AugmentConfig(three_augment=True))
    loader = build_loader(cfg, batch_size=16, img_size=32)
    seen, pairs = {}, 0
    for (x, _), _ in zip(loader, range(loader.batches_per_epoch)):
        for key, img in zip(loader.last_keys, x):
            if key in seen:
                assert not torch.equal(seen[key], img), key
                pairs += 1
            seen[key] = img
    assert pairs == 192


def test_each_epoch_augments_a_sample_afresh(demo_train):
    """The crop and flip of a sample are drawn anew every epoch (its seed names the epoch): the
    same image read again in the next epoch has other pixels."""
    loader = build_loader(_cfg(demo_train, workers=0), batch_size=32, seed=2, img_size=16)
    it, seen = iter(loader), []
    for _ in range(2):
        pixels = {}
        for _ in range(loader.batches_per_epoch):
            x, _ = next(it)
            pixels.update(zip(loader.last_keys, x))
        seen.append(pixels)
    assert seen[0].keys() == seen[1].keys() and len(seen[0]) == 384
    same = [k for k in seen[0] if torch.equal(seen[0][k], seen[1][k])]
    assert not same, same


def test_each_epoch_draws_its_own_mixing(balanced_ids):
    """Mixup's weight is drawn per batch and epoch: batch k of the next epoch mixes by another one.
    Labels are ids (all distinct), so each target row holds the weight and its complement alone."""
    cfg = _cfg(balanced_ids, workers=0, augment=AugmentConfig(mixup_alpha=0.8))
    loader = build_loader(cfg, batch_size=8, seed=0, img_size=16)
    it, weights = iter(loader), []
    for _ in range(2):
        epoch = []
        for _ in range(loader.batches_per_epoch):
            y = next(it)[1][0]
            epoch.append(round(float(y.max()), 6))
            assert float(y.sum()) == pytest.approx(1.0) and int((y > 0).sum()) <= 2, y
        weights.append(epoch)
    assert len(set(weights[0])) == len(weights[0]) == 24, weights[0]  # a weight per batch
    assert sum(a == b for a, b in zip(*weights)) <= 1, weights


def test_elastic_resume_with_repeats_reads_each_copy_once(uneven_ids):
    """2 ranks x 2 workers -> 3 x 0 inside an epoch with data.repeat_augment 2: the copies read
    before the cut and after it are the epoch's pool, each copy once (fewer than one global batch of
    the new layout dropped); the repeat count a mid-epoch state was saved with is required."""
    cfg = _cfg(uneven_ids, workers=2, repeat_augment=2)
    before, states, loaders = _ids_and_states(cfg, 2, 4, 5)
    pool = _pool(loaders[0], 0, dropped=True)  # the old layout's dropped tail is owed to the rest
    after, states1, _ = _ids_and_states(_cfg(uneven_ids, workers=0, repeat_augment=2), 3, 4, None, states)
    seen = Counter(i for r in before + after for i in r)
    assert sum(pool.values()) == 127 and not seen - pool and 0 <= sum((pool - seen).values()) < 3 * 4
    with pytest.raises(DataError, match="inside epoch 0 with data.repeat_augment=2, now 1: resume with 2"):
        build_loader(_cfg(uneven_ids, workers=2), rank=0, world_size=2, batch_size=4, seed=3,
                     img_size=16).resume(states)
    plain = build_loader(_cfg(uneven_ids, workers=0), rank=0, world_size=3, batch_size=4, seed=3, img_size=16)
    plain.resume(states1)  # at the epoch's end: another repeat count goes on
    assert plain.epoch == 1 and plain.plan.repeats == 1


WORKERS_THEN_EXIT = """
import sys
from data_pipeline.loading.loader import build_loader
from pretrain.config import DataConfig
cfg = DataConfig(train_shards=sys.argv[1], val_shards=sys.argv[1], workers=2, shuffle_buffer=20)
it = iter(build_loader(cfg, batch_size=6, seed=3, img_size=16))
for _ in range(4):
    next(it)
"""


def test_a_rank_with_workers_leaves_nothing_in_the_temp_folder(balanced_ids):
    """The rank SIGKILLs its workers at exit; the sockets they made to pass tensors go with the rank's
    own temporary folder, not one per worker left behind."""
    tmp = Path(tempfile.mkdtemp())  # short: a socket's path must fit in 108 bytes
    env = dict(os.environ, TMPDIR=str(tmp))
    r = subprocess.run([sys.executable, "-c", WORKERS_THEN_EXIT, str(balanced_ids)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in tmp.iterdir()) == []
    tmp.rmdir()
