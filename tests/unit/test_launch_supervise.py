"""The real Supervisor over a small python job standing in for the deepspeed runner: signals, stops
between attempts, the stop grace and restarts. The job signals its parent (the supervisor, this
process) itself, as SLURM or a user would."""
import json
import os
import signal
import sys
import time
from types import SimpleNamespace

import pytest

from launch.supervise import Supervisor

JOB = r'''
import json, os, signal, subprocess, sys, time
from pathlib import Path
here = Path(sys.argv[1])
attempt = len(list(here.glob("attempt-*"))) + 1
(here / f"attempt-{attempt}").write_text(json.dumps(sys.argv[2:]))
mode = os.environ["JOB_MODE"].split(",")[min(attempt, len(os.environ["JOB_MODE"].split(","))) - 1]
asked = []
signal.signal(signal.SIGTERM, lambda *_: asked.append(1))
boss = os.getppid()

def status(state, code):
    (here / "status.json").write_text(json.dumps({"state": state, "exit_code": code, "time": time.time()}))
    sys.exit(code)

def wait_asked():
    end = time.time() + 20
    while not asked and time.time() < end:
        time.sleep(0.05)

if mode in ("term-twice", "int-twice"):
    sig = signal.SIGTERM if mode == "term-twice" else signal.SIGINT
    os.kill(boss, sig)
    wait_asked()  # the supervisor forwarded its SIGTERM: the ranks checkpoint...
    os.kill(boss, sig)  # ... while the same stop arrives again
    time.sleep(1.0)
    status("interrupted", 75)
if mode == "deaf":  # never writes its stop checkpoint
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.kill(boss, signal.SIGTERM)
    time.sleep(60)
if mode == "fail-then-term":  # fails; the stop comes during the wait before the restart
    subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(1.0); os.kill({boss}, 15)"],
                     start_new_session=True)
    status("failed", 1)
if mode == "fail":
    status("failed", 1)
if mode == "stopped":  # the ranks saved and stopped with no stop asked for (a launcher went away)
    status("interrupted", 75)
status("completed", 0)
'''


@pytest.fixture
def job(tmp_path, monkeypatch):
    script = tmp_path / "job.py"
    script.write_text(JOB)

    def make(mode):
        monkeypatch.setenv("JOB_MODE", mode)
        return [sys.executable, str(script), str(tmp_path)]
    return make


def attempts(tmp_path):
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("attempt-*"))]


def supervisor(cmd, tmp_path, **kw):
    return Supervisor(cmd, tmp_path / "status.json", stop_file=tmp_path / "stop.request", **kw)


def test_a_repeated_sigterm_is_the_same_stop_and_keeps_the_checkpoint(job, tmp_path):
    """SLURM signals every process and the sbatch script forwards SIGTERM again: one stop."""
    assert supervisor(job("term-twice"), tmp_path).run() == 75


def test_a_second_sigint_kills_the_job_without_a_checkpoint(job, tmp_path):
    assert supervisor(job("int-twice"), tmp_path).run() == 130
    assert not (tmp_path / "status.json").exists()


def test_a_stop_during_the_wait_before_a_restart_starts_nothing(job, tmp_path):
    t0 = time.monotonic()
    code = supervisor(job("fail-then-term,ok"), tmp_path).run(max_restarts=2, backoff_s=8.0)
    assert (code, len(attempts(tmp_path))) == (75, 1)
    assert time.monotonic() - t0 < 6.0  # not the whole 8 s wait


def test_a_stop_while_the_next_command_is_made_starts_nothing(job, tmp_path):
    made = []

    def command():  # the node probe of a restart, during which SIGTERM arrives
        made.append(1)
        if len(made) > 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return job("fail,ok")
    assert supervisor(command, tmp_path).run(max_restarts=1, backoff_s=0.0) == 75
    assert len(attempts(tmp_path)) == 1


def test_a_stop_grace_run_out_is_a_kill_without_a_checkpoint(job, tmp_path, capsys):
    assert supervisor(job("deaf"), tmp_path, stop_grace_s=1.0).run() == 130
    err = capsys.readouterr().err
    assert "without its stop checkpoint" in err and "before its first checkpoint" not in err


def test_every_restart_resumes_even_when_the_first_start_did_not(job, tmp_path):
    """A fresh start (checkpoint.resume=false) sets the checkpoints aside; a restart must not."""
    from launch.commands.run import supervise

    args = SimpleNamespace(stop_grace=10.0, max_restarts=2, restart_backoff=0.0, exclude_slow_hosts=False)
    layout = SimpleNamespace(status=tmp_path / "status.json", stop_request=tmp_path / "stop.request")
    assert supervise(args, job("fail,fail,ok") + ["checkpoint.resume=false"], None, layout) == 0
    assert [a[-1] for a in attempts(tmp_path)] == ["checkpoint.resume=false", "checkpoint.resume=true",
                                                   "checkpoint.resume=true"]


def test_a_stop_nobody_asked_for_is_restarted_at_once(job, tmp_path):
    """The ranks saved and stopped (75) because their launcher or runner went away: a restart."""
    assert supervisor(job("stopped,ok"), tmp_path).run(max_restarts=1, backoff_s=30.0) == 0
    assert len(attempts(tmp_path)) == 2


@pytest.mark.parametrize("status, printed", [
    (None, "143"),
    ({"state": "interrupted", "exit_code": 75, "time": 2e9}, "75"),
    ({"state": "running", "exit_code": None, "time": 2e9}, "143"),
    ({"state": "completed", "exit_code": 0, "time": 1.0}, "143"),  # before the attempt started
    ({"state": "completed", "exit_code": 0, "time": "late"}, "143"),
])
def test_the_exit_code_entry_point_reads_status_json_without_torch(tmp_path, status, printed):
    """`python -m launch.supervise exit-code STATUS_JSON SINCE FALLBACK`, what the sbatch script of
    --launcher srun runs after the job: the run's code or the fallback, and no torch import (seconds
    on a cold node)."""
    import subprocess

    path = tmp_path / "status.json"
    if status is not None:
        path.write_text(json.dumps(status))
    check = "import runpy, sys; runpy.run_module('launch.supervise', run_name='__main__'); " \
            "print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", check, "exit-code", str(path), "1e9", "143"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [printed, "False"]
