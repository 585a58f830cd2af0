"""data.worker_decoder: decoding only a JPEG's crop window (nvImageCodec's CPU backend) gives the
pixels of that window of PIL's full decode, the same crop boxes and draws as the PIL path, the same
corrupt-sample verdicts, and a fallback to PIL when nvImageCodec is missing; the marker walk that
replaces PIL's header parse for plain files reads headers as PIL does.

Tolerance: the window is decoded by libjpeg-turbo with the same integer IDCT and fancy upsampling
as PIL's libjpeg-turbo, and libjpeg-turbo decodes the bordering blocks that upsampling reads, so the
pixels should be equal; the bound allows one grey level (a rounding difference between two builds'
SIMD kernels) and a mean of 0.01. Measured on these files: 0 and 0.
"""
from __future__ import annotations

import io
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as F

from data_pipeline.errors import ConfigError
from data_pipeline.loading.loader import build_loader
from data_pipeline.loading.transforms import SampleTransform
from data_pipeline.shards import crop_decode
from data_pipeline.shards.decode import BadSample, exif_orientation, open_image
from data_pipeline.shards.demo_data import HUES, draw
from pretrain.config import AugmentConfig, DataConfig, load_config

MAX_DIFF, MAX_MEAN = 1, 0.01  # grey levels (0-255): see the module docstring


