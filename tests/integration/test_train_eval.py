"""Evaluation while pre-training (validation.every_steps): validation metrics over every val sample once,
few-shot and kNN probes on the held-out demo shapes (from shards, as ``make demo`` evaluates), the same
on the weights' EMA (train.ema_decay), and training bit-identical with evaluation on or off."""
import json
import shutil
import tarfile

import pytest
from dist_utils import wandb_history

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def val(tmp_path_factory):
    from data_pipeline.shards.writer import write_demo_shards

    root = tmp_path_factory.mktemp("evaldata") / "val"
    write_demo_shards(root, "val", n=75, shard_size=20)  # 75: uneven over ranks and batches
    return root / "manifest.json"


@pytest.fixture(scope="module")
def held_out(val):
    """``demo:ROOT``: the held-out shapes' probe data in shards under ROOT, 10 train and 5 test images
    of each of the 6 shapes (a probe's cost is its images, four passes per evaluation with an EMA)."""
    from data_pipeline.shards.writer import write_demo_shards

    root = val.parent.parent
    write_demo_shards(root / "transfer-train", "transfer-train", n=60, shard_size=32)
    write_demo_shards(root / "transfer-test", "transfer-test", n=30, shard_size=32)
    return f"demo:{root}"


def six_steps(tiny_run, val, *extra, **kw):
    """A tiny run of 6 steps, a line each, validating on ``val`` in evaluation batches of 32 (4 x the
    micro batch; 75 validation samples, on one rank or two, still end in a short batch)."""
    return tiny_run(f"data.val_shards={val}", "train.steps=6", "train.log_every_steps=1",
                    "checkpoint.every_steps=100", "validation.batch_size=32", *extra, **kw)


