"""Safe decoding of one raw sample: image bytes through PIL (JPEG/PNG/WebP only), labels from text.

Nothing else is ever interpreted: no pickle, no torch.load, no numpy loading, whatever the member
is called. ``Image.open(..., formats=...)`` keeps PIL from trying its other plugins (EPS would start
Ghostscript); the pixel count is checked from the header, before any pixel is decoded, so a
decompression bomb costs nothing. Every failure raises :class:`BadSample` with the counter kind.
"""
from __future__ import annotations

import io
import json
import warnings

from PIL import Image

from data_pipeline.shard_reader import IMAGE_EXTS

FORMATS = ("JPEG", "PNG", "WEBP")


class BadSample(Exception):
    def __init__(self, kind: str, detail: str = ""):
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


def open_image(members: dict, max_pixels: int) -> Image.Image:
    """Parse the image header (lazy: no pixels decoded yet); refuse bombs and unknown formats."""
    data = next((members[e] for e in IMAGE_EXTS if e in members), None)
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
    try:
        return img.convert("RGB")  # forces the decode; truncated files fail here
    except Exception as e:
        raise BadSample("corrupt_image", str(e)) from None


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
