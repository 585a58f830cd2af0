"""Planning time and data dropped per epoch: the sample-range plan (data_pipeline.loading.plan) against
a shard-level plan, on the layouts of benchmarks/results/data-plan-cpu.md. Manifests are synthetic (in memory,
no tars): the plan reads only sample counts.

Old figure: the shard-level formula (slots take every S-th shard, each cut to the sum of the
floor(n/S) smallest shard counts, rounded down to whole batches). New: what Plan drops (fewer
than world x batch). Planning time: building the plan, checking it and computing every slot's
sample ranges for one epoch (what all workers of all ranks compute between them), one core,
median of --repeat runs.

    python benchmarks/plan_speed.py            # about 10 s on 2 vCPU
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_pipeline.loading.plan import Plan  # noqa: E402
from data_pipeline.shards.manifest import Shard, ShardSet  # noqa: E402

# (name, shards, samples per shard, spread, world, workers)
CASES = [
    ("ImageNet-1k", 1_282, 1_000, 0.0, 64, 8),
    ("JFT-like", 30_000, 10_000, 0.0, 1_024, 8),
    ("ImageNet-21k", 14_000, 1_000, 0.0, 256, 10),
    ("ImageNet-21k", 14_000, 1_000, 0.0, 128, 8),
    ("100k shards +-10%", 100_000, 3_000, 0.1, 1_024, 8),
]


def shardset(n: int, size: int, spread: float, seed: int = 0) -> ShardSet:
    rng = random.Random(seed)
    lo, hi = round(size * (1 - spread)), round(size * (1 + spread))
    shards = tuple(Shard(i, f"train-{i:06d}.tar", f"/data/train-{i:06d}.tar", rng.randint(lo, hi)) for i in range(n))
    return ShardSet(shards, ("c",), False, ("/data/manifest.json",))


def old_dropped(counts: list[int], slots: int, batch: int):
    """The shard-level plan: None when it refused the layout (fewer shards than slots)."""
    if len(counts) < slots:
        return None
    per_slot = sum(sorted(counts)[: len(counts) // slots]) // batch
    return sum(counts) - slots * per_slot * batch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32,
                    help="micro batch per rank (default 32, as in benchmarks/results/data-plan-cpu.md)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"{'data':<19} {'shards x samples':>18} {'ranks x workers':>15} {'dropped old':>12} "
          f"{'dropped new':>20} {'batches/rank':>12} {'plan s (median)':>15}")
    for name, n, size, spread, world, workers in CASES:
        ss = shardset(n, size, spread)
        counts = [s.samples for s in ss.shards]
        total = sum(counts)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            plan = Plan(ss, world, workers, args.batch, 0, True)
            plan.check()
            plan.layout(0)
            times.append(time.perf_counter() - t0)
        old = old_dropped(counts, world * workers, args.batch)
        old_s = "refused" if old is None else f"{100.0 * old / total:.1f} %"
        new = plan.dropped()
        shape = f"{n:,} x {size:,}" + ("+-10%" if spread else "")
        print(f"{name:<19} {shape:>18} {f'{world:,} x {workers}':>15} {old_s:>12} "
              f"{f'{new:,} ({100.0 * new / total:.4f} %)':>20} {plan.epoch_batches():>12,} "
              f"{statistics.median(times):>15.3f}")
    print(f"[batch {args.batch} per rank; new drop < world x batch by construction; one core, "
          f"median of {args.repeat}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
