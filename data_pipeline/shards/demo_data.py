"""The built-in demo dataset: procedurally drawn shapes as real JPEGs, no downloads.

Each class is a *shape* in a saturated colour of its own hue band, filled with its own texture
(stripes of one orientation and period, a checker of one size, a solid fill...). Colour is the cue
a ViT's patch embedding picks up within a few dozen steps, so a tiny ViT's loss falls clearly
within a few hundred CPU steps (ViT-Tiny/16 at 64 px: 2.06 -> 0.15 over 200 steps of batch 32);
texture and shape are the slower cues. Everything else varies per image and must be ignored:
canvas size (64-96 px), position, scale, rotation, brightness and saturation, a greyish background
(solid, gradient or blotches), jitter of hue, texture angle and period, and pixel noise.
Pre-training uses 10 classes; the transfer task uses 6 *other* shapes, with hues between the
pre-training bands and textures at other angles and periods, so what the model learned transfers
but no class is shared (linear probe on those features: 99% against 87% from a random init and
17% chance). ``demo`` splits ``train``/``val``, ``demo-transfer`` splits ``train``/``test``.

The ``shapes-train`` / ``shapes-val`` splits are the harder set: the 10 pre-training shapes with
their textures, each image's hue drawn from a band three classes wide around its class's own
(``SHAPES_HUE_JITTER``), so colour narrows an image down to about three classes and shape and
texture must tell the rest. Texture periods are 4-12 px on 64-96 px canvases, so that cue thins
out when images are scaled down: what a resolution schedule trades (``benchmarks/
tokens_to_accuracy.py``).

Every image is a pure function of (split, seed, index): generation is parallel, order-free and
fast (about 1 ms per image on one core, JPEG encoding included).

    classes, items = demo_items("train")            # 4096 images of the 10 pre-training shapes
    items[0].image()                                # a PIL image, drawn on demand

Writing them as shards: ``vit-shards --source demo`` or ``write_shards.write_demo_shards``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from data_pipeline.errors import DataError


def _ngon(n, r=1.0, phase=0.0):
    return [(r * math.cos(phase + 2 * math.pi * k / n), r * math.sin(phase + 2 * math.pi * k / n)) for k in range(n)]


def _star(n, r_in):
    """``n`` points alternating between radius 1 and ``r_in``."""
    return [((1.0 if k % 2 == 0 else r_in) * math.cos(math.pi * k / n),
             (1.0 if k % 2 == 0 else r_in) * math.sin(math.pi * k / n)) for k in range(2 * n)]


def _rect(x0, y0, x1, y1):
    return [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]


# Each shape: list of (polygon in [-1, 1]^2, fill) painted in order; fill 0 cuts a hole.
SHAPES = {
    # pre-training classes
    "circle": [(_ngon(40), 1)],
    "square": [(_rect(-0.8, -0.8, 0.8, 0.8), 1)],
    "triangle": [(_ngon(3, 1.0, -math.pi / 2), 1)],
    "star": [(_star(5, 0.42), 1)],
    "plus": [(_rect(-0.9, -0.28, 0.9, 0.28), 1), (_rect(-0.28, -0.9, 0.28, 0.9), 1)],
    "ring": [(_ngon(40), 1), (_ngon(40, 0.55), 0)],
    "hexagon": [(_ngon(6), 1)],
    "crescent": [(_ngon(40), 1), ([(x + 0.45, y) for x, y in _ngon(40, 0.85)], 0)],
    "arrow": [([(-1, -0.22), (0.15, -0.22), (0.15, -0.6), (1, 0), (0.15, 0.6), (0.15, 0.22), (-1, 0.22)], 1)],
    "lshape": [([(-0.8, -0.8), (-0.3, -0.8), (-0.3, 0.35), (0.8, 0.35), (0.8, 0.8), (-0.8, 0.8)], 1)],
    # transfer classes (held out from pre-training)
    "semicircle": [([(math.cos(math.pi * k / 30), -0.5 + math.sin(math.pi * k / 30)) for k in range(31)], 1)],
    "frame": [(_rect(-0.85, -0.85, 0.85, 0.85), 1), (_rect(-0.45, -0.45, 0.45, 0.45), 0)],
    "target": [(_ngon(40), 1), (_ngon(40, 0.7), 0), (_ngon(40, 0.35), 1)],
    "tshape": [([(-0.9, -0.9), (0.9, -0.9), (0.9, -0.5), (0.2, -0.5), (0.2, 0.9), (-0.2, 0.9), (-0.2, -0.5),
                 (-0.9, -0.5)], 1)],
    "bars": [(_rect(-0.9, y, 0.9, y + 0.32), 1) for y in (-0.9, -0.16, 0.58)],
    "star8": [(_star(8, 0.6), 1)],
}
# Fill texture of each class: ("stripes", angle in degrees, period px), ("checker", cell px),
# ("blotches", cell px) or ("solid",).
FILLS = {
    "circle": ("stripes", 0, 6), "square": ("stripes", 90, 6), "triangle": ("stripes", 45, 8),
    "star": ("stripes", 135, 8), "plus": ("checker", 4), "ring": ("checker", 8), "hexagon": ("solid",),
    "crescent": ("stripes", 0, 12), "arrow": ("stripes", 90, 12), "lshape": ("blotches", 6),
    "semicircle": ("stripes", 22, 5), "frame": ("stripes", 112, 10), "target": ("checker", 6),
    "tshape": ("stripes", 67, 7), "bars": ("solid",), "star8": ("stripes", 157, 14),
}
PRETRAIN_CLASSES = ["circle", "square", "triangle", "star", "plus", "ring", "hexagon", "crescent", "arrow", "lshape"]
TRANSFER_CLASSES = ["semicircle", "frame", "target", "tshape", "bars", "star8"]
# Hue of each class's shape: pre-training classes 36 degrees apart, transfer classes in between.
HUES = {**{c: 36.0 * i for i, c in enumerate(PRETRAIN_CLASSES)},
        **{c: 18.0 + 60.0 * i for i, c in enumerate(TRANSFER_CLASSES)}}
HUE_JITTER = 8.0
SHAPES_HUE_JITTER = 54.0  # the shapes-* splits: +-1.5 class bands

SPLITS = {  # split -> (classes, default size, seed salt)
    "train": (PRETRAIN_CLASSES, 4096, 11),
    "val": (PRETRAIN_CLASSES, 1024, 12),
    "transfer-train": (TRANSFER_CLASSES, 1200, 13),
    "transfer-test": (TRANSFER_CLASSES, 600, 14),
    "shapes-train": (PRETRAIN_CLASSES, 4096, 15),  # colour a weak cue: shape and texture decide
    "shapes-val": (PRETRAIN_CLASSES, 1024, 16),
}


def _pattern(h, w, spec, rng) -> np.ndarray:
    """(h, w) float32 in [0, 1] for a texture spec, with a little jitter of angle and scale."""
    xx = np.arange(w, dtype=np.float32)[None, :]
    yy = np.arange(h, dtype=np.float32)[:, None]
    kind = spec[0]
    if kind == "stripes":
        a = math.radians(spec[1] + rng.uniform(-8, 8))
        period = spec[2] * rng.uniform(0.9, 1.1)
        p = np.sin((2 * math.pi / period) * (xx * math.cos(a) + yy * math.sin(a))) > 0
    elif kind == "checker":
        s = spec[1]
        ox, oy = rng.integers(s, size=2)
        p = (((xx + ox) // s) + ((yy + oy) // s)) % 2
    elif kind == "blotches":
        s = spec[1]
        coarse = rng.random((h // s + 2, w // s + 2), dtype=np.float32)
        p = coarse.repeat(s, 0).repeat(s, 1)[:h, :w]
    elif kind == "gradient":
        a = rng.uniform(0, 2 * math.pi)
        p = xx * math.cos(a) + yy * math.sin(a)
        p = (p - p.min()) / max(1e-6, float(p.max() - p.min()))
    else:  # solid
        p = np.zeros((1, 1), np.float32)
    return np.broadcast_to(p, (h, w)).astype(np.float32)


def _hsv(h_deg, s, v) -> np.ndarray:
    """HSV (degrees, [0,1], [0,1]) -> RGB float32 in [0, 255]."""
    c = v * s
    x = c * (1 - abs((h_deg / 60.0) % 2 - 1))
    rgb = [(c, x, 0), (x, c, 0), (0, c, x), (0, x, c), (x, 0, c), (c, 0, x)][int(h_deg % 360 // 60)]
    return (np.array(rgb, np.float32) + (v - c)) * 255.0


def _paint(h, w, c1, spec, rng) -> np.ndarray:
    """(h, w, 3) float32: colour ``c1`` and a darker shade of it mixed by the texture pattern."""
    c2 = c1 * rng.uniform(0.35, 0.65)
    return c1 + (c2 - c1) * _pattern(h, w, spec, rng)[..., None]


_BACKGROUNDS = (("solid",), ("gradient",), ("blotches", 16))


def draw(shape: str, hue: float, rng: np.random.Generator) -> Image.Image:
    """One RGB image of ``shape`` in a saturated colour near ``hue``, filled with its class texture,
    on a greyish background, with random nuisances."""
    w, h = (int(v) for v in rng.integers(64, 97, 2))
    bg = _paint(h, w, _hsv(rng.uniform(0, 360), rng.uniform(0, 0.3), rng.uniform(0.2, 1.0)),
                _BACKGROUNDS[rng.integers(len(_BACKGROUNDS))], rng)
    fg = _paint(h, w, _hsv(hue + rng.uniform(-HUE_JITTER, HUE_JITTER), rng.uniform(0.6, 1.0), rng.uniform(0.6, 1.0)),
                FILLS[shape], rng)
    scale = rng.uniform(0.28, 0.46) * min(w, h)
    cx = rng.uniform(scale, w - scale)
    cy = rng.uniform(scale, h - scale)
    angle = rng.uniform(0, 2 * math.pi)
    ca, sa = math.cos(angle), math.sin(angle)
    mask = Image.new("L", (w, h), 0)
    pen = ImageDraw.Draw(mask)
    for poly, fill in SHAPES[shape]:
        pts = [(cx + scale * (x * ca - y * sa), cy + scale * (x * sa + y * ca)) for x, y in poly]
        pen.polygon(pts, fill=255 * fill)
    m = np.asarray(mask, np.float32)[..., None] * (1.0 / 255.0)
    noise = rng.standard_normal((h, w, 1), dtype=np.float32) * rng.uniform(0, 12)
    img = bg + (fg - bg) * m + noise
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


@dataclass(frozen=True)
class DemoItem:
    """A recipe, not pixels: the writer's worker processes draw it."""
    split: str
    seed: int
    index: int
    labels: tuple

    def load(self) -> Image.Image:
        classes, _, salt = SPLITS[self.split]
        rng = np.random.default_rng([salt, self.seed, self.index])
        shape = classes[self.labels[0]]
        hue = HUES[shape] + (rng.uniform(-SHAPES_HUE_JITTER, SHAPES_HUE_JITTER) if self.split.startswith("shapes-")
                             else 0.0)
        return draw(shape, hue % 360, rng)


def demo_items(split: str, n: int | None = None, seed: int = 0):
    """(class names, items) of a demo split; labels cycle through the classes (balanced)."""
    if split not in SPLITS:
        raise DataError(f"demo split {split!r}: use one of {', '.join(SPLITS)}")
    classes, default_n, _ = SPLITS[split]
    n = default_n if n is None else n
    return list(classes), [DemoItem(split, seed, i, (i % len(classes),)) for i in range(n)]
