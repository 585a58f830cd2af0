"""The batch finisher: what the training process does to each batch its loader workers send.

Workers never send float pixels. Each batch crosses from a worker as a :class:`DeferredBatch`:
finished uint8 samples in one shared-memory tensor, plain JPEG files still to decode, the targets
and the Mixup/CutMix seed; :class:`BatchDecoder` (the one finisher) decodes what is left, then
normalises with augment.mean/std and mixes on its device. ``data.decode_device`` says who decodes:

``worker`` (the default): each dataloader worker decodes (the crop window with nvImageCodec, or
PIL with draft-mode DCT scaling), crops, resizes and flips; its batch is one uint8 (B, 3, S, S)
tensor, a quarter of the bytes (and page faults) of the float32 batch, and the finisher normalises
and mixes it on the device the loader is built for (``build_loader(..., device=)``: the training
device, one batch ahead on a side stream on a GPU, as timm's prefetcher and DALI do; the CPU by
default), with the same float operations, bit for bit, wherever it runs.

``cuda`` / ``cpu`` / ``dali``: workers only read tar members, parse headers (the same bomb and
format checks) and draw each sample's crop box and flip from its seed (``SampleTransform.defer``); the
training process decodes the whole batch, then crops, resizes, flips, normalises and mixes
(Mixup/CutMix) it. ``cuda`` / ``cpu`` decode in one ``torchvision.io.decode_jpeg(list, device=...)``
call (nvJPEG on a GPU); ``dali`` has an NVIDIA DALI pipeline decode only each crop's window, resize
and flip (``dali_decode.py``: the ``mixed`` decoder on a GPU, DALI's CPU operators without one).
Members that are not plain JPEGs (PNG, WebP, CMYK, progressive, EXIF-rotated, larger than
``(4 * img_size)^2`` pixels, or without the EOI marker at the end: ``SampleTransform.defer``) are
decoded in the worker as on the ``worker`` path and travel as finished uint8 samples in the same batch.

``cpu`` crops sample by sample with torch's antialiased resize, as the workers do, and gives their
batches bit for bit (how CI tests this path). ``cuda`` and ``dali`` on a GPU work one batch ahead of
the training step, on a side stream (:class:`~data_pipeline.loading.cuda_streams.CudaStreams`), and
with no host sync of ours: while step N runs, batch N+1 is decoded, cropped, resized, flipped and
normalised in a constant number of kernels. ``cuda`` crops with :func:`crop_batch` (one
``roi_align`` over the batch laid out as an atlas, which averages over each output pixel's area
where torch's antialiased resize weighs a triangle twice as wide: within about a grey level on
average, see tests/unit/test_batch_decode.py); ``dali`` with DALI's antialiased resize
(``dali_decode.py`` says how close). ``dali`` without a GPU runs the same code, DALI's pipeline on its CPU operators.

A JPEG that fails to decode here is retried alone and then through the worker path (PIL); one that
fails both is counted as ``corrupt_image`` of its shard (against ``data.max_corrupt_rate``; once,
not again on a repeat pass). In training its place in the batch is taken by a copy of another
sample of the batch (of the previous batch's last good one when none is left), counted as
``repeated_for_balance``, so every rank still yields batches of the same shape; its key in
``loader.last_keys`` is the copied sample's. In evaluation it is dropped, as the worker path does.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Iterator, Optional

import numpy as np
import torch
import torchvision  # noqa: F401  (registers torch.ops.torchvision.roi_align)
from torch.utils.data import get_worker_info

from data_pipeline.config import DEVICES
from data_pipeline.errors import ConfigError, TooManyCorruptSamples
from data_pipeline.loading import dali_decode
from data_pipeline.loading.cuda_streams import CudaStreams, decode_jpeg
from data_pipeline.loading.transforms import Deferred, SampleTransform, mix_labelled
from data_pipeline.shards.decode import BadSample, open_image

STRIP_ROWS = 4096  # atlas strip height (crop_batch): roi_align's float32 sample positions stay within 1/4000 px


class BatchBuffers:
    """The uint8 shared-memory tensors a DataLoader worker stacks its batches into, reused in turn
    once the training process has finished reading them. A fresh shared-memory tensor costs its
    first-touch page faults in the worker on every batch (about 0.08 ms a sample at 224 px); a
    reused one is warm. ``released`` (shared memory, made by the training process before its
    workers start) counts, per worker, the batches the training process is done with: the finisher
    has read each one (on a GPU, the pin-memory thread copied it before that) and it never leaves
    the loader. Batches reach the training process in each worker's order, so a count says which
    buffers are free. A worker whose next buffer is not yet free (a slow consumer) takes a fresh
    one: it never waits, and never writes into a buffer still being read."""

    def __init__(self, workers: int, slots: int):
        self.slots = slots
        self.released = torch.zeros(max(1, workers), dtype=torch.int64).share_memory_()
        self._buffers: dict = {}  # in a worker: slot -> (storage, its size)
        self._taken = 0  # in a worker: batches stacked so far

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_buffers"], state["_taken"] = {}, 0  # each worker starts its own
        return state

    def take(self, shape: tuple) -> tuple:
        """In a worker: (a uint8 tensor of ``shape`` in shared memory, its tag for :meth:`release`)."""
        worker, number = get_worker_info().id, self._taken
        self._taken += 1
        slot, numel = number % self.slots, math.prod(shape)
        storage, size = self._buffers.get(slot, (None, 0))
        # the slot's last batch (number - slots) must have been released: counts are in order
        if size != numel or int(self.released[worker]) < number - self.slots + 1:
            storage = _shared_storage(numel)
            self._buffers[slot] = (storage, numel)
        return _on(storage, shape), (worker, number)

    def release(self, tag: Optional[tuple]) -> None:
        """In the training process: the batch ``tag`` and every earlier one of its worker are read."""
        if tag is not None:
            self.released[tag[0]] = tag[1] + 1


def _shared_storage(numel: int):
    """A uint8 storage in shared memory, as torch's ``default_collate`` allocates one in a worker."""
    return torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(numel, device="cpu")


