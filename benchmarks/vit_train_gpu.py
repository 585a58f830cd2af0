"""vit-train's own training path on one GPU, lever by lever, beside the plan's prediction.

    python benchmarks/vit_train_gpu.py --output runs/vit-train-gpu          # one H100 / H200: <= 500 s
    python benchmarks/vit_train_gpu.py --smoke --output /tmp/vt             # toy sizes on a CPU

Each row is a whole ``pretrain.train.run`` (the DeepSpeed engine, the loop, the non-finite guard,
metrics.jsonl, a checkpoint at the end) on a shipped config with ``data.synthetic`` (random batches
made on the GPU: the step without the input pipeline) and one lever changed from the row before:

  ViT-L/16  shipped   the shipped config as it was: every block checkpointed, eager, 5e8 buckets
            no-ckpt   no activation checkpointing (what ``auto`` chooses for L/16 on 80 GB)
            model     ``train.compile: model`` with ``auto`` buckets; its step 14 recorded by
                      ``logging.profile`` (that window left out of its img/s): the device's busy share
                      and top ops on vit-train's own path, beside the plain step's
            micro128  the same at micro batch 128, profiled as the model row: measured at 1.44x its
                      img/s where the plan expects 1.03x, so the two profiles say whether the device
                      waits at micro 64
            blocks    the no-ckpt row with ``train.compile: blocks``, one lever from it (its 5e8
                      buckets kept: ``auto`` buckets would reduce during the backward, which neither
                      that row nor the whole-model compile does on one GPU), its step 14 profiled as
                      micro128's
            schedule  the best levers on fewer tokens: ``train.resolution_schedule`` 128 px (micro 128),
                      192 px, 224 px, a third of the steps each; img/s per phase, each phase's windows
                      read from its metrics.jsonl by ``img_size`` (the first of each phase left out:
                      the loader restarts and compile traces the new shape), beside the plan's
                      prediction for that phase (``pretrain.perf.perfmodel.price_tokens``)
  ViT-B/16, ViT-H/14  the best L/16 levers (H/14 at its config's ZeRO-2, micro 32)
  plain     the best plain PyTorch step of the same L/16 job at micro 128: the config's model (its
            classes, its dropout), its loss and targets, ``torch.compile`` of the model, bf16
            autocast, fused AdamW; no DeepSpeed, no loop, no guard: the reference vit-train's MFU
            is held against
            One more step of it runs under ``torch.profiler``: the device's busy share, the
            attention backend ``F.scaled_dot_product_attention`` chose (flash, cuDNN, memory-
            efficient) and the ops with the most device time
  no-dropout  the micro 128 row with ``model.drop_rate=0``: what the recipe's dropout (0.1 in the
            ViT paper's ImageNet-21k recipe) costs the step, apart from what the engine costs
  selective  the micro 128 row with ``train.activation_checkpointing: selective``: what op-level
            checkpointing costs in time and saves in peak memory (last: a lever for runs that do
            not fit, not for this one)
  no-overlap  the model row (micro 64) with ``zero.overlap_comm: false``: with overlap DeepSpeed's
            ZeRO-2 synchronises the device at the end of every micro-step's backward
            (``independent_gradient_partition_epilogue``), and a whole-model compile returns every
            gradient at the end of its backward, so there is nothing to overlap on one GPU

Each row's process runs under ``TORCH_LOGS=recompiles,graph_breaks``: its recompiles, graph breaks and
whether a function hit dynamo's recompile limit (eager from there on) are counted from its log into
the row and said under the table (the compiled rows' speed depends on them: the ``blocks`` row, say).

Every run accumulates ``ACCUMULATION`` micro-batches per optimizer step (on a cluster the optimizer
step is a 1/N shard; on one GPU it is the whole model, so some accumulation keeps it from being a
larger share of the step than it is in a job). Throughput is the median of the logging windows
after the first (compile and warm-up). A row that fails records its error; rows past the time
budget are recorded as skipped. ``vit_train_gpu.json`` gets one row per model and lever (model,
device, path, levers, img_per_s, mfu, hfu, peak_gb, predicted_img_per_s, predicted_mfu); the last
lines printed are a Markdown table (``benchmarks/results/``).

Sync points: vit-train's own (``pretrain.observability.clock.synced_now`` at each log step); the
plain reference is timed the same way, in windows of ``log_every`` steps with ``synced_now`` at each
end, so the ratio of the two compares like with like.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

T_START = time.perf_counter()

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

ACCUMULATION = 4
SHORT = {"vit_tiny_patch16_224": "ViT-Ti/16", "vit_base_patch16_224": "ViT-B/16",
         "vit_large_patch16_224": "ViT-L/16", "vit_huge_patch14_224": "ViT-H/14"}


PLAIN = "torch.compile model, bf16 autocast, fused AdamW"
# data.synthetic makes its batches on the GPU: the prediction leaves the loaders' rate out
SYNTHETIC_RATE = 1e9


@dataclasses.dataclass
class Row:
    model: str  # shipped config file under configs/ (the plain row: a model name)
    lever: str
    overrides: tuple  # dotted overrides (the plain row: micro batch, image size)
    levers: str  # in words, for the table
    steps: int = 0  # the row's own step count (0: the run settings')
    profile_step: int = 0  # a step recorded by logging.profile (its window left out of the img/s)


# ViT-L/16's schedule row: three phases of 8 steps (two logging windows each), the first at micro 128
SCHEDULE = "train.resolution_schedule=[[0,128,128],[0.34,192],[0.67,224]]"


def plan_rows(smoke: bool) -> tuple[list[Row], dict]:
    """The rows in the order they run (most important first: the budget cuts from the end) and the
    run settings."""
    if smoke:
        toy = ("model.img_size=64", "model.num_classes=10", "train.micro_batch_size=4")
        rows = [Row("tiny_cpu", "shipped", toy + ("train.activation_checkpointing=true", "train.compile=false",
                                                  "zero.reduce_bucket_size=500000000"), "checkpoint all, eager"),
                Row("tiny_cpu", "no-ckpt", toy + ("train.activation_checkpointing=auto",
                                                  "zero.reduce_bucket_size=auto"), "auto checkpointing, auto buckets",
                    profile_step=3),
                # two steps a phase: one window each, within the smoke's budget on 2 cores
                Row("tiny_cpu", "schedule", toy + ("train.resolution_schedule=[[0,32,8],[0.34,48],[0.67,64]]",),
                    "32 px (micro 8) / 48 / 64 px", steps=6),
                Row("tiny_cpu", "plain", toy, PLAIN)]
        # inductor's C++ build takes minutes on 2 cores: the smoke leaves train.compile to
        # tests/integration/test_compile.py and traces the plain reference with aot_eager
        return rows, {"steps": 4, "log_every": 2, "budget_s": 600.0, "row_min_s": 60.0}
    L, B, H = "vit_l16_in21k", "vit_b16_in1k", "vit_h14_jft"
    best = ("train.activation_checkpointing=auto", "train.compile=model", "zero.reduce_bucket_size=auto")
    rows = [
        Row(L, "shipped", ("train.activation_checkpointing=true", "train.compile=false",
                           "zero.reduce_bucket_size=500000000"), "checkpoint every block, eager, 5e8 buckets"),
        Row(L, "no-ckpt", ("train.activation_checkpointing=false", "train.compile=false",
                           "zero.reduce_bucket_size=500000000"), "no checkpointing, eager"),
        Row(L, "model", best, "no checkpointing (auto), compile model, auto buckets", profile_step=14),
        # the model row's graph again (inductor's cache): the cheapest row after it
        Row(L, "no-overlap", best + ("zero.overlap_comm=false",), "the model row without zero.overlap_comm"),
        # profiled as the model row: where vit-train's step loses to the plain one, and to itself at micro 64
        Row(L, "micro128", best + ("train.micro_batch_size=128",), "the model row at micro batch 128",
            profile_step=14),
        Row(L, "plain", ("train.micro_batch_size=128",), PLAIN),
        Row(L, "no-dropout", best + ("train.micro_batch_size=128", "model.drop_rate=0.0"),
            "the micro128 row without dropout (model.drop_rate=0)"),
        # profiled too: compiled blocks measured slower than eager through the engine, 1.20x faster plain.
        # After the rows that part vit-train's step from the plain one, ahead of B/16 and H/14, which no
        # L/16 row depends on: at the row times in benchmarks/results/vit-train-h200.json (30-100 s a
        # row, most of it compile; no-overlap reuses the model row's compiled graph) the rows up to here
        # take about 470 s of the 500 on one H200; what is left is run with --only
        Row(L, "blocks", ("train.activation_checkpointing=false", "train.compile=blocks",
                          "zero.reduce_bucket_size=500000000"), "the no-ckpt row with compile blocks",
            profile_step=14),
        Row(B, "model", best, "auto checkpointing, compile model, auto buckets"),
        Row(H, "model", best + ("train.micro_batch_size=32",),
            "ZeRO-2, micro 32, auto checkpointing, compile model, auto buckets"),
        Row(L, "schedule", best + (SCHEDULE,), "compile model, 128 px (micro 128) / 192 / 224 px", steps=24),
        Row(L, "selective", best + ("train.micro_batch_size=128", "train.activation_checkpointing=selective"),
            "the micro128 row checkpointed op by op"),
    ]
    # a row starts only with row_min_s of the budget left, and is cut at the budget's end: the whole
    # script ends within budget_s of its start
    return rows, {"steps": 16, "log_every": 4, "budget_s": 500.0, "row_min_s": 45.0}


def row_overrides(row: Row, run_dir: Path, ckpt_dir: Path, settings: dict) -> list[str]:
    """The row's overrides plus the benchmark's own: synthetic batches, the step count and logging
    windows, ``ACCUMULATION`` micro-batches per step, no W&B, checkpoints in ``ckpt_dir``."""
    from pretrain.config import load_config

    micro = load_config(ROOT / "configs" / f"{row.model}.yaml", list(row.overrides)).train.micro_batch_size
    return list(row.overrides) + [
        "data.synthetic=true", "data.workers=0", f"train.steps={row.steps or settings['steps']}",
        f"train.log_every_steps={settings['log_every']}", f"train.sync_every_steps={settings['log_every']}",
        f"train.global_batch_size={micro * ACCUMULATION}", f"train.output_dir={run_dir}", f"checkpoint.dir={ckpt_dir}",
        "checkpoint.every_steps=100000", "logging.wandb.mode=disabled", "validation.every_steps=0",
        "optim.warmup_steps=1"] + ([f"logging.profile.start_step={row.profile_step}"] if row.profile_step else [])


def device() -> tuple[str | None, float | None]:
    """(name, memory in bytes) of GPU 0 from nvidia-smi (this process never starts CUDA: each row's
    process has the device to itself); (None, None) without one."""
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None, None
    name, mib = (x.strip() for x in line.split(","))
    return name, float(mib) * 2 ** 20


def predicted(cfg, device_name: str | None, memory_bytes: float | None) -> dict:
    """What training will decide for ``auto`` on this device (``pretrain.perf.levers.resolve``, as
    ``pretrain.startup.decide_levers`` does) and the performance model's figures for that layout."""
    from pretrain.perf import levers
    from pretrain.perf.hardware import gpu_key
    from pretrain.perf.perfmodel import layout_from_config, predict

    key = gpu_key(device_name or "")
    cfg, _ = levers.resolve(cfg, 1, gpus_per_node=1, gpu=key, memory_bytes=memory_bytes)
    out = {"checkpointed_blocks": cfg.train.activation_checkpointing, "reduce_bucket_size": cfg.zero.reduce_bucket_size}
    if key is None:
        return out
    p = predict(layout_from_config(cfg, nodes=1, gpus_per_node=1, gpu=key, decode_rate=SYNTHETIC_RATE))
    return {**out, "predicted_img_per_s": p.images_per_second, "predicted_mfu": p.mfu,
            "predicted_gb": p.memory_gb_per_gpu["total"]}


