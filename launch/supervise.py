"""``vit-launch run`` stays alive above the deepspeed runner: signals, outcome, restarts.

    supervisor (vit-launch) -> deepspeed runner -> per-node launcher -> ranks -> data workers

* The runner starts in a session of its own. The first SIGTERM or SIGINT to the supervisor is
  forwarded as SIGTERM to that whole process group (runner, local launcher, ranks): every rank
  checkpoints at its next step and exits 75; ranks on other nodes follow through the per-step stop
  agreement. The signal received is written to ``stop_file`` first: rank 0's closing line names it
  (``stopped (SIGINT to vit-launch)``), not the SIGTERM forwarded or the runner's exit it saw.
  A second SIGINT SIGKILLs the group (exit 130), as does ``stop_grace_s`` without the job ending
  (exit 130: no stop checkpoint; the next run resumes from the last complete one). A repeated
  SIGTERM is the same request: under SLURM one ``scancel``, pre-emption or time limit arrives twice
  (SLURM signals every process of the job, and the sbatch script forwards its own).
* A stop asked between attempts (the wait before a restart, the node probe that makes its command)
  starts nothing more: the supervisor exits 75.
  The runner gets ``PR_SET_PDEATHSIG``: a supervisor killed with ``kill -9`` takes the runner with
  it, and the ranks notice their runner is gone (``pretrain.resilience.lifecycle``) and stop.
* The supervisor waits until the *group* is empty, not just the runner (DeepSpeed's runner can exit
  while its launcher still waits for ranks that are saving).
* The exit code says what happened (``pretrain.resilience.lifecycle``), with one closing line:
  0 done, 2 user error, 75 interrupted after a checkpoint (requeue it), 3 hang, 69 the shard store
  stayed unreachable past ``data.remote_retry_s`` (restart or requeue it), 130 killed without a
  checkpoint (a second SIGINT, or ``stop_grace_s`` ran out), 1 any other failure (a rank's
  exception, a rank killed by a signal: DeepSpeed's launcher would pass on 245 or 247).
  ``status.json`` in the run directory, written by rank 0, decides between "completed" /
  "interrupted" and what the runner reported (DeepSpeed's launcher turns a signalled job into exit 1).
  ``python -m launch.supervise exit-code`` reads it for the sbatch script of ``--launcher srun``.
* ``--max-restarts N``: after a failure (not after a user error, a completed run or a stop asked
  for by a signal) start the job again, after ``min(backoff * 2**k, 300)`` seconds; a job that
  stopped after a checkpoint (75) with no stop asked for (its launcher or the runner went away)
  starts again at once. It resumes from the last complete checkpoint, in the same W&B run
  (``vit-launch run`` hands a callable that appends ``checkpoint.resume=true`` to every command
  after the first). The command may be a callable, asked again before each start
  (``launch/nodes.py``: the nodes left); when it raises ``LaunchError`` there is no restart, and
  its one line says why.
* ``watch``: a callable asked every second while the job runs; a line from it (a straggler named
  on one of the job's nodes) is written to ``stop_file`` (``<output_dir>/stop.request``), which rank
  0 reads at its next sync point: every rank checkpoints and exits 75, and the job starts again at
  once, counted as a restart. A file, not a signal: SIGTERM to a multi-node deepspeed runner makes
  it ``pkill -f`` every deepspeed launcher on every node by its command line, other jobs' too.
* Once rank 0 has said how the attempt ended (``status.json``), whatever of the job's process group
  is still running ``SETTLE_S`` later is killed: an ssh session to a node whose link is cut never
  hears that node's ranks exit.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from data_pipeline.errors import EXIT_UNAVAILABLE, Parser
from data_pipeline.files import write_atomic
from launch.hostfile import LaunchError
from pretrain.resilience.lifecycle import EXIT_HANG, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE

PROG = "vit-launch"
MAX_BACKOFF_S = 300.0
SETTLE_S = 20.0
EXIT_KILLED = 130  # killed without a checkpoint: a second SIGINT, or --stop-grace ran out
STOP_POLL_S = 0.2  # how often a wait between attempts looks for a stop request


def _log(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def _die_with_us() -> None:  # runs in the child between fork and exec
    os.setsid()
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _read_status(path: Optional[Path], since: float) -> Optional[dict]:
    """The run's status.json when it was written by this attempt."""
    if path is None:
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("time", 0), (int, float)):
        return None
    return doc if doc.get("time", 0) >= since else None


