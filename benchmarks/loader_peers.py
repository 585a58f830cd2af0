"""The vitscale loader beside the loaders users would pick instead, measured interleaved in one run:
images/s per worker for the same JPEGs, the same pre-training transform at 224 (random resized
crop scale 0.08-1, ratio 3/4-4/3, flip 0.5, float32 normalised to [-1, 1], CHW), the same batch.

  vitscale     data_pipeline.loading.loader over shards written by vit-shards (decode in the workers)
  streaming    MosaicML streaming: MDS shards written by its MDSWriter, StreamingDataset + DataLoader
  litdata      Lightning litdata: optimize() of PIL JPEGs (its JPEG serializer: decode_jpeg), StreamingDataLoader
  wds-timm     plain webdataset over the same tar shards + timm's create_transform (open_clip/timm style)
  dali-cpu     NVIDIA DALI pipeline on the CPU: readers.file + decoders.image_random_crop (ROI decode) +
               resize + crop_mirror_normalize; one DALI thread per "worker"
  ffcv         if it installs (it needs a C toolchain, OpenCV and libturbojpeg); else the install error
  imagefolder  torchvision ImageFolder + v2 transforms (PIL backend)

Every method reads the same JPEG bytes: the ImageNet-like images of loader_throughput.py
(500x375, quality 90) stored with shorter side 256 as ``vit-shards --resize-shorter 256`` writes
them, so no peer pays for a larger decode than vitscale. Each peer is set up the way its own
documentation shows (its writer, its loader, its defaults). Peers live in their own virtual
environment, never in the project's .venv:

    python3.11 -m venv runs/peers-venv
    runs/peers-venv/bin/pip install --find-links /opt/pypi-more/files torch==2.14.1 torchvision==0.29.1
    runs/peers-venv/bin/pip install -e . mosaicml-streaming litdata timm nvidia-dali-cuda120 [ffcv]
    runs/peers-venv/bin/python benchmarks/loader_peers.py --workers 1,2 --rounds 3
    runs/peers-venv/bin/python benchmarks/loader_peers.py --decoders 512   # + simplejpeg, "PyTurboJPEG<2"

``--decoders N`` times the decode paths alone (PIL, torchvision, simplejpeg, PyTurboJPEG) instead.
A peer that does not import is reported as missing with the error and the rest still run.
"""
from __future__ import annotations

import argparse
import gc
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loader_throughput import make_images, rate_batches  # noqa: E402

from data_pipeline.loading.loader import build_loader  # noqa: E402
from data_pipeline.shards.sources import imagefolder  # noqa: E402
from data_pipeline.shards.writer import write_shards  # noqa: E402
from pretrain.config import AugmentConfig, DataConfig  # noqa: E402

AUG = AugmentConfig()
SCALE, RATIO = tuple(AUG.crop_scale), tuple(AUG.crop_ratio)
MEAN, STD = tuple(AUG.mean), tuple(AUG.std)


def endless(make):
    """Batches forever from a fresh iterable per epoch (loaders whose epochs end)."""
    while True:
        yield from make()


# ------------------------------------------------------------------------------------ data
def prepare(root: Path, n: int, shorter: int) -> dict:
    """The JPEGs, vit-shards' shards of them, and the same stored bytes in each peer's format."""
    root = root / f"n{n}"
    images = root / "imagefolder"
    make_images(images, n)
    shards = root / f"shards-r{shorter}"
    write_shards(imagefolder(str(images)), shards, shard_size=max(64, n // 8), resize_shorter=shorter, quality=90,
                 workers=2, progress=False)
    manifest = json.loads((shards / "manifest.json").read_text())
    samples = []  # (key, jpeg bytes, label) exactly as stored in the shards
    import webdataset as wds

    for s in manifest["shards"]:
        for sample in wds.WebDataset(str(shards / s["name"]), shardshuffle=False):
            samples.append((sample["__key__"], sample["jpg"], int(sample["cls"])))
    folder = root / f"folder-r{shorter}"  # ImageFolder layout of the stored bytes (imagefolder, DALI)
    if not (folder / "done").exists():
        shutil.rmtree(folder, ignore_errors=True)
        for key, data, label in samples:
            (folder / f"c{label}").mkdir(parents=True, exist_ok=True)
            (folder / f"c{label}" / f"{key}.jpg").write_bytes(data)
        (folder / "done").write_text("")
    return {"shards": shards, "folder": folder, "samples": samples, "root": root}


# --------------------------------------------------------------------------------- loaders
def vitscale(d, workers, batch):
    cfg = DataConfig(train_shards=str(d["shards"]), workers=workers, shuffle_buffer=256, augment=AUG)
    return iter(build_loader(cfg, batch_size=batch, img_size=224, seed=0))


def _pil_transform():
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(224, scale=SCALE, ratio=RATIO, antialias=True),
                       v2.RandomHorizontalFlip(AUG.hflip), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                       v2.Normalize(MEAN, STD)])