def measured(metrics_file: Path) -> dict:
    lines = [json.loads(x) for x in metrics_file.read_text().splitlines() if x.strip()]
    timed = [m for m in lines if "images_per_sec" in m and "profiled_steps" not in m]  # not slowed by the profiler
    windows = timed[1:] or timed
    med = lambda k: statistics.median(w[k] for w in windows) if windows and k in windows[0] else None  # noqa: E731
    out = {"img_per_s": med("images_per_sec"), "mfu": med("mfu"), "hfu": med("hfu"),
           "tflops": med("tflops_per_device"), "peak_gb": max((w["peak_memory_gb"] for w in windows), default=None),
           "windows": len(windows)}
    sizes = sorted({m["img_size"] for m in lines if "images_per_sec" in m})
    if len(sizes) > 1:  # a resolution schedule: each phase's windows after its first
        out["phases"] = {}
        for px in sizes:
            own = [m for m in lines if m.get("img_size") == px and "images_per_sec" in m]
            steady = own[1:] or own
            out["phases"][px] = {k: statistics.median(w[k] for w in steady) if k in steady[0] else None
                                 for k in ("images_per_sec", "mfu", "tflops_per_device")} | {"windows": len(steady)}
    return out


def phase_predictions(cfg, device_name: str | None, memory_bytes: float | None) -> dict:
    """The performance model's img/s and MFU for each resolution phase of ``cfg`` on this device."""
    from pretrain.config import image_size
    from pretrain.config.phases import resolution_phases
    from pretrain.perf import levers
    from pretrain.perf.hardware import gpu_key
    from pretrain.perf.perfmodel import layout_from_config, price_tokens

    key = gpu_key(device_name or "")
    if key is None or not cfg.train.resolution_schedule:
        return {}
    cfg, _ = levers.resolve(cfg, 1, gpus_per_node=1, gpu=key, memory_bytes=memory_bytes)
    price = price_tokens(layout_from_config(cfg, nodes=1, gpus_per_node=1, gpu=key, decode_rate=SYNTHETIC_RATE),
                         resolution_phases(cfg.train, image_size(cfg.model)))
    return {r.img_size: {"predicted_img_per_s": r.prediction.images_per_second, "predicted_mfu": r.prediction.mfu,
                         "micro_batch": r.micro_batch} for r in price.phases}


