"""data.decode_device: the training process decodes each batch's JPEGs (torchvision decode_jpeg;
nvJPEG on a GPU). On CPU the same code path must give exactly the worker path's batches; the cuda
path's own logic (prefetch on a side stream, batched crop) runs on the CPU too, its stream calls
recorded instead of made."""
import io
from dataclasses import replace

import numpy as np
import pytest
import torch
from decode_samples import (
    bogus_huffman,
    broken_jpegs,
    calm_and_busy,
    decode_cfg,
    encode_image,
    mixed_samples,
    run_loader,
)
from PIL import Image

from data_pipeline.config import AugmentConfig
from data_pipeline.loading.batch.wire import DeferredBatch
from data_pipeline.loading.loader import build_loader
from data_pipeline.loading.plan import Plan
from data_pipeline.loading.stream import Settings, SlotStream, Start
from data_pipeline.loading.transforms import Deferred, SampleTransform
from data_pipeline.shards.manifest import resolve_shards


@pytest.mark.parametrize("aug", [{}, {"randaugment_ops": 2, "randaugment_magnitude": 9}, {"three_augment": True},
                                 {"mixup_alpha": 0.8, "cutmix_alpha": 1.0}],
                         ids=["crop-flip", "randaugment", "3-augment", "mixup-cutmix"])
def test_cpu_batch_decode_equals_the_worker_path(mixed, aug):
    """Same seeds, same crop boxes and flips, same decoder (libjpeg-turbo), same resize kernel:
    bit-identical batches, targets and keys, with plain JPEGs, worker-decoded members and mixing."""
    want_loader, want = run_loader(decode_cfg(mixed, "worker", **aug), batches=6)
    got_loader, got = run_loader(decode_cfg(mixed, "cpu", **aug), batches=6)
    assert len(got) == len(want) == 6
    for (a, ta, ka), (b, tb, kb) in zip(want, got):
        assert ka == kb
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape == (8, 3, 16, 16)
        assert torch.equal(a, b), (a - b).abs().max()
        assert torch.equal(ta, tb)
    assert got_loader.counters == want_loader.counters
    assert got_loader.state().emitted == want_loader.state().emitted


def test_cpu_batch_decode_eval_pass_equals_the_worker_path(mixed):
    _, want = run_loader(decode_cfg(mixed, "worker", workers=2), train=False)
    _, got = run_loader(decode_cfg(mixed, "cpu", workers=2), train=False)
    assert sum(len(k) for _, _, k in got) == 64  # rank 1's half, every sample once
    assert [k for _, _, k in got] == [k for _, _, k in want]
    for (a, ta, _), (b, tb, _) in zip(want, got):
        assert torch.equal(a, b) and torch.equal(ta, tb)


def _same(batch):
    return batch


@pytest.mark.parametrize("aug,train", [({}, True), ({"mixup_alpha": 0.8, "cutmix_alpha": 1.0}, True), ({}, False)],
                         ids=["train", "mixup-cutmix", "eval"])
