"""Elastic resume through the real deepspeed runner: a ZeRO-2 run on 2 ranks with 2 data workers
each resumes on 1 rank with 1 worker; the recorded samples of the epoch are each sample once."""
import collections
import json
import subprocess

import pytest

from dist_utils import REPO, deepspeed_cmd, job_env, metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from data_pipeline.write_shards import write_demo_shards

    out = tmp_path_factory.mktemp("elastic") / "train"
    write_demo_shards(out, "train", n=256, shard_size=48)  # uneven last shard: ranges cross shards
    return out / "manifest.json"


def run(shards, run_dir, ranks, workers, steps):
    cmd = deepspeed_cmd("pretrain.train", "--config", "configs/tiny_cpu.yaml", f"data.train_shards={shards}",
                        f"train.output_dir={run_dir}", "train.global_batch_size=16", "train.micro_batch_size=8",
                        f"data.workers={workers}", "data.record_samples=true", "logging.wandb.mode=disabled",
                        "train.log_every_steps=1", "checkpoint.every_steps=3", "checkpoint.keep_last=10", "zero.stage=2",
                        f"train.steps={steps}", ranks=ranks)
    return subprocess.run(cmd, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=600)


def test_two_ranks_to_one_rank_finishes_the_epoch_with_every_sample_once(shards, tmp_path):
    out = tmp_path / "run"
    r = run(shards, out, ranks=2, workers=2, steps=6)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run(shards, out, ranks=1, workers=1, steps=16)  # 256 samples / 16 per step: epoch 0 ends at step 16
    assert r.returncode == 0, r.stderr[-3000:]
    assert "was saved on 2 rank(s), resuming on 1" in r.stderr and "resuming from step 6" in r.stderr
    assert (out / "checkpoints" / "step_00000006" / "universal" / "UNIVERSAL").is_file()
    keys = collections.Counter()
    for f in (out / "samples").glob("rank-*.tsv"):
        for line in f.read_text().splitlines():
            step, epoch, key = line.split("\t")
            assert int(epoch) == 0 and 1 <= int(step) <= 16
            keys[key] += 1
    assert len(keys) == 256 and set(keys.values()) == {1}, keys.most_common(3)
    m = metrics(out)
    assert sorted(m) == list(range(1, 17))
    assert json.loads((out / "summary.json").read_text())["step"] == 16
