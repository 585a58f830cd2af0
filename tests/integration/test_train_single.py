"""`python -m pretrain.train` as one process: guard rails and one-line errors."""

import json
import re

import pytest
from dist_utils import TINY_MODEL, job_env, metrics, train_single


def train(shards, run_dir, *extra, fault=None, timeout=240):
    env = job_env(**({"VITSCALE_FAULT": fault} if fault else {}))
    return train_single(shards, run_dir, *extra, env=env, timeout=timeout)


@pytest.mark.parametrize("stage", [0, 3])  # ZeRO-3: the gradient gate works on partitioned parameters
def test_nonfinite_loss_is_skipped_and_counted(shards, tmp_path, stage):
    r = train(shards, tmp_path / "run", "train.steps=5", "train.log_every_steps=1", "checkpoint.every_steps=5",
              f"zero.stage={stage}", fault="nan_loss:3,3,5")
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(tmp_path / "run")
    # Both micro-batches of step 3 were dropped (zero gradients, decided on the device without a
    # host sync) and the step counted: steps are no longer redone with the next batches, which
    # would need the host to know the verdict inside the step (see NonFiniteGuard).
    assert sorted(m) == [1, 2, 3, 4, 5]
    assert m[2]["nonfinite_skipped"] == 0 and m[3]["nonfinite_skipped"] == 2 and m[5]["nonfinite_skipped"] == 3
    assert m[3]["loss"] is None  # no finite micro-batch in that log window: no loss to report
    # step 5 drops its first micro-batch and keeps the second: its loss is that one's, not NaN
    assert m[5]["loss"] is not None and m[5]["loss"] == m[5]["loss"], m[5]
    assert all(v["loss"] == v["loss"] for v in m.values())  # no NaN reached the weights or the log
    assert all(v["grad_norm"] is None or v["grad_norm"] == v["grad_norm"] for v in m.values())


def test_a_checkpoint_save_is_not_in_the_next_windows_throughput(shards, tmp_path):
    """The save of step 4 holds rank 0 for STALL_S seconds (a test fault inside the save): steps 5-8
    took far less than that, and their window says so; the save's seconds are in the run's summary."""
    from pretrain.resilience.faults import STALL_S

    r = train(shards, tmp_path / "run", "train.steps=8", "train.log_every_steps=4", "checkpoint.every_steps=4",
              "zero.stage=1", fault="stall_in_save:4@0")
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(tmp_path / "run")
    window = 4 * m[8]["examples_seen"] / 8 / m[8]["images_per_sec"]  # seconds of steps 5-8 by the log
    assert window < STALL_S / 2, (window, m[8])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["checkpoint_blocked_seconds"][0] >= STALL_S, summary


def test_each_record_logs_the_lr_its_last_step_used(shards, tmp_path):
    """Step s steps with the schedule's value after s - 1 steps: a record logs its last step's, not
    the one the schedule moved on to after it (in warm-up, a step's worth higher)."""
    from dist_utils import TINY_CONFIG, TinyRun

    from pretrain.config import load_config
    from pretrain.distributed.schedule import lr_multiplier

    run, extra = tmp_path / "run", ("train.steps=8", "train.log_every_steps=4")
    assert train(shards, run, *extra).returncode == 0
    m = metrics(run)
    o = load_config(TINY_CONFIG, TinyRun(shards, run, extra).overrides()).optim
    used = lr_multiplier(o.schedule, o.warmup_steps, 8, o.min_lr / o.lr)
    assert [m[s]["lr"] for s in (4, 8)] == pytest.approx([o.lr * used(s - 1) for s in (4, 8)], rel=1e-6)