def run_exit_code(path: Path, since: float) -> Optional[int]:
    """The exit code rank 0 wrote in status.json (``path``) in the attempt started at ``since``, once
    the run has ended; None while it still runs, or when the file is absent, unreadable or older."""
    status = _read_status(path, since)
    if status is None or status.get("state") in (None, "running"):
        return None
    try:
        return int(status["exit_code"])
    except (KeyError, TypeError, ValueError):
        return None


def outcome(code: int, again: Optional[str] = "the same command") -> tuple[int, str]:
    """The documented exit code for the job's raw one, and the closing line saying what happened.
    DeepSpeed's launcher exits with a signalled rank's negative return code modulo 256 (SIGKILL:
    247, SIGSEGV: 245); a shell-style 128 + N means signal N; both are failures (exit 1).
    ``again``: what resumes the job (``lifecycle.resume_command``); None where nothing does (a
    sweep's sizes start over), and the line says only how the job ended."""
    if code == EXIT_OK:
        return code, "the job completed (exit 0)"
    if code == EXIT_USAGE:
        return code, "the job stopped on a user error, said above (exit 2; nothing to retry)"
    if code == EXIT_HANG:
        return code, "the hang watchdog ended the job; stacks in <output_dir>/hang/ (exit 3)"
    if code == EXIT_INTERRUPTED:
        return code, (f"the job stopped after a checkpoint (exit {EXIT_INTERRUPTED})"
                      + (f"; run {again} to resume" if again else ""))
    if code == EXIT_UNAVAILABLE:
        return code, (f"the shard store stayed unreachable past data.remote_retry_s, said above (exit "
                      f"{EXIT_UNAVAILABLE})" + (f"; {again} resumes from the last checkpoint once it is back"
                                                if again else ""))
    if code == EXIT_KILLED:
        return code, (f"the job was killed without a checkpoint (exit {EXIT_KILLED})"
                      + (f"; {again} resumes from the last complete checkpoint" if again else ""))
    why = f"exit code {code}"
    for sig in (256 - code, code - 128):
        if 0 < sig < 65 and code > 128:
            try:
                why = f"a process was killed by {signal.Signals(sig).name} (raw exit code {code})"
            except ValueError:
                continue
            break
    return 1, f"the job failed: {why}; the logs above say where (exit 1)"


