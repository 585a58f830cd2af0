"""Progress of a long loop: a tqdm bar on a terminal, otherwise a plain line every few seconds.

When stderr is a terminal the bar is drawn there (as vit-shards' is). When it is a file or a pipe
(a batch job's log, ``nohup``, ``2>&1 | tee``), a bar would be invisible or thousands of carriage
returns, so a line is printed instead, at most once per ``VITSCALE_PROGRESS_S`` seconds
(default 10; 0 prints on every update)::

      features colours/test: 1234/5000 img (25%), 310 img/s
      L-BFGS colours l2=0.001: 180 evals (at most 625), 41 evals/s, loss 0.4127

A log that stays silent for longer than that means a stuck job, not a slow one. Lines go to
stderr, beside the commands' other log lines: stdout carries results (vit-transfer's table).
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Callable, Optional, TextIO, Union

from data_pipeline.errors import ConfigError

ENV = "VITSCALE_PROGRESS_S"
DEFAULT_INTERVAL_S = 10.0

Note = Union[str, Callable[[], str]]


def interval_from_env(default: float = DEFAULT_INTERVAL_S) -> float:
    """Seconds between progress lines: ``$VITSCALE_PROGRESS_S``, else ``default``."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise ConfigError(f"{ENV}={raw!r}: expected seconds between progress lines (>= 0), e.g. {ENV}=10")
    return value


class Throttle:
    """``due()`` is True at most once per ``interval_s`` seconds (first after ``interval_s`` from
    creation); the caller asks on every update and the throttle decides, so loops stay calls."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.interval_s, self.clock = interval_s, clock
        self.last = clock()

    def due(self) -> bool:
        now = self.clock()
        if now - self.last < self.interval_s:
            return False
        self.last = now
        return True


class Progress:
    """Counts ``unit`` of ``total`` (None: unknown; ``at_most``: ``total`` is a bound, not a
    target, so no percentage). A context manager, like the tqdm bar it stands for."""

    def __init__(self, total: Optional[int], desc: str, unit: str, *, at_most: bool = False,
                 interval_s: Optional[float] = None, file: Optional[TextIO] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.desc, self.unit, self.at_most = total, desc, unit, at_most
        self.file = file or sys.stderr
        self.clock, self.t0, self.n = clock, clock(), 0
        self.bar = self.throttle = None
        if _isatty(self.file):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=self.file, leave=False, dynamic_ncols=True)
        else:
            self.throttle = Throttle(interval_from_env() if interval_s is None else interval_s, clock)

    def update(self, n: int = 1, note: Note = "") -> None:
        """Count ``n`` more; ``note`` (or a function giving it, called only when a line is printed:
        e.g. a loss whose ``.item()`` would sync the GPU) ends the line."""
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.throttle.due():
            print(self.line(note() if callable(note) else note), file=self.file, flush=True)

    def line(self, note: str = "") -> str:
        rate = self.n / max(self.clock() - self.t0, 1e-9)
        if self.total and self.at_most:
            done = f"{self.n} {self.unit} (at most {self.total})"
        elif self.total:
            done = f"{self.n}/{self.total} {self.unit} ({100 * self.n / self.total:.0f}%)"
        else:
            done = f"{self.n} {self.unit}"
        per_s = f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"
        return f"{self.desc}: {done}, {per_s} {self.unit}/s" + (f", {note}" if note else "")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _isatty(f) -> bool:
    try:
        return bool(f.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class StartupLines:
    """Start-up lines on rank 0 (stderr), with seconds since ``started`` (``time.time()``; the
    process's start, default now): building the model, DeepSpeed init, loading a checkpoint and
    the first batch take 10-90 s that would otherwise be silent."""

    def __init__(self, rank: int, started: Optional[float] = None):
        self.on, self.t0 = rank == 0, time.time() if started is None else started

    def __call__(self, msg: str) -> None:
        if self.on:
            print(f"vit-train: {msg} [{time.time() - self.t0:.1f} s]", file=sys.stderr, flush=True)
