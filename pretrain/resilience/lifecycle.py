"""How a training rank stops: signals, a lost launcher, and the exit codes that say why.

Exit codes of ``pretrain.train`` (each rank) and ``vit-launch run`` (the whole job):

    0   EXIT_OK           finished ``train.steps``
    1                     a failure (exception, a dead peer)
    2   EXIT_USAGE        a user mistake, said in one line (nothing to retry; a non-finite loss
                          streak, a checkpoint that cannot be written, a data error)
    3   EXIT_HANG         the hang watchdog fired (``pretrain/resilience/watchdog.py``): stacks in <output_dir>/hang/
    69  EXIT_UNAVAILABLE  (``data_pipeline.errors``) the shard store stayed unreachable past
                          ``data.remote_retry_s``: an infrastructure failure, not a mistake;
                          ``vit-launch --max-restarts`` restarts it, a ``--requeue`` sbatch script
                          requeues it, and it resumes from the last checkpoint
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

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from data_pipeline.files import write_atomic, write_json

EXIT_OK, EXIT_USAGE, EXIT_HANG, EXIT_INTERRUPTED = 0, 2, 3, 75


def process_started() -> float:
    """When this process began, in ``time.time()``'s terms: its age from /proc on Linux (to 10 ms),
    so the interpreter's start and its imports (torch and DeepSpeed: seconds, minutes from a shared
    file system) count as the invocation's start-up. Now, where /proc or the boot clock cannot tell."""
    now = time.time()
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: ticks after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - age if 0 <= age < 86400 else now


STARTED = time.time()  # about when this process started: a rank's records carry it (``report_failure``)


