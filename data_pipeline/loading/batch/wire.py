"""The worker wire format: what crosses from a DataLoader worker to the training process for each
batch. Workers never send float pixels: finished uint8 samples in one shared-memory tensor, plain
JPEG files still to decode end to end in another, the Mixup/CutMix seed, and per sample which of
the two holds it (:class:`DeferredBatch`). The batch's targets and its
:class:`~data_pipeline.loading.batch.record.BatchRecord` travel beside it."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from data_pipeline.loading.batch.buffers import BatchBuffers, stack_shared
from data_pipeline.loading.transforms import Deferred


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
        decoded, tag = stack_shared(done, buffers) if done else (None, None)
        return cls(items, blob, decoded, mix_seed, tag)

    def file(self, item: Deferred) -> torch.Tensor:
        return self.blob[item.span[0]:item.span[1]]

    def pin_memory(self) -> "DeferredBatch":
        """The DataLoader's pin-memory thread calls this (``pin_memory=True`` on a GPU machine): the
        worker-decoded samples are uploaded, and only a pinned source makes that copy asynchronous
        (from pageable memory CUDA may wait for the stream first). The JPEG files are read on the host."""
        return replace(self, decoded=self.decoded.pin_memory()) if self.decoded is not None else self