def test_worker_batches_cross_as_uint8_and_are_normalised_here(mixed, aug, train):
    """data.decode_device: worker. What crosses from a DataLoader worker is uint8 (one shared-memory
    (B, 3, S, S) tensor, no JPEG bytes) with the batch's mix seed; the loader's float32 batches are
    plain torch's (x / 255 - mean) / std of exactly those pixels (the finisher computes
    x * (1 / (255 std)) + (-mean / std), the float ops the workers used to run: within 5e-7 of
    plain torch for these mean/std), mixed afterwards by the batch's seed."""
    from torch.utils.data import DataLoader

    from data_pipeline.loading.transforms import mix_labelled

    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # not 0.5: every channel's arithmetic differs
    cfg = replace(decode_cfg(mixed, "worker", **aug), augment=replace(AugmentConfig(), mean=mean, std=std, **aug))
    loader = build_loader(cfg, batch_size=8, seed=3, img_size=16, train=train)
    stream = SlotStream(loader.plan, 0, loader.settings, Start(0, 0, (0,)), loader.num_classes)
    crossed = []
    for batch, y, record in DataLoader(stream, batch_size=None, collate_fn=_same, num_workers=1):
        assert isinstance(batch, DeferredBatch) and batch.blob.numel() == 0
        assert batch.decoded.dtype == torch.uint8 and batch.decoded.shape == (8, 3, 16, 16)
        assert batch.items == list(range(8)) and (batch.mix_seed is not None) == bool(aug)
        crossed.append((batch, y, record.keys))
        if len(crossed) == 4:
            break
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    for (x, t), (batch, y, keys) in zip(loader, crossed):
        assert loader.last_keys == keys and x.dtype == torch.float32
        want = (batch.decoded.float() / 255 - m) / s
        if batch.mix_seed is not None:
            want, y = mix_labelled(want, y, cfg.augment, batch.mix_seed, loader.num_classes)
        assert (x - want).abs().max() <= 1e-6, (x - want).abs().max()
        assert torch.allclose(t, y.to(t.dtype), atol=1e-6, rtol=0) if aug else torch.equal(t, y)


def test_workers_ship_plain_jpegs_undecoded(mixed):
    """The worker's batch holds the JPEG files' own bytes (one tensor for the batch) and each
    sample's crop box; PNG, CMYK and EXIF-rotated members arrive decoded (finished uint8 samples)."""
    import tarfile

    cfg = decode_cfg(mixed, "cpu")
    shardset = resolve_shards(cfg.train_shards, key="data.train_shards")
    plan = Plan(shardset, 1, 1, 8, 3, True)
    stream = SlotStream(plan, 0, Settings(cfg.augment, 16, 16, cfg.max_image_pixels, False, frozenset(), "cpu"),
                        Start(0, 0, (0,)), 5)
    members = {}
    for sh in sorted(mixed.glob("*.tar")):
        with tarfile.open(sh) as tar:
            for m in tar.getmembers():
                members[m.name] = tar.extractfile(m).read()
    kinds = set()
    for batch, _, record in (next(iter(stream)),) + tuple(x for _, x in zip(range(3), iter(stream))):
        assert isinstance(batch, DeferredBatch) and batch.mix_seed is None
        for item, key in zip(batch.items, record.keys):
            if isinstance(item, Deferred):
                assert bytes(batch.file(item).numpy()) == members[f"{key}.jpg"]
                i = int(key[2:])  # RGB, grey baseline, or EXIF orientation 1 (nothing to turn)
                assert (i % 8 < 5 and i % 16 != 12) or i % 16 in (6, 7), key
                top, left, h, w = item.box
                assert 0 <= top and top + h <= 20 and 0 <= left and left + w <= 24
                kinds.add("jpeg")
            else:
                assert batch.decoded.dtype == torch.uint8 and batch.decoded[item].shape == (3, 16, 16)
                kinds.add("decoded")
    assert kinds == {"jpeg", "decoded"}


def test_a_jpeg_that_fails_to_decode_is_counted_and_its_place_refilled(tmp_path, shard_kit):
    """A JPEG whose header parses but whose data does not decode: both paths count it as
    corrupt_image of its shard; the batch-decode path keeps the batch's shape with a copy of
    another sample."""
    samples = mixed_samples(32, 9)
    good = samples[0][1]["jpg"]
    samples[2] = (samples[2][0], {"jpg": bogus_huffman(good), "cls": b"1"})
    root = shard_kit.make_shards(tmp_path / "bad", [samples], [f"c{i}" for i in range(5)])
    counts = {}
    for device in ("worker", "cpu"):
        loader = build_loader(decode_cfg(root, device, workers=0), batch_size=8, seed=0, img_size=16)
        n, keys = 0, []
        for images, _ in loader:
            assert images.shape == (8, 3, 16, 16) and torch.isfinite(images).all()
            keys += loader.last_keys
            n += 1
            if n == loader.batches_per_epoch:
                break
        counts[device] = loader.counters
        assert counts[device]["corrupt_image"] == 1, counts
        assert samples[2][0] not in keys
    assert counts["cpu"]["repeated_for_balance"] >= 1 and counts["cpu"]["samples"] == counts["worker"]["samples"]


