"""Safe decoding of one raw sample: image bytes through PIL (JPEG/PNG/WebP only), labels from text.

Nothing else is ever interpreted: no pickle, no torch.load, no numpy loading, whatever the member
is called. ``Image.open(..., formats=...)`` keeps PIL from trying its other plugins (EPS would start
Ghostscript); the pixel count is checked from the header, before any pixel is decoded, so a
decompression bomb costs nothing. Every failure raises :class:`BadSample` with the counter kind.

:func:`to_8bit` / :func:`to_rgb` own the one mapping from whatever PIL decodes to the 8-bit pixels a
model sees; ``vit-shards`` uses it before re-encoding and the loader after decoding, so a file looks
the same whichever side converted it:

* EXIF orientation (tag 274, also from XMP) is applied, as ``ImageOps.exif_transpose`` does.
* Transparency (RGBA, LA, PA, P or L/RGB with a ``tRNS`` entry) is composited over **white**:
  ``round((c * a + 255 * (255 - a)) / 255)``. PIL's ``convert("RGB")``, what timm and torchvision
  do, drops alpha and keeps whatever colour hides under transparent pixels (often black, sometimes
  garbage); white is what a viewer shows on a page and does not depend on hidden values.
* 16-bit grey (``I;16``, ``I;16B``, ``I;16L``, ``I;16N``): ``v >> 8``, the high byte, the same rule
  PIL applies itself when it decodes 16-bit RGB(A) PNGs, so grey and colour 16-bit files agree.
  No auto-contrast: a 12-bit scan stored in 16 bits stays as dark as the file says.
* ``I`` (32-bit int): values within 0..65535 are 16-bit data (PIL opens some 16-bit files as ``I``),
  ``v >> 8``; otherwise min-max over the image, ``round((v - lo) * 255 / (hi - lo))``.
* ``F`` (32-bit float): values within [0, 1] are the float-image convention, ``round(v * 255)``;
  otherwise min-max over the finite values. NaN maps to 0, +-inf to the ends.
* CMYK: PIL's ``R = (255 - C) * (255 - K) / 255`` (no ICC profile is applied); 1, L, P, YCbCr,
  LAB: PIL's own conversion. Grey stays one channel in :func:`to_8bit` (smaller JPEGs).
"""
from __future__ import annotations

import io
import json
import warnings

import numpy as np
from PIL import Image

from data_pipeline.shards.reader import IMAGE_EXTS

FORMATS = ("JPEG", "PNG", "WEBP")


class BadSample(Exception):
    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


def image_bytes(members: dict) -> bytes | None:
    """The sample's image member (the first of IMAGE_EXTS it has), or None."""
    return next((members[e] for e in IMAGE_EXTS if e in members), None)


def open_image(members: dict, max_pixels: int) -> Image.Image:
    """Parse the image header (lazy: no pixels decoded yet); refuse bombs and unknown formats."""
    data = image_bytes(members)
    if data is None:
        raise BadSample("no_image")
    try:
        with warnings.catch_warnings():
            # PIL warns above its own global limit; ours (data.max_image_pixels) is enforced below.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:
        raise BadSample("image_too_large", str(e)) from None
    except Exception as e:  # PIL raises many types for garbage bytes; all mean "not an image"
        raise BadSample("corrupt_image", str(e)) from None
    w, h = img.size
    if w <= 0 or h <= 0:
        raise BadSample("corrupt_image", f"size {w}x{h}")
    if w * h > max_pixels:
        raise BadSample("image_too_large", f"{w}x{h} > data.max_image_pixels={max_pixels}")
    return img


def draft(img: Image.Image, need_w: int, need_h: int) -> tuple[Image.Image, float, float]:
    """Ask libjpeg to decode at 1/2, 1/4 or 1/8 scale (DCT scaling, several times cheaper) when the
    result still has at least ``need_w x need_h`` pixels. Returns the image and the x/y scale."""
    w, h = img.size
    if img.format != "JPEG" or w < 2 * need_w or h < 2 * need_h:
        return img, 1.0, 1.0
    img.draft("RGB", (need_w, need_h))
    return img, img.size[0] / w, img.size[1] / h


def load_rgb(img: Image.Image) -> Image.Image:
    """Decode (truncated files fail here) and map to 8-bit RGB, oriented: see :func:`to_rgb`."""
    try:
        return to_rgb(img)
    except Exception as e:
        raise BadSample("corrupt_image", str(e)) from None


# ------------------------------------------------------------------------ pixels -> 8-bit RGB
ORIENTATION = 0x0112  # EXIF tag 274
_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
              4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
              6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90}
_WIDE = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")
_ALPHA = ("RGBA", "RGBa", "LA", "La", "PA")


