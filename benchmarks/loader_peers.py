"""The vitscale loader beside the loaders users would pick instead, measured interleaved in one run:
images/s per worker for the same JPEGs, the same pre-training transform at 224 (random resized
crop scale 0.08-1, ratio 3/4-4/3, flip 0.5, float32 normalised to [-1, 1], CHW), the same batch.

  vitscale     data_pipeline.loading.loader over shards written by vit-shards, decode in the workers
               (data.worker_decoder auto: the crop window only, with nvImageCodec, when installed);
               workers send uint8 batches, this process normalises them (build_loader's device:
               here the CPU; in training the GPU)
  vitscale-pil the same with data.worker_decoder=pil (PIL decodes the whole image): the fallback path
  streaming    MosaicML streaming: MDS shards written by its MDSWriter, StreamingDataset + DataLoader
  litdata      Lightning litdata: optimize() of PIL JPEGs (its JPEG serializer: decode_jpeg), StreamingDataLoader
  wds-timm     plain webdataset over the same tar shards + timm's create_transform (open_clip/timm style)
  wds-timm-u8  the same as timm's own training script sets it up with its prefetcher (use_prefetcher:
               uint8 tensors, timm's fast_collate), normalised here in this process as timm's
               PrefetchLoader does on the GPU
  spdl         Meta's SPDL (spdl-io + spdl): its thread pipeline, FFmpeg decode with the crop, resize and
               flip as a filter; one pipeline thread per "worker"
  dali-cpu     NVIDIA DALI pipeline on the CPU: readers.file + decoders.image_random_crop (ROI decode) +
               resize + crop_mirror_normalize; one DALI thread per "worker"
  ffcv         if it installs (it needs a C toolchain, OpenCV and libturbojpeg); else the install error
  imagefolder  torchvision ImageFolder + v2 transforms (PIL backend); only with --only

Every method reads the same JPEG bytes, stored by ``vit-shards --resize-shorter S --quality 90`` from
generated ImageNet-like JPEGs (``loader_throughput.make_images``): 500x375 originals for S=256 (the
default), originals with shorter side S (667x500 for S=500, ImageNet's typical full size, kept as
they are) above 375. So no peer pays for a larger decode than vitscale. Each peer is set up the way
its own documentation shows (its writer, its loader, its defaults). Peers live in their own virtual
environment, never in the project's .venv:

    python3.11 -m venv runs/peers-venv
    runs/peers-venv/bin/pip install torch==2.14.1 torchvision==0.29.1
    runs/peers-venv/bin/pip install -e '.[decode]' mosaicml-streaming litdata timm spdl nvidia-dali-cuda130 [ffcv]
    apt-get install libavfilter8 libavdevice59      # FFmpeg 5 libraries: spdl-io loads them at run time
    runs/peers-venv/bin/python benchmarks/loader_peers.py --workers 1,2 --resize-shorter 256,500 --rounds 3
    runs/peers-venv/bin/python benchmarks/loader_peers.py --decoders 512   # + simplejpeg, "PyTurboJPEG<2"

``--decoders N`` times the decode paths alone (PIL, torchvision, simplejpeg, PyTurboJPEG, the crop
window) instead. A peer that does not import is reported as missing with the error and the rest
still run. Goals (per worker, at each worker count and size): vitscale >= 1.3x the fastest Python
peer (streaming, litdata, wds-timm, spdl) and >= 1.0x DALI's CPU pipeline.

Loaders that send uint8 batches (vitscale, wds-timm-u8) are normalised in this process, on the
CPU, and that time counts in their CPU-seconds; on a GPU machine it runs on the GPU, so the script
also prints their images per CPU-second without it ("finish on the GPU": the main thread's time
in the finish, measured around it, taken out).
"""
from __future__ import annotations

import argparse
import gc
import io
import json
import math
import os
import random
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

from data_pipeline.loading import loader as loader_module  # noqa: E402
from data_pipeline.loading.batch.decode import BatchDecoder  # noqa: E402
from data_pipeline.loading.loader import build_loader  # noqa: E402
from data_pipeline.shards import crop_decode  # noqa: E402
from data_pipeline.shards.decode import draft  # noqa: E402
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


FINISH = {"cpu_s": 0.0}  # main-thread CPU seconds spent normalising uint8 batches, all loaders so far