def _run_keys(cfg, n):
    loader = build_loader(cfg, batch_size=1, seed=0, img_size=16)
    keys = []
    for _ in loader:
        keys += loader.last_keys
        if len(keys) == n:
            return loader, keys


def test_a_jpeg_cut_short_is_left_to_the_worker():
    """A file without its EOI marker is decoded (and rejected) by PIL in the worker: nvJPEG's batched
    decode may not fail on it. Zero padding after EOI, as some writers leave, is still shipped."""
    from data_pipeline.loading.transforms import ends_at_eoi

    tf = SampleTransform(AugmentConfig(), 16, train=True)
    jpg = encode_image((np.random.default_rng(2).random((40, 48, 3)) * 255).astype(np.uint8), "JPEG", quality=95)
    for data, shipped in ((jpg, True), (jpg + b"\0" * 10, True), (jpg[: len(jpg) // 2], False),
                          (jpg[:-1], False), (bogus_huffman(jpg), True)):
        img = Image.open(io.BytesIO(data))  # the header parses in every case
        assert ends_at_eoi(data) is shipped
        assert isinstance(tf.defer(img, data, seed=5), Deferred) is shipped, len(data)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_sample_met_again_in_a_repeat_pass_is_counted_once(tmp_path, shard_kit, seed):
    """Bad labels (skipped by the worker) make the slot read its shard again; the broken JPEGs met
    again then are not counted a second time: both paths count each bad sample once."""
    samples = broken_jpegs(mixed_samples(16, 4), at=(3, 9))
    for i in (0, 2, 5, 7, 11, 13):
        samples[i] = (samples[i][0], {**samples[i][1], "cls": b"99"})  # outside the 5 classes
    root = shard_kit.make_shards(tmp_path / "s", [samples], [f"c{i}" for i in range(5)])
    for device in ("worker", "cpu"):
        cfg = replace(decode_cfg(root, device, workers=0), max_corrupt_rate=1.0)
        loader = build_loader(cfg, batch_size=4, seed=seed, img_size=16)
        for n, (images, _) in enumerate(loader, 1):
            assert images.shape == (4, 3, 16, 16)
            if n == loader.batches_per_epoch:
                break
        c = loader.counters
        assert (c["corrupt_image"], c["bad_label"]) == (2, 6), (device, c)
        assert c["repeated_for_balance"] >= 1, (device, c)


def test_eval_drops_a_broken_jpeg_as_the_worker_path_does(tmp_path, shard_kit):
    root = shard_kit.make_shards(tmp_path / "e", [broken_jpegs(mixed_samples(16, 5), at=(1,))],
                                 [f"c{i}" for i in range(5)])
    got = {}
    for device in ("worker", "cpu"):
        loader = build_loader(decode_cfg(root, device, workers=0), batch_size=4, img_size=16, train=False)
        batches = [(x, y, list(loader.last_keys), list(loader.last_positions)) for x, y in loader]
        positions = [p for *_, ps in batches for p in ps]  # the broken sample's left out with it
        assert positions == [0, *range(2, 16)], (device, positions)
        got[device] = ([b[:3] for b in batches], loader.counters)
    (want, cw), (have, ch) = got["worker"], got["cpu"]
    assert cw == ch and ch["corrupt_image"] == 1
    # the worker path skips the sample before batching, this one after: batch edges differ
    assert [k for *_, ks in have for k in ks] == [k for *_, ks in want for k in ks]
    assert sum(len(k) for _, _, k in have) == 15
    assert torch.equal(torch.cat([x for x, _, _ in want]), torch.cat([x for x, _, _ in have]))
    assert torch.equal(torch.cat([y for _, y, _ in want]), torch.cat([y for _, y, _ in have]))


def test_micro_batch_of_one_refills_from_the_previous_batch(tmp_path, shard_kit):
    """A batch whose only JPEG fails takes the previous batch's last good sample."""
    samples = mixed_samples(8, 6)
    intact = shard_kit.make_shards(tmp_path / "intact", [samples], [f"c{i}" for i in range(5)])
    _, order = _run_keys(decode_cfg(intact, "worker", workers=0), 8)
    third = [k for k, _ in samples].index(order[2])  # the order depends on the layout, not the pixels
    root = shard_kit.make_shards(tmp_path / "one", [broken_jpegs(samples, at=(third,))], [f"c{i}" for i in range(5)])
    loader = build_loader(replace(decode_cfg(root, "cpu", workers=0), max_corrupt_rate=0.2), batch_size=1, seed=0,
                          img_size=16)
    keys, images = [], []
    for n, (x, _) in enumerate(loader, 1):
        keys += loader.last_keys
        images.append(x)
        if n == loader.batches_per_epoch:
            break
    assert order[2] not in keys and len(keys) == 8 and len(set(keys)) == 7
    assert keys[2] == keys[1] == order[1] and torch.equal(images[2], images[1])
    assert loader.counters["corrupt_image"] == 1 and loader.counters["repeated_for_balance"] == 1


def test_decode_device_errors_name_the_key(tmp_path, mixed):
    from pretrain.config import load_config

    with pytest.raises(ValueError, match=r"data\.decode_device.*gpu"):
        load_config("configs/tiny_cpu.yaml", ["data.decode_device=gpu"])
    if not torch.cuda.is_available():
        from data_pipeline.errors import ConfigError

        with pytest.raises(ConfigError, match=r"^data\.decode_device: cuda, but this process sees no CUDA device"):
            build_loader(decode_cfg(mixed, "cuda"), batch_size=8, img_size=16)


@pytest.mark.gpu
def test_cuda_batch_decode_matches_cpu(mixed, tmp_path, shard_kit):
    """nvJPEG is not libjpeg-turbo (IDCT, chroma upsampling), nor is the cuda path's batched crop
    (area average) torch's antialiased resize: the same samples, boxes and flips, with pixels within
    a few grey levels on smooth images; on the noise images of ``mixed`` (the worst case for both)
    within a bound that a wrong box or flip (~60 levels) still breaks. A broken JPEG is counted on
    the GPU too."""
    _, want = run_loader(decode_cfg(mixed, "cpu"), batches=4)
    _, got = run_loader(decode_cfg(mixed, "cuda"), batches=4)
    for (a, ta, ka), (b, tb, kb) in zip(want, got):
        assert b.is_cuda and ka == kb and torch.equal(ta, tb.cpu())
        assert (a - b.cpu()).abs().mean() < 16 / 127.5
    yy, xx = np.mgrid[0:40, 0:48]
    smooth = [(f"s{i:04d}", {"jpg": encode_image(np.stack([xx * 5 + i, yy * 6, (xx + yy) * 2 + 3 * i], -1).clip(0, 255)
                                            .astype(np.uint8), "JPEG", quality=90), "cls": str(i % 5).encode()})
              for i in range(32)]
    root = shard_kit.make_shards(tmp_path / "smooth", [smooth], [f"c{i}" for i in range(5)])
    _, want = run_loader(decode_cfg(root, "cpu"), batches=2)
    _, got = run_loader(decode_cfg(root, "cuda"), batches=2)
    for (a, _, ka), (b, _, kb) in zip(want, got):
        assert ka == kb and (a - b.cpu()).abs().mean() < 3 / 127.5, (a - b.cpu()).abs().mean() * 127.5
    root = shard_kit.make_shards(tmp_path / "bad", [broken_jpegs(mixed_samples(16, 7), at=(2,))],
                                 [f"c{i}" for i in range(5)])
    loader = build_loader(decode_cfg(root, "cuda", workers=0), batch_size=8, img_size=16)
    for n, (x, _) in enumerate(loader, 1):
        assert x.is_cuda and torch.isfinite(x).all()
        if n == loader.batches_per_epoch:
            break
    assert loader.counters["corrupt_image"] == 1




@pytest.mark.gpu
@pytest.mark.parametrize("aug", [{}, {"mixup_alpha": 0.8, "cutmix_alpha": 1.0}], ids=["crop-flip", "mixup-cutmix"])
def test_worker_batches_finished_on_the_gpu_equal_the_cpus(mixed, aug):
    """data.decode_device: worker with build_loader(device="cuda"): the uint8 batches are uploaded
    and normalised (and mixed) on the GPU, one batch ahead on a side stream: the CPU finish's
    values (the same float32 multiply and add; mixing within rounding), and no host sync after
    start-up while the compute stream is busy."""
    _, want = run_loader(decode_cfg(mixed, "worker", **aug), batches=4)
    _, got = run_loader(decode_cfg(mixed, "worker", **aug), batches=4, device="cuda")
    for (a, ta, ka), (b, tb, kb) in zip(want, got):
        assert b.is_cuda and b.dtype == torch.float32 and ka == kb
        assert torch.equal(a, b.cpu()) if not aug else (a - b.cpu()).abs().max() <= 1e-6
        assert torch.allclose(ta, tb.cpu().to(ta.dtype), atol=1e-6, rtol=0)
    calm_and_busy(lambda: build_loader(decode_cfg(mixed, "worker", **aug), rank=1, world_size=2, batch_size=8,
                                       seed=3, img_size=16, device="cuda"))


class _Filled(torch.utils.data.IterableDataset):
    """Batch i: a (4, 3, 8, 8) tensor of BatchBuffers filled with i, its tag, and how many fresh
    shared-memory tensors the worker has made so far."""

    def __init__(self, buffers, n):
        self.buffers, self.n = buffers, n

    def __iter__(self):
        from data_pipeline.loading.batch import buffers as batch_buffers

        fresh, make = [0], batch_buffers._shared_storage

        def counted(numel):
            fresh[0] += 1
            return make(numel)

        batch_buffers._shared_storage = counted  # in this worker process only
        for i in range(self.n):
            t, tag = self.buffers.take((4, 3, 8, 8))
            yield t.fill_(i % 251), tag, fresh[0]


def test_worker_buffers_are_reused_only_once_released():
    """A worker stacks into the same few shared-memory tensors while the training process releases
    each batch after reading it; a batch held unreleased is never written over (the worker takes a
    fresh tensor instead, and does not wait). Real DataLoader worker processes."""
    from data_pipeline.loading.batch.buffers import BatchBuffers

    buffers = BatchBuffers(1, slots=4)
    loader = torch.utils.data.DataLoader(_Filled(buffers, 60), batch_size=None, num_workers=1, prefetch_factor=2)
    held, fresh = [], []
    for i, (t, tag, made) in enumerate(loader):
        assert tuple(tag) == (0, i) and bool((t == i % 251).all())
        fresh.append(made)
        if 20 <= i < 40:  # read, but held unreleased (the training process releases in order)
            held.append((i, t))
        else:
            buffers.release(tag)  # this one and every earlier one
            held.clear()
        for j, h in held:
            assert bool((h == j % 251).all()), (i, j)  # never written over while held
    assert fresh[19] == 4  # the first round of slots, then reuse
    assert fresh[39] >= fresh[19] + 15 and fresh[-1] == fresh[48]  # fresh ones while held, reuse again after
