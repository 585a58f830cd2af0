"""Shared memory a DataLoader worker stacks its uint8 batches into, reused once the training process
has read them (:class:`BatchBuffers`), and the stacking itself (:func:`stack_shared`)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.utils.data import get_worker_info


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


def stack_shared(samples: list, buffers: Optional[BatchBuffers]) -> tuple:
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