class TimedFinisher(BatchDecoder):
    """The loader's own finisher (normalise, mix), its main-thread CPU time added to ``FINISH``."""

    def __call__(self, *args):
        t = time.thread_time()
        try:
            return super().__call__(*args)
        finally:
            FINISH["cpu_s"] += time.thread_time() - t


loader_module.BatchDecoder = TimedFinisher  # every vitscale loader built below


# ------------------------------------------------------------------------------------ data
def originals(shorter: int) -> tuple:
    """(width, height) of the generated originals for a stored shorter side: 500x375 (ImageNet-like)
    when that is large enough, else 4:3 originals with exactly that shorter side."""
    return (500, 375) if shorter <= 375 else (round(shorter * 4 / 3), shorter)


def prepare(root: Path, n: int, shorter: int) -> dict:
    """The JPEGs, vit-shards' shards of them, and the same stored bytes in each peer's format."""
    size = originals(shorter)
    root = root / (f"n{n}" if size == (500, 375) else f"n{n}-{size[0]}x{size[1]}")
    images = root / "imagefolder"
    make_images(images, n, size)
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
def vitscale(d, workers, batch, worker_decoder="auto"):
    cfg = DataConfig(train_shards=str(d["shards"]), workers=workers, shuffle_buffer=256, augment=AUG,
                     worker_decoder=worker_decoder)
    loader = build_loader(cfg, batch_size=batch, img_size=224, seed=0)
    print(f"    vitscale decode path: {loader.worker_decoder}", flush=True)
    return iter(loader)


def vitscale_pil(d, workers, batch):
    return vitscale(d, workers, batch, "pil")


def _pil_transform():
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(224, scale=SCALE, ratio=RATIO, antialias=True),
                       v2.RandomHorizontalFlip(AUG.hflip), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                       v2.Normalize(MEAN, STD)])


def wds_timm_u8(d, workers, batch):
    """``wds_timm`` as timm's train.py builds it with its prefetcher: the transform stops at uint8
    tensors (``use_prefetcher=True``), ``fast_collate`` batches them, and the batch is normalised
    after it arrives (timm's PrefetchLoader: ``x.float().sub_(255 mean).div_(255 std)`` on the GPU;
    here on the CPU, timed into ``FINISH``)."""
    import timm.data
    import webdataset as wds
    from timm.data.loader import fast_collate

    tf = timm.data.create_transform(224, is_training=True, scale=SCALE, ratio=RATIO, hflip=AUG.hflip, vflip=0.0,
                                    color_jitter=None, auto_augment=None, interpolation="bilinear", mean=MEAN,
                                    std=STD, re_prob=0.0, use_prefetcher=True)
    names = sorted(p.name for p in d["shards"].glob("*.tar"))
    urls = [str(d["shards"] / n) for n in names]
    ds = (wds.WebDataset(urls, shardshuffle=len(urls), nodesplitter=wds.split_by_node)
          .shuffle(256).decode("pil").to_tuple("jpg", "cls").map_tuple(tf, int)
          .batched(batch, collation_fn=fast_collate, partial=False))
    loader = wds.WebLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
    mean = torch.tensor([m * 255 for m in MEAN]).view(1, 3, 1, 1)
    std = torch.tensor([s * 255 for s in STD]).view(1, 3, 1, 1)

    def finished():
        for x, y in endless(lambda: loader):
            t = time.thread_time()
            x = x.float().sub_(mean).div_(std)
            FINISH["cpu_s"] += time.thread_time() - t
            yield x, y
    return finished()


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


