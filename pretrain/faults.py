"""Fault injection for tests: ``VITSCALE_FAULT`` names faults and the steps they fire at.

    VITSCALE_FAULT="kill_in_save:6"            SIGKILL rank 0 mid-save at step 6
    VITSCALE_FAULT="nan_loss:3,3,5"            a non-finite loss at steps 3, 3 (twice) and 5
    VITSCALE_FAULT="hang_in_step:5@1"          rank 1 stops making progress inside step 5
    VITSCALE_FAULT="crash_in_step:3@1"         rank 1 raises inside step 3 of a run started from
                                               scratch (a resumed attempt passes: restart tests)
    VITSCALE_FAULT="kill_in_save:6;nan_loss:3" several faults, ';'-separated

``@R`` limits an entry to rank R. Empty (and free: one environment lookup at start-up) in real
runs. Each fault is fired by the component that owns the moment (``checkpoint.save``, the loop).
"""
from __future__ import annotations

import os
import signal
import time


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


def hang_in_step(step: int, rank: int) -> None:
    """Stop making progress inside ``step`` on the chosen rank (sleeps far past any watchdog)."""
    if step in fault_steps("hang_in_step", rank):
        time.sleep(10 ** 6)


class InjectedFault(RuntimeError):
    pass


def crash_in_step(step: int, rank: int, start_step: int) -> None:
    if start_step == 0 and step in fault_steps("crash_in_step", rank):
        raise InjectedFault(f"injected crash in step {step} on rank {rank} (VITSCALE_FAULT)")