def _on(storage, shape: tuple) -> torch.Tensor:
    """A uint8 tensor of ``shape`` over ``storage``."""
    return torch.empty(0, dtype=torch.uint8).new(storage).resize_(shape)


def _stacked(samples: list, buffers: Optional[BatchBuffers]) -> tuple:
    """uint8 (3, S, S) samples -> (one (n, 3, S, S) tensor, its buffer tag). Inside a DataLoader
    worker it is stacked in shared memory (as torch's ``default_collate`` does), so it crosses to
    the training process without another copy: into one of ``buffers``, or fresh without them."""
    n, (c, h, w) = len(samples), samples[0].shape
    if get_worker_info() is None:
        return torch.stack(samples), None
    if buffers is not None:
        out, tag = buffers.take((n, c, h, w))
        return torch.stack(samples, out=out), tag
    return torch.stack(samples, out=_on(_shared_storage(n * c * h * w), (n, c, h, w))), None


@dataclass
class DeferredBatch:
    """What a worker yields for a batch: two tensors for the whole batch (each tensor crossing from
    a worker costs a file descriptor and a shared-memory segment, so not one per sample) and
    per-sample records. With ``data.decode_device: worker`` every sample is a row of ``decoded``
    and ``blob`` is empty."""
    items: list  # per sample: a Deferred (its file is blob[span]) or the row of ``decoded`` it is
    blob: torch.Tensor  # uint8: the batch's JPEG files end to end
    decoded: Optional[torch.Tensor]  # uint8 (n, 3, S, S): the samples the worker decoded itself
    mix_seed: Optional[int]  # Mixup/CutMix seed of the batch (None: no mixing)
    buffer: Optional[tuple] = None  # BatchBuffers tag of ``decoded``: released once the batch is finished

    @classmethod
    def pack(cls, samples: list, mix_seed: Optional[int], buffers: Optional[BatchBuffers] = None) -> "DeferredBatch":
        """``samples``: Deferred (holding its file) or finished uint8 (3, S, S) tensors; ``buffers``:
        where a worker stacks the finished ones (None: a fresh shared-memory tensor)."""
        items, files, done, offset = [], [], [], 0
        for s in samples:
            if isinstance(s, Deferred):
                items.append(replace(s, data=None, span=(offset, offset + len(s.data))))
                files.append(s.data)
                offset += len(s.data)
            else:
                items.append(len(done))
                done.append(s)
        blob = torch.frombuffer(bytearray(b"".join(files)), dtype=torch.uint8) if files \
            else torch.empty(0, dtype=torch.uint8)
        decoded, tag = _stacked(done, buffers) if done else (None, None)
        return cls(items, blob, decoded, mix_seed, tag)

    def file(self, item: Deferred) -> torch.Tensor:
        return self.blob[item.span[0]:item.span[1]]

    def pin_memory(self) -> "DeferredBatch":
        """The DataLoader's pin-memory thread calls this (``pin_memory=True`` on a GPU machine): the
        worker-decoded samples are uploaded, and only a pinned source makes that copy asynchronous
        (from pageable memory CUDA may wait for the stream first). The JPEG files are read on the host."""
        return replace(self, decoded=self.decoded.pin_memory()) if self.decoded is not None else self


