"""The batch finisher: what the training process does to each batch its loader workers send.

Each batch crosses from a worker as a :class:`~data_pipeline.loading.batch.wire.DeferredBatch`
(finished uint8 samples, plain JPEG files still to decode, the Mixup/CutMix seed) with its targets
and :class:`~data_pipeline.loading.batch.record.BatchRecord`; :class:`BatchDecoder` (the one
finisher) decodes what is left, then normalises with augment.mean/std and mixes on its device.
``data.decode_device`` says who decodes:

``worker`` (the default): each dataloader worker decodes (the crop window with nvImageCodec, or
PIL with draft-mode DCT scaling), crops, resizes and flips; its batch is one uint8 (B, 3, S, S)
tensor, a quarter of the bytes (and page faults) of the float32 batch, and the finisher normalises
and mixes it on the device the loader is built for (``build_loader(..., device=)``: the training
device, one batch ahead on a side stream on a GPU, ``prefetch.py``; the CPU by default), with the
float operations the workers used to run (bit for bit).

``cuda`` / ``cpu`` / ``dali``: workers only read tar members, parse headers (bomb and format checks
as before) and draw each sample's crop box and flip from its seed (``SampleTransform.defer``); the
training process decodes the whole batch, then crops, resizes, flips, normalises and mixes
(Mixup/CutMix) it. ``cuda`` / ``cpu`` decode in one ``torchvision.io.decode_jpeg(list, device=...)``
call (nvJPEG on a GPU); ``dali`` has an NVIDIA DALI pipeline decode only each crop's window, resize
and flip (``dali_decode.py``: the ``mixed`` decoder on a GPU, DALI's CPU operators without one).
Members that are not plain JPEGs (PNG, WebP, CMYK, progressive, EXIF-rotated, larger than
``(4 * img_size)^2`` pixels, or without the EOI marker at the end: ``SampleTransform.defer``) are
decoded in the worker as before and travel as finished uint8 samples in the same batch.

``cpu`` crops sample by sample with torch's antialiased resize, as the workers do, and gives their
batches bit for bit (how CI tests this path). ``cuda`` and ``dali`` on a GPU work one batch ahead of
the training step, on a side stream (``prefetch.py``), and with no host sync of ours: batch N+1 is
decoded, cropped, resized, flipped and normalised in a constant number of kernels. ``cuda`` crops
with :func:`~data_pipeline.loading.batch.crop_atlas.crop_batch` (one ``roi_align`` over the batch laid
out as an atlas); ``dali`` with DALI's antialiased resize (``dali_decode.py`` says how close).
``dali`` without a GPU runs the same code, DALI's pipeline on its CPU operators.

A JPEG that fails to decode here is retried alone and then through the worker path (PIL); one that
fails both is counted, and replaced (training) or dropped (evaluation) by the batch's record
(``record.py``).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch

from data_pipeline.config import DEVICES
from data_pipeline.errors import ConfigError
from data_pipeline.loading import dali_decode
from data_pipeline.loading.batch.crop_atlas import crop_batch
from data_pipeline.loading.batch.record import BatchRecord
from data_pipeline.loading.batch.wire import DeferredBatch
from data_pipeline.loading.cuda_streams import CudaStreams, decode_jpeg
from data_pipeline.loading.transforms import Deferred, SampleTransform, mix_labelled
from data_pipeline.shards.decode import BadSample, open_image


def check_device(device: str, key: str = "data.decode_device") -> None:
    """One-line ConfigError for a device this process cannot decode on."""
    if device not in DEVICES:
        raise ConfigError(f"{key}: must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}: cuda, but this process sees no CUDA device (use worker or cpu)")
    why = dali_decode.unavailable() if device == "dali" else None
    if why is not None:
        raise ConfigError(f"{key}: dali, but {why}")


class BatchDecoder:
    """Finishes a :class:`DeferredBatch` in the training process: float32 (B, 3, S, S) on ``device``,
    normalised with augment.mean/std, mixed when the batch carries a mix seed.

    ``device``: ``cpu``, ``cuda`` (the current CUDA device) or ``dali`` (DALI on the GPU when CUDA
    is there, else on the CPU; ``threads``: DALI's CPU threads), or a ``torch.device`` (cpu or one
    GPU: for batches the workers decoded, ``data.decode_device: worker``). ``batched`` (default: on
    CUDA; always with DALI) crops, resizes and flips the batch in one :func:`crop_batch` (or DALI
    run) and normalises it in one go; otherwise sample by sample, bit for bit as the workers do, each
    sample normalised while it is in cache. ``streams`` (default on CUDA: a :class:`CudaStreams`)
    makes ``prefetch.finish`` work one batch ahead on a side stream."""

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
        self._spare = None  # training: the last good sample of a batch (record.Spare)

    def describe(self) -> str:
        """Who decodes the plain JPEGs this finisher receives undecoded, in words (the start-up line):
        nothing (``data.decode_device: worker``), or the decoder and device of cpu, cuda and dali."""
        if self._dali is not None:
            import nvidia.dali

            where = f"{self.device} (its mixed decoder)" if self._dali.device_id is not None else \
                f"the CPU ({self._dali.threads} thread(s))"
            return f"DALI {nvidia.dali.__version__} on {where}, each crop's window only"
        if self.device.type == "cuda":
            return f"nvJPEG on {self.device} (torchvision's decode_jpeg), a batch ahead on a side stream"
        return "libjpeg-turbo on the CPU (torchvision's decode_jpeg), the whole image"

    def __call__(self, batch: DeferredBatch, targets: torch.Tensor, record: BatchRecord):
        """(images, targets); failures are counted in ``record`` and replaced (training) or dropped
        (evaluation) with their keys there: :class:`~data_pipeline.loading.batch.record.BatchRecord`."""
        items = batch.items
        out, bad = self._batched(batch) if self.batched else self._per_sample(batch)
        failed = set(bad)
        good = [i for i in range(len(items)) if i not in failed]
        targets = self._upload(targets)
        record.count_corrupt(bad, items)
        if not self.transform.train:
            return record.drop(good, out, targets, self._upload) if bad else (out, targets)
        self._spare = record.refill(bad, good, out, targets, self._spare, self.device.type)
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
        and thin for ``crop_batch``'s atlas (a side over ``4 * img_size``), and RandAugment's or 3-Augment's ops."""
        items, S = batch.items, self.transform.size
        jpegs = [i for i, it in enumerate(items) if isinstance(it, Deferred)]
        x, rows, alone = (self._crop_dali if self._dali is not None else self._crop_decoded)(batch, jpegs) \
            if jpegs else (None, [], {})
        parts, order = [], []
        if rows:
            parts.append(self._replay(x, [items[i] for i in rows]) if self.transform.replays else x)
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

    def _replay(self, x: torch.Tensor, items: list) -> torch.Tensor:
        """3-Augment or RandAugment on the cropped (and flipped) uint8 samples, sample by sample:
        each draws its own ops, replayed from its seed after the crop and flip draws, as
        ``SampleTransform.finish`` does."""
        u8 = x.to(torch.uint8)
        for k, it in enumerate(items):
            u8[k] = self.transform.replay(u8[k], it)
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
