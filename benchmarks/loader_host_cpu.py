"""Host CPU per image of the training loader (``data.decode_device: worker``) with its batches
finished on the CPU against on the GPU, measured interleaved in one run.

Workers send uint8 batches; the training process normalises them with augment.mean/std and, with
Mixup/CutMix on, mixes them (``batch.decode.BatchDecoder``) on the device the loader is built for
(``build_loader(..., device=)``). Per round and for each of plain and Mixup/CutMix batches, this
times ``--batches`` batches of 64 at 224 px from shards stored at shorter side 256
(``loader_throughput.make_images``), each finished on ``cpu`` and (where CUDA is present) on
``cuda``, and prints images/s and the CPU milliseconds per image of the training process (the
finish on the CPU, or the pinned-memory copy, upload and kernel launches) and of its workers. On a
machine without CUDA only the ``cpu`` rows run.

    python benchmarks/loader_host_cpu.py                    # 4 workers, 24 batches, 2 rounds
    python benchmarks/loader_host_cpu.py --workers 8 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loader_rate_check import children_cpu  # noqa: E402
from loader_throughput import make_images  # noqa: E402

from data_pipeline.config import AugmentConfig, DataConfig  # noqa: E402
from data_pipeline.loading.loader import build_loader  # noqa: E402
from data_pipeline.shards.sources import imagefolder  # noqa: E402
from data_pipeline.shards.writer import write_shards  # noqa: E402
from pretrain.observability.clock import synced_now  # noqa: E402


def measure(shards: Path, device: str, mix: bool, workers: int, batches: int) -> dict:
    """img/s and CPU ms per image of this process and of the workers over ``batches`` batches,
    after the batches the workers queued while the loader started."""
    aug = AugmentConfig(mixup_alpha=0.8, cutmix_alpha=1.0) if mix else AugmentConfig()
    cfg = DataConfig(train_shards=str(shards), workers=workers, shuffle_buffer=256, augment=aug)
    it = iter(build_loader(cfg, batch_size=64, img_size=224, seed=0, device=device))
    for _ in range(3 * workers):
        next(it)
    t = synced_now(device)  # the batches queued before have finished on the device
    main, work = time.process_time(), children_cpu()
    n = sum(next(it)[0].shape[0] for _ in range(batches))
    wall = synced_now(device) - t  # and the last one's finish
    main, work = time.process_time() - main, children_cpu() - work
    return {"img_s": n / wall, "main_ms": 1000 * main / n, "workers_ms": 1000 * work / n}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batches", type=int, default=24, help="timed batches of 64 per measurement")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "vitscale-loader-host-cpu"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    root = Path(args.data_dir)
    make_images(root / "images", args.images)
    shards = root / "shards-r256"
    if not (shards / "manifest.json").exists():
        write_shards(imagefolder(str(root / "images")), shards, shard_size=128, resize_shorter=256, quality=90,
                     workers=min(8, os.cpu_count() or 1), progress=False)
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    got: dict = {}
    for _ in range(args.rounds):
        for device in devices:
            for mix in (False, True):
                got.setdefault((device, mix), []).append(measure(shards, device, mix, args.workers, args.batches))
    print(f"{args.workers} workers, batch 64 at 224 px, stored side 256, median of {args.rounds} rounds "
          f"({torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}, {os.cpu_count()} CPUs)")
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in got.items()}
    for (device, mix), r in med.items():
        print(f"  finish on {device:4s}{' + Mixup/CutMix' if mix else '':15s} {r['img_s']:7.0f} img/s   CPU per image: "
              f"training process {r['main_ms']:.3f} ms, workers {r['workers_ms']:.3f} ms, "
              f"total {r['main_ms'] + r['workers_ms']:.3f} ms")
    if "cuda" in devices:
        for mix in (False, True):
            c, g = med["cpu", mix], med["cuda", mix]
            print(f"host CPU per image, finish on the CPU / on the GPU{' (Mixup/CutMix)' if mix else ''}: "
                  f"{(c['main_ms'] + c['workers_ms']) / (g['main_ms'] + g['workers_ms']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
