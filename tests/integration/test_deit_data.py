"""DeiT's data pieces through the real deepspeed runner: repeated augmentation and 3-Augment are
data-side (the loader's plan and its workers' transforms), so one 2-rank run with both on, at ZeRO-3,
stands for every stage."""
import collections
import math

import pytest

pytestmark = pytest.mark.slow


def test_repeated_copies_on_both_ranks_with_three_augment(demo_shards, tiny_run, tmp_path):
    """64 images, 2 ranks x 8, data.repeat_augment 2: an epoch is still 4 steps; its sample log
    holds the first 32 samples of the epoch's sequence, each once on each rank; training runs on
    3-Augmented images in a real data worker and the loss stays finite."""
    job = tiny_run("data.repeat_augment=2", "data.augment.three_augment=true", "data.record_samples=true",
                   "data.workers=1", "zero.stage=3", "train.steps=6", "train.log_every_steps=1",
                   shards=demo_shards(64, 32), via="deepspeed", ranks=2)
    r = job.run(600)
    assert r.returncode == 0, r.stderr[-3000:]
    per_rank = {}
    for f in sorted((tmp_path / "run" / "samples").glob("rank-*.tsv")):
        per_rank[f.name] = [line.split("\t") for line in f.read_text().splitlines()]
    assert sorted(per_rank) == ["rank-0.tsv", "rank-1.tsv"]
    epoch0 = {name: collections.Counter(key for step, epoch, key in lines if epoch == "0")
              for name, lines in per_rank.items()}
    assert all(sorted(int(step) for step, epoch, _ in lines if epoch == "0") == sorted([1, 2, 3, 4] * 8)
               for lines in per_rank.values())
    a, b = epoch0.values()
    assert set(a.values()) == set(b.values()) == {1} and set(a) == set(b) and len(a) == 32
    m = job.metrics()
    assert sorted(m) == list(range(1, 7)) and all(math.isfinite(x["loss"]) for x in m.values())