def records(job, stderr: list | None = None):
    """The run's metrics records; its stderr lines appended to ``stderr`` when given."""
    r = job.run(timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    if stderr is not None:
        stderr += r.stderr.splitlines()
    return [json.loads(x) for x in (job.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_evaluation_logs_val_and_fewshot_and_leaves_training_unchanged(tiny_run, val, held_out):
    # with an EMA: its evaluation swaps it into the module and back, which training must not notice either;
    # 12-shot and 100-NN ask for more than the probe's 10 training images a shape, 60 in all
    err: list[str] = []
    on = records(six_steps(tiny_run, val, "validation.every_steps=3", f"validation.fewshot_suites=[{held_out}]",
                           "validation.fewshot_shots=[1,5,12]", "validation.fewshot_seeds=2",
                           f"validation.knn_suites=[{held_out}]", "validation.knn_k=[5,20,100]", "train.ema_decay=0.5",
                           name="on"), err)
    off = records(six_steps(tiny_run, val, "train.ema_decay=0.5", name="off"))
    evals = [r for r in on if "eval/loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    # each evaluation's record carries the run's device-hours so far, past its step's training record's
    hours = {r["step"]: r["device_hours"] for r in on if "loss" in r}
    assert all(0 < hours[r["step"]] <= r["device_hours"] < hours.get(r["step"] + 1, 1e9) for r in evals), on
    for r in evals:
        assert r["eval/samples"] == 75  # every validation sample exactly once
        assert not [k for k in r if "/data/" in k], r  # nothing skipped, nothing retried
        assert 0.0 <= r["eval/top1"] <= r["eval/top5"] <= 1.0 and r["eval/loss"] > 0
        assert 0.0 <= r["eval/fewshot/demo/1shot"] <= 1.0 and 0.0 <= r["eval/fewshot/demo/5shot"] <= 1.0
        assert 0.0 <= r["eval/knn/demo/5nn"] <= 1.0 and 0.0 <= r["eval/knn/demo/20nn"] <= 1.0
        assert r["eval/seconds"] > 0
        assert r["eval/ema/samples"] == 75 and 0.0 <= r["eval/ema/top1"] <= r["eval/ema/top5"] <= 1.0
        assert 0.0 <= r["eval/ema/fewshot/demo/5shot"] <= 1.0
        assert r["eval/ema/loss"] != r["eval/loss"]  # another model: the average of six steps' weights
        assert 0.0 <= r["eval/fewshot/demo/12shot"] <= 1.0 and 0.0 <= r["eval/knn/demo/100nn"] <= 1.0
    # what those two numbers are is said once, at the first evaluation
    short = [x for x in err if "in-training few-shot demo:" in x or "in-training kNN demo:" in x]
    assert len(short) == 2, err[-40:]
    assert "12-shot asks for more examples than class 0 has (10)" in short[0] and "10 at the least" in short[0]
    assert "k=100 asks for more neighbours than the 60 training images" in short[1]
    # training did not notice: the same losses, bit for bit, with and without evaluation
    train_on = [(r["step"], r["loss"]) for r in on if "loss" in r]
    train_off = [(r["step"], r["loss"]) for r in off if "loss" in r]
    assert train_on == train_off and len(train_on) == 6


def test_a_corrupt_validation_image_is_skipped_and_counted_at_each_evaluation(tiny_run, val, tmp_path, shard_kit):
    """One validation image that does not decode: each evaluation scores the other 74 and says why
    one is missing, in its own record (1 per pass, not the passes' running total)."""
    root = tmp_path / "val-bad"
    shutil.copytree(val.parent, root)
    manifest = json.loads(val.read_text())
    first = manifest["shards"][0]
    with tarfile.open(root / first["name"]) as t:
        samples: dict = {}
        for m in t:
            key, ext = m.name.split(".", 1)
            samples.setdefault(key, {})[ext] = t.extractfile(m).read()
    key = next(iter(samples))
    samples[key]["jpg"] = b"not a jpeg at all"
    shard_kit.write_tar(root / first["name"], list(samples.items()))
    first["bytes"] = (root / first["name"]).stat().st_size
    (root / "manifest.json").write_text(json.dumps(manifest))
    evals = [r for r in records(six_steps(tiny_run, root / "manifest.json", "validation.every_steps=3",
                                          "data.max_corrupt_rate=0.1")) if "eval/loss" in r]
    assert [(r["step"], r["eval/samples"], r["eval/data/corrupt_image"]) for r in evals] == [(3, 74, 1), (6, 74, 1)]
    assert not [k for r in evals for k in r if "/data/" in k and k != "eval/data/corrupt_image"], evals


def test_two_ranks_zero3_evaluate_every_val_sample_once(tiny_run, val, held_out):
    job = six_steps(tiny_run, val, "zero.stage=3", "validation.every_steps=3",
                    f"validation.fewshot_suites=[{held_out}]", "validation.fewshot_shots=[1]",
                    "validation.fewshot_seeds=1", f"validation.knn_suites=[{held_out}]", "validation.knn_k=[10]",
                    "train.ema_decay=0.5", via="deepspeed", ranks=2)
    evals = [x for x in records(job) if "eval/loss" in x]
    assert [x["step"] for x in evals] == [3, 6]
    assert all(x["eval/samples"] == 75 and "eval/fewshot/demo/1shot" in x and "eval/knn/demo/10nn" in x
               for x in evals)
    # the EMA, each rank's partition swapped into ZeRO-3's partitions: every sample once too
    assert all(x["eval/ema/samples"] == 75 and "eval/ema/fewshot/demo/1shot" in x for x in evals)
    assert all(x["eval/ema/loss"] != x["eval/loss"] for x in evals)


def test_a_run_reaching_its_target_records_what_it_took_and_ends_there(tiny_run, val):
    """Time to accuracy (validation.target_metric, validation.stop_at_target): the first evaluation that
    reaches the target is recorded with its step, device-hours and images, in summary.json and the
    checkpoint; two ranks end there together (rank 0 alone holds the metrics), off a log step, with a
    checkpoint and exit 0; started again, the run trains nothing."""
    job = six_steps(tiny_run, val, "validation.every_steps=3", "validation.target_metric=eval/loss",
                    "validation.target_value=100", "validation.stop_at_target=true", "train.log_every_steps=2",
                    "logging.wandb.mode=offline", via="deepspeed", ranks=2)
    err: list[str] = []
    recs = records(job, err)
    assert max(r["step"] for r in recs) == 3, recs
    summary = json.loads((job.run_dir / "summary.json").read_text())
    reached = summary["target_reached"]
    assert (reached["metric"], reached["value"], reached["step"], reached["images_seen"]) == ("eval/loss", 100, 3, 48)
    evaluated = next(r for r in recs if "eval/loss" in r)
    assert reached["measured"] == evaluated["eval/loss"] <= 100 and not summary["preempted"]
    hours = (evaluated["device_hours"], reached["device_hours"], summary["device_seconds"] / 3600)
    assert hours == tuple(sorted(hours)), (evaluated, summary)  # the evaluation counted, the save after it not
    ckpt = job.run_dir / "checkpoints" / "step_00000003"
    assert json.loads((ckpt / "run.json").read_text())["target_reached"] == reached
    assert any(x.startswith(f"vit-train: target reached: eval/loss {reached['measured']:.4g} <= 100 at step 3 after ")
               and "; the run ends here (validation.stop_at_target)" in x for x in err), err[-20:]
    assert err[-1].startswith("vit-train: done at step 3 after ") and "; eval/loss <= 100 reached at step 3 " in err[-1]
    # the progress line of the steps up to the target forecasts no time left: the run ends there
    line = next(x for x in err if x.startswith("step 3/6 "))
    assert "eta=" not in line and "device-hours in all" not in line, line
    assert json.loads((job.run_dir / "status.json").read_text())["state"] == "completed"
    # a column of the W&B runs table, to sort runs by what they took to get there
    summary = wandb_history(next((job.run_dir / "wandb").glob("offline-run-*")), "target/step", kind="summary")
    assert {k: summary.get(f"target/{k}") for k in reached} == reached, summary
    again: list[str] = []
    assert len(records(job, again)) == len(recs)  # nothing trained, nothing logged
    assert any("the run reached its target at step 3 (validation.stop_at_target): no step left to train" in x
               for x in again), again[-20:]
    assert json.loads((job.run_dir / "summary.json").read_text())["target_reached"] == reached