def _ppid_of(pid: int) -> Optional[int]:
    """The parent pid of ``pid`` (None once it is gone), from /proc on Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


class StopRequest:
    """Set by SIGTERM, SIGINT, a lost launcher or a request file; read by the loop at its sync
    points (``agreed``)."""

    def __init__(self, watch_launcher: bool, poll_s: float = 2.0):
        self.reason: Optional[str] = None
        self._sigints = 0
        self._file = None
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

    def watch_file(self, path) -> None:
        """Also stop when ``path`` is written after this process started: ``vit-launch run`` asks a
        job to checkpoint and stop that way (its first line is the reason), because a signal to a
        multi-node deepspeed runner makes it ``pkill`` every launcher on every node by name. Looked
        at in ``agreed`` (one stat per sync point); one rank watching is enough."""
        from pathlib import Path

        self._file = Path(path)

    def _look(self) -> None:
        """The request file, when written after this process started, asks to stop; its reason wins
        over a signal's or a lost runner's: ``vit-launch run`` writes the signal it received there
        before it forwards SIGTERM, and a rank may see the runner exit before its own signal handler
        runs (Python runs it only once a collective in C returns)."""
        if self._file is None:
            return
        try:
            if os.stat(self._file).st_mtime >= STARTED:  # an empty file (touch) asks too, naming itself
                self.reason = (self._file.read_text().strip().splitlines() or [self._file.name])[0][:200]
        except OSError:
            pass

    def agreed(self, device) -> bool:
        """All ranks stop together if any rank was asked to (one tiny all-reduce and a host read:
        call it only at the loop's sync points, the same steps on every rank)."""
        from pretrain.distributed.process import any_rank

        self._look()
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


SAY_GRACE_S = 5.0  # before the ranks are connected: how long a rank other than 0 leaves rank 0 to say it first


def _peer_records(errors_dir, rank: int, since: float) -> list[dict]:
    """The records of the other ranks written since ``since`` (this process's start: this attempt),
    oldest first: the ranks that failed on their own, each having said why."""
    from pathlib import Path

    folder = Path(errors_dir)
    heads = [read_record(f) for f in sorted(folder.glob("rank-*.txt"))] if folder.is_dir() else []
    return sorted((h for h in heads if h and h["rank"] != rank and h.get("own") and h.get("time", 0) >= since),
                  key=lambda h: h.get("time", 0))


def report_failure(err: BaseException, hosts: list[str], errors_dir, rank: int, code: int = 1) -> Optional[dict]:
    """A rank of a multi-rank job is failing with ``err`` (``code``: the exit code it would end with):
    its record for ``vit-launch run``, which decides from the records which nodes a restart leaves
    out. ``errors_dir/rank-<R>.txt`` gets a first line of JSON (``rank``, ``host``, ``time``,
    ``started``: when this process started, so a record of an earlier attempt's rank that ended late
    is told apart; ``line``; ``code``; ``own``: a failure of this rank's own, not a peer's; ``lost``:
    the ranks that did not answer) and then the traceback.

    When a collective failed because a peer went away, what the peers left says why, not gloo's
    traceback: a peer that failed on its own wrote its record before it exited (a clean error exit,
    not a network fault), and this rank's line is that it stopped because of it, with that peer's
    exit code (the job's exit code is the cause's, whichever rank the launcher sees end first).
    Without such a record the ranks that did not answer are asked after through the rendezvous store,
    and the line names them and their hosts (dead, or cut off). Returns None for a failure of this
    rank's own (the caller raises it: a user error's one line, else its traceback); for a peer's, the
    head written (``line``, ``code``), and the caller ends with that code without a traceback. A
    rank that leaves no record (killed, its node gone) is what the others' ``lost`` name."""
    import json
    import traceback
    from pathlib import Path

    import torch.distributed as dist

    from pretrain.distributed.process import is_peer_error, lost_peers, node_name

    host = hosts[rank] if rank < len(hosts) else node_name()  # before the ranks exchanged names: our own
    me = f"rank {rank} on {host}"
    line, lost, peers = None, None, None
    if is_peer_error(err) and dist.is_initialized():
        peers = _peer_records(errors_dir, rank, STARTED)
        if not peers:
            found = lost_peers(hosts)
            if found:  # the store waited for their marks: a peer that failed meanwhile has its record now
                peers = [h for h in _peer_records(errors_dir, rank, STARTED) if h["rank"] in found[1]]
                line, lost = found if not peers else (None, None)
        if peers:
            first = peers[0]
            line, code = f"{me}: stopped: {first.get('line', '')}"[:400], first.get("code", 1)
        elif lost is not None:
            code = 1
    own = line is None
    if own:
        line = f"{me}: {type(err).__name__}: {err}".splitlines()[0][:300]
    where = Path(errors_dir) / f"rank-{rank}.txt"
    head = {"rank": rank, "host": host, "time": time.time(), "started": STARTED, "line": line, "code": code,
            "own": own}
    if lost is not None:
        head["lost"] = lost
    try:
        write_atomic(where, json.dumps(head) + "\n" + "".join(traceback.format_exception(err)))
        head["line"] += f" (traceback: {where})"
    except OSError as e:  # the line still says what happened
        head["line"] += f" (traceback not written to {where}: {e.strerror or e})"
    return None if own else head


def _first_to_say(rank: int) -> bool:
    """Whether this failing rank is the job's one voice on the terminal: the first rank to fail says
    why, the others (failing the same way, or because of it) only write their records. Decided
    through the rendezvous store once the ranks are connected (one atomic count; a store out of reach
    lets everyone speak, each side of a cut network for itself). Before that, no rank knows what the
    others met: rank 0 says it, the others give it ``SAY_GRACE_S`` first (the launcher ends them when
    rank 0 fails alike) and speak only if still running, a mistake of their own."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from datetime import timedelta

        from torch.distributed import distributed_c10d as c10d

        try:
            store = c10d._get_default_store()
            store.set_timeout(timedelta(seconds=5))
            return store.add("vitscale/said", 1) == 1
        except Exception:  # noqa: BLE001  the store (on rank 0's host) is out of reach
            return True
    if rank != 0:
        time.sleep(SAY_GRACE_S)
    return True


class FailureRecord:
    """``with FailureRecord(errors_dir) as record:`` around all of a rank's run: when the rank fails
    with a Python exception, its record (``report_failure``) is written once, by ``report`` where
    the failure is first seen (the training loop, so that the ranks ask after their peers at about
    the same time), else on the way out of the block (start-up: the process group, the model,
    DeepSpeed, the data). Only in a job of more than one rank, read from the runner's ``RANK`` and
    ``WORLD_SIZE``, which exist before the process group does. ``hosts``: every rank's node, once
    the ranks have exchanged them (until then a record names only this rank's). ``errors_dir`` may
    be set later (None: not known yet, the config unread; nothing is written).

    ``voice`` is what the command line's one-line errors ask (``cli_errors``): in a job of several
    ranks the first to fail speaks, naming itself, and the others stay silent, so that a job says
    one line per mistake, not one per rank."""

    def __init__(self, errors_dir=None, user_errors: tuple = ()):
        self.errors_dir, self.user_errors = errors_dir, user_errors
        self.hosts: list[str] = []
        self.written = False
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    def __enter__(self) -> "FailureRecord":
        return self

    def code_of(self, err: BaseException) -> int:
        """The exit code ``err`` ends the rank with when it is its own: 2 for a user mistake (one of
        ``user_errors``, or what ``cli_errors`` reports as one), 69 for an unavailable store, else 1."""
        from data_pipeline.errors import exit_code

        return exit_code(err, *self.user_errors)

    def report(self, err: BaseException) -> Optional[int]:
        """Write the record unless written already. None for a failure of this rank's own; for a
        peer's (``report_failure``), the code to end with, without a traceback, after this rank said
        so if a peer went away without a word and this rank is the first to fail."""
        if self.written or self.world <= 1 or self.errors_dir is None:
            return None
        self.written = True
        head = report_failure(err, self.hosts, self.errors_dir, self.rank, self.code_of(err))
        if head is None:
            return None
        # a peer that left no record: nobody else says it. Rank 0 among the lost: the store lives in its
        # process and was just found out of reach, so it is not asked again (each side of a cut speaks)
        if "lost" in head and (0 in head["lost"] or _first_to_say(self.rank)):
            print(f"vit-train: {head['line']}", file=sys.stderr, flush=True)
        return head["code"]

    def voice(self, err: BaseException) -> Optional[str]:
        """For ``cli_errors``: the words before a user error's message on the terminal ("" in a job of
        one rank; ``rank R on HOST: `` when this rank is the job's first to fail), or None to stay
        silent (another rank said it, or says it)."""
        if self.world <= 1:
            return ""
        self.report(err)
        if not _first_to_say(self.rank):
            return None
        host = self.hosts[self.rank] if self.rank < len(self.hosts) else None
        if host is None:
            from pretrain.distributed.process import node_name

            host = node_name()
        return f"rank {self.rank} on {host}: "

    def __exit__(self, kind, err, tb) -> bool:
        if err is not None and not isinstance(err, SystemExit):
            code = self.report(err)
            if code is not None:
                raise SystemExit(code) from None
        return False


def read_record(path) -> Optional[dict]:
    """The JSON first line of a rank's record (``errors/rank-<R>.txt``, ``hang/rank-<R>.txt``)."""
    import json

    try:
        with open(path) as f:
            head = json.loads(f.readline())
    except (OSError, ValueError):
        return None
    return head if isinstance(head, dict) and isinstance(head.get("rank"), int) else None


def write_status(path, state: str, step: int, exit_code: Optional[int] = None,
                 spent: Optional[float] = None) -> None:
    """``status.json`` for schedulers and ``vit-launch``, written atomically (best effort): ``running``
    at start and at each log step (no exit code yet), then how this invocation ended with the code
    the process exits with (``completed`` 0, ``interrupted`` 75, ``failed`` the given code).
    ``spent``: the run's device-seconds so far, every invocation's, work lost to failures included
    (``device_seconds_spent``; the next invocation carries it on: ``spent_before``)."""
    doc = {"state": state, "step": step, "time": time.time()}
    if state != "running":
        doc["exit_code"] = {"completed": EXIT_OK, "interrupted": EXIT_INTERRUPTED}.get(
            state, 1 if exit_code is None else exit_code)
    if spent is not None:
        doc["device_seconds_spent"] = round(spent, 3)
    try:
        write_json(path, doc)
    except OSError:
        pass


def spent_before(path) -> float:
    """The device-seconds the run's earlier invocations spent, as the last ``status.json`` says
    (up to its last write: the start, a log step, or how it ended); 0 without one."""
    try:
        return float(json.loads(Path(path).read_text()).get("device_seconds_spent") or 0.0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0


class RunStatus:
    """Rank 0's ``status.json`` (``path`` None: another rank, which writes nothing); ``spent``: the
    run's device-seconds so far, every invocation's (``write_status``)."""

    def __init__(self, path, spent: Optional[Callable[[], float]] = None):
        self.path, self.spent = path, spent

    def __call__(self, step: int, state: str = "running", exit_code: Optional[int] = None) -> None:
        if self.path is not None:
            write_status(self.path, state, step, exit_code, self.spent() if self.spent else None)


def resume_command(resumes: bool) -> str:
    """What resumes a run from its checkpoint: the command that started it, or, where that set
    ``checkpoint.resume=false`` (a start from scratch, which would set this run's checkpoints aside
    in turn), that command made to resume."""
    return "the same command" if resumes else "the same command with checkpoint.resume=true"


def goodbye_line(result: dict, checkpoint, again: str = "the same command") -> str:
    """The one line saying how a training run ended (``checkpoint``: its newest complete one;
    ``again``: what resumes it, ``resume_command``)."""
    if result["preempted"]:
        return (f"vit-train: stopped ({result['stop_reason']}) at step {result['step']}: checkpoint {checkpoint}; run "
                f"{again} to resume (exit {EXIT_INTERRUPTED})")
    return (f"vit-train: done at step {result['step']}{_cost(result)}{_target(result)}: checkpoint {checkpoint}; "
            f"export with: python -m pretrain.export {result['run_dir']} OUT.safetensors")


def _target(result: dict) -> str:
    """``; eval/top1 >= 0.75 reached at step 40 after 2 device-hours`` (``validation.target_metric``),
    or ``...not reached``; empty without a target."""
    if not result.get("target"):
        return ""
    rec = result.get("target_reached")
    if rec is None:
        return f"; {result['target']} not reached"
    hours = f" after {rec['device_hours']:.3g} device-hours" if rec.get("device_hours") is not None else ""
    return f"; {result['target']} reached at step {rec['step']}{hours}"


def _cost(result: dict) -> str:
    """`` after H device-hours`` (what led to the checkpoint), and the work no checkpoint kept (what
    failures lost, and each earlier invocation's end after its last save) where it is more than 5 %
    of that; empty without the figures."""
    led, spent = result.get("device_seconds"), result.get("device_seconds_spent")
    if led is None:
        return ""
    kept_not = spent is not None and spent > 1.05 * led
    return f" after {led / 3600:.3g} device-hours" + (
        f" (+{(spent - led) / 3600:.3g} spent past the checkpoints)" if kept_not else "")


def say_goodbye(result: dict, summary, status: RunStatus, checkpoint, again: str = "the same command") -> None:
    """Rank 0 at the end of a run: ``summary.json`` (a failed write is a warning: the checkpoint is
    saved, maybe in checkpoint.dir), status.json's final state, then the one closing line."""
    try:
        write_json(summary, result, indent=1)
    except OSError as e:
        print(f"vit-train: warning: cannot write {summary} ({e.strerror or e}); final step {result['step']}",
              file=sys.stderr, flush=True)
    status(result["step"], "interrupted" if result["preempted"] else "completed")
    print(goodbye_line(result, checkpoint, again), file=sys.stderr, flush=True)
