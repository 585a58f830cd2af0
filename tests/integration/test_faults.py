"""Faults on one machine, with real signals and real processes: Ctrl-C and SIGTERM checkpoint and
exit 75, a hung rank trips the watchdog, a damaged checkpoint is set aside, a failed job restarts.
(Two-node and SLURM faults: tests/cluster/.)"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import REPO, TinyRun, group_alive, job_env, metrics, reaped, wait_for

from pretrain.checkpointing import rundir

pytestmark = pytest.mark.slow
EXIT_INTERRUPTED = 75


ZERO1 = ("train.log_every_steps=1", "zero.stage=1")  # every job here: ZeRO-1, a line per step


def launched(tiny_run, *extra, launch_args=()):
    """``vit-launch run`` of a tiny ZeRO-1 job on 2 local ranks."""
    return tiny_run(*ZERO1, *extra, via="launch", ranks=2, launch_args=launch_args)


def logged_step(run_dir: Path) -> int:
    try:
        return max(metrics(run_dir))
    except (OSError, ValueError):
        return 0


def wait_gone(proc, timeout: float) -> None:
    end = time.time() + timeout
    while group_alive(proc) and time.time() < end:
        time.sleep(0.2)
    assert not group_alive(proc), "processes of the job are still running"


def test_sigint_single_process_checkpoints_and_exits_75(tiny_run, tmp_path):
    job = tiny_run(*ZERO1, "train.steps=500", "checkpoint.every_steps=1000", "data.workers=2")
    run, log = job.run_dir, tmp_path / "log.txt"
    with reaped(job.start(log)) as p:
        wait_for(lambda: logged_step(run) >= 2, 240, p, "step 2")
        os.kill(p.pid, signal.SIGINT)  # the main process only, as `kill -INT PID` does
        code = p.wait(120)
    out = log.read_text()
    assert code == EXIT_INTERRUPTED, out[-3000:]
    wait_gone(p, 10)  # its data workers too
    ckpt = rundir.latest_complete(run / "checkpoints")
    assert ckpt is not None and rundir.verify(ckpt) is None
    step = rundir.step_of(ckpt)
    assert 2 <= step < 500
    assert f"vit-train: stopped (SIGINT) at step {step}: checkpoint {ckpt}" in out
    assert json.loads((run / "status.json").read_text())["state"] == "interrupted"
    assert "Traceback" not in out


def test_sigint_to_process_group_of_two_ranks_then_resume(tiny_run, tmp_path):
    job = launched(tiny_run, "train.steps=400", "checkpoint.every_steps=1000", "data.workers=1")
    run, log = job.run_dir, tmp_path / "log.txt"
    with reaped(job.start(log)) as p:
        wait_for(lambda: logged_step(run) >= 2, 300, p, "step 2")
        t0 = time.time()
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C at a terminal: every process of the group
        code = p.wait(150)
        took = time.time() - t0
    out = log.read_text()
    assert code == EXIT_INTERRUPTED, out[-3000:]
    wait_gone(p, 10)
    ckpt = rundir.latest_complete(run / "checkpoints")
    step = rundir.step_of(ckpt)
    assert ckpt is not None and 2 <= step < 400 and rundir.verify(ckpt) is None
    assert took < 120
    assert "the job stopped after a checkpoint (exit 75)" in out
    assert f"vit-train: stopped (SIGINT to vit-launch) at step {step}: checkpoint" in out, out[-3000:]
    # the same command resumes there and finishes
    r = launched(tiny_run, f"train.steps={step + 2}", "checkpoint.every_steps=1000", "data.workers=1").run(300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from step {step}" in r.stderr
    assert json.loads((run / "summary.json").read_text())["step"] == step + 2


def test_sigterm_to_vit_launch_is_the_reason_the_job_names(tiny_run, tmp_path):
    """`kill VIT_LAUNCH_PID` (a scheduler's pre-emption): vit-launch forwards SIGTERM to the job, whose
    ranks may notice their runner's exit first; the closing line names the signal vit-launch got,
    not "runner exited"."""
    job = launched(tiny_run, "train.steps=400", "checkpoint.every_steps=1000", "data.workers=0")
    run, log = job.run_dir, tmp_path / "log.txt"
    with reaped(job.start(log)) as p:
        wait_for(lambda: logged_step(run) >= 2, 300, p, "step 2")
        os.kill(p.pid, signal.SIGTERM)
        code = p.wait(150)
    out = log.read_text()
    step = rundir.step_of(rundir.latest_complete(run / "checkpoints"))
    assert code == EXIT_INTERRUPTED and f"vit-train: stopped (SIGTERM to vit-launch) at step {step}" in out, out[-3000:]
    assert "vit-launch: SIGTERM: asking the job to checkpoint and stop" in out


def test_hung_rank_trips_the_watchdog(tiny_run):
    job = launched(tiny_run, "train.steps=50", "train.hang_timeout_s=8", "data.workers=0")
    run = job.run_dir
    t0 = time.time()
    r = job.run(240, VITSCALE_FAULT="hang_in_step:4@1")
    took = time.time() - t0
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert took < 200
    files = sorted(p.name for p in (run / "hang").glob("rank-*.txt"))
    assert files == ["rank-0.txt", "rank-1.txt"], out[-3000:]
    stacks = (run / "hang" / "rank-1.txt").read_text()
    assert "hang_in_step" in stacks and "Thread" in stacks  # every thread's Python stack
    lines = [ln for ln in out.splitlines() if "vit-train: hang:" in ln]
    assert len(lines) == 1, out[-3000:]
    host = json.loads((run / "hang" / "rank-1.txt").read_text().splitlines()[0])["host"]
    assert host and "at step 4" in lines[0] and f"stopped progressing: rank 1 on {host} (in data of step 4)" in lines[0]


def test_failed_job_restarts_and_resumes(tiny_run):
    job = launched(tiny_run, "train.steps=6", "checkpoint.every_steps=2", "data.workers=0",
                   launch_args=("--max-restarts", "2", "--restart-backoff", "1"))
    run = job.run_dir
    r = job.run(400, VITSCALE_FAULT="crash_in_step:5@1")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "restart 1/2" in out and "restart 2/2" not in out
    assert "resuming from step 4" in out
    # rank 0, left in a collective by its crashed peer: one line, its traceback in errors/ (unless
    # the launcher ended it first); the crashed rank's own traceback stays on the terminal
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" in out, out[-3000:]
    lost = [ln for ln in out.splitlines() if "no answer within" in ln]
    assert all(f"(traceback: {run / 'errors' / 'rank-0.txt'})" in ln for ln in lost), lost
    if lost:
        assert "Connection closed" in (run / "errors" / "rank-0.txt").read_text()
    assert json.loads((run / "summary.json").read_text())["step"] == 6
    m = metrics(run)
    assert sorted(m) == [1, 2, 3, 4, 5, 6]


def _damaged_for_rank_one(shard_kit, root: Path, overrides: tuple[str, ...]) -> Path:
    """Shards whose samples rank 1 reads in epoch 0 (``data.loading.plan``: 2 ranks, one reader slot
    each) are damaged JPEGs; rank 0's are whole. The manifest is that of four shards of 16."""
    from data_pipeline.loading.plan import Plan
    from data_pipeline.shards.manifest import resolve_shards
    from pretrain.config import load_config

    def shards(bad: set) -> Path:
        samples = [[(f"{s:02d}{i:04d}", {"jpg": b"\xff\xd8not a jpeg" if (s, i) in bad else
                                       shard_kit.image_bytes(20, 20, seed=16 * s + i), "cls": str(i % 2).encode()})
                    for i in range(16)] for s in range(4)]
        return shard_kit.make_shards(root, samples, ["a", "b"]) / "manifest.json"

    manifest = shards(set())
    cfg = load_config("configs/tiny_cpu.yaml", [f"data.train_shards={manifest}", *overrides])
    plan = Plan(resolve_shards(str(manifest)), 2, 1, cfg.train.micro_batch_size, cfg.train.seed, True)
    names = [sh.name for sh in plan.shardset.shards]
    bad = {(names.index(p.shard.name), i) for p in plan.slot_pieces(0, 1) for i in range(p.lo, p.hi)}
    return shards(bad)


def test_a_data_error_on_one_rank_is_one_line_naming_it(tiny_run, shard_kit, tmp_path):
    """Rank 1's samples are damaged, rank 0's are not: the job says one line, the data error naming
    rank 1, and exits 2 (a user error, nothing to retry). Rank 0, left in a collective by rank 1's
    clean exit, is not told a network fault: its record says it stopped because of rank 1, with
    rank 1's exit code, and it says nothing on the terminal."""
    from pretrain.resilience.lifecycle import read_record

    common = (*ZERO1, "train.steps=4", "checkpoint.every_steps=100", "model.num_classes=2")
    manifest = _damaged_for_rank_one(shard_kit, tmp_path / "shards", common)
    job = tiny_run(*common, via="deepspeed", ranks=2, shards=manifest)
    r = job.run(300)
    out = r.stdout + r.stderr
    said = [ln for ln in out.splitlines() if ln.startswith("vit-train: error:") or "vit-train: rank" in ln]
    assert r.returncode == 2 and len(said) == 1, (r.returncode, said, out[-3000:])
    assert said[0].startswith("vit-train: error: rank 1 on ") and "yielded a readable sample" in said[0], said
    assert "no answer" not in out and "unreachable" not in out and "Traceback" not in out, out[-3000:]
    heads = {f.name: read_record(f) for f in (job.run_dir / "errors").glob("rank-*.txt")}
    one = heads["rank-1.txt"]
    assert one["own"] and one["code"] == 2 and "TooManyCorruptSamples" in one["line"], one
    zero = heads.get("rank-0.txt")  # none when the launcher ended rank 0 before its collective failed
    if zero is not None:
        assert not zero["own"] and zero["code"] == 2 and "lost" not in zero, zero
        assert zero["line"].startswith(f"rank 0 on {zero['host']}: stopped: rank 1 on "), zero


def test_a_config_mistake_under_the_runner_is_one_line(tiny_run):
    """Every rank reads the same config and finds the same mistake, before the ranks are connected:
    rank 0 alone says it."""
    r = tiny_run("optim.lrr=1", via="deepspeed", ranks=2).run(300)
    out = r.stdout + r.stderr
    said = [ln for ln in out.splitlines() if ln.startswith("vit-train:")]
    assert r.returncode == 2 and said == [
        "vit-train: error: rank 0 on " + said[0].split(" on ", 1)[1].split(":", 1)[0]
        + ": command line: unknown key 'optim.lrr'; did you mean 'optim.lr'?"], out[-3000:]


def test_a_rank_failing_in_start_up_leaves_its_record(tiny_run):
    """A rank that fails before the training loop (here: a batch the 2 ranks cannot split, found
    once the process group says the world size) writes its record too, so ``vit-launch run`` does
    not take it for a rank killed with its node and leave a healthy node out."""
    from launch.nodes import Attempt, named_dead
    from pretrain.resilience.lifecycle import read_record

    t0 = time.time()
    job = tiny_run(*ZERO1, "train.global_batch_size=24", via="deepspeed", ranks=2)
    r = job.run(300)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "train.global_batch_size=24 is not divisible" in out, out[-3000:]
    said = [ln for ln in out.splitlines() if ln.startswith("vit-train: error:")]
    assert len(said) == 1 and said[0].startswith("vit-train: error: rank "), said  # one line per job
    heads = {f.name: read_record(f) for f in sorted((job.run_dir / "errors").glob("rank-*.txt"))}
    assert sorted(heads) == ["rank-0.txt", "rank-1.txt"], out[-3000:]
    for rank, head in enumerate(heads.values()):
        assert head["rank"] == rank and head["started"] >= t0 - 1 and "lost" not in head and head["own"]
        assert head["host"]
        assert f"rank {rank} on {head['host']}: ConfigError: train.global_batch_size=24" in head["line"]
    # a peer naming both ranks lost would not make their node dead: each left its own record
    heads["rank-0.txt"]["lost"] = [1]
    errors = job.run_dir / "errors" / "rank-0.txt"
    errors.write_text(json.dumps(heads["rank-0.txt"]) + "\n")
    assert named_dead(rundir.RunDir.of(job.run_dir), Attempt(t0 - 1, ["h", "h"], ["h"])) == {}


# ----------------------------------------------------------------------------- damaged checkpoint
@pytest.fixture(scope="module")
def two_checkpoints(shards, tmp_path_factory):
    run = tmp_path_factory.mktemp("dmg") / "run"
    r = TinyRun(shards, run, (*ZERO1, "train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=3")).run(300)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_damaged_newest_checkpoint_falls_back(two_checkpoints, tiny_run, tmp_path, damage):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    newest = run / "checkpoints" / "step_00000004"
    victim = max((p for p in newest.iterdir() if p.suffix == ".pt"), key=lambda p: p.stat().st_size)
    if damage == "delete":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    assert rundir.verify(newest) is not None

    # export falls back, warns, and leaves the training run's files alone
    out = tmp_path / "w.safetensors"
    r = subprocess.run([sys.executable, "-m", "pretrain.export", str(run), str(out)], cwd=REPO, env=job_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warning: checkpoint step_00000004 is damaged" in r.stderr and victim.name in r.stderr
    assert "step 2 from" in r.stderr and newest.is_dir()

    # resume falls back to step 2, sets step 4 aside (kept), trains on
    r = tiny_run(*ZERO1, "train.steps=5", "checkpoint.every_steps=2", "checkpoint.keep_last=3").run(300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from step 2" in r.stderr and "is damaged" in r.stderr
    kept = run / "checkpoints" / "damaged" / "step_00000004"
    assert kept.is_dir() and rundir.verify(kept) is not None  # the damaged one, set aside as it was
    assert rundir.verify(newest) is None  # step 4 trained and saved again
    assert rundir.step_of(rundir.latest_complete(run / "checkpoints")) == 5


def test_export_and_transfer_of_a_zero_checkpoint_keep_stdout_for_their_result(two_checkpoints, tmp_path):
    """Reading a ZeRO checkpoint imports DeepSpeed, whose logger writes to stdout (on a CPU its import
    says "Setting accelerator to CPU"): stdout still holds vit-export's loading call alone and
    vit-transfer's table alone, so either can be piped or saved as it is."""
    from transfer_fixtures import write_imagefolder

    def run(module, *args):
        r = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=job_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        return [line for line in r.stdout.splitlines() if line]

    lines = run("pretrain.export", two_checkpoints, tmp_path / "w.safetensors")
    assert len(lines) == 1 and lines[0].startswith("import timm; m = timm.create_model("), lines
    folder = write_imagefolder(tmp_path / "colours", n_train=4, n_test=4)
    lines = run("pretrain.transfer", "--checkpoint", two_checkpoints, "--suite", "imagefolder", "--protocol", "knn",
                "--data-root", folder, "--output", tmp_path / "r.json")
    assert lines[0].startswith("**") and lines[-1].startswith("Evaluated in "), lines
    assert all(line.startswith("|") for line in lines[1:-1]), lines


def test_a_fresh_start_beside_an_earlier_runs_checkpoints_keeps_both(two_checkpoints, tiny_run, tmp_path):
    """checkpoint.resume=false where an earlier run got further: its checkpoints are set aside
    whole, and the fresh run's own saves are not pruned against them."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    r = tiny_run(*ZERO1, "train.steps=2", "checkpoint.every_steps=2", "checkpoint.keep_last=1",
                 "checkpoint.resume=false").run(300)
    assert r.returncode == 0, r.stderr[-3000:]
    kept = run / "checkpoints" / "earlier-1"
    assert f"the checkpoints already in {run / 'checkpoints'} are kept in {kept}" in r.stderr
    mine = rundir.latest_complete(run / "checkpoints")
    assert mine == run / "checkpoints" / "step_00000002" and rundir.verify(mine) is None
    assert (run / "checkpoints" / rundir.LATEST).read_text() == mine.name
    assert [p.name for p in rundir.list_complete(kept)] == ["step_00000002", "step_00000004"]
    assert all(rundir.verify(p) is None for p in rundir.list_complete(kept))
    assert "done at step 2" in r.stderr and f"checkpoint {mine}" in r.stderr


def ask_to_stop(job) -> Path:
    """A stop request ("maintenance") in the job's folder, dated after its start: it asks this job
    to stop at its first sync point."""
    job.run_dir.mkdir(parents=True)
    request = job.run_dir / "stop.request"
    request.write_text("maintenance\n")
    later = time.time() + 3600  # newer than the job's start
    os.utime(request, (later, later))
    return request


def test_a_stopped_fresh_start_names_the_override_that_resumes_it(tiny_run):
    """Started with checkpoint.resume=false, the same command would set this run's checkpoint
    aside and start over: the closing line names checkpoint.resume=true, and that resumes it."""
    job = tiny_run(*ZERO1, "train.steps=3", "checkpoint.resume=false")
    request = ask_to_stop(job)
    r = job.run(300)
    assert r.returncode == 75, r.stderr[-3000:]
    assert "run the same command with checkpoint.resume=true to resume (exit 75)" in r.stderr, r.stderr[-2000:]
    request.unlink()
    r = tiny_run(*ZERO1, "train.steps=3", "checkpoint.resume=false", "checkpoint.resume=true").run(300)
    assert r.returncode == 0 and "resuming from step 1" in r.stderr, r.stderr[-3000:]


def test_a_stop_asked_for_at_the_last_step_ends_a_finished_run(tiny_run):
    """A stop request seen at the last step's sync point: every step trained and saved, so the run
    finished (exit 0, "completed"), not a resume asked of a scheduler."""
    job = tiny_run(*ZERO1, "train.steps=1")
    ask_to_stop(job)
    r = job.run(300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((job.run_dir / "summary.json").read_text())["stop_reason"] == "maintenance"
    assert json.loads((job.run_dir / "status.json").read_text())["state"] == "completed"
    assert "vit-train: done at step 1" in r.stderr


def test_sigterm_to_the_runner_only_leaves_no_orphans(tiny_run, tmp_path):
    """`kill RUNNER_PID`: DeepSpeed's runner dies at once and its launcher is orphaned; the ranks
    notice their runner is gone, checkpoint at the next step and exit."""
    job = tiny_run(*ZERO1, "train.steps=400", "checkpoint.every_steps=1000", "data.workers=1", via="deepspeed", ranks=2)
    run, log = job.run_dir, tmp_path / "log.txt"
    with reaped(job.start(log)) as p:
        wait_for(lambda: logged_step(run) >= 2, 300, p, "step 2")
        os.kill(p.pid, signal.SIGTERM)
        wait_gone(p, 120)
    ckpt = rundir.latest_complete(run / "checkpoints")
    assert ckpt is not None and rundir.verify(ckpt) is None, log.read_text()[-3000:]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "interrupted" and status["step"] == rundir.step_of(ckpt)
    text = log.read_text()  # rank 0 names its own reason, or the rank that noticed first
    assert "vit-train: stopped (runner exited)" in text or "vit-train: stopped (another rank's request)" in text


def test_sigterm_during_start_up_is_a_stop_on_request(tiny_run, tmp_path):
    """SIGTERM to vit-launch before training reached its first step: exit 75 (stopped on request,
    the same command starts again), not the 143 of a signalled runner."""
    run, log = tmp_path / "run", tmp_path / "log.txt"
    with reaped(launched(tiny_run, "train.steps=50", "data.workers=0").start(log)) as job:
        wait_for(lambda: "$ " in log.read_text(), 60, job, "the runner's command line")
        time.sleep(1.0)  # the runner is up; the ranks are still importing
        os.kill(job.pid, signal.SIGTERM)
        job.wait(120)
    assert job.returncode == 75, log.read_text()[-3000:]
    assert not (run / "metrics.jsonl").exists() or not metrics(run)
