"""Real sbatch jobs on a one-machine SLURM (munged, slurmctld, slurmd of our own; see conftest.py),
with scripts written by `vit-launch slurm` for a CPU-only partition: 1 node, 2 ranks.

Launcher: the script's default (pdsh). On a one-node allocation the script passes no hostfile, so
the deepspeed runner starts both ranks locally without ssh and every process of the job lives in
SLURM's batch step, where SLURM's own signals (scancel, requeue, pre-emption) reach them. (srun
would work as well; pdsh is what users get by default, so that is what is tested.)

Requeue: ``scontrol requeue`` ends the running job the way a pre-emption does (SIGTERM to every
process of the job, SIGKILL after KillWait) and puts it back in the queue. SLURM then holds a
requeued job for about two minutes (BeginTime = now + 121 s here); the test lifts that hold with
``scontrol update JobId=J StartTime=now`` to keep the tier short.

Time limit: a ``--requeue --time 2`` job is left to run into its limit; SLURM itself sends the batch
shell USR1 (``--signal=B:USR1@grace``), and the script stops the job and requeues it. The next
attempt gets a longer limit (``scontrol update JobId=J TimeLimit=...``) and is cancelled once it has
resumed and saved past the stop: the steps are set so that no attempt finishes, whatever the speed.
"""
import json
import os
import re
import subprocess
import sys
from datetime import datetime

import pytest
from conftest import REPO, kill_pids, procs, train_overrides, wait_until

from pretrain.checkpointing import checkpoint

pytestmark = pytest.mark.cluster


