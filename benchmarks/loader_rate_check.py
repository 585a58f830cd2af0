"""The performance model's input line against a real 2-rank loading run on this machine.

Per round, interleaved so that other load on the machine biases both alike:

1. the per-worker rate: our loader (``data_pipeline.loading.loader``, 1 rank, 1 worker, the
   pre-training transforms at 224 px, shards stored at shorter side 256) timed in this process,
   as ``benchmarks/loader_throughput.py`` (b) measures it;
2. a 2-rank run: two processes joined by a gloo process group, each iterating its own rank's
   loader with ``--workers`` workers from a common start (a barrier); img/s of both together, and
   the CPU share each rank process itself used while its workers decoded.

Then the model (``pretrain.perf.inputs.node_rate``) is asked for this node's loader rate with the
measured per-worker rate (images per CPU-second of the single worker: its rate on a core of its
own), the job's workers, this machine's cores and the ranks' measured CPU share (a training rank on
a GPU keeps a core busy launching kernels, the model's default; these ranks only take batches), and
prints predicted, measured and their ratio (median over rounds). The prediction is for an idle
machine: under other load the workers get fewer cores, so the script also prints the cores they got
(their CPU seconds over the wall time) and the per-core rate at those, which holds under any load.

    python benchmarks/loader_rate_check.py                    # 1 worker per rank, 3 rounds, ~2 min
    python benchmarks/loader_rate_check.py --workers 2 --rounds 5
    python benchmarks/loader_rate_check.py --worker-decoder pil   # data.worker_decoder (default auto)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from loader_throughput import make_images  # noqa: E402

WORLD = 2
STORED_SIDE = 256


def loader(shards: Path, workers: int, batch: int, decoder: str, rank: int = 0, world: int = 1):
    from data_pipeline.loading.loader import build_loader
    from pretrain.config import AugmentConfig, DataConfig

    cfg = DataConfig(train_shards=str(shards), workers=workers, shuffle_buffer=256, augment=AugmentConfig(),
                     worker_decoder=decoder)
    return iter(build_loader(cfg, rank=rank, world_size=world, batch_size=batch, img_size=224, seed=0))


def children_cpu() -> float:
    """CPU seconds the live child processes (the loader's workers) have used so far."""
    import psutil  # DeepSpeed's own dependency

    total = 0.0
    for c in psutil.Process().children(recursive=True):
        try:
            t = c.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def timed(it, batches: int) -> dict:
    """Images, wall seconds, this process's CPU seconds and its workers' over ``batches`` batches."""
    t0, c0, w0 = time.perf_counter(), time.process_time(), children_cpu()
    n = sum(next(it)[0].shape[0] for _ in range(batches))
    return {"images": n, "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
            "worker_cpu_seconds": children_cpu() - w0}


def rank_job(args) -> None:
    """One rank of the 2-rank run: its loader from a common start, numbers to ``args.out``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=WORLD)
    it = loader(Path(args.shards), args.workers, args.batch, args.worker_decoder, args.rank, WORLD)
    for _ in range(2):  # warm-up: workers started, shuffle buffers filled
        next(it)
    dist.barrier()
    got = timed(it, args.batches)
    dist.barrier()
    Path(args.out).write_text(json.dumps(got))
    dist.destroy_process_group()
    os._exit(0)  # the loader's workers go with the process


def two_ranks(args, shards: Path, tmp: Path) -> dict:
    from pretrain.distributed.process import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    outs = [tmp / f"rank{r}.json" for r in range(WORLD)]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--out", str(outs[r]), "--shards",
                               str(shards), "--workers", str(args.workers), "--batch", str(args.batch),
                               "--batches", str(args.batches), "--worker-decoder", args.worker_decoder], env=env)
             for r in range(WORLD)]
    for p in procs:
        if p.wait(timeout=600) != 0:
            sys.exit(f"loader_rate_check: a rank failed (exit {p.returncode})")
    got = [json.loads(o.read_text()) for o in outs]
    return {"images_per_second": sum(g["images"] / g["seconds"] for g in got),
            "rank_cores": sum(g["cpu_seconds"] / g["seconds"] for g in got) / WORLD,
            "worker_cores": sum(g["worker_cpu_seconds"] / g["seconds"] for g in got),
            "images_per_worker_cpu_second": sum(g["images"] for g in got) / sum(g["worker_cpu_seconds"] for g in got)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=1, help="data.workers of each rank in the 2-rank run")
    p.add_argument("--images", type=int, default=1536)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=12, help="batches timed per rank and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker-decoder", default="auto", choices=("auto", "nvimgcodec", "pil"),
                   help="data.worker_decoder of both runs (default auto, as the config)")
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "vitscale-loader-bench"))
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--shards", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is not None:
        rank_job(args)
        return 0

    import torch

    from data_pipeline.shards.sources import imagefolder
    from data_pipeline.shards.writer import write_shards
    from pretrain.perf import inputs

    torch.set_num_threads(1)
    root = Path(args.data_dir)
    make_images(root / "imagefolder", args.images)
    shards = root / f"shards-check-r{STORED_SIDE}"
    write_shards(imagefolder(str(root / "imagefolder")), shards, shard_size=64, resize_shorter=STORED_SIDE,
                 quality=90, workers=2, progress=False)
    from data_pipeline.shards.crop_decode import describe, resolve

    print(f"worker decode: {describe(resolve(args.worker_decoder))}", flush=True)
    cores = os.cpu_count()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            it = loader(shards, 1, args.batch, args.worker_decoder)
            for _ in range(2):
                next(it)
            one = timed(it, args.batches)
            del it
            # a worker's rate on a core of its own: images per CPU-second it used (its wall rate on an
            # idle machine; under other load the wall rate also counts the time it waited for a core)
            per_core = one["images"] / one["worker_cpu_seconds"]
            run = two_ranks(args, shards, Path(tmp))
            pred = inputs.node_rate("cpu", cores, WORLD, STORED_SIDE, per_core, workers=args.workers,
                                    rank_cores=run["rank_cores"])
            rows.append(dict(per_core=per_core, per_worker_wall=one["images"] / one["seconds"],
                             measured=run["images_per_second"], predicted=pred.images_per_second,
                             at_got=per_core * run["worker_cores"], worker_cores=run["worker_cores"],
                             rank_cores=run["rank_cores"], per_cpu_2=run["images_per_worker_cpu_second"],
                             load=os.getloadavg()[0]))
            print(f"round {r + 1}: 1 worker {per_core:4.0f} img/s per core ({rows[-1]['per_worker_wall']:.0f} wall); "
                  f"{WORLD} ranks x {args.workers}: measured {run['images_per_second']:4.0f} img/s, predicted "
                  f"{pred.images_per_second:4.0f} ({pred.limit}); the workers got {run['worker_cores']:.2f} cores "
                  f"({run['images_per_worker_cpu_second']:.0f} img per CPU-second), the ranks {run['rank_cores']:.2f} "
                  f"each; load average {rows[-1]['load']:.1f}", flush=True)
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    ratios = [row["measured"] / row["predicted"] for row in rows]
    print(f"decode rate {med['per_core']:.0f} img/s per worker on a core of its own (vit-launch plan --decode-rate "
          f"{med['per_core']:.0f} --stored-side {STORED_SIDE}); {WORLD} ranks x {args.workers} worker(s) on {cores} "
          f"cores: predicted {med['predicted']:.0f} img/s, measured {med['measured']:.0f} img/s, measured / predicted "
          f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}], median of {args.rounds} rounds, "
          f"load average {med['load']:.1f}")
    print(f"  other load: the workers got {med['worker_cores']:.2f} of {cores} cores; at those, per-core rate x "
          f"cores gives {med['at_got']:.0f} img/s (measured / that "
          f"{statistics.median(r['measured'] / r['at_got'] for r in rows):.2f}); per image a worker of the "
          f"{WORLD}-rank run used {med['per_core'] / med['per_cpu_2']:.2f}x the CPU of the single worker")
    return 0


if __name__ == "__main__":
    sys.exit(main())
