"""The crop atlas: a whole batch of decoded images of any sizes cropped, resized and flipped in a
constant number of kernels (:func:`crop_batch`), the ``cuda`` path's crop
(``data.decode_device``). It averages over each output pixel's area where torch's antialiased
resize (the ``cpu`` path's, the workers') weighs a triangle twice as wide: within about a grey level
on average (tests/unit/test_decode_streams.py)."""
from __future__ import annotations

import math

import numpy as np
import torch
import torchvision  # noqa: F401  (registers torch.ops.torchvision.roi_align)

STRIP_ROWS = 4096  # atlas strip height (crop_batch): roi_align's float32 sample positions stay within 1/4000 px


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def crop_batch(images: list, boxes: list, flips: list, size: int, upload=_same) -> torch.Tensor:
    """Crop, resize and flip a whole batch in a constant number of kernels (none per sample).

    ``images``: uint8 (3, H_i, W_i) of any sizes on one device, as decode_jpeg returns them (each
    one's H x W must flatten without a copy, or that copy is a kernel per image); ``boxes``: per
    image (top, left, h, w) in its pixels (floats allowed); ``flips``: per image, mirror left-right
    after cropping; ``upload``: moves a host tensor to the images' device (``CudaStreams.upload``).
    Returns float32 (n, 3, size, size) holding whole grey levels, as the uint8 path would.

    One ``roi_align`` (bilinear samples averaged over each output pixel's area) reads every box from
    an atlas: the images one below the other in strips of at most ``STRIP_ROWS`` rows (roi_align's
    batch dimension), each framed by a copy of its edge pixels so that samples near its border read
    its own edge, as a resize of the image alone does. An image wider than tall is stored
    transposed, so the atlas is only as wide as the widest short side (at most ``4 * img_size``
    for what ``SampleTransform.defer`` ships), and transposed back after ``roi_align``; a flipped
    one is stored mirrored. Where each atlas row comes from is worked out on the host from the
    shapes alone and uploaded (12 bytes a row); one gather builds the atlas on the device. Memory
    while it runs, per atlas pixel (a decoded pixel, plus frames and padding to the widest): 3 bytes
    gathered, 12 as float32, 4 of int32 index, besides the 3 of the decoded images."""
    n = len(images)
    H = np.array([im.shape[-2] for im in images], dtype=np.int64)
    W = np.array([im.shape[-1] for im in images], dtype=np.int64)
    t = W > H  # stored transposed
    a, b = np.where(t, W, H), np.where(t, H, W)  # stored rows, columns
    rows = a + 2  # an edge row above and below
    width = int(b.max()) + 2  # an edge column left, and right of the widest
    target = math.ceil(int(rows.sum()) / math.ceil(int(rows.sum()) / STRIP_ROWS))
    strip, y0, fill = np.zeros(n, np.int64), np.zeros(n, np.int64), [0]
    for i in range(n):  # fill strips in batch order, each up to about the same height
        if fill[-1] >= target:
            fill.append(0)
        strip[i], y0[i] = len(fill) - 1, fill[-1]
        fill[-1] += rows[i]
    hs = max(fill)
    # per atlas row: the flat index of its stored column 0, the step per stored column, the last column
    offset = np.concatenate([[0], np.cumsum(H * W)[:-1]])
    dtype = np.int32 if int((H * W).sum()) < 2 ** 31 else np.int64
    base, step, last = (np.zeros(len(fill) * hs, dtype) for _ in range(3))
    rois = np.zeros((n, 5), np.float32)
    for i in range(n):
        at = slice(strip[i] * hs + y0[i], strip[i] * hs + y0[i] + rows[i])
        r = np.clip(np.arange(rows[i]) - 1, 0, a[i] - 1)  # stored row; the edge rows repeat the first/last
        top, left, h, w = boxes[i]
        if flips[i]:
            left = W[i] - left - w
        if t[i]:  # stored row r is image column r (mirrored: W-1-r), stored column q is image row q
            base[at], step[at], last[at] = offset[i] + (W[i] - 1 - r if flips[i] else r), W[i], H[i] - 1
            y, x, hh, ww = left, top, w, h
        else:  # stored row r is image row r, stored column q is image column q (mirrored: W-1-q)
            base[at] = offset[i] + r * W[i] + (W[i] - 1 if flips[i] else 0)
            step[at], last[at] = (-1 if flips[i] else 1), W[i] - 1
            y, x, hh, ww = top, left, h, w
        rois[i] = (strip[i], 1 + x, y0[i] + 1 + y, 1 + x + ww, y0[i] + 1 + y + hh)
    device = images[0].device
    desc = upload(torch.from_numpy(np.stack([base, step, last])))
    rois = upload(torch.from_numpy(rois))
    flat = torch.cat([im.reshape(3, -1) for im in images], dim=1)  # (3, pixels of the batch)
    q = torch.arange(-1, width - 1, device=device, dtype=desc.dtype).clamp_(min=0)  # stored column of each atlas column
    index = torch.minimum(q[None, :], desc[2, :, None]).mul_(desc[1, :, None]).add_(desc[0, :, None])
    atlas = flat.index_select(1, index.view(-1)).view(3, len(fill), hs, width).transpose(0, 1)
    atlas = atlas.to(torch.float32, memory_format=torch.contiguous_format)
    # The op itself, not torchvision.ops.roi_align: under torch.use_deterministic_algorithms that
    # wrapper switches to an eager Python version sized by the whole atlas (its forward kernel is
    # deterministic anyway; only the backward is not).
    out = torch.ops.torchvision.roi_align(atlas, rois, 1.0, size, size, -1, True).round_()
    turned = np.flatnonzero(t)
    if len(turned):
        k = upload(torch.from_numpy(turned))
        out.index_copy_(0, k, out.index_select(0, k).transpose(-1, -2))
    return out