def test_a_stop_logs_the_steps_since_the_last_record(shards, tmp_path):
    """A stop seen at step 3 (a sync point, train.sync_every_steps=3, before the first log step)
    logs steps 1-3 before its checkpoint, so the resumed run's records (4: one step, 8: four)
    leave no step out; the windows holding an invocation's first step say so."""
    import os
    import time

    from pretrain.checkpointing.rundir import RunDir

    run = tmp_path / "run"
    extra = ("train.steps=8", "train.log_every_steps=4", "train.sync_every_steps=3", "checkpoint.every_steps=100")
    request = RunDir.of(str(run), None).stop_request
    request.parent.mkdir(parents=True)
    request.write_text("maintenance\n")
    later = time.time() + 3600  # newer than the job's start: it asks this job to stop
    os.utime(request, (later, later))
    stopped = train(shards, run, *extra)
    assert stopped.returncode == 75 and "stopped (maintenance) at step 3" in stopped.stderr, stopped.stderr[-3000:]
    assert sorted(metrics(run)) == [3], metrics(run)
    assert json.loads((run / "summary.json").read_text())["losses"] == [metrics(run)[3]["loss"]]
    request.unlink()
    assert train(shards, run, *extra).returncode == 0
    m = metrics(run)
    assert sorted(m) == [3, 4, 8]
    assert [m[s]["window_steps"] for s in (3, 4, 8)] == [3, 1, 4]
    assert [m[s]["cold_steps"] for s in (3, 4, 8)] == [1, 1, 0]  # a start's, a resume's first step, none
    assert [m[s]["examples_seen"] for s in (3, 4, 8)] == [3 * 16, 4 * 16, 8 * 16]


def test_each_checkpoint_counts_what_the_invocations_before_it_did_and_cost(shards, tmp_path):
    """run.json's device_seconds (devices x wall-clock of every invocation up to that step),
    images_seen and model_flops, carried over resumes, one of them with another global batch;
    summary.json's are the newest checkpoint's, the metrics' device_hours the run's so far; summary.json's and
    status.json's device_seconds_spent add the work a failed invocation lost; the model card of an
    exported step says that step's own figures, not the last invocation's, nor step x today's
    global batch."""
    import time

    from pretrain.weights import hf
    from pretrain.weights.export import find_checkpoint, run_info

    def saved(step):
        return json.loads((tmp_path / "run" / "checkpoints" / f"step_{step:08d}" / "run.json").read_text())

    t0 = time.time()  # the first invocation fails in step 3, after step 2's checkpoint: its step 3 is lost
    crashed = train(shards, tmp_path / "run", "train.steps=4", "checkpoint.every_steps=2", "train.log_every_steps=2",
                    fault="crash_in_step:3")
    first = time.time() - t0
    assert crashed.returncode != 0
    # the progress line: the step of how many, the cost so far, the time left and the cost at the end
    line = next(ln for ln in crashed.stderr.splitlines() if ln.startswith("step 2/4 "))
    assert re.search(r" device_hours=[0-9.e-]+ eta=[0-9.]+[smhd] \(~[0-9.e-]+ device-hours in all\)$", line), line
    two = saved(2)["device_seconds"]
    failed = json.loads((tmp_path / "run" / "status.json").read_text())
    assert 0 < two < failed["device_seconds_spent"] < first and failed["state"] == "failed", (two, failed, first)
    # from the process's start: the interpreter's and the imports' seconds (about 2 of a tiny run's 3) too
    assert failed["device_seconds_spent"] > 0.75 * first, (failed["device_seconds_spent"] / first)
    t0 = time.time()
    assert train(shards, tmp_path / "run", "train.steps=4", "checkpoint.every_steps=2").returncode == 0
    second = time.time() - t0
    four = saved(4)["device_seconds"]
    assert two < four < two + second and saved(2)["device_seconds"] == two, (two, four, second)
    # summary.json's is what led to the newest checkpoint: the figure an export of it says
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["device_seconds"] == four
    info = run_info(find_checkpoint(tmp_path / "run", 2))
    prep = {"mean": (0.5,) * 3, "std": (0.5,) * 3, "crop_pct": 0.875}
    card = hf.model_card(info["config"], 2, [], None, tmp_path / "run", 1000, prep,
                         totals={k: info[k] for k in ("device_seconds", "images_seen", "model_flops")})
    assert (f"| Device-hours | {two / 3600:.3g} (devices x wall-clock of every invocation up to step 2, start-up, "
            "evaluations and saves included) |") in card, card
    # the global batch halved on a resume (steps 5-6 of 8 images): images and FLOPs of each step as it ran
    assert train(shards, tmp_path / "run", "train.steps=6", "checkpoint.every_steps=2", "train.global_batch_size=8",
                 "train.micro_batch_size=8").returncode == 0
    six, m = saved(6), metrics(tmp_path / "run")
    per_image = saved(4)["model_flops"] / saved(4)["images_seen"]
    assert (saved(4)["images_seen"], six["images_seen"], m[6]["examples_seen"]) == (64, 80, 80)
    assert six["model_flops"] == pytest.approx(per_image * 80)
    # the metrics' device-hours: the same running total, each logged just before its step's save
    secs = {s: r["device_hours"] * 3600 for s, r in m.items() if s % 2 == 0}
    assert secs[2] <= two < secs[4] <= four < secs[6] <= six["device_seconds"], (secs, two, four, six)
    # what the run spent: what led to its checkpoint, and the failed invocation's work past step 2
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    lost = summary["device_seconds_spent"] - summary["device_seconds"]
    assert lost == pytest.approx(failed["device_seconds_spent"] - two, abs=0.05), (summary, failed, two)
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["state"] == "completed" and status["device_seconds_spent"] >= summary["device_seconds_spent"]
    info = run_info(find_checkpoint(tmp_path / "run", 6))
    card = hf.model_card(info["config"], 6, [], None, tmp_path / "run", 1000, prep,
                         totals={k: info[k] for k in ("device_seconds", "images_seen", "model_flops")})
    assert "| Images seen | 80 (over 6 steps; the global batch, now 8, changed on a resume) |" in card, card
    assert f"| Compute | {per_image * 80 / 1e18:.3g} exaFLOPs (the model FLOPs of every step" in card, card
    # an invocation that fails in start-up (its shards gone) spent its start-up too, and says so
    (tmp_path / "gone").mkdir()
    gone = train(shards, tmp_path / "run", "train.steps=8", f"data.train_shards={tmp_path / 'gone'}")
    assert gone.returncode == 2 and "manifest not found (data.train_shards)" in gone.stderr, gone.stderr[-2000:]
    after = json.loads((tmp_path / "run" / "status.json").read_text())
    assert (after["state"], after["step"], after["exit_code"]) == ("failed", 6, 2), after
    assert after["device_seconds_spent"] > status["device_seconds_spent"], (after, status)