def _photo(w: int, h: int, seed: int = 0) -> Image.Image:
    """A demo shape with coarse and fine noise: edges, smooth areas and texture, like a photo."""
    rng = np.random.default_rng(seed)
    arr = np.asarray(draw("star", HUES["star"], rng).resize((w, h), Image.BICUBIC), np.float32)
    coarse = rng.normal(128, 30, (h // 4 + 1, w // 4 + 1, 3)).clip(0, 255).astype(np.uint8)
    arr += np.asarray(Image.fromarray(coarse).resize((w, h), Image.BICUBIC), np.float32) - 128
    arr += rng.normal(0, 12, (h, w, 1))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def _jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


# 4:4:4, 4:2:2, 4:2:0 (blocks of 8, 16x8, 16x16 pixels), progressive, grey; sizes not multiples of 16
VARIANTS = {"444": dict(subsampling=0), "422": dict(subsampling=1), "420": dict(subsampling=2),
            "restart markers": dict(restart_marker_rows=1), "progressive": dict(progressive=True), "grey": dict()}


def test_window_pixels_equal_full_decode():
    decode = crop_decode.decoder()
    rng = np.random.default_rng(1)
    for name, kw in VARIANTS.items():
        img = _photo(203, 157)
        data = _jpeg(img.convert("L") if name == "grey" else img, **kw)
        full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int16)  # PIL: the reference
        for _ in range(25):
            top, left = int(rng.integers(0, 150)), int(rng.integers(0, 190))
            h, w = int(rng.integers(1, 158 - top)), int(rng.integers(1, 204 - left))
            px = decode(data, top, left, h, w)
            assert px is not None and px.shape == (h, w, 3) and px.dtype == np.uint8, (name, top, left, h, w)
            diff = np.abs(px.astype(np.int16) - full[top:top + h, left:left + w])
            assert diff.max() <= MAX_DIFF and diff.mean() <= MAX_MEAN, (name, (top, left, h, w), diff.max())


def test_same_boxes_and_draws_as_the_pil_path():
    """Where PIL's draft mode does not apply (crops under twice the output size) the two paths give
    bit-identical samples, RandAugment and flips included: the same box, the same pixels, the same
    random draws in the same order."""
    aug = AugmentConfig(randaugment_ops=2)
    window, whole = (SampleTransform(aug, 224, train=True, window=w) for w in (True, False))
    for name, kw in VARIANTS.items():
        img = _photo(341, 256, seed=2)
        data = _jpeg(img.convert("L") if name == "grey" else img, **kw)
        assert crop_decode.plain(data) == (name != "progressive")  # the window path runs (progressive: PIL)
        for seed in range(6):
            a = window(open_image({"jpg": data}, 10**9), seed, data)
            b = whole(open_image({"jpg": data}, 10**9), seed, data)
            assert a.shape == (3, 224, 224) and torch.equal(a, b), (name, seed)


def test_large_crops_match_the_full_decode():
    """Crops of more than twice the output size: the window decode equals full decode + crop +
    resize (torchvision's resized_crop on PIL's pixels), where PIL's draft path is only close."""
    data = _jpeg(_photo(640, 480, seed=3))
    tf = SampleTransform(AugmentConfig(crop_scale=[0.5, 1.0], hflip=0.0), 96, train=True, window=True)
    full = F.pil_to_tensor(Image.open(io.BytesIO(data)).convert("RGB"))
    for seed in range(4):
        (top, left, h, w), _ = tf._draw(640, 480, torch.Generator().manual_seed(seed))
        assert min(h, w) >= 2 * 96  # PIL's path would draft-decode this one
        ref = F.resized_crop(full, top, left, h, w, [96, 96], antialias=True)
        diff = (tf(open_image({"jpg": data}, 10**9), seed, data).int() - ref.int()).abs()
        assert diff.max() <= MAX_DIFF and diff.float().mean() <= MAX_MEAN, (seed, diff.max())


def test_plain_files_only():
    """The window decode takes one-pass JPEGs with intact markers; the rest goes to PIL."""
    data = _jpeg(_photo(203, 157))
    assert crop_decode.plain(data) and crop_decode.plain(data + b"\x00" * 100)  # zero padding after EOI
    assert crop_decode.plain(_jpeg(_photo(203, 157), restart_marker_rows=1))
    assert not crop_decode.plain(_jpeg(_photo(203, 157), progressive=True))
    assert not crop_decode.plain(data[:-10]) and not crop_decode.plain(data + b"junk")
    assert not crop_decode.plain(b"\x89PNG\r\n\x1a\n" + data)


def _pil_view(data: bytes):
    """PIL's reading of a header, as the PIL path asks it: (size, mode, EXIF orientation), or None
    when ``open_image`` refuses the file or it is no JPEG."""
    try:
        img = open_image({"jpg": data}, 10**9)
    except BadSample:
        return None
    return (img.size, img.mode, exif_orientation(img)) if img.format == "JPEG" else None


def test_window_size_reads_the_header_as_pil_does():
    """One walk over the markers gives a size only for files the PIL path would send to the window
    decoder with that size (a JPEG in mode L or RGB, EXIF orientation 1, ``plain``), and it gives
    one for the usual plain files. Also over random damage to the header bytes."""
    photo = _photo(203, 157)
    exif = Image.Exif()
    exif[0x0112] = 1
    files = {name: _jpeg(photo.convert("L") if name == "grey" else photo, **kw) for name, kw in VARIANTS.items()}
    files["exif 1"] = _jpeg(photo, exif=exif.tobytes())
    exif[0x0112] = 6
    files["exif 6"] = _jpeg(photo, exif=exif.tobytes())
    files["icc"] = _jpeg(photo, icc_profile=b"\0" * 200)
    files["cmyk"] = _jpeg(photo.convert("CMYK"))
    files["comment"] = _jpeg(photo, comment=b"hello")
    buf = io.BytesIO()
    photo.save(buf, "PNG")
    files["png"] = buf.getvalue()
    sized = set()
    for name, data in files.items():
        size = crop_decode.window_size(data)
        if size is not None:
            sized.add(name)
            assert _pil_view(data) == (size, "L" if name == "grey" else "RGB", 1) and crop_decode.plain(data), name
    assert sized == {"444", "422", "420", "restart markers", "grey", "comment"}, sized
    rng = np.random.default_rng(0)
    base = files["420"]
    header = base.index(b"\xff\xda") + 14  # up to the end of the scan header
    agreed = 0
    for _ in range(3000):
        b = bytearray(base)
        for _ in range(int(rng.integers(1, 4))):
            b[int(rng.integers(2, header))] = int(rng.choice([0, 1, 2, 3, 8, 0xC2, 0xD9, 0xDA, 0xE1, 0xFF,
                                                              rng.integers(256)]))
        size = crop_decode.window_size(bytes(b))
        if size is not None:
            view = _pil_view(bytes(b))
            assert view is not None and view[0] == size and view[1] in ("L", "RGB") and view[2] == 1 \
                and crop_decode.plain(bytes(b)), bytes(b[:header])
            agreed += 1
    assert 100 < agreed < 3000  # damage that leaves a readable header, and damage that does not


def test_window_sample_is_the_pil_path_sample():
    """The worker's sample from the marker walk is the PIL path's, bit for bit (same box, pixels,
    flip and RandAugment); files it does not take give None (then the PIL path runs)."""
    aug = AugmentConfig(randaugment_ops=2)
    for ra in (aug, AugmentConfig()):
        tf = SampleTransform(ra, 64, train=True, window=True)
        for name, kw in VARIANTS.items():
            img = _photo(341, 256, seed=4)
            data = _jpeg(img.convert("L") if name == "grey" else img, **kw)
            for seed in range(4):
                a = tf.window_sample(data, seed, 10**9)
                assert (a is None) == (name == "progressive"), name
                if a is not None:
                    assert torch.equal(a, tf(open_image({"jpg": data}, 10**9), seed, data)), (name, seed)
        assert tf.window_sample(data, 0, 341 * 256 - 1) is None  # over data.max_image_pixels: open_image says so
    assert SampleTransform(aug, 64, train=True, window=False).window_sample(data, 0, 10**9) is None


def test_corrupt_files_get_the_verdict_pil_gives_them():
    """A window decode stops at the window's last row, and nvImageCodec decodes some files PIL
    refuses; the loader's verdict on each damaged file must still be PIL's (counted as corrupt or
    not, exactly as with the PIL path). Cut-short files, and random bytes overwritten anywhere
    after the header."""
    data = _jpeg(_photo(203, 157))
    tf = SampleTransform(AugmentConfig(), 64, train=True, window=True)
    rng = np.random.default_rng(0)
    damaged = [data[:len(data) // 2], data[:-10], data[:-2]]
    for _ in range(300):
        b = bytearray(data)
        pos, n = int(rng.integers(100, len(b) - 2)), int(rng.integers(1, 40))
        b[pos:pos + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        damaged.append(bytes(b))
    refused = 0
    for i, b in enumerate(damaged):
        try:
            Image.open(io.BytesIO(b)).convert("RGB")
            pil = None
        except Exception as e:  # PIL's verdict: the reference
            pil = type(e).__name__
        try:  # the worker's order: the marker walk's window decode, else the PIL path
            if tf.window_sample(b, i, 10**9) is None:
                tf(open_image({"jpg": b}, 10**9), i, b)
            ours = None
        except BadSample as e:
            ours = e.kind
        assert (pil is None) == (ours is None), (i, pil, ours)
        refused += ours is not None
    assert refused >= 20  # the damage did produce files PIL refuses (not a vacuous check)
    assert crop_decode.decoder()(data[:len(data) // 2], 0, 0, 157, 203) is None


def test_loader_says_its_path_and_reads_the_same_samples(demo_train):
    cfg = DataConfig(train_shards=str(demo_train), workers=0, shuffle_buffer=20, augment=AugmentConfig())
    batches = {}
    for choice in ("nvimgcodec", "pil"):
        loader = build_loader(replace(cfg, worker_decoder=choice), batch_size=16, seed=1, img_size=32)
        assert ("nvImageCodec" in loader.worker_decoder) == (choice == "nvimgcodec"), loader.worker_decoder
        it = iter(loader)
        batches[choice] = [(next(it), list(loader.last_keys)) for _ in range(2)]
    for ((xa, ya), ka), ((xb, yb), kb) in zip(batches["nvimgcodec"], batches["pil"]):
        assert ka == kb and torch.equal(ya, yb)
        # normalised to [-1, 1]: one grey level is 2/255; PIL's draft mode shifts some crops slightly
        assert (xa - xb).abs().mean() * 255 / 2 < 2.0


def test_choice_is_checked_and_falls_back_without_nvimgcodec():
    with pytest.raises(ValueError, match=r"data\.worker_decoder.*bogus"):
        load_config("configs/tiny_cpu.yaml", ["data.worker_decoder=bogus"])
    # a process in which nvImageCodec cannot be imported (as on a machine without the package)
    code = ("import sys; sys.modules['nvidia.nvimgcodec'] = None\n"
            "from data_pipeline.shards import crop_decode as c\n"
            "from data_pipeline.errors import ConfigError\n"
            "print(c.resolve('auto'), c.resolve('pil'))\n"
            "try:\n    c.resolve('nvimgcodec')\nexcept ConfigError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "pil pil"
    assert lines[1].startswith("data.worker_decoder: nvimgcodec, but nvidia.nvimgcodec does not import") \
        and "pip install nvidia-nvimgcodec" in lines[1] and len(lines) == 2
    assert crop_decode.resolve("auto") == "nvimgcodec"  # here, where it is installed
    with pytest.raises(ConfigError, match=r"^data\.worker_decoder: 'bogus'"):  # a DataConfig made in code
        crop_decode.resolve("bogus")
