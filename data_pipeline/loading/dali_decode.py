"""``data.decode_device: dali``: an NVIDIA DALI pipeline decodes, crops, resizes and flips the plain
JPEGs of each batch in the training process.

The workers still read tar members and draw each sample's crop box and flip
(``SampleTransform.defer``, as for ``cpu`` / ``cuda``), so the plan, resume and sample accounting
are unchanged; ``batch.decode.BatchDecoder`` hands this module the batch's files, boxes and flips
and does the rest (worker-decoded members, corrupt samples, RandAugment, normalisation, mixing).

The pipeline, per sample: ``decoders.image_slice`` decodes only the window (libjpeg-turbo's cropped
decode on the CPU; on a GPU the ``mixed`` decoder: the hardware JPEG engine of A100/H100 for part of
the batch, nvJPEG's CUDA decoder for the rest), ``resize`` takes the box out of the window and scales
it to ``img_size`` (linear, antialiased when it shrinks), ``crop_mirror_normalize`` flips and lays
it out as CHW, uint8. Feeding is through ``external_source``, one batch a run, no prefetch of
DALI's own (``prefetch.finish`` works a batch ahead on the GPU).

Pixels against the ``worker`` path (torch's antialiased resize of the crop, PIL's decode): the CPU
decode is libjpeg-turbo with the same integer IDCT and fancy upsampling, the resize the same
triangle filter; what differs is the rounding (torch's uint8 kernel computes in fixed point) and
the crop's border, where torch renormalises the filter's weights over the pixels inside the crop
and DALI repeats the edge pixel. So: within one grey level inside, a few levels in the outermost
rows and columns, more on noise (``tests/unit/test_dali_decode.py`` states the bounds). In
evaluation (resize of the whole image, then centre crop) the window holds the box plus the filter's
reach, so the border is the image's own. On a GPU nvJPEG's IDCT and its (non-fancy) chroma
upsampling add their own difference, as for ``cuda``.

A file DALI fails on fails the whole run, and DALI's pipeline is not to be used after an error: it
is rebuilt (milliseconds on the CPU), and the batch's files are run one at a time to find the ones
that fail; ``BatchDecoder`` then gives those to the worker path (PIL), which decodes them or
counts them as corrupt.

Fork: the DataLoader forks its workers from this process (again for every evaluation pass) while
pipelines exist. A forked child has none of a pipeline's threads, and destroying the pipeline there
(the child's garbage collector meeting a dropped loader, say) waits for them forever. So in a
child every pipeline inherited from the parent is set aside, never run nor destroyed (workers end
with ``os._exit``), and a child that used DALI would build its own.
"""
from __future__ import annotations

import math
import os
import weakref
from typing import Callable, Optional

import numpy as np
import torch

__all__ = ["DaliCrop", "host_output", "package", "unavailable", "window"]

_crops: "weakref.WeakSet[DaliCrop]" = weakref.WeakSet()  # every DaliCrop of this process
_inherited: list = []  # in a forked child: the parent's pipelines, set aside (see the module docstring)


def _set_aside_in_child() -> None:
    for crop in list(_crops):
        if crop._pipe is not None:
            _inherited.append(crop._pipe)
            crop._pipe, crop._capacity = None, 0


os.register_at_fork(after_in_child=_set_aside_in_child)


def package() -> str:
    """The DALI wheel built for this torch's CUDA major version (``nvidia-dali-cuda130`` for CUDA 13)."""
    major = (torch.version.cuda or "13").split(".")[0]
    return f"nvidia-dali-cuda{major}0"


