"""3-Augment (DeiT III, Touvron et al. 2022): after the crop and flip, one of grayscale,
solarization or Gaussian blur, chosen uniformly per image, then colour jitter 0.3.

DeiT III composes it from PIL operations (its ``augment.py``: ``RandomChoice`` over
``Grayscale(3)``, ``ImageOps.solarize``, ``ImageFilter.GaussianBlur(radius ~ U(0.1, 2))``, then
torchvision's ``ColorJitter(0.3, 0.3, 0.3)``, which on a PIL image calls ``ImageEnhance``). A
sample on the CPU (a data worker's, or the training process's with ``data.decode_device: cpu``)
goes through those PIL calls themselves; one on a GPU (``cuda``, ``dali``) through the same
operations written as uint8 tensor ops (:func:`apply_tensor`) with PIL's own integer arithmetic,
so that for the same draws the pixels are PIL's, bit for bit, on either path:

* grayscale: ``convert("L")``'s 16-bit fixed-point luma ``(19595 R + 38470 G + 7471 B + 2^15) >> 16``;
* solarize: levels >= 128 inverted;
* blur: PIL's Gaussian approximation, three passes of an extended box filter per axis (its
  ``BoxBlur.c``: the fractional box radius from the standard deviation, 24-bit fixed-point
  weights, edges repeated, each pass rounded to uint8), horizontal passes first;
* brightness / contrast / saturation: ``Image.blend(degenerate, image, factor)`` in float32,
  truncated to uint8 (contrast's degenerate is the rounded mean of the luma, saturation's the luma).

The draws come from the sample's own generator (``transforms.SampleTransform`` continues the
stream that drew its crop and flip), so a resumed run and every decode device draw the same ops:
the choice (``randint(3)``), the blur radius when blur is chosen (``uniform_(0.1, 2.0)``), then
``ColorJitter.get_params``' calls in its order (``randperm(4)``, then one ``uniform_`` for each of
brightness, contrast and saturation). Cost per 224 x 224 sample on one CPU core: about 1.5 ms
through PIL, three times that through the tensor ops (the blur's six passes dominate), which is
why the CPU takes PIL's path; on an H200 the tensor ops take about 0.8 ms a sample, bound by their
some fifty kernel launches.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

JITTER = 0.3  # DeiT III's --color-jitter with 3-Augment
BLUR_RADIUS = (0.1, 2.0)  # DeiT III's GaussianBlur(radius_min, radius_max): the blur's standard deviation
OPS = ("grayscale", "solarize", "blur")
PASSES = 3  # box-filter passes per axis in PIL's Gaussian approximation


@dataclass(frozen=True)
class Draw:
    """What one sample drew: its op (an index into ``OPS``), the blur's radius (0 unless blur), and
    the colour jitter's order of (brightness, contrast, saturation, hue) with its three factors."""
    op: int
    radius: float
    order: tuple
    factors: tuple  # brightness, contrast, saturation


def draw(gen: torch.Generator) -> Draw:
    """The sample's 3-Augment draws from ``gen``, where its crop and flip draws left it."""
    op = int(torch.randint(0, len(OPS), (1,), generator=gen))
    radius = float(torch.empty(1).uniform_(*BLUR_RADIUS, generator=gen)) if OPS[op] == "blur" else 0.0
    order = tuple(int(i) for i in torch.randperm(4, generator=gen))
    lo, hi = max(0.0, 1.0 - JITTER), 1.0 + JITTER
    factors = tuple(float(torch.empty(1).uniform_(lo, hi, generator=gen)) for _ in range(3))
    return Draw(op, radius, order, factors)


def apply(x: torch.Tensor, d: Draw) -> torch.Tensor:
    """uint8 (3, H, W) -> uint8 (3, H, W) on ``x``'s device: the op of ``d``, then its colour
    jitter; through PIL on the CPU, through :func:`apply_tensor` elsewhere (the same pixels)."""
    return apply_pil(x, d) if x.device.type == "cpu" else apply_tensor(x, d)


def apply_pil(x: torch.Tensor, d: Draw) -> torch.Tensor:
    """:func:`apply` by the PIL calls DeiT III's composition makes (a CPU tensor)."""
    img = Image.fromarray(np.ascontiguousarray(x.permute(1, 2, 0).numpy()))
    if OPS[d.op] == "grayscale":
        img = img.convert("L").convert("RGB")
    elif OPS[d.op] == "solarize":
        img = ImageOps.solarize(img)
    else:
        img = img.filter(ImageFilter.GaussianBlur(d.radius))
    for i in d.order:
        if i < 3:  # 3 is hue, which ColorJitter(0.3, 0.3, 0.3) leaves out
            img = (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color)[i](img).enhance(d.factors[i])
    return torch.from_numpy(np.array(img)).permute(2, 0, 1)


