"""The sample-level plan and the rest of an epoch after a layout change, as plain logic (no tars),
over a seeded sweep of shard-size lists and layouts; the plan's command line; the sample log."""
from __future__ import annotations

import json
import random

import pytest

from data_pipeline.errors import DataError
from data_pipeline.loading.plan import Plan, main, plan_line, shuffle_seed
from data_pipeline.loading.remainder import rest_epoch
from data_pipeline.loading.sample_log import SampleLog
from data_pipeline.loading.stream import ShuffleBuffer
from data_pipeline.shards.manifest import Shard, ShardSet


def _shardset(counts) -> ShardSet:
    shards = tuple(Shard(i, f"s{i}.tar", f"/nowhere/s{i}.tar", c) for i, c in enumerate(counts))
    return ShardSet(shards, ("a", "b"), False, ("/nowhere/manifest.json",))


def _samples(pieces) -> list[tuple[int, int, int]]:
    """(shard, index in shard, copy) of each sample the pieces read, in order."""
    return [(p.shard.index, i, p.copy) for p in pieces for i in range(p.lo, p.hi)]


def _cases(n, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        counts = [rng.choice([0, rng.randint(1, 60)]) if rng.random() < 0.1 else rng.randint(1, 60)
                  for _ in range(rng.randint(1, 30))]
        yield counts, rng.randint(1, 5), rng.randint(1, 4), rng.randint(1, 8), rng.randint(0, 9)


@pytest.mark.parametrize("repeats", [1, 3])
def test_sweep_equal_batches_each_sample_once_drop_below_one_global_batch(repeats):
    """Each sample (with data.repeat_augment: each copy of a chosen sample) once per epoch."""
    checked = 0
    for counts, world, workers, batch, seed in _cases(300):
        plan = Plan(_shardset(counts), world, workers, batch, seed, True, repeats)
        total = sum(counts)
        if total < world * workers * batch:
            with pytest.raises(DataError, match=f"fewer than batch_size={batch} samples"):
                plan.check()
            continue
        plan.check()
        checked += 1
        q = plan.epoch_batches()
        assert 0 <= plan.dropped() < world * batch and plan.used() == q * world * batch
        for epoch in (0, 1):
            seen = []
            for rank in range(world):
                rank_samples = 0
                for role in range(workers):
                    pieces = plan.slot_pieces(epoch, rank * workers + role)
                    assert all(0 <= p.lo < p.hi <= p.shard.samples for p in pieces)
                    n = sum(p.samples for p in pieces)
                    assert n == plan.role_batches(q, role) * batch  # whole batches, as rotation needs
                    rank_samples += n
                    seen += _samples(pieces)
                assert rank_samples == q * batch  # every rank the same number of batches
            assert len(seen) == len(set(seen)) == plan.used()
    assert checked > 150


@pytest.mark.parametrize("repeats", [1, 3])
def test_epochs_permute_shards_and_layout_does_not_change_the_sequence(repeats):
    plan = Plan(_shardset([10] * 20), 2, 2, 4, 7, True, repeats)
    assert plan.epoch_order(0) != plan.epoch_order(1)
    other = Plan(plan.shardset, 3, 1, 5, 7, True, repeats)
    assert other.epoch_order(1) == plan.epoch_order(1)  # the sequence depends on (seed, epoch) only
    # slots are contiguous ranges of it: concatenated in slot order they are its first used() samples
    seq = _samples(plan.pieces(1, [(0, plan.total)]))
    joined = [x for s in range(plan.slots) for x in _samples(plan.slot_pieces(1, s))]
    assert joined == seq[:plan.used()]


def test_evaluation_split_covers_every_sample_in_manifest_order():
    plan = Plan(_shardset([5, 0, 9, 3]), 3, 2, 4, 0, False)
    joined = [x for s in range(plan.slots) for x in _samples(plan.slot_pieces(0, s))]
    assert joined == [(i, j, 0) for i, c in enumerate([5, 0, 9, 3]) for j in range(c)]
    assert sum(plan.rank_batches(r) for r in range(3)) == sum(
        -(-len(_samples(plan.slot_pieces(0, s))) // 4) for s in range(6))


def _consumed(plan: Plan, epoch: int, emitted: list[int], buffer: int, pool_slots, level=0):
    """What each old slot's real shuffle buffer emitted first, replayed on the (shard, index) pairs."""
    out = []
    for slot, pieces in enumerate(pool_slots):
        items = _samples(pieces)
        buf = ShuffleBuffer(buffer, random.Random(shuffle_seed(plan.seed, epoch, slot, level)))
        it = buf(iter(items))
        out += [next(it) for _ in range(min(emitted[slot], len(items)))]
    return out


def _random_emitted(rng, plan, pool_size):
    """A mid-epoch position: each rank has yielded ``b`` batches; emissions per slot somewhere
    between what those batches needed and the whole range (good samples only, so exactly needed)."""
    q = plan.rank_batches_for(pool_size)
    b = rng.randint(0, q)
    return [plan.role_batches(b, r % plan.workers) * plan.batch_size for r in range(plan.slots)], b


@pytest.mark.parametrize("repeats", [1, 3])
@pytest.mark.parametrize("seed", range(40))
def test_rest_of_epoch_is_what_the_old_layout_left_each_once(seed, repeats):
    rng = random.Random(seed)
    counts = [rng.randint(1, 40) for _ in range(rng.randint(2, 25))]
    shardset, s_seed, epoch, buffer = _shardset(counts), rng.randint(0, 9), rng.randint(0, 3), rng.randint(1, 30)
    layouts = [(rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 6)) for _ in range(3)]
    if sum(counts) < max(w * k * b for w, k, b in layouts[:1]):
        return
    # level 0: a plain epoch on layout 0, interrupted
    old = Plan(shardset, *layouts[0], s_seed, True, repeats)
    slots0 = [old.slot_pieces(epoch, s) for s in range(old.slots)]
    emitted, _ = _random_emitted(rng, old, old.total)
    consumed = _consumed(old, epoch, emitted, buffer, slots0)
    source = {"epoch": epoch, "world_size": old.world_size, "workers": old.workers, "batch_size": old.batch_size,
              "shuffle_buffer": buffer, "emitted": emitted, "rest": None}
    # level 1: layout 1 reads the rest; interrupted again; level 2: layout 2 finishes the epoch
    for level, (world, workers, batch) in enumerate(layouts[1:], start=1):
        new = Plan(shardset, world, workers, batch, s_seed, True, repeats)
        rests = [rest_epoch(new, r, source) for r in range(world)]
        assert {r.batches for r in rests} == {rests[0].batches} and rests[0].level == level
        q = rests[0].batches
        slots = [list(r.pieces[k]) for r in rests for k in range(workers)]
        for rank, r in enumerate(rests):
            for k in range(workers):
                assert sum(p.samples for p in r.pieces[k]) == new.role_batches(q, k) * batch
        rest = [x for s in slots for x in _samples(s)]
        assert len(rest) == len(set(rest)) and not set(rest) & set(consumed)
        everything = set(_samples(old.pieces(epoch, [(0, old.total)])))
        assert len(everything - set(consumed) - set(rest)) == rests[0].dropped < world * batch
        if level == 2:
            break
        emitted, _ = _random_emitted(rng, new, q * world * batch + rests[0].dropped)
        consumed += _consumed(new, epoch, emitted, buffer, slots, level)
        source = {"epoch": epoch, "world_size": world, "workers": workers, "batch_size": batch,
                  "shuffle_buffer": buffer, "emitted": emitted, "rest": source}


def test_plan_line_and_cli(tmp_path, capsys):
    root = tmp_path / "s"
    root.mkdir()
    shards = [{"name": f"t-{i}.tar", "samples": 100 + i, "bytes": 1} for i in range(10)]
    for s in shards:
        (root / s["name"]).write_bytes(b"")  # the plan reads manifests only
    (root / "manifest.json").write_text(json.dumps({
        "format": "vitscale-shards", "version": 1, "classes": ["a"], "total": 1045, "shards": shards}))
    line = plan_line(str(root / "manifest.json"), world_size=4, workers=2, batch_size=8)
    # 1045 // 32 = 32 batches per rank, 1024 used, 21 dropped
    assert "1,045 samples in 10 shards on 4 rank(s) x 2 worker(s), batch 8: 32 batches per rank per epoch; " \
           "1,024 samples used, 21 dropped (2.010%) per epoch; planned in " in line
    main([str(root / "manifest.json"), "--world-size", "4", "--workers", "2", "--batch", "8"])
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.split(" planned in ")[0] == line.split(" planned in ")[0]
    for extra, needle in [({"manifest": str(root / "nope.json")}, "manifest not found"),
                          ({"--world-size": "0"}, "world size must be an integer >= 1"),
                          ({"--batch": "200"}, "fewer than batch_size=200")]:
        opts = {"manifest": str(root / "manifest.json"), "--world-size": "4", "--workers": "2", "--batch": "8",
                **extra}
        argv = [opts.pop("manifest")] + [x for kv in opts.items() for x in kv]
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and needle in err and "\n" not in err, err


def test_sample_log_appends_and_truncates_on_resume(tmp_path):
    log = SampleLog(tmp_path / "samples", rank=1)
    log.open(resume_step=0)
    for step in range(1, 6):
        log.write(step, 0, [f"k{step}a", f"k{step}b"])
        if step == 3:
            log.flush()
    path = tmp_path / "samples" / "rank-1.tsv"
    assert path.read_text().splitlines()[:6] == ["1\t0\tk1a", "1\t0\tk1b", "2\t0\tk2a", "2\t0\tk2b",
                                                 "3\t0\tk3a", "3\t0\tk3b"]
    log.close()
    assert len(path.read_text().splitlines()) == 10
    again = SampleLog(tmp_path / "samples", rank=1)
    again.open(resume_step=3)  # resumed from the step-3 checkpoint: steps 4 and 5 happen again
    assert path.read_text().splitlines()[-1] == "3\t0\tk3b"
    again.write(4, 1, ["x"])
    again.close()
    assert path.read_text().splitlines()[-2:] == ["3\t0\tk3b", "4\t1\tx"]
    assert not [p for p in (tmp_path / "samples").iterdir() if p.name != "rank-1.tsv"]  # no temp left
