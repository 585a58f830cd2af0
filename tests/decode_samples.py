"""Samples, loader configs and checks shared by the decode tests (tests/unit/test_batch_decode.py,
test_dali_decode.py, test_decode_streams.py): shards that mix what the training process decodes
(baseline RGB and grey JPEGs) with what workers decode (PNG, progressive, large, CMYK, EXIF-rotated),
JPEGs that parse but do not decode, and the calm-versus-busy check of a GPU loader."""
import io
from dataclasses import replace

import numpy as np
import torch
from PIL import Image

from data_pipeline.config import AugmentConfig, DataConfig
from data_pipeline.loading.loader import build_loader


def encode_image(arr, fmt, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **kw)
    return buf.getvalue()


def mixed_samples(n: int, seed: int):
    """A mix of what shards hold: RGB and grey baseline JPEGs (decoded by the training process), and
    PNG, progressive, large, CMYK and EXIF-rotated JPEG members (decoded by the worker)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        arr = (rng.random((20, 24, 3)) * 200 + 20).astype(np.uint8)
        kind = i % 8
        if kind == 5:
            img = {"png": encode_image(arr, "PNG")}
        elif kind == 6:
            grey = np.ascontiguousarray(arr[..., 0])
            img = {"jpg": encode_image(grey, "JPEG", progressive=i % 16 == 14)}  # grey; every other one progressive
        elif kind == 7:
            exif = Image.Exif()
            exif[0x0112] = 6 if i % 16 == 7 else 1
            buf = io.BytesIO()
            (Image.fromarray(arr).convert("CMYK") if i % 16 == 15 else Image.fromarray(arr)).save(
                buf, "JPEG", exif=exif.tobytes())
            img = {"jpg": buf.getvalue()}
        elif i % 16 == 12:  # over (4 x img_size)^2 pixels: decoded by the worker (draft mode)
            big = (rng.random((72, 80, 3)) * 200 + 20).astype(np.uint8)
            img = {"jpg": encode_image(big, "JPEG", quality=90)}
        else:
            img = {"jpg": encode_image(arr, "JPEG", quality=90)}
        out.append((f"{seed:02d}{i:04d}", {**img, "cls": str(i % 5).encode()}))
    return out


def decode_cfg(shards, device, workers=1, **aug):
    return DataConfig(train_shards=str(shards / "manifest.json"), val_shards=str(shards / "manifest.json"),
                      workers=workers, shuffle_buffer=16, decode_device=device, max_corrupt_rate=0.1,
                      augment=replace(AugmentConfig(), **aug))


def run_loader(cfg, train=True, batches=None, device=None):
    loader = build_loader(cfg, rank=1, world_size=2, batch_size=8, seed=3, img_size=16, train=train, device=device)
    out = []
    for images, targets in loader:
        out.append((images.clone(), targets.clone(), list(loader.last_keys)))
        if batches and len(out) == batches:
            break
    return loader, out


def bogus_huffman(jpg: bytes) -> bytes:
    """``jpg`` with its first Huffman table's code counts set to 255 each: PIL's header parse (which
    skips table contents) and the EOI check pass, so the file is shipped undecoded, and every
    decoder (libjpeg-turbo in PIL and torchvision, nvJPEG) rejects the table."""
    at = jpg.index(b"\xff\xc4") + 5  # marker, length (2), class/id (1): then the 16 counts
    return jpg[:at] + b"\xff" * 16 + jpg[at + 16:]


def broken_jpegs(samples, at):
    """``samples`` with the JPEGs at positions ``at`` replaced by ones that do not decode (the header
    still parses, so they are shipped undecoded)."""
    out, rng = list(samples), np.random.default_rng(1)
    for i in at:
        key, members = out[i]
        jpg = encode_image((rng.random((40, 48, 3)) * 255).astype(np.uint8), "JPEG", quality=95)
        out[i] = (key, {"jpg": bogus_huffman(jpg), "cls": members["cls"]})
    return out


def calm_and_busy(make_loader, n: int = 8) -> None:
    """A GPU loader's first ``n`` batches equal whether the device is drained after each batch
    (calm) or the compute stream is kept busy the way a training step keeps it (busy); after the
    first busy batch no torch call may synchronise (sync debug mode "error"). ``make_loader()``
    builds a fresh loader whose batches arrive on the GPU."""
    def run(busy: bool):
        loader = make_loader()
        load = torch.randn(2048, 2048, device="cuda")
        out = []
        try:
            for i, (x, y) in enumerate(loader, 1):
                assert x.is_cuda
                out.append((x.clone(), y.clone()))  # on the compute stream, after the batch's event
                if busy:
                    for _ in range(30):  # a step's worth of queued kernels
                        load = torch.tanh(load @ load)
                    if i == 1:
                        torch.cuda.set_sync_debug_mode("error")
                else:
                    torch.cuda.synchronize()
                if i == n:
                    break
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return out

    calm, busy = run(False), run(True)
    assert len(calm) == len(busy) == n
    for (a, ta), (b, tb) in zip(calm, busy):
        assert torch.equal(a, b) and torch.equal(ta, tb)
