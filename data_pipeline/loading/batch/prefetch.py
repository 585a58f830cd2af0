"""The DataLoader's batches finished one by one in the training process (:func:`finish`): on a GPU
one batch ahead, on a side stream, as timm's prefetcher and DALI do. While step N runs, batch N+1 is
uploaded (decoded, cropped, resized, flipped), normalised and mixed on the side stream, ordered
against the training step by events alone, with no host sync of ours. The streams and the only
calls that order them are :class:`~data_pipeline.loading.cuda_streams.CudaStreams`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from data_pipeline.loading.batch.buffers import BatchBuffers
from data_pipeline.loading.batch.record import BatchRecord
from data_pipeline.loading.batch.wire import DeferredBatch


@dataclass
class _Issued:
    """A batch whose work is queued on the side stream; ``ready`` is recorded after the last of it."""
    images: Optional[torch.Tensor]
    targets: Optional[torch.Tensor]
    record: BatchRecord
    ready: object = None
    error: Optional[BaseException] = None  # raised when the batch is handed out, in batch order


def finish(decoder, batches: Iterator, buffers: Optional[BatchBuffers] = None) -> Iterator:
    """The DataLoader's (images, targets, record) with each :class:`DeferredBatch` finished by
    ``decoder`` (a ``decode.BatchDecoder``; other batches pass as they are). Without
    ``decoder.streams``, each batch when it is asked for. With them, batch N+1 is issued to the side
    stream before batch N is handed out, so it decodes while step N computes; streams are ordered by
    events only, no host wait of ours (see :func:`_issue` and :func:`_hand_out`; torchvision's decode
    call itself returns once nvJPEG is done: the host waits for the decode, not for the step). An
    error finishing batch N+1 is raised when N+1 is asked for, after N. Each batch's worker buffer is
    released to ``buffers`` once the batch is finished (or issued: it was pinned before it got here)."""
    release = buffers.release if buffers is not None else (lambda tag: None)
    if decoder.streams is None:
        for images, targets, record in batches:
            if isinstance(images, DeferredBatch):  # its failures join the batch's tally (an
                batch = images  # eval batch may end up empty)
                images, targets = decoder(batch, targets, record)
                release(batch.buffer)
            yield images, targets, record
        return
    issued = None
    for batch in batches:
        following = _issue(decoder, *batch)
        if isinstance(batch[0], DeferredBatch):  # read (the pinned copy is what the side stream uploads)
            release(batch[0].buffer)
        if issued is not None:
            yield _hand_out(decoder.streams, issued)
        issued = following
    if issued is not None:
        yield _hand_out(decoder.streams, issued)


def _issue(decoder, images, targets, record: BatchRecord) -> _Issued:
    """Queue the batch's work on the side stream. The side stream first waits for an event
    recorded on the compute stream now: the batch's kernels run after the steps already queued
    there, so none of them can touch what those steps read (the allocator, told by
    ``record_stream`` in :func:`_hand_out`, keeps their memory apart as well)."""
    if not isinstance(images, DeferredBatch):
        return _Issued(images, targets, record)
    s = decoder.streams
    s.wait(s.side, s.record(s.compute))
    try:
        with s.use(s.side):
            images, targets = decoder(images, targets, record)
    except Exception as e:  # noqa: BLE001  (re-raised in batch order by _hand_out)
        return _Issued(None, None, record, error=e)
    return _Issued(images, targets, record, ready=s.record(s.side) if images is not None else None)


def _hand_out(s, issued: _Issued) -> tuple:
    """The compute stream waits for the batch's event (the host does not), and each tensor it
    will read is marked as used there, so the allocator does not hand its memory to the side
    stream again before the step that reads it has run."""
    if issued.error is not None:
        raise issued.error
    if issued.ready is not None:
        s.wait(s.compute, issued.ready)
        s.record_stream(issued.images, s.compute)
        s.record_stream(issued.targets, s.compute)
    return issued.images, issued.targets, issued.record
