"""Pre-training through the real deepspeed runner: 2 CPU ranks, gloo, demo shards.

Each job costs ~15-25 s (process start, gloo rendezvous, DeepSpeed init), so jobs are shared
between checks where one run can prove several things.
"""
import json
import signal
from pathlib import Path

import pytest
import torch
from dist_utils import (
    TINY_MODEL,
    deepspeed_cmd,
    group_alive,
    kill_group,
    metrics,
    reaped,
    run_job,
    start_job,
    wait_for,
    wandb_records,
)

from pretrain.checkpointing import checkpoint
from pretrain.models.vit import create_model
from pretrain.weights.export import export, load_run_weights
from pretrain.weights.load import load_weights

pytestmark = pytest.mark.slow


def job(tiny_run, name, *extra, via="deepspeed"):
    """A run of these tests: 2 ranks (``via`` deepspeed) x micro-batches of 16, one data worker each,
    W&B offline."""
    return tiny_run("train.global_batch_size=32", "train.micro_batch_size=16", "data.workers=1",
                    "logging.wandb.mode=offline", *extra, name=name, via=via, ranks=2)


def assert_ok(r):
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


@pytest.mark.parametrize("stage, steps, extra", [
    (1, 20, ["train.precision=bf16"]),  # (12 steps leave test_vit's loss 0.32 lower: too close to the bound)
    (2, 20, ["train.precision=fp32"]),  # bf16 at ZeRO-2: test_reduce_dtype, test_host_sync
    # fp32: export compared tightly; steps 7-8 profiled on both ranks
    (3, 20, ["train.activation_checkpointing=true", "train.precision=fp32", "logging.profile.start_step=7",
             "logging.profile.steps=2", "logging.profile.ranks=[]"]),
])
def test_zero_stage_trains_and_reduces_loss(tiny_run, tmp_path, stage, steps, extra):
    every = steps // 4
    run = job(tiny_run, f"zero{stage}", f"zero.stage={stage}", f"train.steps={steps}",
              f"train.log_every_steps={every}", f"checkpoint.every_steps={steps}", f"optim.warmup_steps={every}",
              "optim.lr=2e-3", *extra)
    assert_ok(run.run())
    m = run.metrics()
    assert sorted(m) == list(range(every, steps + 1, every))
    first, last = m[every]["loss"], m[steps]["loss"]
    assert last < first - 0.3, f"ZeRO-{stage}: loss {first:.3f} -> {last:.3f}"
    for key in ("lr", "grad_norm", "images_per_sec", "images_per_sec_per_device", "tflops_per_device",
                "data_wait_share", "peak_memory_gb", "examples_seen", "data/samples"):
        assert key in m[steps], key
    assert m[steps]["examples_seen"] == steps * 32
    if stage == 3:
        assert m[steps]["hw_tflops_per_device"] > m[steps]["tflops_per_device"]  # recompute counted as HFU only
        check_zero3_export(run.run_dir, tmp_path)
        check_profile(run.run_dir, m)
    if stage == 1:
        check_bf16_optimizer_export(run.run_dir, tmp_path)


def check_profile(run, m):
    """logging.profile steps 7-8 on every rank: each rank's trace holds those two steps, marked, and
    ZeRO-3's parameter gathers and gradient reduce-scatters among its ops; its summary counts them;
    the one window holding them says so and is not judged for stragglers."""
    import gzip

    assert {s for s, r in m.items() if "profiled_steps" in r} == {10} and m[10]["profiled_steps"] == 2, m
    # the profiled window is no evidence for the straggler check (every rank leaves it out alike)
    assert [s for s, r in sorted(m.items()) if "straggler/ratio" in r] == [5, 15, 20], m
    for rank in (0, 1):
        folder = run / "profile" / "steps-7-8"
        with gzip.open(folder / f"rank-{rank}.json.gz", "rt") as f:
            events = json.load(f)["traceEvents"]
        marks = sorted(e["name"] for e in events if e.get("cat") == "user_annotation" and "vit-train" in e["name"])
        assert marks == ["vit-train step 7", "vit-train step 8"], marks
        ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
        assert {"aten::mm", "c10d::_allgather_base_", "c10d::_reduce_scatter_base_"} <= ops, sorted(ops)[:50]
        summary = json.loads((folder / f"rank-{rank}.json").read_text())
        assert summary["rank"] == rank and summary["steps"] == 2 and 0 < summary["busy_share"] <= 1, summary
        if rank == 0:  # rank 0's summary in the window's metrics too
            assert m[10]["profile/busy_share"] == summary["busy_share"], m[10]
            assert m[10]["profile/ms_per_step"] == summary["ms_per_step"], m[10]
        assert summary["top"] and all(not t["name"].startswith("vit-train") for t in summary["top"]), summary
        assert (folder / f"rank-{rank}.txt").read_text().count("aten::mm") >= 1