def imagefolder_peer(d, workers, batch):
    from torchvision.datasets import ImageFolder

    loader = torch.utils.data.DataLoader(ImageFolder(str(d["folder"]), transform=_pil_transform()), batch_size=batch,
                                         shuffle=True, num_workers=workers, drop_last=True,
                                         persistent_workers=workers > 0)
    return endless(lambda: loader)


def wds_timm(d, workers, batch):
    """webdataset as its README and open_clip use it: shard shuffle, sample shuffle buffer, PIL decode,
    timm's training transform (colour jitter and random erasing off: the same semantics as ours)."""
    import timm.data
    import webdataset as wds

    tf = timm.data.create_transform(224, is_training=True, scale=SCALE, ratio=RATIO, hflip=AUG.hflip, vflip=0.0,
                                    color_jitter=None, auto_augment=None, interpolation="bilinear", mean=MEAN,
                                    std=STD, re_prob=0.0)
    names = sorted(p.name for p in d["shards"].glob("*.tar"))
    urls = [str(d["shards"] / n) for n in names]
    ds = (wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.split_by_node)
          .shuffle(256).decode("pil").to_tuple("jpg", "cls").map_tuple(tf, int).batched(batch, partial=False))
    loader = wds.WebLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
    return endless(lambda: loader)


def streaming_peer(d, workers, batch):
    """MosaicML streaming: MDSWriter with the image bytes as they are stored (``bytes``; its ``jpeg``
    encoding would re-encode them), StreamingDataset(shuffle=True) decoding with PIL + the same
    torchvision transform, the torch DataLoader its docs pair it with."""
    from streaming import MDSWriter
    from streaming.base.util import clean_stale_shared_memory

    out = d["root"] / "mds"
    if not (out / "index.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        with MDSWriter(out=str(out), columns={"image": "bytes", "label": "int"}, compression=None) as w:
            for _, data, label in d["samples"]:
                w.write({"image": data, "label": label})
    clean_stale_shared_memory()
    ds = MDSImages(local=str(out), shuffle=True, batch_size=batch)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=workers, drop_last=True,
                                         persistent_workers=workers > 0)
    return endless(lambda: loader)


def _litdata_item(item):
    from PIL import Image

    path, label = item
    return {"image": Image.open(path), "label": label}  # a JpegImageFile: litdata stores the file's bytes


try:  # the peers pickle their datasets into their workers: the classes live at module level
    import streaming as _streaming
except ImportError:
    _streaming = None

if _streaming is not None:
    class MDSImages(_streaming.StreamingDataset):
        """MosaicML's StreamingDataset decoding the stored bytes with PIL + the same transform."""

        def __getitem__(self, idx):
            from PIL import Image

            if not hasattr(self, "tf"):
                self.tf = _pil_transform()
            s = super().__getitem__(idx)
            return self.tf(Image.open(io.BytesIO(s["image"])).convert("RGB")), s["label"]


try:
    import litdata as _ld
except ImportError:
    _ld = None

if _ld is not None:
    class LitImages(_ld.StreamingDataset):
        """litdata's StreamingDataset with the same tensor transform."""

        def __getitem__(self, idx):
            from torchvision.transforms import v2

            if not hasattr(self, "tf"):
                self.tf = v2.Compose([v2.RandomResizedCrop(224, scale=SCALE, ratio=RATIO, antialias=True),
                                      v2.RandomHorizontalFlip(AUG.hflip), v2.ToDtype(torch.float32, scale=True),
                                      v2.Normalize(MEAN, STD)])
            s = super().__getitem__(idx)
            img = s["image"]
            if not isinstance(img, torch.Tensor):  # without torchvision's decoder litdata gives PIL
                img = v2.functional.pil_to_tensor(img.convert("RGB"))
            return self.tf(img), s["label"]