def spdl_peer(d, workers, batch):
    """Meta's SPDL as its examples build a loader: a thread pipeline (``spdl.pipeline``) whose decode
    stage runs ``workers`` at once (FFmpeg through spdl-io, which releases the GIL), with the random
    resized crop, the resize and the flip as one FFmpeg filter (SPDL's way to preprocess), then
    batches normalised to float CHW. The crop box comes from the demuxed header's size."""
    import spdl.io
    from spdl.pipeline import PipelineBuilder
    from torchvision.transforms import v2

    samples = d["samples"]
    crop = v2.RandomResizedCrop(224, scale=SCALE, ratio=RATIO)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD).view(1, 3, 1, 1) * 255

    def source():
        rng = random.Random(0)
        while True:
            order = list(range(len(samples)))
            rng.shuffle(order)
            for i in order:
                yield samples[i][1], samples[i][2]

    def decode(item):
        data, label = item
        packets = spdl.io.demux_image(data)
        top, left, h, w = crop.get_params(torch.empty(1, packets.height, packets.width), list(SCALE), list(RATIO))
        flip = ",hflip" if random.random() < AUG.hflip else ""
        frames = spdl.io.decode_packets(
            packets, filter_desc=f"crop={w}:{h}:{left}:{top},scale=224:224:flags=bilinear{flip},format=rgb24")
        return spdl.io.to_numpy(spdl.io.convert_frames(frames)), label

    def collate(items):
        x = torch.from_numpy(np.stack([a for a, _ in items])).permute(0, 3, 1, 2).float()
        return x.sub_(mean).div_(std), torch.tensor([y for _, y in items])

    pipeline = (PipelineBuilder().add_source(source())
                .pipe(decode, concurrency=workers, output_order="completion")
                .aggregate(batch, drop_last=True)
                .pipe(collate)
                .add_sink(2)
                .build(num_threads=workers))
    pipeline.start()
    return iter(pipeline.get_iterator(timeout=600))


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


PEERS = {"vitscale": vitscale, "vitscale-pil": vitscale_pil, "streaming": streaming_peer, "litdata": litdata_peer,
         "wds-timm": wds_timm, "wds-timm-u8": wds_timm_u8, "spdl": spdl_peer, "dali-cpu": dali_cpu,
         "ffcv": ffcv_peer, "imagefolder": imagefolder_peer}
UINT8 = ("vitscale", "vitscale-pil", "wds-timm-u8")  # normalised in this process: on a GPU, by the GPU
DEFAULT = [n for n in PEERS if n != "imagefolder"]
PYTHON_PEERS = ("streaming", "litdata", "wds-timm", "spdl")  # the goal: vitscale >= 1.3x the fastest of these


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

    def draft_path(b, box):  # data.worker_decoder=pil: DCT-scaled when the crop has 2x the pixels per side
        img = Image.open(io.BytesIO(b))
        top, left, hh, ww = box
        r = min(hh, ww) / 224
        img, sx, sy = draft(img, math.ceil(img.size[0] / r), math.ceil(img.size[1] / r))
        rgb = F.pil_to_tensor(img.convert("RGB"))
        if sx != 1.0 or sy != 1.0:
            top, left = int(top * sy), int(left * sx)
            hh = max(1, min(rgb.shape[1] - top, round(hh * sy)))
            ww = max(1, min(rgb.shape[2] - left, round(ww * sx)))
        return F.resized_crop(rgb, top, left, hh, ww, [224, 224], antialias=True)

    paths = {"PIL full decode": pil, "PIL, draft when crop >= 2x (vitscale pil)": draft_path,
             "torchvision decode_jpeg full (litdata)": tv}
    try:
        window = crop_decode.decoder()
        paths["crop window, nvImageCodec (vitscale)"] = lambda b, box: F.resize(
            torch.from_numpy(window(b, *box)).permute(2, 0, 1), [224, 224], antialias=True)
    except ImportError:
        pass
    try:
        import simplejpeg

        def sj_scaled(b, box):  # DCT scaling (1/2..1/8) of the whole image when the crop allows it
            top, left, hh, ww = box
            H, W = simplejpeg.decode_jpeg_header(b)[:2]
            f = 1
            while f < 8 and min(hh, ww) >= 2 * f * 224:
                f *= 2
            a = simplejpeg.decode_jpeg(b, "RGB", min_height=math.ceil(H / f), min_width=math.ceil(W / f))
            sy, sx = a.shape[0] / H, a.shape[1] / W
            if sx != 1.0 or sy != 1.0:
                top, left = int(top * sy), int(left * sx)
                hh, ww = max(1, min(a.shape[0] - top, round(hh * sy))), max(1, min(a.shape[1] - left, round(ww * sx)))
            return F.resized_crop(torch.from_numpy(a).permute(2, 0, 1), top, left, hh, ww, [224, 224], antialias=True)
        paths["simplejpeg, DCT-scaled when crop >= 2x"] = sj_scaled

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
    ref = [pil(b, box) for b, box in zip(data, boxes)]
    print(f"\ndecode + crop + resize to 224, ms per image over {len(data)} stored JPEGs (one thread, "
          "median of 3 passes; |diff| to PIL's full decode + crop + resize: mean, max):")
    for name, f in paths.items():
        diffs = [(f(b, box).int() - r.int()).abs() for b, box, r in zip(data, boxes, ref)]
        diff = f"{float(torch.stack([x.float().mean() for x in diffs]).mean()):.3f}, {max(int(x.max()) for x in diffs)}"
        times = []
        for _ in range(3):
            t = time.perf_counter()
            for b, box in zip(data, boxes):
                f(b, box)
            times.append((time.perf_counter() - t) * 1000 / len(data))
        print(f"  {name:<44s} {float(np.median(times)):6.3f} ms   [{min(times):.3f}-{max(times):.3f}]   diff {diff}")