def run_row(row: Row, settings: dict, scratch: Path, out_dir: Path, dev: tuple, timeout_s: float) -> dict:
    """One ``vit-train`` process (``python -m pretrain.train``), its log in ``out_dir``."""
    from pretrain.config import load_config

    run_dir, ckpt_dir = scratch / f"{row.model}-{row.lever}", scratch / f"{row.model}-{row.lever}-ckpt"
    config = ROOT / "configs" / f"{row.model}.yaml"
    overrides = row_overrides(row, run_dir, ckpt_dir, settings)
    cfg = load_config(config, overrides)
    out = {"model": SHORT.get(cfg.model.name, cfg.model.name), "config": f"configs/{row.model}.yaml",
           "lever": row.lever, "levers": row.levers, "path": "vit-train", "overrides": list(row.overrides),
           "micro_batch": cfg.train.micro_batch_size, "accumulation": ACCUMULATION, "zero": cfg.zero.stage,
           **predicted(cfg, *dev)}
    t0 = time.perf_counter()
    log = out_dir / f"{row.model}-{row.lever}.log"
    try:
        with open(log, "w") as fh:
            proc = subprocess.run([sys.executable, "-m", "pretrain.train", "--config", str(config), *overrides],
                                  cwd=ROOT, env=child_env(), stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s)
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():  # what the run measured, also when it failed later (the final save, say)
            out.update(**measured(metrics))
            shutil.copy(metrics, out_dir / f"{row.model}-{row.lever}-metrics.jsonl")
        summary = run_dir / "profile" / f"steps-{row.profile_step}-{row.profile_step}" / "rank-0.json"
        if row.profile_step and summary.exists():  # logging.profile's summary of the step
            out["profile"] = json.loads(summary.read_text())
        out["compile"] = compile_events(log.read_text(errors="replace"))
        if proc.returncode != 0:
            tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or [""]
            out.update(status="error", error=f"exit {proc.returncode}: {tail[0][:300]}")
        else:
            out["status"] = "ok"
            for px, pred in phase_predictions(cfg, *dev).items():
                out.get("phases", {}).setdefault(px, {}).update(pred)
    except subprocess.TimeoutExpired:
        out.update(status="error", error=f"past its {timeout_s:.0f} s")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    out["seconds"] = time.perf_counter() - t0
    return out