def litdata_peer(d, workers, batch):
    """litdata: optimize() of PIL JPEG images (its JPEG serializer keeps the bytes and decodes with
    torchvision's decode_jpeg), StreamingDataset + StreamingDataLoader, tensor transforms."""
    import litdata as ld

    out = d["root"] / "litdata"
    if not (out / "index.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        files = sorted(d["folder"].glob("c*/*.jpg"))
        ld.optimize(fn=_litdata_item, inputs=[(str(f), int(f.parent.name[1:])) for f in files],
                    output_dir=str(out), chunk_bytes="64MB", num_workers=1)
    ds = LitImages(str(out), shuffle=True, drop_last=True)
    loader = ld.StreamingDataLoader(ds, batch_size=batch, num_workers=workers, drop_last=True,
                                    persistent_workers=workers > 0)
    return endless(lambda: loader)


def dali_cpu(d, workers, batch):
    """DALI on the CPU (device_id=None): ROI decode of the random crop (libjpeg-turbo), resize,
    flip + normalise to float CHW; ``workers`` DALI threads."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator

    @pipeline_def(batch_size=batch, num_threads=workers, device_id=None, seed=0, prefetch_queue_depth=2)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=str(d["folder"]), random_shuffle=True, name="r")
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB, random_area=list(SCALE),
                                               random_aspect_ratio=list(RATIO))
        images = fn.resize(images, resize_x=224, resize_y=224, antialias=True)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                          mean=[m * 255 for m in MEAN], std=[s * 255 for s in STD],
                                          mirror=fn.random.coin_flip(probability=AUG.hflip))
        return images, labels

    p = pipe()
    p.build()
    it = DALIGenericIterator([p], ["x", "y"], reader_name="r", auto_reset=True)

    def batches():
        for out in it:
            yield out[0]["x"], out[0]["y"]
    return endless(batches)


def ffcv_peer(d, workers, batch):
    import ffcv  # noqa: F401  (the benchmark only reaches here when it imports)
    raise RuntimeError("ffcv imported but its pipeline is not written here")


PEERS = {"vitscale": vitscale, "streaming": streaming_peer, "litdata": litdata_peer, "wds-timm": wds_timm,
         "dali-cpu": dali_cpu, "ffcv": ffcv_peer, "imagefolder": imagefolder_peer}


def decoders(d, n: int) -> None:
    """The decode levers, one process, one thread: ms per image to turn the stored JPEG into the
    224x224 uint8 crop (the same crop boxes for every path; resize = torch's antialiased bilinear,
    as in ``transforms.SampleTransform``). Paths that are not installed are skipped."""
    import torchvision
    from PIL import Image
    from torchvision.transforms import v2
    from torchvision.transforms.v2 import functional as F

    torch.manual_seed(0)
    data = [b for _, b, _ in d["samples"][:n]]
    boxes = []
    for b in data:
        w, h = Image.open(io.BytesIO(b)).size
        boxes.append(v2.RandomResizedCrop.get_params(torch.empty(3, h, w), list(SCALE), list(RATIO)))

    def finish(chw, box):
        top, left, hh, ww = box
        return F.resized_crop(chw, top, left, hh, ww, [224, 224], antialias=True)

    def pil(b, box):
        return finish(F.pil_to_tensor(Image.open(io.BytesIO(b)).convert("RGB")), box)

    def tv(b, box):
        return finish(torchvision.io.decode_jpeg(torch.frombuffer(b, dtype=torch.uint8)), box)

    paths = {"PIL full decode (vitscale today)": pil, "torchvision decode_jpeg full (litdata)": tv}
    try:
        import simplejpeg

        paths["simplejpeg full decode"] = lambda b, box: finish(
            torch.from_numpy(simplejpeg.decode_jpeg(b, "RGB")).permute(2, 0, 1), box)
        paths["simplejpeg fastdct+fastupsample"] = lambda b, box: finish(
            torch.from_numpy(simplejpeg.decode_jpeg(b, "RGB", fastdct=True, fastupsample=True)).permute(2, 0, 1), box)
    except ImportError:
        pass
    try:
        from turbojpeg import TJPF_RGB, TurboJPEG

        tj = TurboJPEG()

        def tj_crop(b, box):  # lossless MCU-aligned crop of the box, then decode only that
            top, left, hh, ww = box
            x0, y0 = left // 16 * 16, top // 16 * 16
            small = tj.crop(b, x0, y0, left + ww - x0, top + hh - y0)
            rgb = torch.from_numpy(tj.decode(small, pixel_format=TJPF_RGB)).permute(2, 0, 1)
            return F.resized_crop(rgb, top - y0, left - x0, hh, ww, [224, 224], antialias=True)
        paths["PyTurboJPEG full decode"] = lambda b, box: finish(
            torch.from_numpy(tj.decode(b, pixel_format=TJPF_RGB)).permute(2, 0, 1), box)
        paths["PyTurboJPEG crop-then-decode"] = tj_crop
    except (ImportError, RuntimeError, OSError):
        pass
    ref = [pil(b, box) for b, box in zip(data[:8], boxes[:8])]
    print(f"\ndecode + crop + resize to 224, ms per image over {len(data)} stored JPEGs (one thread, "
          "median of 3 passes; max |diff| to PIL's pixels on 8 images):")
    for name, f in paths.items():
        diff = max(int((f(b, box).int() - r.int()).abs().max()) for b, box, r in zip(data, boxes, ref))
        times = []
        for _ in range(3):
            t = time.perf_counter()
            for b, box in zip(data, boxes):
                f(b, box)
            times.append((time.perf_counter() - t) * 1000 / len(data))
        print(f"  {name:<38s} {float(np.median(times)):6.3f} ms   [{min(times):.3f}-{max(times):.3f}]   diff {diff}")


def check_batch(name, x) -> None:
    """Same output semantics: float32 (B, 3, 224, 224) in about [-1, 1]."""
    assert x.dtype == torch.float32 and tuple(x.shape[1:]) == (3, 224, 224), (name, x.dtype, x.shape)
    lo, hi = float(x.min()), float(x.max())
    assert -1.05 <= lo < 0 < hi <= 1.05, (name, lo, hi)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=1024, help="an epoch should span several measurements")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts (DALI: threads)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=8, help="timed batches per measurement (after the prefetched ones)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of interleaved measurements per worker count")
    p.add_argument("--resize-shorter", type=int, default=256)
    p.add_argument("--only", help="comma-separated subset of: " + ",".join(PEERS))
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "vitscale-loader-peers"))
    p.add_argument("--json", help="write the results here")
    p.add_argument("--decoders", type=int, metavar="N", help="instead: time the decode paths on N stored JPEGs")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t = time.perf_counter()
    d = prepare(Path(args.data_dir), args.images, args.resize_shorter)
    kb = np.mean([len(b) for _, b, _ in d["samples"]]) / 1024
    print(f"data: {len(d['samples'])} JPEGs stored with shorter side {args.resize_shorter} (mean {kb:.0f} KB), "
          f"prepared in {time.perf_counter() - t:.0f} s", flush=True)
    if args.decoders:
        decoders(d, args.decoders)
        return 0
    names = args.only.split(",") if args.only else list(PEERS)
    results, missing = {}, {}
    for workers in (int(w) for w in args.workers.split(",")):
        its = {}
        for name in names:
            if name in missing:
                continue
            try:
                t = time.perf_counter()
                it = PEERS[name](d, workers, args.batch)
                x = next(it)[0]
                check_batch(name, x)
                rate_batches(it, 1)  # warm-up: workers started, buffers filled
                its[name] = it
                print(f"  {name:<12s} workers={workers}: ready in {time.perf_counter() - t:.1f} s", flush=True)
            except Exception as e:  # a peer that does not install or run here: say so, go on
                missing[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                print(f"  {name:<12s} unavailable: {missing[name]}", flush=True)
        rates = {k: [] for k in its}
        for _ in range(args.rounds):
            for name, it in its.items():
                # While the others ran, this loader filled its prefetch queue (2 batches per worker,
                # DALI's 2): take those untimed, then time batches made from now on.
                for _ in range(2 * workers):
                    next(it)
                rates[name].append(rate_batches(it, args.batches) / workers)
        for name, r in rates.items():
            results.setdefault(name, {})[workers] = {"median": float(np.median(r)), "min": min(r), "max": max(r)}
        del its
        gc.collect()
        time.sleep(1)

    counts = sorted({w for r in results.values() for w in r})
    print(f"\nimages/s per worker, median of {args.rounds} rounds [min-max]; batch {args.batch}, 224 px, "
          "torch threads 1")
    print(f"{'method':<12s}" + "".join(f"{f'{w} worker(s)':>26s}" for w in counts))
    for name in names:
        if name in results:
            cells = "".join(f"{r['median']:10.0f} [{r['min']:.0f}-{r['max']:.0f}]".rjust(26) if r else " " * 26
                            for r in (results[name].get(w) for w in counts))
            print(f"{name:<12s}{cells}")
    for w in counts:
        peers = {n: r[w]["median"] for n, r in results.items() if n != "vitscale" and w in r}
        if "vitscale" in results and w in results["vitscale"] and peers:
            best = max(peers, key=peers.get)
            ours = results["vitscale"][w]["median"]
            print(f"{w} worker(s): vitscale / fastest peer ({best}) = {ours / peers[best]:.2f} (goal >= 1.3)")
    for name, why in missing.items():
        print(f"{name}: not measured: {why}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "missing": missing, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
