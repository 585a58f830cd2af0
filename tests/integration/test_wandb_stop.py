"""W&B keeps every logged step whatever stops the job: read back from W&B's own offline files
(``dist_utils.wandb_records``) and compared with metrics.jsonl, for a real 2-rank job through
``vit-launch run`` stopped by SIGTERM, and for a job whose other rank crashed, then resumed (the
same W&B run id, no gap, no duplicate). DeepSpeed's launcher SIGTERMs every descendant of every rank on
a stop or a peer's crash; W&B's service answers SIGTERM with a forced shutdown that dropped the
unwritten history (a 7-byte file), so it now runs out of the ranks' process tree."""
import json
import os
import signal
import time
from pathlib import Path

import pytest
from dist_utils import metrics, reaped, wait_for, wandb_records

pytestmark = pytest.mark.slow


def launch(tiny_run, *extra):
    """``vit-launch run`` on 2 local ranks, W&B offline, a line every 2 steps."""
    return tiny_run("logging.wandb.mode=offline", "train.log_every_steps=2", *extra, via="launch", ranks=2)


def wandb_steps(run: Path, settle_s: float = 20.0) -> dict[str, list[int]]:
    """{offline run folder: the steps of its history records, in file order}, read once the files
    stopped growing (W&B's writer may still flush after the job returned)."""
    files = sorted((run / "wandb").glob("offline-run-*/*.wandb"))
    sizes, deadline = None, time.time() + settle_s
    while time.time() < deadline:
        now = [f.stat().st_size for f in files]
        if now == sizes:
            break
        sizes = now
        time.sleep(2.0)
    out = {}
    for f in files:
        recs = wandb_records(f)
        out[f.parent.name] = [int(r.history.step.num) for r in recs if r.WhichOneof("record_type") == "history"]
    return out


def run_ids(run: Path) -> set[str]:
    return {p.name.rsplit("-", 1)[1] for p in (run / "wandb").glob("offline-run-*")}


def test_sigterm_keeps_every_logged_step(tiny_run, tmp_path):
    """(The resume that continues the run id is checked after the crash below.)"""
    run, log = tmp_path / "run", tmp_path / "log.txt"
    with reaped(launch(tiny_run, "train.steps=400", "checkpoint.every_steps=1000").start(log)) as job:
        wait_for(lambda: (run / "metrics.jsonl").exists() and max(metrics(run), default=0) >= 8, 240, job, "step 8")
        os.kill(job.pid, signal.SIGTERM)  # vit-launch: the whole job is asked to stop
        job.wait(120)
    assert job.returncode == 75, log.read_text()[-3000:]
    logged = sorted(metrics(run))
    steps = wandb_steps(run)
    assert len(steps) == 1 and list(steps.values())[0] == logged, (steps, logged)  # every step, once


def test_a_crashed_peer_leaves_rank_0s_history_whole_and_the_resume_logs_each_step_once(tiny_run, tmp_path):
    """Rank 1 crashes in step 11: rank 0 logged up to step 10, the last checkpoint is step 8. The
    resume recomputes steps 9-10: metrics.jsonl holds each step once (cut back to step 8 on resume),
    and W&B, which already holds step 10, is sent only the steps after it."""
    run = tmp_path / "run"
    r = launch(tiny_run, "train.steps=400", "checkpoint.every_steps=4").run(300, VITSCALE_FAULT="crash_in_step:11@1")
    assert r.returncode != 0
    assert sorted(metrics(run)) == [2, 4, 6, 8, 10], (r.stdout + r.stderr)[-3000:]
    assert list(wandb_steps(run).values()) == [[2, 4, 6, 8, 10]]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and status["step"] == 10  # the last step reached, not the start
    first = set(wandb_steps(run))

    r = launch(tiny_run, "train.steps=14", "checkpoint.every_steps=4").run(300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "resuming from step 8" in r.stdout + r.stderr
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6, 8, 10, 12, 14]  # 10 once: the crashed attempt's line was cut back
    second = [v for k, v in wandb_steps(run).items() if k not in first]
    assert second == [[12, 14]] and len(run_ids(run)) == 1