def test_startup_says_what_it_is_doing(shards, tmp_path):
    """Start-up takes 10-90 s: rank 0 says each phase (stderr), and the last line gives the final
    step, the checkpoint and the export command."""
    r = train(shards, tmp_path / "run", "train.steps=2", "train.log_every_steps=5", "zero.stage=1")
    assert r.returncode == 0, r.stderr[-3000:]
    phases = [f"vit-train: building {TINY_MODEL} (64 px) on 1 rank(s) [",
              "vit-train: DeepSpeed init: ZeRO-1, fp32, 0.3M parameters [",
              "vit-train: data.decode_device=worker: JPEGs decoded by this process (data.workers=0): ",
              "vit-train: waiting for the first batch (data.workers=0) [",
              "vit-train: step 1 done; a line every 5 steps ["]
    at = [r.stderr.find(p) for p in phases]
    assert -1 not in at and at == sorted(at), r.stderr[-3000:]
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    hours = json.loads((tmp_path / "run" / "summary.json").read_text())["device_seconds"] / 3600
    assert r.stderr.strip().splitlines()[-1] == (f"vit-train: done at step 2 after {hours:.3g} device-hours: "
                                                 f"checkpoint {ckpt}; export with: "
                                                 f"python -m pretrain.export {tmp_path / 'run'} OUT.safetensors")
    again = train(shards, tmp_path / "run", "train.steps=3", "train.log_every_steps=5", "zero.stage=1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"vit-train: resuming: verifying and loading the newest checkpoint in {ckpt.parent} [" in again.stderr
    # started again below its checkpoint's step: said, not "waiting for the first batch"
    past = train(shards, tmp_path / "run", "train.steps=2", "train.log_every_steps=5", "zero.stage=1")
    assert past.returncode == 0 and "waiting for the first batch" not in past.stderr, past.stderr[-3000:]
    assert "vit-train: the checkpoint is at step 3, train.steps=2: no step left to train [" in past.stderr
    # what led to the checkpoint is its own count: the invocation that trained nothing is spent, not kept
    three = json.loads((ckpt.parent / "step_00000003" / "run.json").read_text())["device_seconds"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["device_seconds"] == three < summary["device_seconds_spent"], (three, summary)
    assert past.stderr.strip().splitlines()[-1].startswith(f"vit-train: done at step 3 after {three / 3600:.3g} "
                                                           "device-hours"), past.stderr[-3000:]


@pytest.mark.parametrize("device, decoder", [
    ("cpu", "libjpeg-turbo on the CPU (torchvision's decode_jpeg)"),
    ("dali", "DALI "),
])
def test_startup_says_which_decode_path_runs(shards, tmp_path, device, decoder):
    """With data.decode_device cpu or dali the training process decodes the JPEGs, not the workers:
    the start-up line said only what the workers would have used."""
    r = train(shards, tmp_path / "run", "train.steps=1", "zero.stage=1", f"data.decode_device={device}",
              "data.workers=1")
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stderr.splitlines() if "decode" in ln and ln.startswith("vit-train: data.")]
    assert len(line) == 1, r.stderr[-3000:]
    assert line[0].startswith(f"vit-train: data.decode_device={device}: JPEGs decoded in this process by {decoder}")
    assert "other images (PNG, progressive JPEG, ...) by 1 data worker(s) with PIL" in line[0]


def test_nonfinite_in_a_row_stops_naming_steps(shards, tmp_path):
    """Step 2's two micro-batches and step 3's first: three in a row. The verdict is read at the
    next sync point (the last step here, log_every_steps=10), before its checkpoint."""
    r = train(shards, tmp_path / "run", "train.steps=5", "train.max_nonfinite_steps=3", "zero.stage=1",
              fault="nan_loss:2,2,3")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines[-1] == "vit-train: error: 3 non-finite losses in a row at steps 2-3; lower optim.lr or check the data"
    assert not (tmp_path / "run" / "checkpoints" / "step_00000005").exists()
    status = json.loads((tmp_path / "run" / "status.json").read_text())  # the process's own code
    assert status["state"] == "failed" and status["exit_code"] == r.returncode == 2, status


def test_a_crash_before_the_first_checkpoint_then_a_fresh_start_logs_each_step_once(shards, tmp_path):
    """The same command after a crash at step 5 with no checkpoint yet starts from scratch: the
    crashed attempt's records are kept beside as metrics.1.jsonl, metrics.jsonl holds steps 1-8 once."""
    run = tmp_path / "run"
    args = ("train.steps=8", "train.log_every_steps=1", "checkpoint.every_steps=100")
    crashed = train(shards, run, *args, fault="crash_in_step:5")
    assert crashed.returncode == 1, crashed.stderr[-3000:]
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 1 and status["step"] == 4, status
    again = train(shards, run, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9)), steps
    kept = [json.loads(ln)["step"] for ln in (run / "metrics.1.jsonl").read_text().splitlines()]
    assert kept == [1, 2, 3, 4], kept
    assert "metrics.1.jsonl" in again.stderr
    assert json.loads((run / "status.json").read_text())["exit_code"] == 0


@pytest.mark.parametrize("override, needle", [
    ("model.num_classes=7", "manifest.json lists 10 classes; set model.num_classes=10"),
    ("data.train_shards=/nonexistent/manifest.json", "/nonexistent"),
    ("train.micro_batch_size=5", "train.global_batch_size"),
    ("deepspeed.gradient_clipping=0.5", "deepspeed.gradient_clipping=0.5 contradicts 1.0, which vitscale sets from "
                                        "optim.grad_clip: change that instead"),
])
def test_user_errors_are_one_line(shards, tmp_path, override, needle):
    r = train(shards, tmp_path / "run", "train.steps=2", override)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("vit-train: error:") and needle in last, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    if override.startswith(("model.num_classes", "data.")):  # the shards are read before the model is built
        assert "building " not in r.stderr and "DeepSpeed init" not in r.stderr, r.stderr[-2000:]


def test_validation_shards_of_other_classes_are_one_line_before_the_model(shards, tmp_path, shard_kit):
    """Validation labels index the training head: val shards written with another class list would score
    every sample against another class; vit-train says so, from the manifests, before it builds anything."""
    sample = ("000000", {"jpg": shard_kit.image_bytes(), "cls": b"0"})
    val = shard_kit.make_shards(tmp_path / "val", [[sample]], ["a", "b"], prefix="val")
    r = train(shards, tmp_path / "run", "train.steps=2", f"data.val_shards={val}/manifest.json",
              "validation.every_steps=1")
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"vit-train: error: data.val_shards: {val}/manifest.json lists 2 classes against the "
                           f"10 of {shards}"), r.stderr[-2000:]
    assert "building " not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_multi_label_shards_read_single_label_are_one_line_before_the_model(tmp_path, shard_kit):
    """Multi-label shards also hold each sample's first label as .cls: with data.multi_label=false
    (the default) the run would train on it alone, without a word."""
    samples = [(f"{i:06d}", {"jpg": shard_kit.image_bytes(), "cls": b"0", "json": b'{"labels": [0, 2]}'})
               for i in range(16)]
    multi = shard_kit.make_shards(tmp_path / "multi", [samples], [f"c{i}" for i in range(10)], multi_label=True)
    r = train(multi, tmp_path / "run", "train.steps=2")
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last == (f"vit-train: error: data.multi_label=false but {multi}/manifest.json holds multi-label samples, "
                    "of which it would train on each one's first label alone; set data.multi_label=true"), last
    assert "building " not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_the_deepspeed_section_reaches_deepspeed(shards, tmp_path):
    """A key of ``deepspeed:`` that no section of ours covers is in the config DeepSpeed runs with:
    its flops profiler reports at step 1."""
    r = train(shards, tmp_path / "run", "train.steps=2",
              'deepspeed.flops_profiler={"enabled": true, "profile_step": 1, "top_modules": 1, "detailed": false}')
    assert r.returncode == 0, r.stderr[-3000:]
    assert "DeepSpeed Flops Profiler" in r.stdout + r.stderr