def check_device(device: str, key: str = "data.decode_device") -> None:
    """One-line ConfigError for a device this process cannot decode on."""
    if device not in DEVICES:
        raise ConfigError(f"{key}: must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}: cuda, but this process sees no CUDA device (use worker or cpu)")
    why = dali_decode.unavailable() if device == "dali" else None
    if why is not None:
        raise ConfigError(f"{key}: dali, but {why}")


@dataclass
class _Issued:
    """A batch whose work is queued on the side stream; ``ready`` is recorded after the last of it."""
    images: Optional[torch.Tensor]
    targets: Optional[torch.Tensor]
    meta: dict
    ready: object = None
    error: Optional[BaseException] = None  # raised when the batch is handed out, in batch order


# ---------------------------------------------------------------------------------- batched crop
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


# ---------------------------------------------------------------------------------- the decoder
class BatchDecoder:
    """Finishes a :class:`DeferredBatch` in the training process: float32 (B, 3, S, S) on ``device``,
    normalised with augment.mean/std, mixed when the batch carries a mix seed.

    ``device``: ``cpu``, ``cuda`` (the current CUDA device) or ``dali`` (DALI on the GPU when CUDA
    is there, else on the CPU; ``threads``: DALI's CPU threads), or a ``torch.device`` (cpu or one
    GPU: for batches the workers decoded, ``data.decode_device: worker``). ``batched`` (default: on
    CUDA; always with DALI) crops, resizes and flips the batch in one :func:`crop_batch` (or DALI
    run) and normalises it in one go; otherwise sample by sample, bit for bit as the workers do, each
    sample normalised while it is in cache. ``streams`` (default on CUDA: a :class:`CudaStreams`)
    makes :meth:`finish` work one batch ahead on a side stream."""

    def __init__(self, transform: SampleTransform, aug, device, max_pixels: int, num_classes: int,
                 streams=None, batched: Optional[bool] = None, threads: int = 1):
        self.transform, self.aug, self.max_pixels, self.num_classes = transform, aug, max_pixels, num_classes
        where = device if isinstance(device, torch.device) else torch.device(
            "cuda" if device == "cuda" or (device == "dali" and torch.cuda.is_available()) else "cpu")
        gpu = where.type == "cuda"
        # no index: the current CUDA device (DeepSpeed's engine has set it to the rank's GPU by then)
        self.device = torch.device("cuda", torch.cuda.current_device() if where.index is None else where.index) \
            if gpu else torch.device("cpu")
        self.streams = streams if streams is not None or not gpu else CudaStreams(self.device)
        self.batched = device == "dali" or (gpu if batched is None else batched)
        self._dali = dali_decode.DaliCrop(transform.size, self.device.index if gpu else None, threads) \
            if device == "dali" else None
        std = torch.tensor(aug.std, dtype=torch.float32).view(3, 1, 1)
        self.scale = (1.0 / (std * 255.0)).to(self.device)
        self.shift = (-torch.tensor(aug.mean, dtype=torch.float32).view(3, 1, 1) / std).to(self.device)
        self._spare = None  # training: the last good sample (image, target, key, shard) of a batch

    # ------------------------------------------------------------------ one batch ahead (CUDA)
    def finish(self, batches: Iterator, buffers: Optional[BatchBuffers] = None) -> Iterator:
        """The DataLoader's (images, targets, meta) with each :class:`DeferredBatch` finished (other
        batches pass as they are). Without ``streams``, each batch when it is asked for. With them,
        batch N+1 is issued to the side stream before batch N is handed out, so it decodes while
        step N computes; streams are ordered by events only, no host wait of ours (see
        :meth:`_issue` and :meth:`_hand_out`; torchvision's decode call itself returns once nvJPEG
        is done: the host waits for the decode, not for the step). An error finishing batch N+1 is
        raised when N+1 is asked for, after N. Each batch's worker buffer is released to
        ``buffers`` once the batch is finished (or issued: it was pinned before it got here)."""
        release = buffers.release if buffers is not None else (lambda tag: None)
        if self.streams is None:
            for images, targets, meta in batches:
                if isinstance(images, DeferredBatch):  # its failures join the batch's tally (an
                    batch = images  # eval batch may end up empty)
                    images, targets = self(batch, targets, meta)
                    release(batch.buffer)
                yield images, targets, meta
            return
        issued = None
        for batch in batches:
            following = self._issue(*batch)
            if isinstance(batch[0], DeferredBatch):  # read (the pinned copy is what the side stream uploads)
                release(batch[0].buffer)
            if issued is not None:
                yield self._hand_out(issued)
            issued = following
        if issued is not None:
            yield self._hand_out(issued)

    def _issue(self, images, targets, meta) -> _Issued:
        """Queue the batch's work on the side stream. The side stream first waits for an event
        recorded on the compute stream now: the batch's kernels run after the steps already queued
        there, so none of them can touch what those steps read (the allocator, told by
        ``record_stream`` in :meth:`_hand_out`, keeps their memory apart as well)."""
        if not isinstance(images, DeferredBatch):
            return _Issued(images, targets, meta)
        s = self.streams
        s.wait(s.side, s.record(s.compute))
        try:
            with s.use(s.side):
                images, targets = self(images, targets, meta)
        except Exception as e:  # noqa: BLE001  (re-raised in batch order by _hand_out)
            return _Issued(None, None, meta, error=e)
        return _Issued(images, targets, meta, ready=s.record(s.side) if images is not None else None)

    def _hand_out(self, issued: _Issued):
        """The compute stream waits for the batch's event (the host does not), and each tensor it
        will read is marked as used there, so the allocator does not hand its memory to the side
        stream again before the step that reads it has run."""
        if issued.error is not None:
            raise issued.error
        if issued.ready is not None:
            s = self.streams
            s.wait(s.compute, issued.ready)
            s.record_stream(issued.images, s.compute)
            s.record_stream(issued.targets, s.compute)
        return issued.images, issued.targets, issued.meta

    # ------------------------------------------------------------------------------- one batch
    def __call__(self, batch: DeferredBatch, targets: torch.Tensor, meta: dict):
        """(images, targets); records failures in ``meta`` (its tally and keys) for the loader."""
        items = batch.items
        out, bad = self._batched(batch) if self.batched else self._per_sample(batch)
        failed = set(bad)
        good = [i for i in range(len(items)) if i not in failed]
        targets = self._upload(targets)
        keys, shards = meta.get("keys") or [""] * len(items), meta.get("shards") or [""] * len(items)
        self._count([items[i] for i in bad], [shards[i] for i in bad], meta["tally"])
        if not self.transform.train:
            if bad:  # evaluation: a short batch, as the worker path gives
                meta.update(keys=[keys[i] for i in good], shards=[shards[i] for i in good])
                if not good:
                    return None, None
                rows = self._upload(torch.tensor(good))
                out, targets = out.index_select(0, rows), targets.index_select(0, rows)
            return out, targets
        if bad:
            self._replace(bad, good, out, targets, keys, shards, meta["tally"]["counts"])
        if good:
            self._spare = (out[good[-1]].clone(), targets[good[-1]].clone(), keys[good[-1]], shards[good[-1]])
        if batch.mix_seed is not None:
            out, targets = mix_labelled(out, targets, self.aug, batch.mix_seed, self.num_classes)
        return out, targets

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        return self.streams.upload(t) if self.streams is not None else t.to(self.device, non_blocking=True)

    def _per_sample(self, batch: DeferredBatch):
        """(normalised float rows, failed rows), sample by sample: the workers' kernels, bit for bit."""
        items = batch.items
        jpegs = [i for i, it in enumerate(items) if isinstance(it, Deferred)]
        pixels = dict(zip(jpegs, self._decode([batch.file(items[i]) for i in jpegs])))
        out = torch.empty((len(items), 3, self.transform.size, self.transform.size), dtype=torch.float32,
                          device=self.device)
        decoded = batch.decoded.to(self.device, non_blocking=True) if batch.decoded is not None else None
        bad = []
        for i, it in enumerate(items):
            u8 = self._finish(it, batch.file(it), pixels[i]) if isinstance(it, Deferred) else decoded[it]
            if u8 is None:
                bad.append(i)
                continue
            out[i].copy_(u8).mul_(self.scale).add_(self.shift)
        return out, bad

    def _batched(self, batch: DeferredBatch):
        """(normalised float rows, failed rows) in a constant number of kernels: the JPEGs decoded
        and cropped together (:meth:`_crop_decoded`, or :meth:`_crop_dali`), one upload for the
        worker-decoded samples, one scatter into batch order, one normalisation. Per sample only what
        is rare or differs per sample: a JPEG that failed here (PIL, in this process), one too long
        and thin for ``crop_batch``'s atlas (a side over ``4 * img_size``), and RandAugment's ops."""
        items, S = batch.items, self.transform.size
        jpegs = [i for i, it in enumerate(items) if isinstance(it, Deferred)]
        x, rows, alone = (self._crop_dali if self._dali is not None else self._crop_decoded)(batch, jpegs) \
            if jpegs else (None, [], {})
        parts, order = [], []
        if rows:
            parts.append(self._randaugment(x, [items[i] for i in rows]) if self.transform.train
                         and self.transform.randaug is not None else x)
            order += rows
        if batch.decoded is not None:
            parts.append(self._upload(batch.decoded).float())
            order += [i for i, it in enumerate(items) if not isinstance(it, Deferred)]  # rows 0, 1, ... in order
        kept = [i for i, u8 in alone.items() if u8 is not None]
        if kept:
            parts.append(torch.stack([alone[i] for i in kept]).float())
            order += kept
        bad = sorted(i for i, u8 in alone.items() if u8 is None)
        if order == list(range(len(items))):
            out = torch.cat(parts) if len(parts) > 1 else parts[0]
        else:  # rows that failed stay unset: replaced or dropped by the caller
            out = torch.empty((len(items), 3, S, S), dtype=torch.float32, device=self.device)
            if parts:
                out.index_copy_(0, self._upload(torch.tensor(order)), torch.cat(parts))
        return out.mul_(self.scale).add_(self.shift), bad

    def _crop_decoded(self, batch: DeferredBatch, jpegs: list):
        """The rows ``jpegs`` decoded in one torchvision call (nvJPEG on CUDA) and cropped, resized
        and flipped by one :func:`crop_batch`: (float32 rows of whole grey levels, the batch rows
        they are, {batch row: finished uint8 sample, or None when it failed} for those done alone)."""
        items, S = batch.items, self.transform.size
        alone, crop = {}, []  # row -> finished uint8 (3, S, S) or None (failed); rows for crop_batch
        for i, px in zip(jpegs, self._decode([batch.file(items[i]) for i in jpegs])):
            it = items[i]
            if px is None or tuple(px.shape[-2:]) != (it.size[1], it.size[0]):
                alone[i] = self._finish(it, batch.file(it), px)
            elif max(px.shape[-2:]) > 4 * S:
                alone[i] = self.transform.finish(px, it)
            else:
                crop.append((i, px))
        if not crop:
            return None, [], alone
        x = crop_batch([px for _, px in crop], [self._box(items[i]) for i, _ in crop],
                       [items[i].flip for i, _ in crop], S, self._upload)
        return x, [i for i, _ in crop], alone

    def _crop_dali(self, batch: DeferredBatch, jpegs: list):
        """:meth:`_crop_decoded` by one DALI run (``dali_decode.DaliCrop``): each file's window
        decoded, resized and flipped; its output reaches torch through :meth:`CudaStreams.take` on
        the side stream (``dali_decode.host_output`` on the CPU). Files DALI fails on go through the
        worker path (PIL) alone."""
        items, S, blob = batch.items, self.transform.size, batch.blob.numpy()
        files = [blob[items[i].span[0]:items[i].span[1]] for i in jpegs]
        windows = [dali_decode.window(self._box(items[i]), items[i].size, S, reach=items[i].box is None)
                   for i in jpegs]
        take = self.streams.take if self.streams is not None else dali_decode.host_output
        x, failed = self._dali(files, windows, [items[i].flip for i in jpegs], take)
        alone = {jpegs[k]: self._finish(items[jpegs[k]], batch.file(items[jpegs[k]]), None) for k in failed}
        rows = [i for i in jpegs if i not in alone]
        return (x.float() if x is not None else None), rows, alone

    def _box(self, item: Deferred) -> tuple:
        """The sample's crop (top, left, h, w) in its decoded image: the worker's draw in training; in
        evaluation the region that ``SampleTransform.finish``'s resize (shorter side to
        ``resize``) and center crop keep, in the image's own pixels."""
        if item.box is not None:
            return item.box
        (W, H), S, R = item.size, self.transform.size, self.transform.resize
        if W <= H:  # torchvision's resize: the longer side truncated
            w2, h2 = R, int(R * H / W)
        else:
            w2, h2 = int(R * W / H), R
        top, left = int(round((h2 - S) / 2.0)), int(round((w2 - S) / 2.0))
        return top * H / h2, left * W / w2, S * H / h2, S * W / w2

    def _randaugment(self, x: torch.Tensor, items: list) -> torch.Tensor:
        """RandAugment on the cropped (and flipped) uint8 samples, sample by sample: each draws its
        own ops, replayed from its seed after the crop and flip draws, as ``SampleTransform.finish``
        does."""
        u8 = x.to(torch.uint8)
        for k, it in enumerate(items):
            u8[k] = self.transform.randaugment(u8[k], it)
        return u8.float()

    def _decode(self, datas: list) -> list:
        """Decoded uint8 (3, H, W) per file (None: this decoder could not); one batched call. With
        ``streams``: nvJPEG allocates on the decode stream, the current (side) stream waits for it,
        and every output is marked as read there (see :func:`decode_jpeg`)."""
        if not datas:
            return []
        s = self.streams
        with s.use(s.decode) if s is not None else nullcontext():
            try:
                out = list(decode_jpeg(datas, self.device))
            except RuntimeError:  # one bad file fails the whole call: find it
                out = []
                for d in datas:
                    try:
                        out.append(decode_jpeg(d, self.device))
                    except RuntimeError:
                        out.append(None)
        if s is not None:
            s.wait(s.side, s.record(s.decode))
            for px in out:
                if px is not None:
                    s.record_stream(px, s.side)
        return out

    def _finish(self, item: Deferred, data: torch.Tensor, pixels: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if pixels is not None and tuple(pixels.shape[-2:]) == (item.size[1], item.size[0]):
            return self.transform.finish(pixels, item)
        # the worker path (PIL), from the same bytes and seed; None when PIL cannot either
        try:
            img = open_image({"jpg": data.numpy().tobytes()}, self.max_pixels)
            return self._upload(self.transform(img, item.seed)) if self.streams is not None \
                else self.transform(img, item.seed).to(self.device)
        except BadSample:
            return None

    @staticmethod
    def _count(failed: list, shards: list, tally: dict) -> None:
        """Failed decodes join the batch's tally as ``corrupt_image`` of their shard, unless an
        earlier pass over the same sample counted it (``Deferred.counted``)."""
        for item, shard in zip(failed, shards):
            if item.counted:
                tally["counts"]["corrupt_image"] = tally["counts"].get("corrupt_image", 0) + 1
                tally["bad_by_shard"][shard] = tally["bad_by_shard"].get(shard, 0) + 1

    def _replace(self, bad: list, good: list, out: torch.Tensor, targets: torch.Tensor, keys: list,
                 shards: list, counts: dict) -> None:
        """Training: each failed row takes a copy of a good row of the batch (or, in a batch with
        none, of the previous batch's last good sample), counted as ``repeated_for_balance``;
        ``keys`` and ``shards`` (the batch's, in ``meta``) follow."""
        if not good and self._spare is None:
            names = ", ".join(sorted(set(shards[i] for i in bad)))
            raise TooManyCorruptSamples(f"none of the {len(bad)} JPEGs of the first batch decoded on "
                                        f"{self.device.type} (shards: {names})")
        for k, i in enumerate(bad):
            if good:
                src = good[k % len(good)]
                image, target, key, shard = out[src], targets[src], keys[src], shards[src]
            else:
                image, target, key, shard = self._spare
            out[i].copy_(image)
            targets[i] = target
            keys[i], shards[i] = key, shard
            counts["repeated_for_balance"] = counts.get("repeated_for_balance", 0) + 1
