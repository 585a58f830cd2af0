"""The hang watchdog: a rank that makes no progress for ``train.hang_timeout_s`` ends the job.

The loop calls ``beat(step, phase)`` as it moves (reading a batch, forward, the agreement
all-reduce, backward, checkpoint); a daemon thread checks the time since the last beat. The first
step (start-up, first collectives, JIT builds) and checkpoints get ``slow_factor`` times the
allowance. When it fires, the rank writes every thread's Python stack to
``<output_dir>/hang/rank-<R>.txt`` (first line: a JSON header with rank, step, phase, idle seconds),
waits briefly for the other ranks' files, and exits with ``EXIT_HANG``. The first rank done waiting
(it creates ``hang/reported``) prints one line naming the step and the rank(s) that stopped
progressing: the ranks furthest behind (a rank stuck inside a step is still in an earlier phase
than its peers, who wait for it in
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
from typing import Optional

from pretrain.resilience.lifecycle import EXIT_HANG, STARTED

REPORTED = "reported"
PHASES = ("start", "data", "forward", "gather", "agree", "backward", "log", "eval", "stop", "checkpoint", "end")


class Watchdog:
    def __init__(self, hang_dir: Path, rank: int, world: int, timeout_s: float, slow_factor: float = 3.0,
                 startup_s: float = 0.0):
        self.dir, self.rank, self.world = Path(hang_dir), rank, world
        self.timeout, self.slow_factor = float(timeout_s), slow_factor
        self.startup_s = max(float(startup_s), self.timeout * slow_factor)
        self.step, self.phase, self.key = 0, "start", "train.startup_timeout_s"
        self.hosts: list[str] = []  # every rank's node name, once known (the report names hosts)
        self.last, self.allowance = time.monotonic(), self.startup_s
        self.fired = threading.Event()
        if self.timeout > 0:
            threading.Thread(target=self._run, name="vitscale-watchdog", daemon=True).start()

    def beat(self, step: int, phase: str, slow: bool = False, startup: bool = False) -> None:
        """Progress: ``phase`` of ``step`` began. The next beat is due within ``train.hang_timeout_s``,
        ``slow_factor`` times that for slow phases (checkpoint, evaluation), and within
        ``train.startup_timeout_s`` (at least the slow allowance) in start-up's first step."""
        self.step, self.phase = step, phase
        if startup:
            self.allowance, self.key = self.startup_s, "train.startup_timeout_s"
        else:
            self.allowance, self.key = self.timeout * (self.slow_factor if slow else 1.0), "train.hang_timeout_s"
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
        head = {"rank": self.rank, "host": self.hosts[self.rank] if self.rank < len(self.hosts) else None,
                "step": self.step, "phase": self.phase, "idle_s": round(idle, 1), "time": time.time(),
                "started": STARTED}
        path = self.dir / f"rank-{self.rank}.txt"
        with open(path, "w") as f:
            f.write(json.dumps(head) + "\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        others = self._gather(wait_s=min(30.0, max(10.0, self.timeout)))
        if _first_to_report(self.dir):
            bound = self.startup_s if self.key == "train.startup_timeout_s" else self.timeout
            print(f"vit-train: hang: no progress for {idle:.0f}s ({self.key}={bound:g}) at step "
                  f"{self.step}; stopped progressing: {describe(others, self.world, self.hosts)}; stacks in {self.dir}",
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


def describe(headers: dict[int, dict], world: int, hosts: Optional[list[str]] = None) -> str:
    """The laggards, each with its node: ``rank 3 on node-b (in forward of step 12)``, or for ranks
    that wrote no stack file ``rank 3 on node-b, rank 4 on node-c (no stack file: ...)``."""
    lag = laggards(headers, world)
    hosts = hosts or []

    def who(r: int) -> str:
        host = hosts[r] if r < len(hosts) else headers.get(r, {}).get("host")
        return f"rank {r} on {host}" if host else f"rank {r}"
    if any(r not in headers for r in lag):
        return f"{', '.join(map(who, lag))} (no stack file: dead or stuck outside Python)"
    return ", ".join(f"{who(r)} (in {headers[r]['phase']} of step {headers[r]['step']})" for r in lag)


def clear(hang_dir: Path, rank: int) -> None:
    """Remove this rank's stack file of an earlier hang (a restarted run starts clean); rank 0
    also removes the report marker."""
    for name in [f"rank-{rank}.txt"] + ([REPORTED] if rank == 0 else []):
        try:
            os.unlink(Path(hang_dir) / name)
        except FileNotFoundError:
            pass


# The guard process: reads phase names on stdin; at the deadline it names the phase on stderr and
# SIGKILLs the rank; EOF (the rank finished start-up, or died) ends it quietly.
_GUARD = r"""
import os, select, signal, sys, time
parent, timeout, prefix = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
deadline, phase, buf = time.monotonic() + timeout, "start", b""
while True:
    left = deadline - time.monotonic()
    if left <= 0:
        os.write(2, (f"{prefix}: start-up did not finish within train.startup_timeout_s={timeout:g} s "
                     f"(phase: {phase}); ending this rank\n").encode())
        try:
            os.kill(parent, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(0)
    ready, _, _ = select.select([0], [], [], min(left, 1.0))
    if os.getppid() != parent:  # the rank is gone
        sys.exit(0)
    if ready:
        chunk = os.read(0, 4096)
        if not chunk:
            sys.exit(0)
        buf += chunk
        *lines, buf = buf.split(b"\n")
        if b"\x00done" in lines:
            sys.exit(0)
        if lines:
            phase = lines[-1].decode(errors="replace")
"""


class StartupGuard:
    """Bounds start-up (process group and DeepSpeed's shm set-up, model build, DeepSpeed init, a
    universal-checkpoint conversion, the first step) by ``train.startup_timeout_s``.

    A process of its own, not a thread: DeepSpeed's CPU shm set-up busy-waits in C++ for every
    peer's buffer file while holding the GIL, so a rank whose peer died before creating its file
    would spin forever and no Python thread of it could run. The guard is told each phase; past
    the bound it prints one line naming the phase and SIGKILLs the rank (the launcher then ends
    the job). ``done()`` ends it (a message, not the pipe's end: forked data workers hold copies of
    its write end); so does the rank's death."""

    def __init__(self, timeout_s: float, prog: str = "vit-train"):
        import subprocess

        self.proc = None
        if timeout_s > 0:
            self.proc = subprocess.Popen([sys.executable, "-c", _GUARD, str(os.getpid()), str(timeout_s), prog],
                                         stdin=subprocess.PIPE, start_new_session=True)

    def phase(self, name: str) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.write(name.encode() + b"\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass

    def done(self) -> None:
        if self.proc is None:
            return
        self.phase("\x00done")
        try:
            self.proc.stdin.close()
            self.proc.wait(5)
        except (BrokenPipeError, OSError):
            pass
        except Exception:  # subprocess.TimeoutExpired: it must not outlive start-up
            self.proc.kill()
        self.proc = None