class Supervisor:
    def __init__(self, cmd, status_path: Optional[Path], stop_grace_s: float = 90.0,
                 watch: Optional[Callable[[], Optional[str]]] = None, stop_file: Optional[Path] = None,
                 env: Optional[dict] = None, again: Optional[str] = "the same command"):
        """``env``: the job's environment (None: this process's); ``again``: as ``outcome``'s."""
        self.cmd, self.status_path, self.stop_grace_s, self.watch = cmd, status_path, stop_grace_s, watch
        self.stop_file, self.env, self.again = stop_file, env, again
        self.proc: Optional[subprocess.Popen] = None
        self.signals = 0
        self.stop_deadline: Optional[float] = None
        self.restart_asked = False  # the watch stopped this attempt to start the job again
        self.interrupts = 0  # SIGINTs: the second kills the job
        self.running = False  # an attempt's process group is up (signals go to it)
        self.stopping = False  # this attempt was asked by a signal to checkpoint and stop
        self.killed: Optional[str] = None  # why this attempt was SIGKILLed: "interrupt" or "grace"
        self.stop_signal = ""  # the first signal's name

    def _on_signal(self, signum, frame) -> None:
        self.signals += 1
        name = signal.Signals(signum).name
        self.stop_signal = self.stop_signal or name
        self.interrupts += signum == signal.SIGINT
        if self.proc is None or not self.running:  # between attempts: no new one starts (run, run_once)
            if self.signals == 1:
                _log(f"{name}: not starting the job again")
            return
        if not self.stopping:
            self._ask_stop(name)
        elif signum == signal.SIGINT and self.interrupts > 1:
            _log("second SIGINT: killing the job without a checkpoint")
            self.killed = "interrupt"
            self._signal_group(signal.SIGKILL)
        # a repeated SIGTERM is the same request: SLURM signals every process of the job and the
        # sbatch script forwards its own, so one scancel or time limit arrives here twice

    def _ask_stop(self, name: str) -> None:
        self.stopping = True
        _log(f"{name}: asking the job to checkpoint and stop (Ctrl-C again to kill it)")
        if self.stop_file is not None:  # the reason rank 0 names: the signal received here, whichever of
            try:  # the forwarded SIGTERM or the runner's exit a rank notices first
                write_atomic(self.stop_file, f"{name} to {PROG}\n")
            except OSError:
                pass
        self._signal_group(signal.SIGTERM)
        self.stop_deadline = time.monotonic() + self.stop_grace_s

    def _signal_group(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def run_once(self, watch: bool = False) -> Optional[int]:
        """Start the job, wait for every process of its group, return the outcome's exit code (None:
        the command could not be made, said in one line)."""
        started = time.time()
        try:
            cmd = self.cmd() if callable(self.cmd) else self.cmd  # a callable may change it between restarts
        except LaunchError as e:
            _log(f"not starting the job: {e}")
            return None
        if self.signals:  # asked to stop while the command was made (the node probe): start nothing
            _log("stopped on request before the job started")
            return EXIT_INTERRUPTED
        if self.stop_file is not None:
            self.stop_file.unlink(missing_ok=True)  # an earlier attempt's request
        self.stop_deadline, self.stopping, self.killed = None, False, None  # an earlier attempt's stop is over
        self.proc = subprocess.Popen(cmd, preexec_fn=_die_with_us, env=self.env)
        self.running = True
        if self.signals and not self.stopping:  # a signal between the check above and the start
            self._ask_stop(self.stop_signal)
        code, ended, looked, settled = None, None, 0.0, False
        while True:
            if code is None:
                code = self.proc.poll()
            if code is not None and not _group_alive(self.proc.pid):
                break
            if self.stop_deadline is not None and time.monotonic() > self.stop_deadline:
                _log(f"the job did not stop within {self.stop_grace_s:g}s of the request; killing it")
                self.killed = "grace"
                self._signal_group(signal.SIGKILL)
                self.stop_deadline = None
            if time.monotonic() - looked >= 1.0:
                looked = time.monotonic()
                if ended is None and self._final(started):
                    ended = looked
                if ended is not None and not settled and looked - ended > SETTLE_S:
                    _log(f"rank 0 ended {looked - ended:.0f}s ago and part of the job still runs (an ssh session "
                         "to a node that does not answer?); killing what is left of it here")
                    self._signal_group(signal.SIGKILL)
                    settled = True
                line = None
                if watch and self.watch and self.stop_file and not self.restart_asked and not self.signals:
                    line = self.watch()
                if line:
                    _log(f"{line}: asking the job to checkpoint and stop ({self.stop_file.name}), to start it again "
                         "without that node")
                    self.restart_asked = True
                    write_atomic(self.stop_file, f"vit-launch: {line}\n")
                    self.stop_deadline = time.monotonic() + self.stop_grace_s
            time.sleep(0.2)
        self.running = False
        status = _read_status(self.status_path, started)
        if status and status.get("state") in ("completed", "interrupted"):
            return int(status["exit_code"])
        if settled and status and status.get("state") == "failed":
            return int(status["exit_code"])
        if self.killed == "interrupt":
            return EXIT_KILLED
        if self.killed == "grace" and self.signals:
            _log(f"the job was killed {self.stop_grace_s:g}s after the stop request, without its stop checkpoint"
                 + (f"; {self.again} resumes from the last complete checkpoint" if self.again else ""))
            return EXIT_KILLED
        if self.signals and not (status and status.get("state") == "failed"):
            # stopped on request before training reached a step it could checkpoint (start-up):
            # nothing was lost, the same command starts again
            _log("the job was stopped during start-up, before its first checkpoint")
            return EXIT_INTERRUPTED
        return code if code >= 0 else 128 - code  # -9: killed by SIGKILL -> 137, as a shell says

    def _final(self, since: float) -> bool:
        """Rank 0 wrote how this attempt ended."""
        status = _read_status(self.status_path, since)
        return bool(status and status.get("state") in ("completed", "interrupted", "failed"))

    def _wait(self, seconds: float) -> bool:
        """Sleep ``seconds`` in short slices; False as soon as a stop was asked for."""
        end = time.monotonic() + seconds
        while not self.signals and time.monotonic() < end:
            time.sleep(min(STOP_POLL_S, max(end - time.monotonic(), 0.0)))
        return not self.signals

    def run(self, max_restarts: int = 0, backoff_s: float = 10.0) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            attempt, last = 0, 1
            while True:
                self.restart_asked = False
                code = self.run_once(watch=attempt < max_restarts)
                if code is None:  # the nodes left cannot run it: the line above says why
                    code = last
                    break
                last = code
                if self.restart_asked and not self.signals and code in (EXIT_OK, EXIT_INTERRUPTED, 1) \
                        and attempt < max_restarts:
                    if code == EXIT_OK:
                        break  # it finished meanwhile
                    attempt += 1
                    _log(f"restart {attempt}/{max_restarts} now (it resumes from the checkpoint it just wrote)")
                    continue
                if code == EXIT_INTERRUPTED and not self.signals and attempt < max_restarts:
                    # the ranks saved and stopped with no stop asked for here: their launcher or the
                    # runner went away (a lost node's ssh, a killed launcher); start it again as asked
                    attempt += 1
                    _log(f"the job stopped after a checkpoint with no stop asked for (its launcher or runner went "
                         f"away?); restart {attempt}/{max_restarts} now (it resumes from that checkpoint)")
                    continue
                if code in (EXIT_OK, EXIT_USAGE, EXIT_INTERRUPTED) or self.signals or attempt >= max_restarts:
                    break
                attempt += 1
                wait = min(backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
                _log(f"the job failed with exit code {code}; restart {attempt}/{max_restarts} in {wait:g}s "
                     f"(it resumes from the last complete checkpoint)")
                if not self._wait(wait):
                    code = last = EXIT_INTERRUPTED
                    _log("stopped on request before the restart; nothing was started")
                    break
            code, line = outcome(code, self.again)
            _log(line)
            return code
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m launch.supervise exit-code STATUS_JSON SINCE FALLBACK`` prints the run's exit code
    (``run_exit_code``), or FALLBACK where there is none: the sbatch script of ``vit-launch slurm
    --launcher srun`` asks it, since srun ends with the runner's code. Cheap: no torch import."""
    ap = Parser(prog="python -m launch.supervise", description="What the batch script of `vit-launch slurm "
                "--launcher srun` asks of a run it started.")
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("exit-code", help="print the exit code rank 0 wrote in status.json since SINCE, "
                                         "else FALLBACK (still running, absent, unreadable or older)")
    p.add_argument("status_json", type=Path, metavar="STATUS_JSON", help="the run's status.json")
    p.add_argument("since", type=float, metavar="SINCE", help="the attempt's start, in seconds since the epoch")
    p.add_argument("fallback", metavar="FALLBACK", help="what to print where status.json gives no code")
    args = ap.parse_args(argv)
    code = run_exit_code(args.status_json, args.since)
    print(args.fallback if code is None else code)


if __name__ == "__main__":
    main()