def apply_tensor(x: torch.Tensor, d: Draw) -> torch.Tensor:
    """:func:`apply` by uint8 tensor ops on any device, PIL's arithmetic (the ops below)."""
    x = (grayscale, solarize, lambda t: gaussian_blur(t, d.radius))[d.op](x)
    for i in d.order:
        if i < 3:  # 3 is hue, which ColorJitter(0.3, 0.3, 0.3) leaves out
            x = (brightness, contrast, saturation)[i](x, d.factors[i])
    return x


# ------------------------------------------------------------------------------------ the ops
def luma(x: torch.Tensor) -> torch.Tensor:
    """PIL's ``convert("L")`` of uint8 (3, H, W): int32 (H, W)."""
    r, g, b = x.to(torch.int32).unbind(0)
    return (r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16


def grayscale(x: torch.Tensor) -> torch.Tensor:
    """torchvision's ``Grayscale(3)`` of a PIL image: the luma in all three channels."""
    return luma(x).to(torch.uint8).expand(3, -1, -1).contiguous()


def solarize(x: torch.Tensor) -> torch.Tensor:
    """``ImageOps.solarize`` (threshold 128)."""
    return torch.where(x >= 128, 255 - x, x)


def _blend(degenerate: torch.Tensor, x: torch.Tensor, factor: float) -> torch.Tensor:
    """``Image.blend(degenerate, x, factor)``: ``degenerate + factor * (x - degenerate)`` in float32
    (a separate multiply and add, as PIL's C computes it), clipped to [0, 255], truncated."""
    a = degenerate.to(torch.float32)
    step = (x.to(torch.float32) - a) * np.float32(factor)
    return (a + step).clamp_(0, 255).to(torch.uint8)


def brightness(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``ImageEnhance.Brightness``: a blend with black."""
    return _blend(torch.zeros_like(x), x, factor)


def contrast(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``ImageEnhance.Contrast``: a blend with the mean luma, rounded to a level (on the sample's
    device: no host read)."""
    mean = torch.floor(luma(x).sum(dtype=torch.int64).to(torch.float64) / (x.shape[-1] * x.shape[-2]) + 0.5)
    return _blend(mean.to(torch.uint8).expand_as(x), x, factor)


def saturation(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``ImageEnhance.Color``: a blend with the luma."""
    return _blend(luma(x).to(torch.uint8).expand_as(x), x, factor)


def box_radius(sigma: float, passes: int = PASSES) -> float:
    """PIL's ``_gaussian_blur_radius``: the extended box radius whose ``passes`` passes have
    variance ``sigma^2`` (Gwosdek et al. 2011), in the float32 / float64 steps PIL's C takes."""
    f = np.float32
    sigma2 = f(f(sigma) * f(sigma)) / f(passes)
    L = f(np.sqrt(12.0 * np.float64(sigma2) + 1.0))
    length = f(np.floor((np.float64(L) - 1.0) / 2.0))
    a = f(f(2) * length + f(1)) * f(length * f(length + f(1)) - f(3) * sigma2)
    a = a / f(f(6) * f(sigma2 - f(length + f(1)) * f(length + f(1))))
    return float(f(length + a))


def _box_pass(x: torch.Tensor, radius: float, dim: int) -> torch.Tensor:
    """One pass of PIL's ``ImagingHorizontalBoxBlur`` along ``dim`` of int64 levels ``x``: each
    output is ``ww`` times the sum of the ``2r + 1`` inputs around it plus ``fw`` times the next
    one on each side (indices clamped to the line), in 24-bit fixed point, rounded to a level."""
    r = int(radius)
    ww = int(np.float32(1 << 24) / (np.float32(radius) * np.float32(2) + np.float32(1)))
    fw = ((1 << 24) - (2 * r + 1) * ww) // 2
    n = x.shape[dim]
    idx = torch.arange(-r - 1, n + r + 1, device=x.device).clamp_(0, n - 1)
    padded = x.index_select(dim, idx)  # position j holds input j - r - 1, clamped
    window = padded.narrow(dim, 1, n).clone()
    for k in range(2, 2 * r + 2):  # r is 0 or 1 for DeiT's radii: a few slices beat a cumulative sum
        window += padded.narrow(dim, k, n)
    far = padded.narrow(dim, 0, n) + padded.narrow(dim, 2 * r + 2, n)
    return (window.mul_(ww).add_(far.mul_(fw)).add_(1 << 23)) >> 24


def gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """``ImageFilter.GaussianBlur(sigma)`` of a uint8 (C, H, W) tensor: the passes along the width,
    then those along the height, each one's output a whole level as PIL stores it."""
    radius = box_radius(sigma) if sigma != 0 else 0.0
    if radius == 0:
        return x.clone()
    y = x.to(torch.int64)
    for dim in (-1,) * PASSES + (-2,) * PASSES:
        y = _box_pass(y, radius, dim)
    return y.to(torch.uint8)
