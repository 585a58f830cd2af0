"""Elastic resume through the real deepspeed runner: a run resumes on another number of ranks and
data workers (ZeRO-2: 2 ranks x 2 workers -> 1 x 1; ZeRO-3: 1 x 1 -> 2 x 2). The recorded samples
of the interrupted epoch are each sample exactly once, and the loss carries on from where it was
instead of jumping back to a fresh model's."""
import collections
import json
import math
import subprocess

import pytest

from dist_utils import REPO, deepspeed_cmd, demo_manifest, job_env, metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return demo_manifest(tmp_path_factory, n=256, shard_size=48)  # uneven last shard: ranges cross shards


def run(shards, run_dir, ranks, workers, stage, **env):
    cmd = deepspeed_cmd("pretrain.train", "--config", "configs/tiny_cpu.yaml", f"data.train_shards={shards}",
                        f"train.output_dir={run_dir}", "train.global_batch_size=16", "train.micro_batch_size=8",
                        f"data.workers={workers}", "data.record_samples=true", "logging.wandb.mode=disabled",
                        "train.log_every_steps=1", "checkpoint.every_steps=3", "checkpoint.keep_last=10",
                        f"zero.stage={stage}", "optim.lr=1e-3", "optim.warmup_steps=2", "optim.schedule=constant",
                        "train.steps=16", ranks=ranks)  # 256 samples / 16 per step: epoch 0 ends at step 16
    return subprocess.run(cmd, cwd=REPO, env=job_env(**env), capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("stage, before, after", [(2, (2, 2), (1, 1)), (3, (1, 1), (2, 2))])
def test_resume_on_another_layout_finishes_the_epoch_with_every_sample_once(shards, tmp_path, stage, before, after):
    out = tmp_path / "run"
    r = run(shards, out, *before, stage=stage, VITSCALE_FAULT="crash_in_step:10")  # dies after saving step 9
    assert r.returncode != 0 and "injected crash in step 10" in r.stderr, r.stderr[-3000:]
    first = metrics(out)
    r = run(shards, out, *after, stage=stage)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"was saved on {before[0]} rank(s), resuming on {after[0]}" in r.stderr
    assert "resuming from step 9" in r.stderr
    assert (out / "checkpoints" / "step_00000009" / "universal" / "UNIVERSAL").is_file()
    keys = collections.Counter()
    for f in (out / "samples").glob("rank-*.tsv"):
        for line in f.read_text().splitlines():
            step, epoch, key = line.split("\t")
            assert int(epoch) == 0 and 1 <= int(step) <= 16
            keys[key] += 1
    assert len(keys) == 256 and set(keys.values()) == {1}, keys.most_common(3)
    m = metrics(out)
    assert sorted(m) == list(range(1, 17))
    # the curve continues: a fresh model's zero-initialised head gives exactly ln(10) at its first step
    fresh = math.log(10)
    assert first[1]["loss"] == pytest.approx(fresh, abs=1e-4) and abs(first[9]["loss"] - fresh) > 0.02, first
    assert abs(m[10]["loss"] - first[9]["loss"]) < abs(m[10]["loss"] - fresh), (first[9], m[10])
    assert m[10]["lr"] == first[9]["lr"]
    assert json.loads((out / "summary.json").read_text())["step"] == 16