def unavailable() -> Optional[str]:
    """Why DALI cannot run in this process (None: it can)."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as e:
        return f"nvidia.dali does not import ({e}); pip install {package()}"
    return None


def window(box: tuple, size: tuple, out: int, reach: bool) -> tuple:
    """What the pipeline needs for one sample: the window to decode, (top, left) and (h, w) in
    whole pixels of the image, and the box inside it, (y0, x0) and (y1, x1) relative to the window.

    ``box``: (top, left, h, w) in the image's pixels (floats allowed); ``size``: the image's (W, H);
    ``out``: the output side. ``reach``: the window also holds the pixels that the resize's filter
    reads around the box (``max(h / out, 1)`` rows, ``max(w / out, 1)`` columns), as a resize of the
    whole image does (evaluation); without it the window is the box itself, as a resize of the crop
    alone (training: the box is whole pixels)."""
    top, left, h, w = box
    W, H = size
    if not reach:
        return (top, left), (h, w), (0.0, 0.0), (float(h), float(w))
    ry, rx = max(h / out, 1.0), max(w / out, 1.0)
    y0, x0 = max(0, math.floor(top - ry)), max(0, math.floor(left - rx))
    y1, x1 = min(H, math.ceil(top + h + ry)), min(W, math.ceil(left + w + rx))
    return (y0, x0), (y1 - y0, x1 - x0), (top - y0, left - x0), (top + h - y0, left + w - x0)


def host_output(pipe) -> torch.Tensor:
    """The output of ``pipe``'s run (a CPU pipeline) as a uint8 torch tensor, copied out of DALI's
    buffer, which goes back to DALI when its Python object goes."""
    from nvidia.dali.plugin.pytorch import feed_ndarray

    (out,) = pipe.outputs()
    dense = out.as_tensor()
    return feed_ndarray(dense, torch.empty(dense.shape(), dtype=torch.uint8))


class DaliCrop:
    """``crop(files, windows, flips, take)`` -> (uint8 (k, 3, out, out) of the files that decoded, in
    order, or None; positions of those that did not). ``device_id``: the GPU (None: DALI's CPU
    operators); ``threads``: DALI's CPU threads (the CPU decode, and on a GPU the Huffman decoding
    of what the hardware engine does not take). The pipeline is built on first use, after the
    DataLoader's workers have forked, and again for a larger batch or after an error."""

    # pixels and behaviour we rely on, set rather than left to DALI's defaults
    DECODE = dict(axis_names="HW", normalized_anchor=False, normalized_shape=False,
                  adjust_orientation=False, use_fast_idct=False)
    MIXED = dict(jpeg_fancy_upsampling=False,  # nvJPEG's ROI decode does not take fancy upsampling everywhere
                 hw_decoder_load=0.65)  # share of each batch for the A100/H100 hardware JPEG engine

    def __init__(self, out: int, device_id: Optional[int], threads: int = 1):
        self.out, self.device_id, self.threads = int(out), device_id, max(1, int(threads))
        self._pipe, self._capacity = None, 0
        _crops.add(self)

    def _build(self, batch_size: int):
        from nvidia.dali import Pipeline, fn, types

        pipe = Pipeline(batch_size=batch_size, num_threads=self.threads, device_id=self.device_id, seed=0,
                        prefetch_queue_depth=1, exec_async=True, exec_pipelined=True, exec_dynamic=True)
        decode = dict(self.DECODE, output_type=types.RGB, dtype=types.UINT8)
        if self.device_id is not None:
            decode.update(self.MIXED, device="mixed")
        else:
            decode.update(device="cpu")
        with pipe:
            files = fn.external_source(name="files", dtype=types.UINT8, ndim=1)
            anchor = fn.external_source(name="anchor", dtype=types.INT32, ndim=1)
            shape = fn.external_source(name="shape", dtype=types.INT32, ndim=1)
            roi_start = fn.external_source(name="roi_start", dtype=types.FLOAT, ndim=1)
            roi_end = fn.external_source(name="roi_end", dtype=types.FLOAT, ndim=1)
            flip = fn.external_source(name="flip", dtype=types.INT32, ndim=0)
            image = fn.decoders.image_slice(files, anchor, shape, **decode)
            image = fn.resize(image, size=[self.out, self.out], roi_start=roi_start, roi_end=roi_end,
                              roi_relative=False, interp_type=types.INTERP_LINEAR, antialias=True,
                              subpixel_scale=True, dtype=types.UINT8)
            pipe.set_outputs(fn.crop_mirror_normalize(image, mirror=flip, output_layout="CHW", dtype=types.UINT8,
                                                      mean=[0.0], std=[1.0]))
        pipe.build()
        self._pipe, self._capacity = pipe, batch_size

    def _run(self, files: list, windows: list, flips: list, take: Callable) -> torch.Tensor:
        if self._pipe is None or len(files) > self._capacity:
            self._build(max(len(files), self._capacity))
        pipe = self._pipe
        pipe.feed_input("files", files)
        pipe.feed_input("anchor", np.array([w[0] for w in windows], np.int32))
        pipe.feed_input("shape", np.array([w[1] for w in windows], np.int32))
        pipe.feed_input("roi_start", np.array([w[2] for w in windows], np.float32))
        pipe.feed_input("roi_end", np.array([w[3] for w in windows], np.float32))
        pipe.feed_input("flip", np.array(flips, np.int32))
        pipe.schedule_run()
        return take(pipe)

    def __call__(self, files: list, windows: list, flips: list, take: Callable) -> tuple:
        """``files``: 1-D uint8 arrays (the JPEG files); ``windows``: :func:`window` per file;
        ``flips``: per file, mirror left-right after the resize; ``take(pipe)``: the run's output as a
        torch tensor (:func:`host_output`, or ``CudaStreams.take`` on a GPU)."""
        try:
            return self._run(files, windows, flips, take), []
        except RuntimeError:  # a file failed, and with it the pipeline: find which, one at a time
            self._pipe = None
        good, bad = [], []
        for i in range(len(files)):
            try:
                good.append(self._run(files[i:i + 1], windows[i:i + 1], flips[i:i + 1], take))
            except RuntimeError:
                self._pipe = None
                bad.append(i)
        return (torch.cat(good) if good else None), bad
