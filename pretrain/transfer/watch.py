"""``--watch RUN_DIR``: evaluate each new checkpoint of a pre-training run as it appears.

Never in the training job's way: it only polls and reads -- no lock, no marker, nothing written
under the run directory -- and lowers its own CPU priority. A checkpoint is evaluated only once it
is complete: its directory holds the ``COMPLETE`` marker (written by ``pretrain.checkpoint`` after
every rank finished), or it is the tag named by the checkpoint root's ``latest`` file (which is
written last). Half-written directories are skipped until then; a checkpoint that the training
job prunes while we read it is reported and skipped, never retried forever.

Stops when the run's final step (``train.steps`` in the checkpoint's ``run.json``) has been
evaluated, or after ``eval.watch_idle_timeout_s`` without a new checkpoint (None: never).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import yaml

from pretrain.transfer.errors import TransferError

COMPLETE = "COMPLETE"
LATEST = "latest"
_STEP = re.compile(r"(\d+)$")  # step_00001000 (ours), global_step1000 (DeepSpeed's default)


def checkpoint_dir(run_dir: str | Path) -> Path:
    """Where a run keeps its checkpoints: RUN_DIR itself when it is the checkpoint root, the
    ``checkpoint.dir`` of its config.yaml when set, else RUN_DIR/checkpoints."""
    p = Path(run_dir)
    if not p.is_dir():
        raise TransferError(f"{p}: run directory not found")
    if (p / LATEST).is_file() or any(_tag_step(d.name) is not None for d in p.iterdir() if d.is_dir()):
        return p
    cfg = p / "config.yaml"
    if cfg.is_file():
        try:
            d = ((yaml.safe_load(cfg.read_text()) or {}).get("checkpoint") or {}).get("dir")
        except yaml.YAMLError:
            d = None
        if d:
            return Path(d)
    return p / "checkpoints"


def _tag_step(name: str) -> Optional[int]:
    m = _STEP.search(name)
    return int(m.group(1)) if m and name.startswith(("step_", "global_step")) else None


def ready(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first, as (step, path)."""
    if not ckpt_dir.is_dir():
        return []
    tags = {d.name for d in ckpt_dir.iterdir() if d.is_dir() and (d / COMPLETE).is_file()}
    try:
        latest = (ckpt_dir / LATEST).read_text().strip()
    except OSError:  # absent, or being replaced right now: the next poll sees it
        latest = ""
    if latest and (ckpt_dir / latest).is_dir():
        tags.add(latest)
    found = [(_tag_step(t), ckpt_dir / t) for t in tags]
    return sorted((s, p) for s, p in found if s is not None)


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
            last_new = clock()
            try:
                evaluate(step, path)
                evaluated.append(step)
            except (TransferError, OSError) as e:  # e.g. pruned by the training job mid-read
                log(f"vit-transfer: skipped step {step} ({path}): {str(e).splitlines()[0] if str(e) else type(e).__name__}")
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
