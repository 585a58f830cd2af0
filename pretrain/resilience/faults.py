"""Fault injection for tests: ``VITSCALE_FAULT`` names faults and the steps they fire at.

    VITSCALE_FAULT="kill_in_save:6"            SIGKILL rank 0 mid-save at step 6
    VITSCALE_FAULT="nan_loss:3,3,5"            non-finite inputs (so a non-finite loss) in two
                                               micro-batches of step 3 and one of step 5
    VITSCALE_FAULT="hang_in_step:5@1"          rank 1 stops making progress in step 5's first batch
    VITSCALE_FAULT="crash_in_step:3@1"         rank 1 raises in step 3 of a run started from
                                               scratch (a resumed attempt passes: restart tests)
    VITSCALE_FAULT="stall_in_save:10@0"        rank 0 holds still for STALL_S inside the save of step
                                               10 (once per checkpoint folder): a test cuts the
                                               network while a save is in progress
    VITSCALE_FAULT="kill_in_save:6;nan_loss:3" several faults, ';'-separated

``@R`` limits an entry to rank R. Neither the training loop nor the checkpoint code carries hooks:
faults are injected by wrapping what they are handed, once at start-up, and without
``VITSCALE_FAULT`` nothing is wrapped. Step faults wrap the batch stream (``wrap_batches``), as a
broken input pipeline or a stuck worker would show up; save faults wrap the engine's
``save_checkpoint`` (``wrap_save``), the moment a checkpoint's files exist but are not yet complete.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Callable, Iterator, Optional


def fault_steps(name: str, rank: int | None = None) -> list[int]:
    """The steps at which fault ``name`` fires on ``rank``, once per listed entry."""
    out = []
    for part in os.environ.get("VITSCALE_FAULT", "").split(";"):
        key, _, steps = part.partition(":")
        if key != name or not steps:
            continue
        steps, _, only = steps.partition("@")
        if only and rank is not None and int(only) != rank:
            continue
        out += [int(s) for s in steps.split(",")]
    return out


def kill_in_save(step: int) -> None:
    """SIGKILL this process (rank 0) after DeepSpeed wrote its files but before the checkpoint is
    marked complete: a crash mid-save must never lose the previous checkpoint."""
    if step in fault_steps("kill_in_save"):
        os.kill(os.getpid(), signal.SIGKILL)


STALL_S = 5.0  # shorter than the tests' train.pg_timeout_s: the stall alone ends nothing


def stall_in_save(step: int, rank: int, ckpt_dir) -> None:
    """Hold this rank still for ``STALL_S`` seconds inside the save of ``step`` (after its files are
    handed to the writer, before the ranks agree the checkpoint is complete). Once per checkpoint
    folder: ``<ckpt_dir>/.stall_in_save.<step>`` is created as the stall begins (a test waits for it,
    then cuts the network) and a resumed attempt that saves that step again does not stall."""
    from pathlib import Path

    if step not in fault_steps("stall_in_save", rank):
        return
    marker = Path(ckpt_dir) / f".stall_in_save.{step}"
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    time.sleep(STALL_S)


def wrap_save(engine, *, rank: int, step_of: Callable[[str], Optional[int]],
              defer: Optional[Callable] = None) -> None:
    """Nothing without save faults for this rank; else ``engine.save_checkpoint`` is wrapped so that
    once the engine has written a checkpoint's files (or, for an asynchronous save, queued them) the
    save faults of its step fire (``step_of``: the step of a checkpoint tag): ``kill_in_save`` on
    rank 0, then ``stall_in_save``, both before the ranks mark the checkpoint complete. ``defer``
    (the asynchronous writer's ``submit``) runs them on the writer thread behind the queued files,
    mid-write with training going on."""
    if not ((rank == 0 and fault_steps("kill_in_save")) or fault_steps("stall_in_save", rank)):
        return
    save = engine.save_checkpoint

    def fire(step: int, ckpt_dir) -> None:
        if rank == 0:
            kill_in_save(step)
        stall_in_save(step, rank, ckpt_dir)

    def save_checkpoint(save_dir, tag=None, **kwargs):
        out = save(save_dir, tag=tag, **kwargs)
        step = step_of(tag)
        if defer is not None:
            defer(fire, step, save_dir)
        else:
            fire(step, save_dir)
        return out

    engine.save_checkpoint = save_checkpoint


class InjectedFault(RuntimeError):
    pass


def wrap_batches(batches: Iterator, *, rank: int, start_step: int, accumulation: int) -> Iterator:
    """``batches`` unchanged without ``VITSCALE_FAULT``; else a stream that fires the step faults
    of this rank in the micro-batches of their steps (step = start_step + 1 + i // accumulation)."""
    nan = fault_steps("nan_loss", rank)
    hang = set(fault_steps("hang_in_step", rank))
    crash = set(fault_steps("crash_in_step", rank)) if start_step == 0 else set()
    if not (nan or hang or crash):
        return batches

    def hang_in_step():
        time.sleep(10 ** 6)  # far past any watchdog

    def stream():
        for i, (x, y) in enumerate(batches):
            step, first = start_step + 1 + i // accumulation, i % accumulation == 0
            if first and step in hang:
                hang_in_step()
            if first and step in crash:
                raise InjectedFault(f"injected crash in step {step} on rank {rank} (VITSCALE_FAULT)")
            if step in nan:
                nan.remove(step)
                x = x.float() * float("nan")
            yield x, y

    return stream()