def check_bf16_optimizer_export(run, tmp_path):
    """ZeRO-1 in bf16 with fp32 accumulation is DeepSpeed's BF16_Optimizer, whose files zero_to_fp32
    cannot read: the export still gives the fp32 master weights, which round to exactly the bf16
    weights DeepSpeed saved for the module (on 2 ranks: partitions concatenated in rank order)."""
    from safetensors.torch import load_file

    from pretrain.checkpointing.rundir import latest_complete

    ckpt = latest_complete(run / "checkpoints")
    assert len(list(ckpt.glob("bf16_zero_pp_rank_*optim_states.pt"))) == 2
    out = tmp_path / "w1.safetensors"
    export(run, out)
    exported = load_file(out)
    module = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    assert set(exported) == set(module)
    for k, v in module.items():
        assert exported[k].dtype == torch.float32 and torch.equal(exported[k].to(torch.bfloat16), v), k


def check_zero3_export(run, tmp_path):
    """Export consolidates ZeRO-3 shards; its outputs equal the live sharded model's; timm loads it."""
    live = tmp_path / "live.pt"
    r = run_job(deepspeed_cmd("tests.jobs.zero3_live_outputs", str(run), str(live)))
    assert_ok(r)
    out = tmp_path / "w.safetensors"
    info = export(run, out)
    assert info["step"] == 20
    model = create_model(TINY_MODEL, img_size=64, num_classes=10).eval()
    load_weights(model, out)
    x = torch.load(live)["x"]
    with torch.no_grad():
        ours = model(x)
    torch.testing.assert_close(ours, torch.load(live)["logits"], rtol=1e-4, atol=1e-4)
    import timm
    ref = timm.create_model(TINY_MODEL, img_size=64, num_classes=10).eval()
    from safetensors.torch import load_file
    ref.load_state_dict(load_file(str(out)), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(ref(x), ours, rtol=1e-5, atol=1e-5)


def test_exact_resume_after_kills_across_resolution_phases_and_wandb_run(tiny_run, tmp_path):
    """N steps in one go == the same run stopped three ways and restarted to N: bit-identical
    exported weights and EMA of the weights (``vit-export --ema``), the same loss curve, one W&B run.

    The run has a resolution schedule (32 px micro 16, then 48 px micro 8, then 64 px micro 4: the
    global batch kept by 1, 2 and 4 accumulation steps) with patch dropout and an EMA: (1) rank 0 is
    SIGKILLed after DeepSpeed wrote step 6 but before it was marked complete (the run switched at step
    5 itself); (2) resumed from step 4, the resumed run switches to 48 px, and the whole job is
    kill -9'ed in step 8, once checkpoint 6 is complete; (3) resumed from step 6 (before the second
    switch, which the resumed run makes), it finishes. Each step at its phase's resolution."""
    common = ["zero.stage=2", "train.steps=8", "train.log_every_steps=1", "checkpoint.every_steps=2",
              "checkpoint.keep_last=5", "optim.warmup_steps=2", "train.ema_decay=0.9", "train.ema_warmup=true",
              "model.patch_drop_rate=0.5", "train.resolution_schedule=[[0,32,16],[0.5,48,8],[0.75,64,4]]"]
    straight = job(tiny_run, "straight", *common)  # the reference, beside the interrupted run
    ref, ref_log = straight.run_dir, tmp_path / "straight.log"
    reference = straight.start(ref_log)

    with reaped(reference):
        interrupted = job(tiny_run, "interrupted", *common)
        run = interrupted.run_dir
        ckpts = run / "checkpoints"
        # 1) rank 0 is SIGKILLed after DeepSpeed wrote step 6 but before it was marked complete
        r = interrupted.run(VITSCALE_FAULT="kill_in_save:6")
        assert r.returncode != 0
        assert (ckpts / "step_00000006").is_dir() and not (ckpts / "step_00000006" / "COMPLETE").exists()
        assert checkpoint.latest_complete(ckpts).name == "step_00000004"
        # 2) resumes from step 4; the whole job is kill -9'ed in step 8, once step 6 is complete
        log = tmp_path / "second.log"
        p = interrupted.start(log, VITSCALE_FAULT="hang_in_step:8")
        try:
            wait_for(lambda: (ckpts / "step_00000006" / "COMPLETE").exists(), 240, p, "checkpoint 6")
            wait_for(lambda: "step 7/8 " in log.read_text(), 120, p, "step 7")
        finally:
            kill_group(p, signal.SIGKILL)
            p.wait()
        second = log.read_text()
        assert "resuming from step 4" in second and "step 5: 48 px, micro batch 8 x 2 accumulation step(s)" in second
        # 3) resumes again and finishes
        r = interrupted.run()
        assert_ok(r)
        assert "resuming from step 6" in r.stderr and "step 7: 64 px, micro batch 4 x 4" in r.stderr, r.stderr[-3000:]

        assert reference.wait(300) == 0, ref_log.read_text()[-3000:]
    a, _ = load_run_weights(ref)
    b, info = load_run_weights(run)
    assert info["step"] == 8 and a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"
    ea, _ = load_run_weights(ref, ema=True)
    eb, _ = load_run_weights(run, ema=True)
    assert ea.keys() == a.keys() and any(not torch.equal(ea[k], a[k]) for k in a)  # the average, not the weights
    for k in ea:
        assert torch.equal(ea[k], eb[k]), f"the EMA of {k} differs after resume"
    ma, mb = metrics(ref), metrics(run)
    assert [ma[s]["loss"] for s in range(1, 9)] == [mb[s]["loss"] for s in range(1, 9)]
    assert [mb[s]["img_size"] for s in range(1, 9)] == [32] * 4 + [48] * 2 + [64] * 2
    assert [mb[s]["examples_seen"] for s in range(1, 9)] == [32 * s for s in range(1, 9)]
    # FLOPs at each step's resolution and kept tokens: 6 x the forward's multiply-adds
    from pretrain.models.arch import analytic_flops

    for s, px in ((4, 32), (6, 48), (8, 64)):
        flops = 6 * analytic_flops(TINY_MODEL, px, 10, patch_drop_rate=0.5)
        assert mb[s]["tflops_per_device"] == pytest.approx(flops * mb[s]["images_per_sec_per_device"] / 1e12)

    # the W&B offline runs: one run id across restarts, holding the logged keys
    run_id = json.loads((ckpts / "step_00000008" / "run.json").read_text())["wandb_run_id"]
    dirs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(dirs) >= 3 and all(d.name.endswith(run_id) for d in dirs)
    keys, config_keys = set(), set()
    for rec in wandb_records(next(dirs[-1].glob("*.wandb"))):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            keys |= {i.key or "/".join(i.nested_key) for i in rec.history.item}
        elif kind in ("config", "run"):
            cfg = rec.config if kind == "config" else rec.run.config
            config_keys |= {i.key for i in cfg.update}
    for k in ("train/loss", "train/lr", "train/grad_norm", "train/images_per_sec", "train/tflops_per_device",
              "train/data_wait_share", "train/step"):
        assert k in keys, (k, sorted(keys))
    assert {"world_size", "zero_stage", "global_batch_size", "model_gflops_fwd"} <= config_keys


def test_sigterm_saves_checkpoint_and_exits(tiny_run, tmp_path):
    preempt = job(tiny_run, "preempt", "zero.stage=1", "train.steps=100000", "train.log_every_steps=1",
                  "checkpoint.every_steps=100000")
    run, log = preempt.run_dir, tmp_path / "job.log"
    cmd = preempt.cmd()
    with reaped(start_job(cmd, log)) as p:
        log_file = run / "metrics.jsonl"
        wait_for(lambda: log_file.exists() and len(log_file.read_text().splitlines()) >= 2, 240, p, "two logged steps")
        # DeepSpeed's CPU shm all-reduce made a 66 MB /dev/shm file per rank; the ranks unlinked
        # them after start-up (still mapped), so no way of ending the job can leave them behind
        assert "deepspeed_shm_comm_op built successfully" in log.read_text(), log.read_text()[-2000:]
        port = cmd[cmd.index("--master_port") + 1]
        left = sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
        assert left == [], f"rank shm buffers not released: {left}"
        kill_group(p, signal.SIGTERM)  # as SLURM does on preemption: every process of the job
        wait_for(lambda: not group_alive(p), 120, None, "the job to exit after SIGTERM")
    saved = checkpoint.latest_complete(run / "checkpoints")
    assert saved is not None, log.read_text()[-3000:]
    assert 2 <= json.loads((saved / "run.json").read_text())["step"] < 100000
    assert "vit-train: stopped (SIGTERM) at step" in log.read_text()  # the one line of pretrain.resilience.lifecycle

    # the same run on another world size resumes (elastic: universal checkpoint + the data plan)
    step = json.loads((saved / "run.json").read_text())["step"]
    r = job(tiny_run, "preempt", "zero.stage=1", f"train.steps={step + 1}", via="python").run(300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "was saved on 2 rank(s), resuming on 1" in r.stderr and f"resuming from step {step}" in r.stderr
    assert f"vit-train: done at step {step + 1}" in r.stderr
