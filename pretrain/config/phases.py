"""``train.resolution_schedule`` as phases: which steps train at which resolution and micro batch.

    train:
      steps: 1000
      micro_batch_size: 64
      resolution_schedule: [[0.0, 128, 256], [0.6, 192, 128], [0.9, 224]]

Each entry is ``[fraction, px]`` or ``[fraction, px, micro batch]``: the phase starts after
``round(fraction x train.steps)`` steps (the first at 0.0) and trains at ``px`` with that micro
batch (``train.micro_batch_size`` without a third value); the global batch is the same in every
phase, so the accumulation steps follow. The schedule above runs steps 1-600 at 128 px, 601-900 at
192 px and 901-1000 at 224 px. An empty schedule (the default) is one phase at the model's
resolution. Pure arithmetic on the config (no torch): training, the checks, the memory model and
``vit-launch plan`` read the same phases.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pretrain.models.arch import img_size_problem


@dataclass(frozen=True)
class Phase:
    """Steps ``first..last`` (counted from 1, both included) at ``img_size`` px, ``micro_batch`` images
    per rank and forward."""
    first: int
    last: int
    img_size: int
    micro_batch: int

    @property
    def steps(self) -> int:
        return self.last - self.first + 1


def start_step(fraction: float, steps: int) -> int:
    """Steps done before a phase that starts at ``fraction`` of ``steps`` (rounded: 0.29 x 100 is 29,
    not the 28 that the float product's floor would give)."""
    return round(fraction * steps)


def resolution_phases(train, img_size: int) -> list[Phase]:
    """The phases of ``train`` (a ``TrainConfig``) for a model at ``img_size`` px: one phase per
    schedule entry that holds at least one step, in order; one phase at ``img_size`` and
    ``train.micro_batch_size`` without a schedule (or with ``train.steps`` 0). Entries are assumed
    checked (``check_schedule``)."""
    entries = [(start_step(float(e[0]), train.steps), int(e[1]),
                int(e[2]) if len(e) > 2 else train.micro_batch_size) for e in train.resolution_schedule]
    if not entries or train.steps <= 0:
        return [Phase(1, max(0, train.steps), img_size, train.micro_batch_size)]
    ends = [start for start, _, _ in entries[1:]] + [train.steps]
    return [Phase(start + 1, end, px, micro) for (start, px, micro), end in zip(entries, ends) if end > start]


def batch_unit(train) -> int:
    """The smallest share of the global batch per rank that every micro batch of ``train`` divides
    (``train.micro_batch_size`` and each schedule phase's): the global batch must be a multiple of
    this times the world size (``checks.check_world_size``)."""
    micros = [train.micro_batch_size] + [int(e[2]) for e in train.resolution_schedule if len(e) > 2]
    return math.lcm(*micros)


def log_windows(phases: list[Phase], log_every: int) -> list[tuple[int, int, bool]]:
    """The logging windows a fresh run of ``phases`` writes, as ``(first step, last step, cold)``:
    as the training loop cuts them, a window ends at every multiple of ``log_every``, at the last
    step and at the end of each phase; it is cold when it holds a first step (the run's, or a
    phase's: the loader's start or restart, a new shape's trace), whose seconds are not the pace
    (``cold_steps`` in the metrics; ``launch/plot_scaling.py`` drops those windows)."""
    out, first = [], 1
    for p in phases:
        for step in range(p.first, p.last + 1):
            if window_ends(step, p, log_every):
                out.append((first, step, first == p.first))
                first = step + 1
    return out


def window_ends(step: int, phase: Phase, log_every: int) -> bool:
    """A logging window ends at ``step`` (of ``phase``): a multiple of ``log_every`` or the phase's
    last step (a window holds one resolution; the run's last step is its last phase's)."""
    return step % log_every == 0 or step == phase.last


def steps_by_phase(phases: list[Phase], after: int, upto: int) -> list[tuple[Phase, int]]:
    """How many of steps ``after + 1 .. upto`` each phase holds; the steps past the last phase's end
    (a run resumed with more ``train.steps``) in the last, at its resolution."""
    final = len(phases) - 1
    return [(p, max(0, (upto if i == final else min(p.last, upto)) - max(p.first - 1, after)))
            for i, p in enumerate(phases)]


def phase_at(phases: list[Phase], step: int) -> Phase:
    """The phase of ``step`` (counted from 1); the last phase past its end (a run resumed with more
    ``train.steps`` is priced by its own config's phases)."""
    for p in phases:
        if step <= p.last:
            return p
    return phases[-1]


def check_schedule(train, model: str, fail) -> None:
    """Each entry ``[fraction, px]`` or ``[fraction, px, micro batch]``: fractions from 0.0, rising,
    below 1; ``px`` an input size of ``model`` (``arch.img_size_problem``); a positive micro
    batch. ``fail(key, message)`` raises. The micro batch against the global batch and the world
    size: ``check_world_size``."""
    key = "train.resolution_schedule"
    last = None
    for i, e in enumerate(train.resolution_schedule):
        if len(e) not in (2, 3):
            fail(key, f"entry {i} is {e}: expected [fraction, px] or [fraction, px, micro batch]")
        fraction, px = e[0], e[1]
        if i == 0 and fraction != 0:
            fail(key, f"the first entry must start at 0.0, got {fraction}")
        if not 0 <= fraction < 1 or (last is not None and fraction <= last):
            fail(key, f"entry {i}: fractions of train.steps must rise from 0.0 and stay below 1, got {fraction}")
        last = fraction
        problem = img_size_problem(model, px)
        if problem:
            fail(key, f"entry {i}: resolution {px:g} {problem}")
        if len(e) == 3 and (e[2] != int(e[2]) or e[2] <= 0):
            fail(key, f"entry {i}: micro batch {e[2]:g} must be a positive integer")
