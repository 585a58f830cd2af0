"""A training run's batches when the resolution and the micro batch change at step boundaries
(``train.resolution_schedule``), on the loader's unchanged plan.

The loader keeps the layout it was built with (its micro batch ``B`` and data plan): the samples,
their order, the epoch boundaries, the resume state and the sample log are those of a run at one
resolution. Two stages around it make a step of the schedule:

* :func:`sized_batches`: each step's ``per_step`` loader batches (the rank's images of one optimizer
  step, ``global batch / (world x B)``) at that step's size. Where the size changes (a step boundary,
  on every rank alike, since it is a function of the step) the loader's iterator is closed and a new
  one started at the new size from the position of the last batch yielded: the loader's exact-resume
  path, so the samples are those the old size would have yielded, cropped at the new one.
* :func:`regrouped`: those images cut into the step's micro batches (concatenated where the phase's
  micro batch is larger than ``B``, split where smaller). A step's images divide by either size, so a
  micro batch never spans two steps and the position at every step boundary is the loader's own.

Both pass batches through untouched where nothing changes (one size, micro batch ``B``).
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch


def sized_batches(loader, size_at: Callable[[int], int], start_step: int, per_step: int) -> Iterator:
    """``loader``'s batches from step ``start_step + 1`` on, ``per_step`` a step, each step's cropped
    at ``size_at(step)`` px (``loader.set_img_size``). The loader's iterator is closed when this
    generator is."""
    step, it = start_step, None
    try:
        while True:
            step += 1
            size = size_at(step)
            if it is None or size != loader.img_size:
                if it is not None:
                    it.close()  # its workers end; their batches ahead at the old size are not yielded
                loader.set_img_size(size)
                it = iter(loader)
            for _ in range(per_step):
                yield next(it)
    finally:
        if it is not None:
            it.close()


def regrouped(batches: Iterator, micro_at: Callable[[int], int], start_step: int, images_per_step: int) -> Iterator:
    """``batches`` (``images_per_step`` images of this rank per step, in batches of a size that
    divides it) as micro batches of ``micro_at(step)`` images. Concatenating costs one copy of the
    step's images on their device; splitting costs nothing (views); a step whose micro batch is the
    incoming size passes the batches as they are."""
    step, parts, have, done = start_step + 1, [], 0, 0
    for x, y in batches:
        micro = micro_at(step)
        if not parts and x.shape[0] == micro:
            out = [(x, y)]
        else:
            parts.append((x, y))
            have += x.shape[0]
            out = []
            while have >= micro:
                xs, ys = parts[0] if len(parts) == 1 else (torch.cat([p[0] for p in parts]),
                                                           torch.cat([p[1] for p in parts]))
                out.append((xs[:micro], ys[:micro]))
                parts = [(xs[micro:], ys[micro:])] if have > micro else []
                have -= micro
        for batch in out:
            yield batch
            done += batch[0].shape[0]
            if done == images_per_step:
                step, done = step + 1, 0
