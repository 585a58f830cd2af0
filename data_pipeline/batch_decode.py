"""``data.decode_device``: where a training batch's JPEGs are decoded.

``worker`` (the default): each dataloader worker decodes with PIL (draft-mode DCT scaling), crops,
resizes and normalises; the batch arrives ready.

``cuda`` / ``cpu``: workers only read tar members, parse headers (bomb and format checks as
before) and draw each sample's crop box and flip from its seed (``SampleTransform.defer``); the
training process decodes the whole batch in one ``torchvision.io.decode_jpeg(list, device=...)``
call (nvJPEG on a GPU), then crops, resizes, flips, normalises and mixes (Mixup/CutMix) on that
device. ``cpu`` runs the same code path on the CPU, which is how CI tests it. Members that are not
plain JPEGs (PNG, WebP, CMYK, progressive, EXIF-rotated, larger than ``(4 * img_size)^2`` pixels,
or without the EOI marker at the end: ``SampleTransform.defer``) are decoded in the worker as
before and travel as finished uint8 samples in the same batch.

A JPEG that fails to decode here is retried alone and then through the worker path (PIL); one that
fails both is counted as ``corrupt_image`` of its shard (against ``data.max_corrupt_rate``; once,
not again on a repeat pass). In training its place in the batch is taken by a copy of another
sample of the batch (of the previous batch's last good one when none is left), counted as
``repeated_for_balance``, so every rank still yields batches of the same shape; its key in
``loader.last_keys`` is the copied sample's. In evaluation it is dropped, as the worker path does.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Optional

import torch

from data_pipeline.config import DEVICES
from data_pipeline.decode import BadSample, open_image
from data_pipeline.errors import ConfigError, TooManyCorruptSamples
from data_pipeline.transforms import Deferred, SampleTransform, mix_labelled

# torchvision 0.29 deprecates its codecs for TorchCodec (not one of our dependencies); decode_jpeg
# still works, and its warning would come once per batch.
warnings.filterwarnings("ignore", category=DeprecationWarning, module="torchvision.io.image")


def decode_jpeg(data, device: torch.device):
    """torchvision's decode_jpeg to RGB. On CUDA the caller's stream is drained first: torchvision
    hands nvJPEG output blocks from the caching allocator but runs the decode on a stream of its
    own that does not wait for the caller's, so it can overwrite memory that queued kernels (the
    previous step's) still read (pytorch/vision#9606, meta-pytorch/torchcodec#1634). The decode
    syncs the host itself when it returns, so the wait moves earlier more than it adds one."""
    from torchvision.io import ImageReadMode
    from torchvision.io import decode_jpeg as tv_decode_jpeg

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return tv_decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


@dataclass
class DeferredBatch:
    """What a worker yields instead of an image tensor when the training process decodes: two
    tensors for the whole batch (each tensor crossing from a worker costs a file descriptor and a
    shared-memory segment, so not one per sample) and per-sample records."""
    items: list  # per sample: a Deferred (its file is blob[span]) or the row of ``decoded`` it is
    blob: torch.Tensor  # uint8: the batch's JPEG files end to end
    decoded: Optional[torch.Tensor]  # uint8 (n, 3, S, S): the samples the worker decoded itself
    mix_seed: Optional[int]  # Mixup/CutMix seed of the batch (None: no mixing)

    @classmethod
    def pack(cls, samples: list, mix_seed: Optional[int]) -> "DeferredBatch":
        """``samples``: Deferred (holding its file) or finished uint8 (3, S, S) tensors."""
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
        return cls(items, blob, torch.stack(done) if done else None, mix_seed)

    def file(self, item: Deferred) -> torch.Tensor:
        return self.blob[item.span[0]:item.span[1]]


def check_device(device: str, key: str = "data.decode_device") -> None:
    """One-line ConfigError for a device this process cannot decode on."""
    if device not in DEVICES:
        raise ConfigError(f"{key}: must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}: cuda, but this process sees no CUDA device (use worker or cpu)")


class BatchDecoder:
    """Finishes a :class:`DeferredBatch` in the training process: float32 (B, 3, S, S) on ``device``,
    normalised with augment.mean/std, mixed when the batch carries a mix seed."""

    def __init__(self, transform: SampleTransform, aug, device: str, max_pixels: int, num_classes: int):
        self.transform, self.aug, self.max_pixels, self.num_classes = transform, aug, max_pixels, num_classes
        # the current CUDA device: DeepSpeed's engine has set it to the rank's GPU by then
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        std = torch.tensor(aug.std, dtype=torch.float32).view(3, 1, 1)
        self.scale = (1.0 / (std * 255.0)).to(self.device)
        self.shift = (-torch.tensor(aug.mean, dtype=torch.float32).view(3, 1, 1) / std).to(self.device)
        self._spare = None  # training: the last good sample (image, target, key, shard) of a batch

    def __call__(self, batch: DeferredBatch, targets: torch.Tensor, meta: dict):
        """(images, targets); records failures in ``meta`` (its tally and keys) for the loader."""
        items = batch.items
        jpegs = [i for i, it in enumerate(items) if isinstance(it, Deferred)]
        pixels = dict(zip(jpegs, self._decode([batch.file(items[i]) for i in jpegs])))
        out = torch.empty((len(items), 3, self.transform.size, self.transform.size), dtype=torch.float32,
                          device=self.device)
        decoded = batch.decoded.to(self.device, non_blocking=True) if batch.decoded is not None else None
        bad, good = [], []
        for i, it in enumerate(items):
            u8 = self._finish(it, batch.file(it), pixels[i]) if isinstance(it, Deferred) else decoded[it]
            if u8 is None:
                bad.append(i)
                continue
            good.append(i)
            out[i].copy_(u8).mul_(self.scale).add_(self.shift)
        targets = targets.to(self.device, non_blocking=True)
        keys, shards = meta.get("keys") or [""] * len(items), meta.get("shards") or [""] * len(items)
        self._count([items[i] for i in bad], [shards[i] for i in bad], meta["tally"])
        if not self.transform.train:
            if bad:  # evaluation: a short batch, as the worker path gives
                meta.update(keys=[keys[i] for i in good], shards=[shards[i] for i in good])
                if not good:
                    return None, None
                out, targets = out[good], targets[good]
            return out, targets
        if bad:
            self._replace(bad, good, out, targets, keys, shards, meta["tally"]["counts"])
        if good:
            self._spare = (out[good[-1]].clone(), targets[good[-1]].clone(), keys[good[-1]], shards[good[-1]])
        if batch.mix_seed is not None:
            out, targets = mix_labelled(out, targets, self.aug, batch.mix_seed, self.num_classes)
        return out, targets

    def _decode(self, datas: list) -> list:
        """Decoded uint8 (3, H, W) per file (None: this decoder could not); one batched call."""
        if not datas:
            return []
        try:
            return list(decode_jpeg(datas, self.device))
        except RuntimeError:  # one bad file fails the whole call: find it
            out = []
            for d in datas:
                try:
                    out.append(decode_jpeg(d, self.device))
                except RuntimeError:
                    out.append(None)
            return out

    def _finish(self, item: Deferred, data: torch.Tensor, pixels: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if pixels is not None and tuple(pixels.shape[-2:]) == (item.size[1], item.size[0]):
            return self.transform.finish(pixels, item)
        # the worker path (PIL), from the same bytes and seed; None when PIL cannot either
        try:
            img = open_image({"jpg": data.numpy().tobytes()}, self.max_pixels)
            return self.transform(img, item.seed).to(self.device)
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
            raise TooManyCorruptSamples(f"none of the {len(bad)} JPEGs of the first batch decoded on "
                                        f"{self.device.type} (shards: {', '.join(sorted(set(shards[i] for i in bad)))})")
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

