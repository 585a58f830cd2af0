"""Loader throughput against two references measured in the same run, images/s per worker:

  (a) JPEG decode alone with PIL (``Image.open(f).convert("RGB")``) of the original files
  (b) our loader (data_pipeline.loading.loader) with the pre-training transforms at 224, reading shards
      written with ``vit-shards --resize-shorter S`` from the same files
  (c) torchvision ImageFolder + DataLoader with the same transforms (RandomResizedCrop 224, flip,
      to float, normalise) over the original files
  (b0) our loader on shards *without* pre-resizing, to show what the pre-resize buys
  (bd) with ``--decode-device cuda`` (or ``cpu``): (b)'s shards with data.decode_device=DEVICE, the
       training process decoding each batch (nvJPEG on a GPU); compared with (b) in total img/s

Targets: b/c >= 1.5 and b/a >= 0.8. Images are generated: about ImageNet-sized
(500x375 and 375x500) JPEGs at quality 90 with natural-image-like content (smooth regions, edges
and fine noise), so file sizes are in ImageNet's range. Default run: under two minutes on 2 cores.

    python benchmarks/loader_throughput.py                    # 768 images, 1 worker, batch 64, 3 rounds
    python benchmarks/loader_throughput.py --images 2048 --workers 2
    python benchmarks/loader_throughput.py --workers 8 --decode-device cuda   # on a GPU machine

The last lines give the measured per-worker rates as ``vit-launch plan --decode-rate`` flags, so
the performance model's input line uses this machine's own decode speed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_pipeline.loading.loader import build_loader  # noqa: E402
from data_pipeline.shards.demo_data import demo_items  # noqa: E402
from data_pipeline.shards.sources import imagefolder  # noqa: E402
from data_pipeline.shards.writer import write_shards  # noqa: E402
from pretrain.config import AugmentConfig, DataConfig  # noqa: E402
from pretrain.observability.clock import synced_now  # noqa: E402

CLASSES = 10


def make_images(root: Path, n: int, size: tuple = (500, 375)) -> None:
    """ImageNet-like JPEGs in an ImageFolder layout (one sub-folder per class): demo shapes scaled
    to ``size`` (every fourth one turned upright: 375x500 for the default 500x375) plus coarse and
    fine noise, so that at quality 90 files average about 100 KB at 500x375, near ImageNet's mean
    (~110 KB); smooth synthetic images would decode unrealistically fast."""
    recipe = {"n": n, "version": 2} if tuple(size) == (500, 375) else {"n": n, "version": 2, "size": list(size)}
    if (root / "done").exists() and json.loads((root / "done").read_text()) == recipe:
        return
    _, items = demo_items("train", n)
    rng = np.random.default_rng(0)
    for i, item in enumerate(items):
        w, h = tuple(size) if i % 4 else tuple(size)[::-1]
        arr = np.asarray(item.load().resize((w, h), Image.BICUBIC), np.float32)
        coarse = rng.normal(128, 30, (h // 4 + 1, w // 4 + 1, 3)).clip(0, 255).astype(np.uint8)
        arr += np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC), np.float32) - 128
        arr += rng.normal(0, 12, (h, w, 1))
        d = root / f"c{item.labels[0]}"
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(d / f"{i:06d}.jpg", quality=90)
    (root / "done").write_text(json.dumps(recipe))


def rate_pil(files) -> float:
    t0 = time.perf_counter()
    for f in files:
        with Image.open(f) as img:
            img.convert("RGB")
    return len(files) / (time.perf_counter() - t0)


def rate_batches(it, batches: int) -> float:
    # (bd) on a GPU: each clock read waits for the device (at the start, the batches queued before;
    # at the end, the last batch's decode); on the CPU, or before CUDA starts, synced_now only reads it
    def device():
        return "cuda" if torch.cuda.is_initialized() else None

    t0 = synced_now(device())
    n = sum(next(it)[0].shape[0] for _ in range(batches))
    return n / (synced_now(device()) - t0)


def ours(shards: Path, workers: int, batch: int, decode_device: str = "worker"):
    cfg = DataConfig(train_shards=str(shards), workers=workers, shuffle_buffer=256, augment=AugmentConfig(),
                     decode_device=decode_device)
    return iter(build_loader(cfg, batch_size=batch, img_size=224, seed=0))  # endless


def imagefolder_loader(root: Path, workers: int, batch: int):
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2

    aug = AugmentConfig()
    tf = v2.Compose([v2.RandomResizedCrop(224, scale=tuple(aug.crop_scale), ratio=tuple(aug.crop_ratio),
                                          antialias=True),
                     v2.RandomHorizontalFlip(aug.hflip), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                     v2.Normalize(aug.mean, aug.std)])
    loader = torch.utils.data.DataLoader(ImageFolder(str(root), transform=tf), batch_size=batch, shuffle=True,
                                         num_workers=workers, drop_last=True, persistent_workers=workers > 0)
    while True:
        yield from loader


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=768)
    p.add_argument("--workers", type=int, default=1, help="dataloader workers for (b) and (c)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="measurements are interleaved a,b,c,b0 per round")
    p.add_argument("--settle", type=float, default=1.5, help="idle seconds before each measurement")
    p.add_argument("--resize-shorter", type=int, default=256, help="vit-shards --resize-shorter for (b)")
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "vitscale-loader-bench"))
    p.add_argument("--skip-full", action="store_true", help="skip (b0), the loader on full-size shards")
    p.add_argument("--decode-device", choices=("cpu", "cuda", "dali"), help="add (bd): data.decode_device=DEVICE")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    root = Path(args.data_dir)
    images = root / "imagefolder"
    t = time.perf_counter()
    make_images(images, args.images)
    src = imagefolder(str(images))
    shard_size = max(args.batch, args.images // max(4, args.workers))
    resized = root / f"shards-r{args.resize_shorter}"
    write_shards(src, resized, shard_size=shard_size, resize_shorter=args.resize_shorter, quality=90,
                 workers=2, progress=False)
    full = root / "shards-full"
    write_shards(src, full, shard_size=shard_size, progress=False)
    files = [it.path for it in src.items]
    mean_kb = np.mean([os.path.getsize(f) for f in files]) / 1024
    print(f"data: {len(files)} JPEGs 500x375/375x500, mean {mean_kb:.0f} KB; shards pre-resized to shorter side "
          f"{args.resize_shorter}; prepared in {time.perf_counter() - t:.0f}s")

    # Loaders start once (start-up excluded); rounds interleave the methods so that load from
    # other processes on the machine biases all of them alike. Reported: median over rounds.
    per = max(1, args.workers)
    batches = max(2, min(args.images // 2, 256) // args.batch)
    runs = {"a": lambda: rate_pil(files[: batches * args.batch])}
    its = {"b": ours(resized, args.workers, args.batch), "c": imagefolder_loader(images, args.workers, args.batch)}
    if not args.skip_full:
        its["b0"] = ours(full, args.workers, args.batch)
    if args.decode_device:
        its["bd"] = ours(resized, args.workers, args.batch, args.decode_device)
    for name, it in its.items():
        rate_batches(it, 2)  # warm-up: workers started, shuffle buffers filled
        runs[name] = (lambda it=it: rate_batches(it, batches) / per)
    rates = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k, f in runs.items():
            # the loader measured last refills its prefetch queue in the background: let it finish
            time.sleep(args.settle)
            rates[k].append(f())
    med = {k: float(np.median(v)) for k, v in rates.items()}
    spread = {k: f"[{min(v):.0f}-{max(v):.0f}]" for k, v in rates.items()}
    print(f"(a)  PIL decode alone, full-size JPEG           {med['a']:7.1f} img/s              {spread['a']}")
    print(f"(b)  vitscale loader, shards resized to {args.resize_shorter:<4d}    {med['b']:7.1f} img/s per worker   "
          f"{spread['b']}")
    print(f"(c)  torchvision ImageFolder, same transforms   {med['c']:7.1f} img/s per worker   {spread['c']}")
    if "b0" in med:
        print(f"(b0) vitscale loader, full-size shards          {med['b0']:7.1f} img/s per worker   {spread['b0']}")
    if "bd" in med:
        print(f"(bd) vitscale loader, decode_device={args.decode_device:<4s}         "
              f"{med['bd']:7.1f} img/s per worker   "
              f"{spread['bd']}   bd/b = {med['bd'] / med['b']:.2f}")
    print(f"b/a = {med['b'] / med['a']:.2f} (target >= 0.8)   b/c = {med['b'] / med['c']:.2f} (target >= 1.5)   "
          f"[median of {args.rounds} rounds; workers={args.workers}, batch={args.batch}, torch threads=1]")
    # the measured rates, in the words of the performance model's input line (pretrain/perf/inputs.py)
    print(f"vit-launch plan ... --decode cpu --decode-rate {med['b']:.0f} --stored-side {args.resize_shorter}")
    if "b0" in med:
        print(f"vit-launch plan ... --decode cpu --decode-rate {med['b0']:.0f} --stored-side 375   # full-size shards")
    if "bd" in med and args.decode_device == "cuda":
        print(f"vit-launch plan ... --decode cuda --decode-rate {med['bd']:.0f} --stored-side {args.resize_shorter}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