def write_script(tmp_path, manifest, run_dir, *extra_cli, overrides=()):
    out = tmp_path / "job.sbatch"
    logs = tmp_path / "job logs"  # not there yet (`vit-launch slurm` makes it); its space, quoted for sbatch
    r = subprocess.run([sys.executable, "-m", "launch", "slurm", "--config", "configs/tiny_cpu.yaml", "--nodes", "1",
                        "--gpus-per-node", "0", "--ranks-per-node", "2", "--cpus-per-node", str(os.cpu_count()),
                        "--log-dir", str(logs), "--output", str(out), *extra_cli,
                        *train_overrides(manifest, run_dir, *overrides)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert logs.is_dir(), "the log folder must exist before sbatch"
    text = out.read_text()
    assert "--gpus-per-node=" not in text and "--gres" not in text and "--exclusive" not in text
    return out, logs


def job_env(slurm):
    env = {**os.environ, **slurm.env, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    for k in ("VITSCALE_FAULT", "OMP_NUM_THREADS", "MASTER_PORT"):
        env.pop(k, None)
    return env


def submit(slurm, script) -> str:
    r = subprocess.run(["sbatch", "--parsable", str(script)], cwd=REPO, env=job_env(slurm), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, f"sbatch: {r.stderr}"
    return r.stdout.strip().split(";")[0]


def state(slurm, job_id) -> str:
    return slurm.job(job_id).get("JobState", "?")


def wait_state(slurm, job_id, states, timeout, logs):
    try:
        return wait_until(lambda: state(slurm, job_id) in states and state(slurm, job_id), timeout,
                          f"job {job_id} to reach {states}", 1)
    except AssertionError as e:
        raise AssertionError(f"{e}; now {slurm.job(job_id)}\n{job_log(logs)[-4000:]}\n{slurm.log()[-3000:]}") from None


def job_log(logs) -> str:
    return "\n".join(p.read_text() for p in sorted(logs.glob("*.out")))


@pytest.fixture
def jobs(slurm):
    """Job ids submitted by the test; cancelled at teardown, and any process of theirs killed."""
    ids, run_dirs = [], []
    yield ids, run_dirs
    for j in ids:
        slurm.cmd("scancel", "--full", j, check=False)
    for j in ids:
        try:
            wait_until(lambda: state(slurm, j) not in ("RUNNING", "COMPLETING", "PENDING", "REQUEUED"), 90, "cancel", 1)
        except AssertionError:
            pass
    table = procs()
    kill_pids({p for p, (_, _, cmd) in table.items() if any(str(d) in cmd for d in run_dirs)})


def test_sbatch_cpu_job_trains(slurm, jobs, demo_manifest, tmp_path):
    ids, run_dirs = jobs
    run_dir = tmp_path / "run"
    run_dirs.append(run_dir)
    script, logs = write_script(tmp_path, demo_manifest, run_dir, overrides=("train.steps=10",
                                                                                 "checkpoint.every_steps=10"))
    job = submit(slurm, script)
    ids.append(job)
    final = wait_state(slurm, job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"),
                       400, logs)
    out = job_log(logs)
    assert final == "COMPLETED", f"{slurm.job(job)}\n{out[-4000:]}"
    assert "vit-train:" in out and "on 2 rank(s)" in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == 10 and summary["world_size"] == 2, summary
    assert (logs / f"hostfile.{job}").read_text() == "localhost slots=2\n"


def test_requeued_job_resumes_in_the_same_wandb_run(slurm, jobs, demo_manifest, tmp_path):
    ids, run_dirs = jobs
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    run_dirs.append(run_dir)
    steps = 60
    script, logs = write_script(tmp_path, demo_manifest, run_dir, "--requeue", "--signal-grace", "60",
                                overrides=(f"train.steps={steps}", "checkpoint.every_steps=5",
                                           "checkpoint.keep_last=3"))
    text = script.read_text()
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@60" in text
    job = submit(slurm, script)
    ids.append(job)

    def first_checkpoint():
        if state(slurm, job) not in ("PENDING", "RUNNING", "CONFIGURING"):
            raise AssertionError(f"job {job} is {slurm.job(job)} before its first checkpoint\n{job_log(logs)[-4000:]}")
        return checkpoint.latest_complete(ckpts) if ckpts.is_dir() else None
    wait_until(first_checkpoint, 300, "the first complete checkpoint", 0.3)
    run_id = json.loads((checkpoint.latest_complete(ckpts) / "run.json").read_text())["wandb_run_id"]
    assert run_id

    slurm.cmd("scontrol", "requeue", job)
    wait_state(slurm, job, ("PENDING",), 180, logs)  # after KillWait at most: the old processes are gone
    info = slurm.job(job)
    assert info.get("Restarts") == "1", info
    saved = checkpoint.latest_complete(ckpts)
    saved_step = json.loads((saved / "run.json").read_text())["step"]
    assert saved_step < steps, "the job finished before the requeue; raise train.steps"
    leftovers = {p for p, (_, _, cmd) in procs().items() if str(run_dir) in cmd}
    assert not leftovers, f"processes of the requeued job still alive: {leftovers}"

    slurm.cmd("scontrol", "update", f"JobId={job}", "StartTime=now")  # lift SLURM's ~2 min requeue hold
    final = wait_state(slurm, job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), 400, logs)
    out = job_log(logs)
    assert final == "COMPLETED", f"{slurm.job(job)}\n{out[-4000:]}"
    assert "(restart 0)" in out and "(restart 1)" in out, out[-3000:]  # --open-mode=append kept both runs' log
    m = re.findall(r"resuming from step (\d+)", out)
    assert m and int(m[-1]) == saved_step, (m, saved_step, out[-3000:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["step"] == steps and summary["resumed_from"] == saved_step, summary
    # the same W&B run before and after the requeue
    final_id = json.loads((checkpoint.latest_complete(ckpts) / "run.json").read_text())["wandb_run_id"]
    assert final_id == run_id
    assert str(summary["wandb_dir"]).endswith(run_id), summary["wandb_dir"]
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) >= 2 and all(d.name.endswith(run_id) for d in runs), runs


# The time limit of test_time_limit_requeues_and_resumes: SLURM's shortest (whole minutes). slurmctld
# looks at time limits periodically and may send --signal up to 60 s early (`man sbatch`; no
# slurm.conf option makes the look more frequent), so USR1 comes 30-90 s into the job: after the
# ranks are training (their first checkpoint, every 20 steps, is saved about 16 s in), and at least
# 30 s before SLURM would end the job, for a stop that takes about 3 s.
LIMIT_MIN, GRACE_S = 2, 30


def _local(stamp: str) -> datetime:
    """A time from the job log (`date -Is`, with its offset) or from scontrol (local, none)."""
    t = datetime.fromisoformat(stamp)
    return t.astimezone().replace(tzinfo=None) if t.tzinfo else t


def test_time_limit_requeues_and_resumes(slurm, jobs, demo_manifest, tmp_path):
    """SLURM itself signals the job near its time limit (``--signal=B:USR1@grace``); the script
    stops the job (a checkpoint, exit 75) and requeues it; the next attempt resumes from that
    checkpoint."""
    ids, run_dirs = jobs
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    run_dirs.append(run_dir)
    steps = 1_000_000  # never reached: only the time limit stops the first attempt
    script, logs = write_script(tmp_path, demo_manifest, run_dir, "--requeue", "--time", str(LIMIT_MIN),
                                "--signal-grace", str(GRACE_S),
                                overrides=(f"train.steps={steps}", "checkpoint.every_steps=20",
                                           "checkpoint.keep_last=2"))
    assert f"#SBATCH --time={LIMIT_MIN}\n" in script.read_text()
    job = submit(slurm, script)
    ids.append(job)
    wait_state(slurm, job, ("RUNNING",), 60, logs)
    end = _local(slurm.job(job)["EndTime"])

    def requeued():
        info = slurm.job(job)
        if info.get("JobState") not in ("RUNNING", "COMPLETING", "REQUEUED", "PENDING"):
            raise AssertionError(f"job {job} ended instead of being requeued: {info}\n{job_log(logs)[-4000:]}")
        return info.get("JobState") == "PENDING" and info.get("Restarts") == "1"
    # the time limit, SLURM's look at it (periodic), the stop (seconds): well within this bound
    wait_until(requeued, LIMIT_MIN * 60 + 90, f"job {job} to be requeued at its time limit", 1)
    out = job_log(logs)
    first = out.split("(restart 1)")[0]
    assert "(restart 0)" in first, out[-3000:]
    signalled = re.findall(r"^(\S+) batch script: signal", first, re.M)
    assert len(signalled) == 1, first[-3000:]
    lead = (end - _local(signalled[0])).total_seconds()
    assert GRACE_S - 5 <= lead <= GRACE_S + 65, (f"USR1 came {lead:.0f} s before the end {end}, not "
                                                 f"--signal-grace {GRACE_S} s (+ up to 60 s early)")
    assert "job exited with status 75" in first, first[-3000:]
    ctld = (slurm.root / "log" / "slurmctld.log").read_text()
    assert f"Requeuing JobId={job}\n" in ctld  # the script's `scontrol requeue` (the test sent none)
    assert f"Time limit exhausted for JobId={job}\n" not in ctld, "SLURM killed the job: it did not stop in time"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "interrupted" and status["exit_code"] == 75, status
    stop_step = status["step"]
    saved = checkpoint.latest_complete(ckpts)
    assert saved is not None and json.loads((saved / "run.json").read_text())["step"] == stop_step, (saved, status)
    leftovers = {p for p, (_, _, cmd) in procs().items() if str(run_dir) in cmd}
    assert not leftovers, f"processes of the requeued job still alive: {leftovers}"

    # the second attempt: a longer limit, so no second signal comes while it is looked at
    slurm.cmd("scontrol", "update", f"JobId={job}", "TimeLimit=10")
    slurm.cmd("scontrol", "update", f"JobId={job}", "StartTime=now")  # lift SLURM's ~2 min requeue hold

    def trained_past_the_stop():
        info = slurm.job(job)
        if info.get("JobState") not in ("PENDING", "RUNNING"):
            raise AssertionError(f"job {job} is {info} after its requeue\n{job_log(logs)[-4000:]}")
        latest = checkpoint.latest_complete(ckpts) if ckpts.is_dir() else None
        return latest is not None and json.loads((latest / "run.json").read_text())["step"] > stop_step
    wait_until(trained_past_the_stop, 240, f"the requeued job's first checkpoint past step {stop_step}", 0.5)
    again = job_log(logs).split("(restart 1)", 1)[1]
    assert re.findall(r"resuming from step (\d+)", again) == [str(stop_step)], again[-3000:]
    slurm.cmd("scancel", job)  # the jobs fixture waits for it to end
