"""Evaluation while pre-training (validation.every_steps): validation metrics over every val sample once,
few-shot probes on the held-out demo shapes, and training bit-identical with evaluation on or off."""
import json
import subprocess
import sys

import pytest

from dist_utils import REPO, deepspeed_cmd, job_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from data_pipeline.shards.writer import write_demo_shards

    root = tmp_path_factory.mktemp("evaldata")
    write_demo_shards(root / "train", "train", n=256, shard_size=64)
    write_demo_shards(root / "val", "val", n=75, shard_size=20)  # 75: uneven over ranks and batches
    return root


def args(data, run_dir, *extra):
    return ["--config", "configs/tiny_cpu.yaml", f"data.train_shards={data / 'train' / 'manifest.json'}",
            f"data.val_shards={data / 'val' / 'manifest.json'}", f"train.output_dir={run_dir}",
            "train.global_batch_size=16", "train.micro_batch_size=8", "data.workers=0", "train.steps=6",
            "train.log_every_steps=1", "checkpoint.every_steps=100", "logging.wandb.mode=disabled", *extra]


def records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def single(data, run_dir, *extra):
    r = subprocess.run([sys.executable, "-m", "pretrain.train", *args(data, run_dir, *extra)], cwd=REPO,
                       env=job_env(), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    return records(run_dir)


def test_evaluation_logs_val_and_fewshot_and_leaves_training_unchanged(data, tmp_path):
    on = single(data, tmp_path / "on", "validation.every_steps=3", "validation.fewshot_suites=[demo]",
                "validation.fewshot_shots=[1,5]", "validation.fewshot_seeds=2")
    off = single(data, tmp_path / "off")
    evals = [r for r in on if "eval/loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    for r in evals:
        assert r["eval/samples"] == 75  # every validation sample exactly once
        assert 0.0 <= r["eval/top1"] <= r["eval/top5"] <= 1.0 and r["eval/loss"] > 0
        assert 0.0 <= r["eval/fewshot/demo/1shot"] <= 1.0 and 0.0 <= r["eval/fewshot/demo/5shot"] <= 1.0
        assert r["eval/seconds"] > 0
    # training did not notice: the same losses, bit for bit, with and without evaluation
    train_on = [(r["step"], r["loss"]) for r in on if "loss" in r]
    train_off = [(r["step"], r["loss"]) for r in off if "loss" in r]
    assert train_on == train_off and len(train_on) == 6


def test_two_ranks_zero3_evaluate_every_val_sample_once(data, tmp_path):
    run = tmp_path / "run"
    r = subprocess.run(deepspeed_cmd("pretrain.train", *args(data, run, "zero.stage=3", "validation.every_steps=3",
                                                             "validation.fewshot_suites=[demo]", "validation.fewshot_shots=[1]",
                                                             "validation.fewshot_seeds=1")),
                       cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    evals = [x for x in records(run) if "eval/loss" in x]
    assert [x["step"] for x in evals] == [3, 6]
    assert all(x["eval/samples"] == 75 and "eval/fewshot/demo/1shot" in x for x in evals)
