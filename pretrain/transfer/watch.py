"""``--watch RUN_DIR``: evaluate each new checkpoint of a pre-training run as it appears.

Never in the training job's way: it only polls and reads -- no lock, no marker, nothing written
under the run directory -- and lowers its own CPU priority. A checkpoint is evaluated only once it
is complete: its directory holds the ``COMPLETE`` marker (written by ``pretrain.checkpointing.checkpoint`` after
every rank finished), or it is the tag named by the checkpoint root's ``latest`` file (which is
written last). Half-written directories are skipped until then; a checkpoint that the training
job prunes while we read it is reported and skipped, never retried forever.

Stops when the run's final step (``train.steps`` in the checkpoint's ``run.json``) has been
evaluated, or after ``eval.watch_idle_timeout_s`` without a new checkpoint (None: never), counted
from the end of the last evaluation.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from pretrain.checkpointing.rundir import checkpoint_root, list_complete, step_of
from pretrain.transfer.errors import TransferError
from pretrain.weights.pretrained import CheckpointError


def checkpoint_dir(run_dir: str | Path) -> Path:
    """Where a run keeps its checkpoints (``pretrain.checkpointing.rundir.checkpoint_root``)."""
    if not Path(run_dir).is_dir():
        raise TransferError(f"{run_dir}: run directory not found")
    return checkpoint_root(run_dir)


def ready(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first, as (step, path)."""
    return [(step_of(p), p) for p in list_complete(ckpt_dir)]


def final_step(ckpt: Path) -> Optional[int]:
    """``train.steps`` of the run that wrote ``ckpt`` (None when unknown)."""
    try:
        return int(json.loads((ckpt / "run.json").read_text())["config"]["train"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def watch(run_dir: str | Path, evaluate: Callable[[int, Path], None], *, poll_s: float,
          idle_timeout_s: Optional[float] = None, done: Iterable[int] = (), log=_log,
          sleep=time.sleep, clock=time.monotonic) -> list[int]:
    """Call ``evaluate(step, path)`` once per new complete checkpoint; returns the steps
    evaluated. ``done``: steps evaluated earlier (a restarted watcher skips them)."""
    ckpt_dir = checkpoint_dir(run_dir)
    seen, evaluated = set(done), []
    try:
        os.nice(5)  # the training job's data workers come first on a shared node
    except OSError:
        pass
    log(f"vit-transfer: watching {ckpt_dir} every {poll_s:g}s")
    last_new = clock()
    while True:
        items = ready(ckpt_dir)
        for step, path in items:
            if step in seen:
                continue
            seen.add(step)
            try:
                evaluate(step, path)
                evaluated.append(step)
            except (TransferError, CheckpointError, OSError) as e:  # e.g. pruned by the training job mid-read
                log(f"vit-transfer: skipped step {step} ({path}): "
                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")
            # idle from here: an evaluation longer than the timeout must not end the watch before the
            # checkpoints written while it ran are looked for
            last_new = clock()
        if items:
            step, path = items[-1]
            fs = final_step(path)
            if fs is not None and step >= fs:
                log(f"vit-transfer: step {step} is the run's last; done watching")
                return evaluated
        if idle_timeout_s is not None and clock() - last_new >= idle_timeout_s:
            log(f"vit-transfer: no new checkpoint for {idle_timeout_s:g}s; done watching")
            return evaluated
        sleep(poll_s)