def test_each_record_logs_the_epoch_of_the_data_position(demo_shards, tmp_path):
    """204 images as batches of 8: 25 batches an epoch and 4 dropped for balance, so epoch 0 ends
    inside step 13 and epoch 1 with step 25. Each record's ``epoch`` is the loader's epoch after the
    step (from the sample log: the epoch of the next sample) plus the share of the 204 positions
    consumed in it; with data.repeat_augment the copies count, as the loader's epochs count them."""
    from collections import Counter

    run = tmp_path / "run"
    r = train(demo_shards(204, 51), run, "train.steps=26", "train.log_every_steps=1", "checkpoint.every_steps=100",
              "data.record_samples=true", "data.repeat_augment=2")
    assert r.returncode == 0, r.stderr[-3000:]
    m = metrics(run)
    lines = [line.split("\t") for line in (run / "samples" / "rank-0.tsv").read_text().splitlines()]
    consumed, expected = Counter(), {}
    for i, (step, epoch, _key) in enumerate(lines):
        consumed[int(epoch)] += 1
        last_of_step = i + 1 == len(lines) or lines[i + 1][0] != step
        if last_of_step:
            after = int(lines[i + 1][1]) if i + 1 < len(lines) else int(epoch)  # the loader's epoch after the step
            expected[int(step)] = after + (consumed[after] / 204 if after == int(epoch) else 0.0)
    assert sorted(m) == sorted(expected) == list(range(1, 27))
    assert [m[s]["epoch"] for s in m] == pytest.approx([expected[s] for s in m], abs=1e-12)
    assert m[12]["epoch"] == pytest.approx(192 / 204) and m[13]["epoch"] == pytest.approx(1 + 8 / 204)
    assert m[25]["epoch"] == 2.0 and m[26]["epoch"] == pytest.approx(2 + 16 / 204)
