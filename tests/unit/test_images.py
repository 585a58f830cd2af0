"""Images are faithful: every PIL mode a folder of real files holds, and EXIF orientation, come out
of the writer (``vit-shards``) and of the loader's decode as the pixels a viewer shows.

Each case writes real bytes with PIL (or, for 16-bit colour PNGs, which PIL cannot write, with a
few lines of zlib) and compares against a reference computed here with numpy from the arrays the
file was made of, never by calling the code under test. The mapping under test is documented in
``data_pipeline/shards/decode.py``: alpha over white, 16-bit by the high byte, I/F by range or min-max.
"""
from __future__ import annotations

import io
import json
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data_pipeline.loading.transforms import SampleTransform
from data_pipeline.shards.cli import main
from data_pipeline.shards.decode import load_rgb, open_image, to_rgb

RNG = np.random.default_rng(12)
H, W = 20, 28  # small: the writer re-encodes JPEG at 4:4:4 below 64 px, so q100 stays within ~2


def _save(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _grey3(g: np.ndarray) -> np.ndarray:
    return np.repeat(g[..., None], 3, axis=2).astype(np.uint8)


def _over_white(c: np.ndarray, a: np.ndarray) -> np.ndarray:
    """Reference compositing in float64: c * a + white * (1 - a), rounded."""
    a = a.astype(np.float64) / 255.0
    a = a[..., None] if c.ndim > a.ndim else a
    return np.round(c.astype(np.float64) * a + 255.0 * (1.0 - a)).astype(np.uint8)


def _png16(arr: np.ndarray) -> bytes:
    """A 16-bit PNG (grey, grey+alpha, RGB or RGBA by the channel count) written by hand."""
    h, w, c = arr.shape
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", w, h, 16, {1: 0, 2: 4, 3: 2, 4: 6}[c], 0, 0, 0)
    raw = b"".join(b"\0" + arr[y].astype(">u2").tobytes() for y in range(h))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def _u16() -> np.ndarray:
    a = RNG.integers(0, 65536, (H, W), dtype=np.uint16)
    a.flat[:6] = [0, 65535, 255, 256, 257 * 128, 65280]  # the ends and the byte edges
    return a


# ------------------------------------------------------------------ cases: (bytes, ext, reference)
def _cases() -> dict:
    c = {}
    bits = RNG.random((H, W)) > 0.5
    c["1.png"] = (_save(Image.fromarray(bits), "PNG"), _grey3(bits * 255))
    c["1.tif"] = (_save(Image.fromarray(bits), "TIFF"), _grey3(bits * 255))
    g = RNG.integers(0, 256, (H, W), dtype=np.uint8)
    c["L.png"] = (_save(Image.fromarray(g), "PNG"), _grey3(g))
    a = RNG.integers(0, 256, (H, W), dtype=np.uint8)
    a[0, :4] = [0, 255, 1, 254]
    la = Image.fromarray(np.stack([g, a], -1), "LA")
    c["LA.png"] = (_save(la, "PNG"), _grey3(_over_white(g, a)))
    c["LA.tif"] = (_save(la, "TIFF"), _grey3(_over_white(g, a)))
    idx = RNG.integers(0, 16, (H, W), dtype=np.uint8)
    pal = RNG.integers(0, 256, (16, 3), dtype=np.uint8)
    p = Image.fromarray(idx, "P")
    p.putpalette(pal.tobytes())
    for fmt, ext in (("PNG", "png"), ("GIF", "gif"), ("BMP", "bmp"), ("TIFF", "tif")):
        c[f"P.{ext}"] = (_save(p, fmt), pal[idx])
    keyed = pal[idx].copy()
    keyed[idx == 5] = 255
    c["P-trns-index.png"] = (_save(p, "PNG", transparency=5), keyed)
    c["P-trns-index.gif"] = (_save(p, "GIF", transparency=5), keyed)
    alphas = RNG.integers(0, 256, 16, dtype=np.uint8)
    c["P-trns-table.png"] = (_save(p, "PNG", transparency=alphas.tobytes()), _over_white(pal[idx], alphas[idx]))
    rgb = RNG.integers(0, 256, (H, W, 3), dtype=np.uint8)
    rgba = Image.fromarray(np.concatenate([rgb, a[..., None]], -1), "RGBA")
    for fmt, ext, kw in (("PNG", "png", {}), ("TIFF", "tif", {}), ("WEBP", "webp", {"lossless": True, "exact": True})):
        c[f"RGBA.{ext}"] = (_save(rgba, fmt, **kw), _over_white(rgb, a))
    key = tuple(int(v) for v in rgb[3, 3])
    keyed = rgb.copy()
    keyed[(rgb == key).all(-1)] = 255
    c["RGB-trns.png"] = (_save(Image.fromarray(rgb), "PNG", transparency=key), keyed)
    cmyk = RNG.integers(0, 256, (H, W, 4), dtype=np.uint8)
    k = cmyk[..., 3:].astype(np.float64)
    c["CMYK.tif"] = (_save(Image.frombytes("CMYK", (W, H), cmyk.tobytes()), "TIFF"),
                     np.round((255 - cmyk[..., :3]) * (255 - k) / 255).astype(np.uint8))
    cmyk_jpeg = _save(Image.frombytes("CMYK", (W, H), cmyk.tobytes()), "JPEG", quality=95)
    dec = np.asarray(Image.open(io.BytesIO(cmyk_jpeg))).astype(np.float64)  # the CMYK libjpeg gives
    c["CMYK.jpg"] = (cmyk_jpeg, np.round((255 - dec[..., :3]) * (255 - dec[..., 3:]) / 255).astype(np.uint8))
    grey_jpeg = _save(Image.fromarray(g), "JPEG", quality=95)
    c["L.jpg"] = (grey_jpeg, _grey3(np.asarray(Image.open(io.BytesIO(grey_jpeg)))))
    u = _u16()
    c["I16.png"] = (_save(Image.fromarray(u), "PNG"), _grey3(u >> 8))
    c["I16.tif"] = (_save(Image.fromarray(u), "TIFF"), _grey3(u >> 8))
    c["I16B.tif"] = (_save(Image.frombytes("I;16B", (W, H), u.astype(">u2").tobytes()), "TIFF"), _grey3(u >> 8))
    c["I16-trns.png"] = (_save(Image.fromarray(u), "PNG", transparency=int(u[2, 2])),
                         _grey3(np.where(u == u[2, 2], 255, u >> 8)))
    u3 = np.stack([_u16(), _u16(), _u16()], -1)
    c["RGB16.png"] = (_png16(u3), (u3 >> 8).astype(np.uint8))  # PIL's own high-byte rule, for reference
    i32 = u.astype(np.int32)
    c["I-16bit.tif"] = (_save(Image.fromarray(i32, "I"), "TIFF"), _grey3(u >> 8))
    c["I-16bit.ppm"] = (_save(Image.fromarray(i32, "I"), "PPM"), _grey3(u >> 8))
    wide = RNG.integers(-70000, 200000, (H, W)).astype(np.int32)
    lo, hi = wide.min(), wide.max()
    c["I-wide.tif"] = (_save(Image.fromarray(wide, "I"), "TIFF"),
                       _grey3(np.round((wide - lo) * 255.0 / (hi - lo))))
    unit = RNG.random((H, W)).astype(np.float32)
    unit[0, :2] = [0.0, 1.0]
    c["F-unit.tif"] = (_save(Image.fromarray(unit, "F"), "TIFF"), _grey3(np.round(unit.astype(np.float64) * 255)))
    f = (RNG.random((H, W)) * 40 - 7).astype(np.float32)
    f[1, 1] = np.nan
    fin = f[np.isfinite(f)].astype(np.float64)
    ref = np.round((f.astype(np.float64) - fin.min()) * 255.0 / (fin.max() - fin.min()))
    c["F-range.tif"] = (_save(Image.fromarray(f, "F"), "TIFF"), _grey3(np.nan_to_num(ref, nan=0.0)))
    ycc = RNG.integers(0, 256, (H, W, 3), dtype=np.uint8)
    y, cb, cr = (ycc[..., i].astype(np.float64) for i in range(3))
    c["YCbCr.tif"] = (_save(Image.frombytes("YCbCr", (W, H), ycc.tobytes()), "TIFF"),
                      np.clip(np.round(np.stack([y + 1.402 * (cr - 128), y - 0.344136 * (cb - 128)
                                                 - 0.714136 * (cr - 128), y + 1.772 * (cb - 128)], -1)), 0, 255
                              ).astype(np.uint8))
    return c


CASES = _cases()
EXACT = 1  # rounding of PIL's fixed-point conversions (CMYK, YCbCr); everything else is exact
LOSSY = {"YCbCr.tif": 1, "CMYK.tif": 1, "CMYK.jpg": 1}


def _close(got: np.ndarray, want: np.ndarray, tol: int, name: str) -> None:
    assert got.shape == want.shape, (name, got.shape, want.shape)
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
    assert diff.max() <= tol, (name, int(diff.max()), np.argwhere(diff > tol)[:3].tolist())


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_conversion_matches_numpy_reference(name):
    """The shared mapping (decode.to_rgb), on the file as PIL opens it, for every format."""
    data, want = CASES[name]
    _close(np.asarray(to_rgb(Image.open(io.BytesIO(data)))), want, LOSSY.get(name, 0), name)


@pytest.mark.parametrize("name", sorted(n for n in CASES if n.rsplit(".", 1)[1] in ("png", "webp", "jpg")))
def test_loader_decode_matches_reference(name):
    """The loader's own path: a shard member through open_image + load_rgb (as another tool, or
    an older vit-shards that copied them, stored them)."""
    data, want = CASES[name]
    ext = name.rsplit(".", 1)[1]
    _close(np.asarray(load_rgb(open_image({ext: data}, 10**9))), want, LOSSY.get(name, 0), name)


def _write_filelist(tmp_path: Path, files: dict, *extra) -> tuple[Path, dict]:
    (tmp_path / "img").mkdir(parents=True, exist_ok=True)
    lines = []
    for name, data in files.items():
        (tmp_path / "img" / name).write_bytes(data)
        lines.append(f"img/{name}\t0")
    (tmp_path / "list.tsv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "shards"
    assert main(["--source", f"filelist:{tmp_path / 'list.tsv'}", "--output", str(out), "--no-shuffle",
                 "--quality", "100", "--quiet", *extra]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["total"] == len(files) and m["skipped"] == {}
    stored = {}
    for s in m["shards"]:
        with tarfile.open(out / s["name"]) as t:
            for member in t.getmembers():
                key, ext = member.name.split(".", 1)
                if ext != "cls":
                    stored[int(key)] = (ext, t.extractfile(member).read())
    assert not list(out.glob(".*tmp*")) and not (out / ".vit-shards-progress.json").exists()
    return out, {name: stored[i] for i, name in enumerate(files)}


def test_writer_stores_every_mode_as_the_reference(tmp_path):
    """vit-shards without resizing: PNG sources stay PNG (lossless, exact), other formats become
    JPEG q100 4:4:4 (within a few levels); read back with plain PIL, no vitscale code."""
    stored = _write_filelist(tmp_path, {n: d for n, (d, _) in CASES.items()})[1]
    for name, (ext, data) in stored.items():
        want = CASES[name][1]
        img = Image.open(io.BytesIO(data))
        assert img.mode in ("RGB", "L", "P", "1"), (name, img.mode)  # what any stock reader gets right
        src_ext = name.rsplit(".", 1)[1]
        assert ext == (src_ext if src_ext in ("png", "webp") else "jpg"), (name, ext)
        tol = LOSSY.get(name, 0) if ext != "jpg" else 4
        _close(np.asarray(img.convert("RGB")), want, tol, name)


def test_writer_resize_path_keeps_levels(tmp_path):
    """--resize-shorter used to turn 16-bit files white: flat images of each wide mode keep their
    level through decode, resize and re-encode."""
    big = (96, 64)
    v16 = 0x5A3C  # -> 0x5A = 90
    files = {
        "I16.png": _save(Image.new("I;16", big, v16), "PNG"),
        "I16.tif": _save(Image.new("I;16", big, v16), "TIFF"),
        "I.tif": _save(Image.new("I", big, v16), "TIFF"),
        "F.tif": _save(Image.new("F", big, 0.5), "TIFF"),
        "RGBA.png": _save(Image.new("RGBA", big, (0, 0, 0, 0)), "PNG"),  # fully transparent black
        "LA.png": _save(Image.new("LA", big, (0, 128)), "PNG"),
        "RGB16.png": _png16(np.full((big[1], big[0], 3), [v16, 0x1234, 0xFFFF], np.uint16)),
    }
    want = {"I16.png": 90, "I16.tif": 90, "I.tif": 90, "F.tif": 128, "RGBA.png": 255,
            "LA.png": 127, "RGB16.png": (90, 18, 255)}
    stored = _write_filelist(tmp_path, files, "--resize-shorter", "32")[1]
    for name, (ext, data) in stored.items():
        img = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), np.int16)
        assert img.shape == (32, 48, 3), (name, img.shape)
        assert np.abs(img - np.array(want[name], np.int16)).max() <= 1, (name, img[0, 0])


def test_lab_tiff_is_converted_not_refused():
    """LAB (TIFF only) goes through PIL's own LAB -> sRGB. Its 8-bit a/b and PIL's approximations
    allow only a coarse check against the CIE formula (D50 Lab -> XYZ -> sRGB) computed here."""
    src = RNG.integers(0, 256, (H, W, 3), dtype=np.uint8)
    lab = Image.open(io.BytesIO(_save(Image.fromarray(src).convert("LAB"), "TIFF")))
    assert lab.mode == "LAB"
    v = np.asarray(lab)
    l_ = v[..., 0] * 100.0 / 255.0
    a_, b_ = (v[..., i].view(np.int8).astype(np.float64) for i in (1, 2))
    fy = (l_ + 16) / 116
    finv = lambda t: np.where(t > 6 / 29, t ** 3, 3 * (6 / 29) ** 2 * (t - 4 / 29))  # noqa: E731
    xyz = np.stack([0.9642 * finv(fy + a_ / 500), finv(fy), 0.8249 * finv(fy - b_ / 200)], -1)
    m = np.array([[3.1338561, -1.6168667, -0.4906146], [-0.9787684, 1.9161415, 0.0334540],
                  [0.0719453, -0.2289914, 1.4052427]])
    lin = np.clip(xyz @ m.T, 0, 1)
    ref = np.where(lin <= 0.0031308, 12.92 * lin, 1.055 * lin ** (1 / 2.4) - 0.055) * 255
    diff = np.abs(np.asarray(to_rgb(lab), np.float64) - ref)
    assert diff.mean() < 4 and np.percentile(diff, 90) < 10, (diff.mean(), diff.max())


# ------------------------------------------------------------------------------ EXIF orientation
def _expected_orientation(d: np.ndarray, o: int) -> np.ndarray:
    """The EXIF spec's display transform for each tag, in numpy."""
    return {1: d, 2: d[:, ::-1], 3: d[::-1, ::-1], 4: d[::-1], 5: d.transpose(1, 0, 2),
            6: np.rot90(d, -1), 7: np.rot90(d, 2).transpose(1, 0, 2), 8: np.rot90(d, 1)}[o]


def _quadrants(w: int, h: int) -> np.ndarray:
    q = np.zeros((h, w, 3), np.uint8)
    q[: h // 2, : w // 2] = (230, 30, 30)
    q[: h // 2, w // 2:] = (30, 230, 30)
    q[h // 2:, : w // 2] = (30, 30, 230)
    q[h // 2:, w // 2:] = (230, 230, 30)
    return q


def _jpeg_with_orientation(arr: np.ndarray, o: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = o
    return _save(Image.fromarray(arr), "JPEG", quality=95, exif=exif.tobytes())


@pytest.mark.parametrize("o", range(1, 9))
def test_loader_applies_exif_orientation(o):
    arr = _quadrants(24, 16)
    data = _jpeg_with_orientation(arr, o)
    assert Image.open(io.BytesIO(data)).getexif()[0x0112] == o
    stored = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))  # plain PIL ignores the tag
    want = _expected_orientation(stored, o)
    _close(np.asarray(load_rgb(open_image({"jpg": data}, 10**9))), want, 0, f"orientation {o}")


@pytest.mark.parametrize("o", [1, 3, 5, 6, 7, 8])
def test_train_crop_of_oriented_jpeg_equals_crop_of_upright_image(o):
    """The random crop is drawn from the size as displayed: a turned JPEG gives, seed for seed,
    the crop of the same pixels stored upright."""
    from types import SimpleNamespace

    aug = SimpleNamespace(crop_scale=(0.2, 1.0), crop_ratio=(0.75, 1.333), hflip=0.0, randaugment_ops=0,
                          three_augment=False)
    tf = SampleTransform(aug, 12, train=True)
    data = _jpeg_with_orientation(RNG.integers(0, 256, (18, 30, 3), dtype=np.uint8), o)
    upright = _expected_orientation(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")), o)
    png = _save(Image.fromarray(np.ascontiguousarray(upright)), "PNG")
    for seed in range(6):
        a = tf(open_image({"jpg": data}, 10**9), seed)
        b = tf(open_image({"png": png}, 10**9), seed)
        assert a.shape == (3, 12, 12) and bool((a == b).all()), (o, seed)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_exif_after_pixels(arr: np.ndarray, o: int) -> bytes:
    """A PNG whose orientation sits in an eXIf chunk after the image data (allowed by the PNG
    spec; PIL reads such a chunk only when it decodes the pixels)."""
    exif = Image.Exif()
    exif[0x0112] = o
    png = _save(Image.fromarray(arr), "PNG")
    end = png.rindex(b"IEND") - 4
    return png[:end] + _png_chunk(b"eXIf", exif.tobytes()) + png[end:]


@pytest.mark.parametrize("o", [3, 5, 6, 7, 8])
def test_train_crop_of_png_with_late_exif_equals_crop_of_upright_image(tmp_path, o):
    """A PNG whose eXIf chunk follows its pixel data, stored by the writer as it comes: its training
    crop is, seed for seed, the crop of the same pixels stored upright, so drawn within
    ``crop_ratio`` on the size as displayed."""
    from types import SimpleNamespace

    aug = SimpleNamespace(crop_scale=(0.08, 1.0), crop_ratio=(0.75, 1.333), hflip=0.0, randaugment_ops=0,
                          three_augment=False)
    tf = SampleTransform(aug, 12, train=True)
    arr = RNG.integers(0, 256, (20, 60, 3), dtype=np.uint8)
    data = _png_exif_after_pixels(arr, o)
    assert "exif" not in Image.open(io.BytesIO(data)).info  # not known from the header
    stored = _write_filelist(tmp_path, {"late.png": data})[1]["late.png"]
    assert stored == ("png", data)
    upright = _save(Image.fromarray(np.ascontiguousarray(_expected_orientation(arr, o))), "PNG")
    for seed in range(8):
        a = tf(open_image({"png": stored[1]}, 10**9), seed)
        b = tf(open_image({"png": upright}, 10**9), seed)
        assert a.shape == (3, 12, 12) and bool((a == b).all()), (o, seed)


def _png_tagged(arr: np.ndarray, o: int, style: str) -> bytes:
    """A PNG of ``arr`` with orientation ``o`` stored the ways files in the wild carry it: an eXIf
    chunk before or after the image data, ImageMagick's hex "Raw profile type exif" in a tEXt or
    zTXt chunk (before or after the image data), or XMP's ``tiff:Orientation`` in an iTXt chunk."""
    from PIL import PngImagePlugin

    exif = Image.Exif()
    exif[0x0112] = o
    raw = exif.tobytes()
    profile = f"\nexif\n{len(raw):8}\n{raw.hex()}\n"
    if style == "exif":
        return _save(Image.fromarray(arr), "PNG", exif=raw)
    if style == "exif_late":
        return _png_exif_after_pixels(arr, o)
    info = PngImagePlugin.PngInfo()
    if style in ("raw_profile", "raw_profile_zip"):
        info.add_text("Raw profile type exif", profile, zip=style == "raw_profile_zip")
    elif style == "raw_profile_late":
        png = _save(Image.fromarray(arr), "PNG")
        end = png.rindex(b"IEND") - 4
        return png[:end] + _png_chunk(b"tEXt", b"Raw profile type exif\0" + profile.encode()) + png[end:]
    elif style == "xmp":
        xmp = ('<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
               f'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="{o}"/>'
               '</rdf:RDF></x:xmpmeta>')
        info.add_itxt("XML:com.adobe.xmp", xmp)
    return _save(Image.fromarray(arr), "PNG", pnginfo=info)


PNG_ORIENTATION_STYLES = ("exif", "exif_late", "raw_profile", "raw_profile_zip", "raw_profile_late", "xmp")


@pytest.mark.parametrize("style", PNG_ORIENTATION_STYLES)
@pytest.mark.parametrize("o", range(1, 9))
def test_png_orientation_agrees_with_exif_transpose(style, o):
    """PIL's own ``ImageOps.exif_transpose`` is the reference, however the PNG stores it; the
    training crop of the file is the crop of the same pixels stored upright."""
    from types import SimpleNamespace

    from PIL import ImageOps

    arr = RNG.integers(0, 256, (10, 30, 3), dtype=np.uint8)
    data = _png_tagged(arr, o, style)
    want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    np.testing.assert_array_equal(want, _expected_orientation(arr, o))  # PIL reads the tag: the case tests something
    got = np.asarray(load_rgb(open_image({"png": data}, 10**9)))
    np.testing.assert_array_equal(got, want, err_msg=f"{style} {o}")
    aug = SimpleNamespace(crop_scale=(0.08, 1.0), crop_ratio=(0.75, 1.333), hflip=0.0, randaugment_ops=0,
                          three_augment=False)
    tf = SampleTransform(aug, 8, train=True)
    upright = _save(Image.fromarray(np.ascontiguousarray(want)), "PNG")
    for seed in range(3):
        assert bool((tf(open_image({"png": data}, 10**9), seed) == tf(open_image({"png": upright}, 10**9), seed)).all())


def test_writer_applies_png_raw_profile_orientation_when_reencoding(tmp_path):
    """A PNG the writer converts (here: resized) is turned as displayed, whichever chunk holds its
    orientation; the stored PNG has no orientation left to apply twice."""
    from PIL import ImageOps

    arr = _quadrants(64, 32)
    files = {f"{style}-o{o}.png": _png_tagged(arr, o, style)
             for style in ("raw_profile", "raw_profile_late", "xmp") for o in (1, 3, 6, 8)}
    _, turned = _write_filelist(tmp_path, files, "--resize-shorter", "16")
    for name, data in files.items():
        ext, out = turned[name]
        img = Image.open(io.BytesIO(out))
        img.load()
        assert ext == "png" and img.getexif().get(0x0112, 1) == 1, name
        want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"), np.int16)
        got = np.asarray(img.convert("RGB"), np.int16)
        h, w = want.shape[:2]
        assert got.shape[:2] == (h // 2, w // 2), (name, got.shape)
        for y, x in ((h // 4, w // 4), (h // 4, 3 * w // 4), (3 * h // 4, w // 4), (3 * h // 4, 3 * w // 4)):
            assert np.abs(got[y // 2, x // 2] - want[y, x]).max() <= 12, (name, y, x)


def test_writer_keeps_oriented_jpegs_and_applies_orientation_when_reencoding(tmp_path):
    arr = _quadrants(64, 32)
    files = {f"o{o}.jpg": _jpeg_with_orientation(arr, o) for o in range(1, 9)}
    _, kept = _write_filelist(tmp_path / "kept", files)
    for o in range(1, 9):  # copied byte for byte; the loader turns them (test above)
        assert kept[f"o{o}.jpg"] == ("jpg", files[f"o{o}.jpg"])
    _, turned = _write_filelist(tmp_path / "resized", files, "--resize-shorter", "16")
    for o in range(1, 9):
        img = Image.open(io.BytesIO(turned[f"o{o}.jpg"][1]))
        assert img.getexif().get(0x0112, 1) == 1  # no tag left to apply twice
        got = np.asarray(img.convert("RGB"), np.int16)
        want = _expected_orientation(arr, o)
        h, w = want.shape[:2]
        assert got.shape[:2] == (h // 2, w // 2), (o, got.shape)
        for y, x in ((h // 4, w // 4), (h // 4, 3 * w // 4), (3 * h // 4, w // 4), (3 * h // 4, 3 * w // 4)):
            assert np.abs(got[y // 2, x // 2] - want[y, x]).max() <= 12, (o, y, x, got[y // 2, x // 2], want[y, x])