def exif_orientation(img: Image.Image) -> int:
    """The EXIF orientation 1..8 that ``ImageOps.exif_transpose`` applies (1: none or unreadable):
    PIL's ``getexif``, tag 274 or else XMP's ``tiff:Orientation``. JPEG/WebP: from the header,
    before any pixel is decoded. A PNG is decoded first (an error there raises), as
    ``exif_transpose`` does: its eXIf chunk, an ImageMagick "Raw profile type exif" text chunk or
    its XMP may follow the pixel data, and PIL reads those only when it decodes."""
    if img.format == "PNG":
        img.load()
    try:
        value = img.getexif().get(ORIENTATION, 1)
    except Exception:  # a damaged EXIF block is metadata; the pixels are still good
        return 1
    return value if value in _TRANSPOSE else 1


def oriented_size(img: Image.Image) -> tuple[int, int]:
    """(width, height) as displayed: swapped for the orientations that transpose (5..8)."""
    w, h = img.size
    return (h, w) if exif_orientation(img) >= 5 else (w, h)


def to_8bit(img: Image.Image) -> Image.Image:
    """Decode ``img`` (any mode) and return it oriented, in mode ``L`` or ``RGB``: the one mapping
    described in the module docstring, used by the writer and the loader."""
    img.load()
    orientation = exif_orientation(img)
    mode, trns = img.mode, img.info.get("transparency")
    if mode in _WIDE:
        grey = _wide_to_8bit(img)
        alpha = None
        if isinstance(trns, int):  # tRNS of a 16-bit grey PNG: one fully transparent value
            alpha = np.where(np.asarray(img) == trns, 0, 255).astype(np.uint8)
        out = Image.fromarray(grey if alpha is None else _over_white(grey[..., None], alpha[..., None])[..., 0], "L")
    elif mode in _ALPHA or trns is not None:
        grey = mode in ("LA", "La", "L", "1")
        rgba = np.asarray(img.convert("LA" if grey else "RGBA"))
        if rgba[..., -1].min() == 255:
            out = Image.fromarray(np.ascontiguousarray(rgba[..., :-1][..., 0] if grey else rgba[..., :3]),
                                  "L" if grey else "RGB")
        else:
            pix = _over_white(rgba[..., :-1], rgba[..., -1:])
            out = Image.fromarray(pix[..., 0] if grey else pix, "L" if grey else "RGB")
    elif mode in ("RGB", "L"):
        out = img
    elif mode == "1":
        out = img.convert("L")
    else:  # P, CMYK, YCbCr, LAB, HSV, RGBX: PIL's conversions
        out = img.convert("RGB")
    return out.transpose(_TRANSPOSE[orientation]) if orientation != 1 else out


def to_rgb(img: Image.Image) -> Image.Image:
    """:func:`to_8bit`, grey replicated to three channels."""
    out = to_8bit(img)
    return out if out.mode == "RGB" else out.convert("RGB")


def _over_white(colour: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """uint8 colour (..., C) composited over white with uint8 alpha (..., 1); exact rounding
    (c*a + 255*(255-a) is never a half-multiple of 255, 255 being odd)."""
    c, a = colour.astype(np.uint32), alpha.astype(np.uint32)
    return ((c * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)


def _wide_to_8bit(img: Image.Image) -> np.ndarray:
    """I;16*, I and F pixels -> uint8 (H, W), by the rules in the module docstring."""
    a = np.asarray(img)
    if img.mode.startswith("I;16"):
        return (a.astype(np.uint16) >> 8).astype(np.uint8)
    if img.mode == "I" and a.size and a.min() >= 0 and a.max() <= 65535:
        return (a >> 8).astype(np.uint8)
    a = a.astype(np.float64)
    finite = np.isfinite(a)
    if not finite.any():
        return np.zeros(a.shape, np.uint8)
    lo, hi = a[finite].min(), a[finite].max()
    if img.mode == "F" and lo >= 0.0 and hi <= 1.0:
        lo, scale = 0.0, 255.0
    else:
        scale = 255.0 / (hi - lo) if hi > lo else 0.0
    out = np.round((np.clip(a, lo, hi) - lo) * scale)
    return np.where(np.isnan(a), 0, out).astype(np.uint8)


def parse_label(members: dict, num_classes: int, multi_label: bool):
    """``.cls`` holds one integer as text; ``.json`` holds ``{"labels": [ints]}`` for multi-label
    data. Returns an int, or a list of ints when ``multi_label``. Out-of-range labels are bad."""
    labels = None
    try:
        if multi_label and "json" in members:
            meta = json.loads(members["json"].decode("utf-8"))
            labels = meta.get("labels") if isinstance(meta, dict) else None
            if not isinstance(labels, list) or not all(type(x) is int for x in labels):
                raise ValueError(f"json labels {labels!r}")
        elif "cls" in members:
            labels = [int(members["cls"].decode("ascii").strip())]
        else:
            raise ValueError("no .cls member" + (" and no .json member" if multi_label else ""))
    except (ValueError, UnicodeDecodeError, AttributeError, RecursionError) as e:
        raise BadSample("bad_label", str(e)) from None
    bad = [x for x in labels if not 0 <= x < num_classes]
    if bad:
        raise BadSample("bad_label", f"label {bad[0]} outside [0, {num_classes})")
    return labels if multi_label else labels[0]