# torch.compile's own account of each row in its log: a recompile or a graph break in the step costs what
# compiling was to save, and past the recompile limit a function runs eagerly (dynamo's messages)
COMPILE_LOGS = "recompiles,graph_breaks"


def compile_events(log: str) -> dict:
    """Dynamo's recompiles and graph breaks in a log written under ``TORCH_LOGS=COMPILE_LOGS``,
    whether a function hit the recompile limit, and the first few messages (their reasons follow
    them in the log)."""
    lines = log.splitlines()
    recompiles = [ln for ln in lines if "Recompiling function" in ln]
    breaks = [ln for ln in lines if re.search(r"Graph break (\(user stack suppressed[^)]*\) )?in user code at", ln)]
    events = set(recompiles + breaks)
    said = [ln for ln in lines if ln in events]  # in the log's order
    return {"recompiles": len(recompiles), "graph_breaks": len(breaks),
            "recompile_limit_hit": any("recompile_limit" in ln or "cache_size_limit" in ln for ln in lines),
            "first": [re.sub(r"^.*?\[__\w+\] ", "", ln)[:200] for ln in said[:3]]}


def child_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    env.setdefault("TORCH_LOGS", COMPILE_LOGS)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):  # each row is a world of one of its own
        env.pop(k, None)
    return env


