"""The hang watchdog: a rank that makes no progress for ``train.hang_timeout_s`` ends the job.

The loop calls ``beat(step, phase)`` as it moves (reading a batch, forward, the agreement
all-reduce, backward, checkpoint); a daemon thread checks the time since the last beat. The first
step (start-up, first collectives, JIT builds) and checkpoints get ``slow_factor`` times the
allowance. When it fires, the rank writes every thread's Python stack to
``<output_dir>/hang/rank-<R>.txt`` (first line: a JSON header with rank, step, phase, idle seconds),
waits briefly for the other ranks' files, and exits with ``EXIT_HANG``. The first rank done waiting
(it creates ``hang/reported``) prints one line naming the step and the rank(s) that stopped progressing: the ranks furthest
behind (a rank stuck inside a step is still in an earlier phase than its peers, who wait for it in
the next collective), or those that wrote no file at all.

Cost: two attribute writes per beat; the thread wakes every few seconds. A rank stuck in C code
that holds the GIL cannot run the thread; the process-group timeout (``train.pg_timeout_s``) ends
that case.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path

from pretrain.lifecycle import EXIT_HANG

REPORTED = "reported"
PHASES = ("start", "data", "forward", "agree", "backward", "log", "eval", "stop", "checkpoint", "end")


class Watchdog:
    def __init__(self, hang_dir: Path, rank: int, world: int, timeout_s: float, slow_factor: float = 3.0):
        self.dir, self.rank, self.world = Path(hang_dir), rank, world
        self.timeout, self.slow_factor = float(timeout_s), slow_factor
        self.step, self.phase = 0, "start"
        self.last, self.allowance = time.monotonic(), self.timeout * slow_factor
        self.fired = threading.Event()
        if self.timeout > 0:
            threading.Thread(target=self._run, name="vitscale-watchdog", daemon=True).start()

    def beat(self, step: int, phase: str, slow: bool = False) -> None:
        self.step, self.phase = step, phase
        self.allowance = self.timeout * (self.slow_factor if slow else 1.0)
        self.last = time.monotonic()

    def _run(self) -> None:
        poll = max(0.5, min(5.0, self.timeout / 5))
        while True:
            time.sleep(poll)
            idle = time.monotonic() - self.last
            if idle > self.allowance:
                self._fire(idle)

    def hold_if_fired(self) -> None:
        """Called on the way out by exception: once the watchdog fired (a peer that gave up first
        breaks our collective), let it finish its report and exit with EXIT_HANG."""
        if self.fired.is_set():
            time.sleep(3600)

    def _fire(self, idle: float) -> None:
        self.fired.set()
        self.dir.mkdir(parents=True, exist_ok=True)
        head = {"rank": self.rank, "step": self.step, "phase": self.phase, "idle_s": round(idle, 1)}
        path = self.dir / f"rank-{self.rank}.txt"
        with open(path, "w") as f:
            f.write(json.dumps(head) + "\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        others = self._gather(wait_s=min(30.0, max(10.0, self.timeout)))
        if _first_to_report(self.dir):
            print(f"vit-train: hang: no progress for {idle:.0f}s (train.hang_timeout_s={self.timeout:g}) at step "
                  f"{self.step}; stopped progressing: {describe(others, self.world)}; stacks in {self.dir}",
                  file=sys.stderr, flush=True)
        os._exit(EXIT_HANG)

    def _gather(self, wait_s: float) -> dict[int, dict]:
        """Headers of the ranks that fired, waiting up to ``wait_s`` for all ``world`` of them."""
        end = time.monotonic() + wait_s
        while True:
            found = read_headers(self.dir)
            if len(found) >= self.world or time.monotonic() >= end:
                found.setdefault(self.rank, {"rank": self.rank, "step": self.step, "phase": self.phase})
                return found
            time.sleep(0.5)


def _first_to_report(hang_dir: Path) -> bool:
    """True on exactly one rank: the one that creates the ``reported`` marker first."""
    try:
        os.close(os.open(Path(hang_dir) / REPORTED, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def read_headers(hang_dir: Path) -> dict[int, dict]:
    out = {}
    for p in Path(hang_dir).glob("rank-*.txt"):
        try:
            with open(p) as f:
                head = json.loads(f.readline())
            out[int(head["rank"])] = head
        except (OSError, ValueError, KeyError):
            continue
    return out


def laggards(headers: dict[int, dict], world: int) -> list[int]:
    """The ranks that stopped progressing: those without a stack file, else those furthest behind."""
    silent = [r for r in range(world) if r not in headers]
    if silent:
        return silent

    def pos(h):
        return (h["step"], PHASES.index(h["phase"]) if h["phase"] in PHASES else 0)

    behind = min(pos(h) for h in headers.values())
    return sorted(r for r, h in headers.items() if pos(h) == behind)


def describe(headers: dict[int, dict], world: int) -> str:
    lag = laggards(headers, world)
    if any(r not in headers for r in lag):
        return f"rank(s) {', '.join(map(str, lag))} (no stack file: dead or stuck outside Python)"
    return ", ".join(f"rank {r} (in {headers[r]['phase']} of step {headers[r]['step']})" for r in lag)


def clear(hang_dir: Path, rank: int) -> None:
    """Remove this rank's stack file of an earlier hang (a restarted run starts clean); rank 0
    also removes the report marker."""
    for name in [f"rank-{rank}.txt"] + ([REPORTED] if rank == 0 else []):
        try:
            os.unlink(Path(hang_dir) / name)
        except FileNotFoundError:
            pass
