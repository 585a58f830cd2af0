"""How a training rank stops: signals, a lost launcher, and the exit codes that say why.

Exit codes of ``pretrain.train`` (each rank) and ``vit-launch run`` (the whole job):

    0   EXIT_OK           finished ``train.steps``
    1                     a failure (exception, a dead peer, a non-finite loss streak)
    2   EXIT_USAGE        a user mistake, said in one line (nothing to retry)
    3   EXIT_HANG         the hang watchdog fired (``pretrain/resilience/watchdog.py``): stacks in <output_dir>/hang/
    75  EXIT_INTERRUPTED  stopped on request (SIGTERM, SIGINT, the launcher went away) after saving
                          a checkpoint, or (``vit-launch``) during start-up before any step: start
                          the same command again to resume (EX_TEMPFAIL, so a scheduler may requeue
                          and ``train && export`` stops)

SIGTERM (preemption, ``scancel``) and SIGINT (Ctrl-C) both ask for a checkpoint at a step boundary
within ``train.sync_every_steps`` steps (the ranks agree only at the loop's sync points, so no step
waits on the host) and then a clean exit; a second SIGINT exits at once (130). Every rank also watches its
launcher: when the process that started it (the deepspeed launcher) or that launcher's parent
(the runner) exits, the rank stops as if signalled, so a killed runner leaves no orphans.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

from data_pipeline.files import write_json

EXIT_OK, EXIT_USAGE, EXIT_HANG, EXIT_INTERRUPTED = 0, 2, 3, 75


def _ppid_of(pid: int) -> Optional[int]:
    """The parent pid of ``pid`` (None once it is gone), from /proc on Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


class StopRequest:
    """Set by SIGTERM, SIGINT or a lost launcher; read by the loop at its sync points (``agreed``)."""

    def __init__(self, watch_launcher: bool, poll_s: float = 2.0):
        self.reason: Optional[str] = None
        self._sigints = 0
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        if watch_launcher:
            self._lifeline(poll_s)

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self._sigints += 1
            if self._sigints > 1:  # the second Ctrl-C: no checkpoint, out now (data workers die with us)
                print("vit-train: second SIGINT: exiting without a checkpoint", file=sys.stderr, flush=True)
                os._exit(130)
        self.request(signal.Signals(signum).name)

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def agreed(self, device) -> bool:
        """All ranks stop together if any rank was asked to (one tiny all-reduce and a host read:
        call it only at the loop's sync points, the same steps on every rank)."""
        from pretrain.distributed.process import any_rank

        stop = any_rank(self.requested, device)
        if stop and self.reason is None:
            self.reason = "another rank's request"
        return stop

    def _lifeline(self, poll_s: float) -> None:
        """A daemon thread noticing that the launcher (our parent) or the runner (its parent) exited."""
        parent = os.getppid()
        grandparent = _ppid_of(parent)

        def watch():
            import time

            while self.reason is None:
                time.sleep(poll_s)
                if os.getppid() != parent:
                    self.request("launcher exited")
                elif grandparent not in (None, 1) and _ppid_of(parent) != grandparent:
                    self.request("runner exited")

        threading.Thread(target=watch, name="vitscale-lifeline", daemon=True).start()


def report_lost_peer(err: BaseException, hosts: list[str], errors_dir, rank: int) -> bool:
    """After a collective failed because a peer went away or could not be reached: one line naming
    the ranks and hosts that did not answer (asked through the rendezvous store), with this rank's
    traceback written to ``errors_dir/rank-<R>.txt`` instead of the terminal, where it repeated in
    27 lines of gloo wording what the line says. Returns whether that was the failure (the caller
    then exits 1 without a traceback); False for any other error, which keeps its traceback."""
    import traceback
    from pathlib import Path

    from pretrain.distributed.process import is_peer_error, unreachable_peers

    if not is_peer_error(err):
        return False
    line = unreachable_peers(hosts)
    if not line:
        return False
    where = Path(errors_dir) / f"rank-{rank}.txt"
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text("".join(traceback.format_exception(err)))
        line += f" (traceback: {where})"
    except OSError as e:  # the line still says what happened
        line += f" (traceback not written to {where}: {e.strerror or e})"
    print(f"vit-train: {line}", file=sys.stderr, flush=True)
    return True


def write_status(path, state: str, step: int, exit_code: Optional[int] = None) -> None:
    """``status.json`` for schedulers and ``vit-launch``, written atomically (best effort): ``running``
    at start and at each log step (no exit code yet), then how this invocation ended with the code
    the process exits with (``completed`` 0, ``interrupted`` 75, ``failed`` the given code)."""
    doc = {"state": state, "step": step, "time": time.time()}
    if state != "running":
        doc["exit_code"] = {"completed": EXIT_OK, "interrupted": EXIT_INTERRUPTED}.get(
            state, 1 if exit_code is None else exit_code)
    try:
        write_json(path, doc)
    except OSError:
        pass


class RunStatus:
    """Rank 0's ``status.json`` (``path`` None: another rank, which writes nothing)."""

    def __init__(self, path):
        self.path = path

    def __call__(self, step: int, state: str = "running", exit_code: Optional[int] = None) -> None:
        if self.path is not None:
            write_status(self.path, state, step, exit_code)


def goodbye_line(result: dict, checkpoint) -> str:
    """The one line saying how a training run ended (``checkpoint``: its newest complete one)."""
    if result["preempted"]:
        return (f"vit-train: stopped ({result['stop_reason']}) at step {result['step']}: checkpoint {checkpoint}; run "
                f"the same command to resume (exit {EXIT_INTERRUPTED})")
    return (f"vit-train: done at step {result['step']}: checkpoint {checkpoint}; export with: python -m pretrain.export "
            f"{result['run_dir']} OUT.safetensors")