def plain_row(row: Row, settings: dict, out_dir: Path, smoke: bool, timeout_s: float) -> dict:
    """The plain reference in a process of its own (``--plain``), its JSON read back."""
    name = row.model
    res = out_dir / f"plain-{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--output", str(out_dir), "--plain", name,
           "--steps", str(settings["steps"]), "--log-every", str(settings["log_every"])] + [
        f"--plain-override={o}" for o in row.overrides] + (
        ["--smoke"] if smoke else [])
    t0 = time.perf_counter()
    try:
        with open(out_dir / f"plain-{name}.log", "w") as fh:
            subprocess.run(cmd, cwd=ROOT, env=child_env(), stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s)
        out = json.loads(res.read_text()) if res.exists() else {
            "model": name, "lever": "plain", "levers": PLAIN, "status": "error", "error": "no result"}
        out["compile"] = compile_events((out_dir / f"plain-{name}.log").read_text(errors="replace"))
    except subprocess.TimeoutExpired:
        out = {"model": name, "lever": "plain", "levers": PLAIN, "status": "error",
               "error": f"past its {timeout_s:.0f} s"}
    out["seconds"] = time.perf_counter() - t0
    return out


def error_text(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:300]}"


def plain_step_row(config: str, overrides: list, steps: int, log_every: int, smoke: bool) -> dict:
    """The best plain PyTorch step of the same job: the config's model as vit-train builds it (its
    classes, dropout, stochastic depth), its loss on the synthetic loader's kind of targets, at its
    micro batch and resolution; ``torch.compile`` of the whole model, bf16 autocast, fused AdamW,
    ``ACCUMULATION`` micro-batches per step. No DeepSpeed, no loader, no guard. Timed in windows of
    ``log_every`` steps, as vit-train's rows are, after two warm-up steps."""
    from pretrain.config import image_size, load_config
    from pretrain.models.arch import config_macs
    from pretrain.models.losses import classification_loss
    from pretrain.observability.clock import synced_now
    from pretrain.observability.flops import peak_tflops, train_flops_per_image
    from pretrain.weights.init_from import build_model

    cfg = load_config(ROOT / "configs" / f"{config}.yaml", list(overrides))
    m, micro, img = cfg.model, cfg.train.micro_batch_size, image_size(cfg.model)
    out = {"model": SHORT.get(m.name, m.name), "config": f"configs/{config}.yaml", "lever": "plain",
           "path": "plain PyTorch", "levers": PLAIN, "overrides": list(overrides), "micro_batch": micro,
           "accumulation": ACCUMULATION, "drop_rate": m.drop_rate, "num_classes": m.num_classes,
           "multi_label": cfg.data.multi_label}
    t0 = time.perf_counter()
    try:
        cuda = torch.cuda.is_available()
        device = torch.device("cuda" if cuda else "cpu")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        model = build_model(cfg).to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda or None)
        model.compile(backend="inductor" if cuda or not smoke else "aot_eager")
        x = torch.randn(micro, 3, img, img, device=device)
        y = torch.randint(0, m.num_classes, (micro,), device=device)
        if cfg.data.multi_label:  # as data.synthetic makes them: one class on per image
            y = torch.nn.functional.one_hot(y, m.num_classes).float()

        def step():
            for _ in range(ACCUMULATION):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    logits = model(x)
                loss = classification_loss(logits, y, multi_label=cfg.data.multi_label,
                                           smoothing=cfg.optim.label_smoothing, loss=cfg.optim.loss)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(2):
            step()
        # timed as vit-train logs: windows of log_every steps, the device synchronised once at each end
        # of a window (synced_now), not around every step; the median window
        windows = []
        for _ in range(max(3, steps // log_every - 1)):
            t = synced_now(device)
            for _ in range(log_every):
                step()
            windows.append((synced_now(device) - t) / log_every)
        out["windows"] = len(windows)
        ips = micro * ACCUMULATION / statistics.median(windows)
        out["profile"] = profile_step(step, cuda)
        flops = train_flops_per_image(config_macs(m, img))[0] * ips
        peak = peak_tflops()
        out.update(status="ok", img_per_s=ips, tflops=flops / 1e12, mfu=flops / (peak * 1e12) if peak else None,
                   peak_gb=torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        out.update(status="error", error=error_text(e))
    out["seconds"] = time.perf_counter() - t0
    return out


def profile_step(step, cuda: bool) -> dict:
    """One more step under ``torch.profiler``, summarised as vit-train's ``logging.profile`` does
    (``pretrain.observability.profile.summarize``): the share of the step the device was busy, which
    attention kernel ``F.scaled_dot_product_attention`` dispatched to (flash, cuDNN, memory-
    efficient, math), and the ops with the most device time (CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    from pretrain.observability.profile import STEP_MARK, exported_summary

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        with torch.autograd.profiler.record_function(f"{STEP_MARK}1"):
            step()
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        return exported_summary(prof, Path(d) / "trace.json", prof.key_averages(), "cuda" if cuda else "cpu")


def table(rows: list[dict]) -> str:
    from pretrain.observability.profile import summary_line

    def f(v, spec):
        return format(v, spec) if isinstance(v, (int, float)) else "-"

    lines = ["| model | lever | levers | micro | img/s | MFU | HFU | peak GB | predicted img/s | predicted MFU | s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['model']} | {r['lever']} | {r.get('levers', '')} | {r.get('micro_batch', '-')} | "
                         f"{r.get('status')}: {r.get('error', '')} | | | | | | {f(r.get('seconds'), '.0f')} |")
            continue
        lines.append(f"| {r['model']} | {r['lever']} | {r['levers']} | {r['micro_batch']} | "
                     f"{f(r['img_per_s'], ',.0f')} | {f(r.get('mfu'), '.1%')} | {f(r.get('hfu'), '.1%')} | "
                     f"{f(r.get('peak_gb'), '.1f')} | "
                     f"{f(r.get('predicted_img_per_s'), ',.0f')} | {f(r.get('predicted_mfu'), '.1%')} | "
                     f"{f(r.get('seconds'), '.0f')} |")
    for r in rows:
        if r.get("status") == "ok" and r.get("profile"):
            lines += ["", f"{r['model']} {r['lever']}, one step profiled: attention "
                      f"{', '.join(r['profile']['attention']) or 'none seen'}; {summary_line(r['profile'])}"]
    for r in rows:
        c = r.get("compile") or {}
        if c.get("recompiles") or c.get("graph_breaks") or c.get("recompile_limit_hit"):
            lines += ["", f"{r['model']} {r['lever']}: torch.compile recompiled {c['recompiles']} time(s), broke the "
                      f"graph {c['graph_breaks']} time(s)" + ("; the recompile limit was hit (eager from there)"
                                                               if c["recompile_limit_hit"] else "")
                      + "; first: " + " | ".join(c["first"])]
    for r in rows:
        if r.get("status") == "ok" and r.get("phases"):
            lines += ["", f"{r['model']} {r['lever']}, per resolution phase (its windows after the first):", "",
                      "| px | micro | img/s | MFU | predicted img/s | predicted MFU |", "|---|---|---|---|---|---|"]
            for px, p in sorted(r["phases"].items(), key=lambda kv: int(kv[0])):
                lines.append(f"| {px} | {p.get('micro_batch', '-')} | {f(p.get('images_per_sec'), ',.0f')} | "
                             f"{f(p.get('mfu'), '.1%')} | {f(p.get('predicted_img_per_s'), ',.0f')} | "
                             f"{f(p.get('predicted_mfu'), '.1%')} |")
    return "\n".join(lines)


def environment() -> dict:
    import deepspeed

    env = {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "python": sys.version.split()[0],
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", help="folder for vit_train_gpu.json, the rows' logs and metrics (not needed with "
                                     "--predict-only)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on a CPU: every code path, no meaningful figure")
    ap.add_argument("--only", default="", help="comma-separated MODEL:LEVER or LEVER names to run (default: all)")
    ap.add_argument("--predict-only", metavar="DEVICE_NAME",
                    help="print the rows with the plan's predictions for that CUDA device name (e.g. 'NVIDIA H100 "
                         "80GB HBM3', 80 GiB assumed) and run nothing")
    ap.add_argument("--plain", default="", help=argparse.SUPPRESS)  # CONFIG: the reference's own process
    ap.add_argument("--plain-override", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--log-every", type=int, default=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.output and not args.predict_only:
        ap.error("--output is required (unless --predict-only)")
    if args.plain:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        r = plain_step_row(args.plain, args.plain_override, args.steps, args.log_every, args.smoke)
        (out / f"plain-{args.plain}.json").write_text(json.dumps(r) + "\n")
        return 0
    rows, settings = plan_rows(args.smoke)
    if args.predict_only:
        from pretrain.config import load_config

        out_rows = []
        for row in rows:
            if row.lever == "plain":
                continue
            cfg = load_config(ROOT / "configs" / f"{row.model}.yaml",
                              row_overrides(row, Path("/tmp/unused"), Path("/tmp/unused"), settings))
            out_rows.append({"model": SHORT.get(cfg.model.name, cfg.model.name), "lever": row.lever,
                             "levers": row.levers, "micro_batch": cfg.train.micro_batch_size, "status": "ok",
                             "img_per_s": None, **predicted(cfg, args.predict_only, 80 * 2 ** 30)})
            phases = phase_predictions(cfg, args.predict_only, 80 * 2 ** 30)
            if phases:  # the schedule row: each phase's prediction under the table
                out_rows[-1]["phases"] = phases
        print(table(out_rows))
        return 0
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    if args.only:
        keep = set(args.only.split(","))
        rows = [r for r in rows if r.lever in keep or f"{r.model}:{r.lever}" in keep]
    dev = device()
    # run folders and checkpoints in memory where /dev/shm has room for ViT-H's (about 10 GB), else on disk
    shm = Path("/dev/shm")
    roomy = shm.is_dir() and shutil.disk_usage(shm).free > 24 * 2 ** 30
    scratch = Path(tempfile.mkdtemp(prefix="vit-train-gpu-", dir=shm if roomy else None))
    results = {"what": "vit-train's own path on one device, lever by lever", "device": dev[0] or "cpu",
               "accumulation": ACCUMULATION, "settings": settings, "rows": []}

    def save():
        (out / "vit_train_gpu.json").write_text(json.dumps(results, indent=1) + "\n")

    try:
        for row in rows:
            left = settings["budget_s"] - (time.perf_counter() - T_START)
            if left < settings["row_min_s"]:
                results["rows"].append({"model": row.model, "device": results["device"], "lever": row.lever,
                                        "levers": row.levers, "status": "skipped", "error": "time budget spent"})
                continue
            print(f"== {row.model} {row.lever}: {row.levers} ({left:.0f} s left)", flush=True)
            if row.lever == "plain":
                r = plain_row(row, settings, out, args.smoke, left)
            else:
                r = run_row(row, settings, scratch, out, dev, left)
            results["rows"].append({"device": results["device"], **r})  # each row says where it ran
            print(json.dumps(r), flush=True)
            save()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        results["seconds"] = time.perf_counter() - T_START
        results["environment"] = environment()
        save()
    print(table(results["rows"]))
    return 0 if all(r.get("status") in ("ok", "skipped") for r in results["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
