"""No host-device sync inside a step (issue 14): between sync points (log and checkpoint steps,
every ``train.sync_every_steps``) the loop never reads a tensor on the host, so on a GPU the CPU
runs ahead and queues the next micro-batch's kernels. Counted in a real single-process run with
``torch.Tensor``'s reading methods wrapped, per step (the watchdog's beats say which step)."""
import json
import subprocess
import sys

import pytest

from dist_utils import REPO, demo_manifest, job_env

# Runs pretrain.train.main in this process with the counters installed; writes the counts.
JOB = r"""
import collections, json, os, sys
import torch
from pretrain import watchdog

OURS = os.path.join(sys.argv[1], "pretrain") + os.sep
where = {"step": 0}
counts = collections.Counter()
beat = watchdog.Watchdog.beat

def tracked_beat(self, step, phase, slow=False):
    where["step"] = step
    return beat(self, step, phase, slow=slow)

watchdog.Watchdog.beat = tracked_beat

def counting(name):
    orig = getattr(torch.Tensor, name)
    def wrapper(self, *a, **k):
        caller = sys._getframe(1).f_code.co_filename
        counts[f"{where['step']}:{'ours' if caller.startswith(OURS) else 'other'}:{name}"] += 1
        return orig(self, *a, **k)
    setattr(torch.Tensor, name, wrapper)

for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
    counting(name)
from pretrain.train import main
try:
    main(sys.argv[3:])
except SystemExit as e:
    code = e.code
with open(sys.argv[2], "w") as f:
    json.dump({"code": code, "counts": counts}, f)
"""


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return demo_manifest(tmp_path_factory, n=256, shard_size=64)


@pytest.mark.parametrize("stage", [1, 2])
def test_no_host_sync_between_sync_points(shards, tmp_path, stage):
    out = tmp_path / "counts.json"
    args = ["--config", "configs/tiny_cpu.yaml", f"data.train_shards={shards}", f"train.output_dir={tmp_path / 'run'}",
            "train.global_batch_size=16", "train.micro_batch_size=8", "data.workers=0", "logging.wandb.mode=disabled",
            "train.steps=8", "train.log_every_steps=4", "train.sync_every_steps=4", "checkpoint.every_steps=1000",
            f"zero.stage={stage}"]
    r = subprocess.run([sys.executable, "-c", JOB, str(REPO), str(out), *args], cwd=REPO,
                       env=job_env(VITSCALE_FAULT="nan_loss:6"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["code"] == 0, r.stderr[-3000:]
    ours = {k: v for k, v in got["counts"].items() if ":ours:" in k}
    between = {k: v for k, v in ours.items() if int(k.split(":")[0]) not in (0, 4, 8)}
    assert between == {}, f"host reads in non-sync steps: {between} (all: {got['counts']})"
    assert any(k.startswith(("4:", "8:")) for k in ours), ours  # the counter does see the sync points
    m = json.loads(json.dumps([json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
                               if '"loss"' in ln]))
    assert [x["nonfinite_skipped"] for x in m] == [0, 1]  # step 6's dropped micro-batch, read at step 8


def test_sigint_stops_at_the_next_sync_point(shards, tmp_path):
    """Between log steps the ranks agree on a stop only every train.sync_every_steps: Ctrl-C still
    ends in a checkpoint at a step boundary and exit 75, at a sync step (a multiple of 3 or 5)."""
    import os
    import signal

    from dist_utils import group_alive, kill_group, metrics, start_job, wait_for
    from pretrain import rundir

    run, log = tmp_path / "run", tmp_path / "log.txt"
    cmd = [sys.executable, "-m", "pretrain.train", "--config", "configs/tiny_cpu.yaml", f"data.train_shards={shards}",
           f"train.output_dir={run}", "train.global_batch_size=16", "train.micro_batch_size=8", "data.workers=0",
           "logging.wandb.mode=disabled", "train.steps=500", "train.log_every_steps=5", "train.sync_every_steps=3",
           "checkpoint.every_steps=1000"]
    p = start_job(cmd, log)
    try:
        wait_for(lambda: (run / "metrics.jsonl").exists() and max(metrics(run), default=0) >= 5, 240, p, "step 5")
        os.kill(p.pid, signal.SIGINT)
        p.wait(120)
    finally:
        if group_alive(p):
            kill_group(p)
    assert p.returncode == 75, log.read_text()[-3000:]
    ckpt = rundir.latest_complete(run / "checkpoints")
    assert ckpt is not None and rundir.verify(ckpt) is None
    step = rundir.step_of(ckpt)
    assert 5 <= step < 500 and (step % 3 == 0 or step % 5 == 0), step
