"""No host-device sync inside a step: between sync points (log and checkpoint steps, every
``train.sync_every_steps``) nothing in the process reads a tensor on the host, so on a GPU the CPU
runs ahead and queues the next micro-batch's kernels. Counted in a real single-process bf16 run with
``torch.Tensor``'s reading methods wrapped for every caller (DeepSpeed's included), per step (the
watchdog's beats say which step), for each ZeRO stage. One data worker decodes, as in real runs
(its CPU-side crop sampling happens in that process, not in the training process)."""
import json
import subprocess
import sys

import pytest
import torch
from dist_utils import REPO, job_env

# Runs pretrain.train.main in this process with the counters installed; writes the counts.
JOB = r"""
import collections, json, os, sys
import torch
from pretrain.resilience import watchdog

where = {"step": 0}
counts = collections.Counter()
beat = watchdog.Watchdog.beat

def tracked_beat(self, step, phase, **kw):
    where["step"] = step
    return beat(self, step, phase, **kw)

watchdog.Watchdog.beat = tracked_beat

def counting(name):
    orig = getattr(torch.Tensor, name)
    def wrapper(self, *a, **k):
        frame = sys._getframe(1)
        path = frame.f_code.co_filename.split("site-packages/")[-1]
        where_from = os.path.relpath(path, sys.argv[1]) if path.startswith(sys.argv[1]) else path
        where_from += ":" + frame.f_code.co_name
        counts[f"{where['step']}|{name}|{where_from}"] += 1
        return orig(self, *a, **k)
    setattr(torch.Tensor, name, wrapper)

for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
    counting(name)
from pretrain.train import main
try:
    main(sys.argv[3:])
except SystemExit as e:
    code = e.code
with open(sys.argv[2], "w") as f:
    json.dump({"code": code, "counts": counts}, f)
"""

# Host reads per step between sync points that are not ours, by ZeRO stage (bf16, fp32 reduction,
# gradient clipping on; stage 0 in fp32, since bf16 there is refused), as {caller: count}. DeepSpeed
# reads the gradient norm on the host every step when it clips (BF16_Optimizer for ZeRO-1 with fp32
# accumulation, DeepSpeedZeroOptimizer for ZeRO-2, the stage-0 engine, ZeRO-3's optimizer); torch's
# AdamW reads its step counter, a host tensor unless the optimizer is fused (as on GPUs). Pinned
# exactly: a new read, ours or a DeepSpeed upgrade's, fails here. Our own code reads nothing.
NORM_CHECK = "deepspeed/runtime/utils.py:is_invalid_grad_norm"
CLIP = "deepspeed/runtime/utils.py:clip_tensors_by_global_norm"
ADAM_STEP = "torch/optim/optimizer.py:_get_value"
ALLOWED = {
    0: {ADAM_STEP: 80},  # fp32, no ZeRO: AdamW's per-parameter step (80 tensors in test_vit), host tensors
    1: {NORM_CHECK: 1, CLIP: 1, ADAM_STEP: 2},  # BF16_Optimizer: norm validity, clip decision
    2: {NORM_CHECK: 2, ADAM_STEP: 2},  # step()'s validity check and unscale_and_clip_grads'
    3: {NORM_CHECK: 1, ADAM_STEP: 2},
}


def allowed(stage: int, cuda: bool) -> dict:
    """ALLOWED for this machine: with CUDA the AdamW is fused (pretrain.distributed.engine.use_fused_adamw)
    and keeps its step counter on the device, so its host reads are gone."""
    return {k: v for k, v in ALLOWED[stage].items() if not (cuda and k == ADAM_STEP)}
OURS = ("pretrain/", "data_pipeline/", "launch/")


def run_counted(tiny_run, out, *extra):
    """Steps of two micro-batches of 2 (the reads do not depend on the batch; bf16 matmuls are
    slow on CPUs without bf16 units)."""
    job = tiny_run("train.global_batch_size=4", "train.micro_batch_size=2", "data.workers=1", "train.steps=8",
                   "train.log_every_steps=4", "train.sync_every_steps=4", "checkpoint.every_steps=1000",
                   "train.precision=bf16", *extra)
    r = subprocess.run([sys.executable, "-c", JOB, str(REPO), str(out), *job.args()], cwd=REPO,
                       env=job_env(VITSCALE_FAULT="nan_loss:6"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["code"] == 0, r.stderr[-3000:]
    return got["counts"], r


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_host_sync_between_sync_points(tiny_run, tmp_path, stage):
    extra = [f"zero.stage={stage}"] + (["train.precision=fp32"] if stage == 0 else [])  # bf16 needs stage >= 1
    counts, _ = run_counted(tiny_run, tmp_path / "counts.json", *extra)
    per_step = {s: {k: v for k, v in counts.items() if int(k.split("|")[0]) == s} for s in range(1, 9)}
    between = {s: _callers(per_step[s]) for s in (2, 3, 5, 6, 7)}  # step 1 is start-up; 4 and 8 sync
    ours = {s: {k: v for k, v in c.items() if k.startswith(OURS)} for s, c in between.items()}
    assert all(not v for v in ours.values()), ours
    for s, callers in between.items():
        assert callers == allowed(stage, torch.cuda.is_available()), (s, callers)
    assert sum(per_step[4].values()) > 0 and sum(per_step[8].values()) > 0  # the counter does see the sync points
    m = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln]
    assert [x["nonfinite_skipped"] for x in m] == [0, 1]  # step 6's dropped micro-batch, read at step 8



def _callers(counts: dict) -> dict:
    """{"file:function-line": reads} of one step's counts."""
    out: dict = {}
    for key, n in counts.items():
        _, _, where = key.split("|")
        out[where] = out.get(where, 0) + n
    return out


def test_sigint_stops_at_the_next_sync_point(tiny_run, tmp_path):
    """Between log steps the ranks agree on a stop only every train.sync_every_steps: Ctrl-C still
    ends in a checkpoint at a step boundary and exit 75, at a sync step (a multiple of 3 or 5)."""
    import os
    import signal

    from dist_utils import metrics, reaped, wait_for

    from pretrain.checkpointing import rundir

    job = tiny_run("train.steps=500", "train.log_every_steps=5", "train.sync_every_steps=3",
                   "checkpoint.every_steps=1000")
    run, log = job.run_dir, tmp_path / "log.txt"
    with reaped(job.start(log)) as p:
        wait_for(lambda: (run / "metrics.jsonl").exists() and max(metrics(run), default=0) >= 5, 240, p, "step 5")
        os.kill(p.pid, signal.SIGINT)
        p.wait(120)
    assert p.returncode == 75, log.read_text()[-3000:]
    ckpt = rundir.latest_complete(run / "checkpoints")
    assert ckpt is not None and rundir.verify(ckpt) is None
    step = rundir.step_of(ckpt)
    assert 5 <= step < 500 and (step % 3 == 0 or step % 5 == 0), step