def check_batch(name, x) -> None:
    """Same output semantics: float32 (B, 3, 224, 224) in about [-1, 1]."""
    assert x.dtype == torch.float32 and tuple(x.shape[1:]) == (3, 224, 224), (name, x.dtype, x.shape)
    lo, hi = float(x.min()), float(x.max())
    assert -1.05 <= lo < 0 < hi <= 1.05, (name, lo, hi)


def drain(it, workers: int) -> None:
    """While the others ran, this loader filled its queues (2 batches per DataLoader worker, DALI's
    prefetch depth 2, SPDL's stage queues: about 6 batches): take those untimed, at least 2 per
    worker and then until two batches in a row took longer than a queued one takes (10 ms), so
    that the timed batches are made from now on."""
    for _ in range(2 * workers):
        next(it)
    slow = 0
    for _ in range(32):
        t = time.perf_counter()
        next(it)
        slow = slow + 1 if time.perf_counter() - t > 0.010 else 0
        if slow == 2:
            return


TICK = os.sysconf("SC_CLK_TCK")


def _children() -> set:
    """PIDs of this process's descendants (DataLoader workers and whatever they start)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, pp in parent.items() if pp in frontier} - found
        found |= frontier
    return found


def _threads() -> set:
    """Thread ids of this process (DALI's and SPDL's decode threads run here)."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def _ticks(path: str) -> float:
    """CPU seconds (user + system) of the process or thread whose stat file is ``path``."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, IndexError, ValueError):  # gone: it used nothing more
        return 0.0


def _cpu(pids, tids) -> float:
    """CPU seconds used so far by one loader: this process's main thread (which receives its
    batches), the threads it started here (``tids``) and its processes (``pids``). Other loaders'
    threads refilling their queues meanwhile are not counted."""
    return (time.thread_time() + sum(_ticks(f"/proc/self/task/{t}/stat") for t in tids)
            + sum(_ticks(f"/proc/{p}/stat") for p in pids))


def measure(d, names, workers_list, args, missing) -> dict:
    """{name: {workers: {median, min, max, cpu, gpu_finish}}} for one stored size, methods
    interleaved per round; ``cpu``: median images per CPU-second of the loader (its processes and
    threads, see ``_cpu``); ``gpu_finish`` (uint8 loaders): the same without the main thread's time
    normalising and mixing (``FINISH``), what the host spends when a GPU finishes the batch."""
    results = {}
    for workers in workers_list:
        its, pids, tids = {}, {}, {}
        for name in names:
            if name in missing:
                continue
            try:
                t = time.perf_counter()
                before, threads = _children(), _threads()
                it = PEERS[name](d, workers, args.batch)
                x = next(it)[0]
                check_batch(name, x)
                rate_batches(it, 1)  # warm-up: workers started, buffers filled
                its[name], pids[name], tids[name] = it, _children() - before, _threads() - threads
                print(f"  {name:<12s} workers={workers}: ready in {time.perf_counter() - t:.1f} s", flush=True)
            except Exception as e:  # a peer that does not install or run here: say so, go on
                missing[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                print(f"  {name:<12s} unavailable: {missing[name]}", flush=True)
        rates, per_cpu, gpu_finish = {k: [] for k in its}, {k: [] for k in its}, {k: [] for k in its}
        for _ in range(args.rounds):
            for name, it in its.items():
                drain(it, workers)
                c, f = _cpu(pids[name], tids[name]), FINISH["cpu_s"]
                rates[name].append(rate_batches(it, args.batches) / workers)
                used, finish = _cpu(pids[name], tids[name]) - c, FINISH["cpu_s"] - f
                per_cpu[name].append(args.batches * args.batch / max(used, 1e-9))
                gpu_finish[name].append(args.batches * args.batch / max(used - finish, 1e-9))
        for name, r in rates.items():
            results.setdefault(name, {})[workers] = {"median": float(np.median(r)), "min": min(r), "max": max(r),
                                                     "cpu": float(np.median(per_cpu[name]))}
            if name in UINT8:
                results[name][workers]["gpu_finish"] = float(np.median(gpu_finish[name]))
        del its
        gc.collect()
        time.sleep(1)
    return results


def report(results: dict, names: list, shorter: int, args) -> list:
    """Prints the tables and the ratios; returns the goal lines."""
    counts = sorted({w for r in results.values() for w in r})
    print(f"\nstored shorter side {shorter}: batch {args.batch}, 224 px, torch threads 1, {args.rounds} rounds")
    head = (f"{f'{w} worker(s): img/s per worker':>34s}{'img per CPU-s':>15s}{'finish on GPU':>15s}" for w in counts)
    print(f"{'method':<13s}" + "".join(head))
    for name in names:
        if name in results:
            cells = "".join((f"{r['median']:10.0f} [{r['min']:.0f}-{r['max']:.0f}]".rjust(34) + f"{r['cpu']:15.0f}"
                             + (f"{r['gpu_finish']:15.0f}" if "gpu_finish" in r else " " * 15))
                            if r else " " * 64 for r in (results[name].get(w) for w in counts))
            print(f"{name:<13s}{cells}")
    goals = []
    for w in counts:
        if w not in results.get("vitscale", {}):
            continue
        for key, what in (("median", "img/s per worker"), ("cpu", "img per CPU-second"),
                          ("gpu_finish", "img per CPU-second, uint8 batches finished on the GPU")):
            ours = results["vitscale"][w][key]
            # the float32 peers' own measure; uint8 peers (wds-timm-u8) on the same footing as ours
            theirs = {n: r[w].get(key, r[w]["cpu"]) if key == "gpu_finish" else r[w][key]
                      for n, r in results.items() if n != "vitscale" and w in r}
            ratios = {n: ours / v for n, v in theirs.items()}
            print(f"{w} worker(s), {what}, vitscale / each: " + ", ".join(f"{n} {v:.2f}" for n, v in ratios.items()))
            py = {n: theirs[n] for n in PYTHON_PEERS if n in theirs}
            line = f"side {shorter}, {w} worker(s), {what}:"
            if py:
                best = max(py, key=py.get)
                line += f" vitscale / fastest Python peer ({best}) = {ours / py[best]:.2f} (goal >= 1.3)"
            if "dali-cpu" in ratios:
                line += f"; vitscale / DALI CPU = {ratios['dali-cpu']:.2f} (goal >= 1.0)"
            if key == "gpu_finish" and "wds-timm-u8" in ratios:
                line += f"; vitscale / wds-timm-u8 = {ratios['wds-timm-u8']:.2f}"
            goals.append(line)
    return goals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=1024, help="an epoch should span several measurements")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts (DALI, SPDL: threads)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=8, help="timed batches per measurement (after the prefetched ones)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of interleaved measurements per worker count")
    p.add_argument("--resize-shorter", default="256", help="comma-separated stored shorter sides, e.g. 256,500")
    p.add_argument("--only", help="comma-separated subset of: " + ",".join(PEERS))
    p.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "vitscale-loader-peers"))
    p.add_argument("--json", help="write the results here")
    p.add_argument("--decoders", type=int, metavar="N", help="instead: time the decode paths on N stored JPEGs")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    names = args.only.split(",") if args.only else DEFAULT
    workers_list = [int(w) for w in args.workers.split(",")]
    every, missing, goals = {}, {}, []
    for shorter in (int(x) for x in args.resize_shorter.split(",")):
        t = time.perf_counter()
        d = prepare(Path(args.data_dir), args.images, shorter)
        kb = np.mean([len(b) for _, b, _ in d["samples"]]) / 1024
        print(f"data: {len(d['samples'])} JPEGs, originals {originals(shorter)}, stored with shorter side {shorter} "
              f"(mean {kb:.0f} KB), prepared in {time.perf_counter() - t:.0f} s; load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)
        if args.decoders:
            decoders(d, args.decoders)
            continue
        every[shorter] = measure(d, names, workers_list, args, missing)
        goals += report(every[shorter], names, shorter, args)
        print(f"load average after: {os.getloadavg()[0]:.1f}", flush=True)
    if goals:
        print("\n" + "\n".join(goals))
    for name, why in missing.items():
        print(f"{name}: not measured: {why}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": every, "missing": missing, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
