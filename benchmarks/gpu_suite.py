"""One command for the GPU figures: training speed, memory and input speed in one run.

    make bench-gpu                                            # one H100: about 8 minutes
    python benchmarks/gpu_suite.py --output runs/bench-gpu    # the same
    python benchmarks/gpu_suite.py --smoke --output /tmp/s    # toy sizes on CPU, under ~90 s

Sections, each with its own time budget (a measurement stops early when its budget is spent; the
whole suite plans 8 minutes on one H100, ``Plan.total_budget``, and ends within 9: Time, below):

  peak    the device's measured bf16 matmul TFLOP/s beside the data-sheet peak (pretrain.perf.hardware)
  model   for ViT-B/16, L/16, H/14 at 224 px, bf16 autocast, one batch per model: timm's model,
          ours eager, ours with each block compiled, ours with activation checkpointing. The four
          share the batch and alternate step by step in one process (clock, heat and other load
          hit all alike); median step time -> img/s, TFLOP/s, MFU (model FLOPs), HFU (checkpointing
          re-runs the blocks' forward) and peak memory of one model alone
  zero    ZeRO-1, ZeRO-3 and ZeRO-3 with zero.leaf_blocks=false through
          pretrain.distributed.engine.initialize (deepspeed.initialize) in a world of one (the process
          group started as pretrain.distributed.process.init_distributed does), one after the other,
          ViT-L/16, the model built as training builds it (pretrain.train.build_model)
  loader  our ShardLoader at 224 px over shards of ImageNet-like JPEGs (loader_throughput.make_images:
          500x375, ~100 KB, pre-resized to shorter side 256 as ``vit-shards --resize-shorter 256``
          writes them): decoded in the workers (data.decode_device=worker; the crop window by
          nvImageCodec where installed, as the device kit does, else PIL), then by nvJPEG
          in the training process (data.decode_device=cuda; on CPU its cpu code path), then by
          DALI's pipeline in the training process (data.decode_device=dali: its mixed decoder on a
          GPU, its CPU operators without one), with its rate over the nvJPEG row's; a machine
          without DALI (carried in parts: ``make device-kit-nvidia``) records why instead

A row that fails (out of memory, a compile error) records its error and the suite goes on. MFU is
against the data-sheet peak when the device is in pretrain.perf.hardware's table, else against the measured
matmul peak (``peak_source`` says which). Outputs: ``suite.json`` and ``suite.md`` (the tables for
benchmarks/results/gpu-suite-<gpu>.md) in ``--output``.

Sync points: every timed region starts and ends with ``pretrain.observability.clock.synced_now`` (the device
finishes its queue, then the clock is read), so that the clock measures finished GPU work; that
costs the overlap of one step with the next (a few per cent at most for steps of 100+ ms).

Time: the budget counts from the start of the process (imports and CUDA start-up included) and
plans 8 minutes, so that the suite ends within 9 even when a compile overruns its group's budget
(by 30 s at most) and fits in a 10-minute command with the device kit's install before it
(``benchmarks/device_run.sh``). ``suite.json`` is written after every part.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

T_START = time.perf_counter()  # the suite's clock starts with the process (imports count)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # loader_throughput's image maker

from pretrain.observability.clock import synced_now  # noqa: E402  (drains the device queue, then reads the clock)

GIB = 1024 ** 3
SHORT = {"vit_tiny_patch16_224": "ViT-Ti/16", "vit_small_patch16_224": "ViT-S/16", "vit_base_patch16_224": "ViT-B/16",
         "vit_large_patch16_224": "ViT-L/16", "vit_huge_patch14_224": "ViT-H/14"}


@dataclass
class Plan:
    """Sizes and time budgets (seconds) of one suite run."""
    models: list = field(default_factory=lambda: [("vit_base_patch16_224", 128, 75.0),
                                                  ("vit_large_patch16_224", 64, 90.0),
                                                  ("vit_huge_patch14_224", 32, 105.0)])  # (name, batch, budget)
    img: int = 224
    warmup: int = 2  # untimed steps per variant (the compiled one compiles in its first)
    iters: int = 20  # timed steps per variant at most (fewer when the budget runs out)
    zero_model: str = "vit_large_patch16_224"
    zero_batch: int = 64
    zero_budget: float = 100.0  # the three ZeRO rows, model builds and deepspeed.initialize included
    matmul_n: int = 8192
    matmul_budget: float = 6.0
    loader_images: int = 4096  # shard samples: loader_sources distinct JPEGs, repeated
    loader_sources: int = 256
    loader_batch: int = 128
    loader_workers: int = 8
    loader_img: int = 224
    loader_budget: float = 65.0  # shard writing included; three rows
    total_budget: float = 480.0  # 8 minutes planned, from the process start (see the module doc)
    overrun: float = 30.0  # a group whose warm-up (compile) spent its budget: one more step each, then stop
    compile_backend: str = "inductor"


def smoke_plan() -> Plan:
    """Toy sizes on CPU: every section and code path, none of the figures mean anything."""
    return Plan(models=[("vit_tiny_patch16_224", 4, 25.0)], img=64, warmup=1, iters=3,
                zero_model="vit_tiny_patch16_224", zero_batch=4, zero_budget=25.0, matmul_n=256,
                matmul_budget=1.0, loader_images=64, loader_sources=8, loader_batch=8, loader_workers=1,
                loader_budget=8.0,
                # the smoke checks that every code path runs, not speed: its total and overrun leave room for a
                # machine loaded by the rest of the test suite, so that no row is cut for time (the cut itself
                # is tested with a zero total); on an idle machine the section budgets end it in about 90 s
                total_budget=420.0, overrun=120.0,
                # inductor's C++ code generation is slow on 2 cores (tests/integration/test_compile.py covers
                # it); aot_eager still traces each block through dynamo and AOTAutograd
                compile_backend="aot_eager")


# ------------------------------------------------------------------------------------ helpers
class Clock:
    """The suite's deadline: each section gets its planned budget, cut so that the sections
    after it keep ``reserve`` seconds each."""

    def __init__(self, total: float, t0: float | None = None):
        self.t0, self.total = time.perf_counter() if t0 is None else t0, total

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def budget(self, planned: float, later_sections: int, reserve: float = 5.0) -> float:
        return max(0.0, min(planned, self.total - self.elapsed() - later_sections * reserve))


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free_memory(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def error_text(e: BaseException) -> str:
    kind = "OOM" if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e) else type(e).__name__
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{kind}: {first[:300]}"


def process_peak_gib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB): the CPU stand-in for
    CUDA's per-step peak, for the whole process rather than one row."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 ** 2)


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in opt.state.values():
        n += sum(t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t) and t.ndim > 0)
    return n


def train_flops(name: str, img: int) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs with activation checkpointing) per image, pretrain.observability.flops'
    convention: 6 x forward multiply-adds; checkpointing re-runs the blocks' forward."""
    from pretrain.models.arch import analytic_flops
    from pretrain.observability.flops import train_flops_per_image

    parts = analytic_flops(name, img, breakdown=True)
    return train_flops_per_image(parts["total"], recompute_macs=parts["blocks"])


def compile_helper(backend: str):
    """(function compiling a model's blocks in place, description): train.compile's own helper
    (``pretrain.distributed.engine.compile_blocks``), so the suite measures what training runs, with
    ``backend`` (inductor on a GPU; the smoke's aot_eager still traces every block through dynamo
    and AOTAutograd, without inductor's C++ build on a 2-core CPU)."""
    from pretrain.distributed.engine import compile_blocks

    return (lambda model: compile_blocks(model, backend=backend)), \
        f"pretrain.distributed.engine.compile_blocks (train.compile's helper), backend {backend}"


# --------------------------------------------------------------------------------- peak matmul
def measure_matmul(plan: Plan, device, budget: float) -> dict:
    """Best of several timed windows of n x n x n matmuls in the compute dtype."""
    from pretrain.distributed.precision import bf16_supported
    from pretrain.observability.flops import peak_tflops

    dtype = torch.bfloat16 if bf16_supported() else torch.float32
    n = plan.matmul_n
    row = {"section": "peak", "name": f"{str(dtype).split('.')[-1]} matmul {n}^3", "status": "ok", "error": None,
           "dtype": str(dtype).split(".")[-1], "n": n}
    try:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        sync(device)
        # one window ~ 0.2 s of work: estimate from a single product
        t = synced_now(device)
        a @ b
        per = max(synced_now(device) - t, 1e-6)
        reps = max(1, int(0.2 / per))
        rates, end = [], time.perf_counter() + budget
        while time.perf_counter() < end or len(rates) < 3:
            t = synced_now(device)
            for _ in range(reps):
                a @ b
            rates.append(2 * n ** 3 * reps / (synced_now(device) - t) / 1e12)  # the window ends when the GPU is done
        row.update(measured_tflops=max(rates), median_tflops=statistics.median(rates), windows=len(rates))
    except Exception as e:  # noqa: BLE001 - a row records its failure, the suite goes on
        row.update(status="error", error=error_text(e))
    sheet = peak_tflops() if device.type == "cuda" else None
    row["datasheet_tflops"] = sheet
    if sheet and row.get("measured_tflops"):
        row["measured_over_datasheet"] = row["measured_tflops"] / sheet
    return row


# ------------------------------------------------------------------------------ model variants
class Variant:
    """One model + AdamW whose training step can be timed; memory as if it were alone."""

    def __init__(self, label: str, name: str, plan: Plan, device, compile_fn=None, ckpt: bool = False):
        self.label, self.device, self.ckpt = label, device, ckpt
        if label == "timm":
            import timm

            m = timm.create_model(name, img_size=plan.img, num_classes=1000, pretrained=False)
        else:
            from pretrain.models.vit import create_model

            m = create_model(name, img_size=plan.img, num_classes=1000)
            m.set_grad_checkpointing(ckpt)
        self.model = m.to(device).train()
        if compile_fn is not None:
            compile_fn(self.model)
        cuda = device.type == "cuda"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=cuda or None)
        from pretrain.distributed.precision import autocast_bf16

        self.amp = autocast_bf16(device)
        self.times: list[float] = []
        self.peak_delta = 0
        self.error = None

    def step(self, x, y) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed_step(self, x, y) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            sync(self.device)
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t = synced_now(self.device)
        self.step(x, y)
        self.times.append(synced_now(self.device) - t)  # the step counts when the GPU has finished it
        if cuda:
            self.peak_delta = max(self.peak_delta, torch.cuda.max_memory_allocated() - before)

    def drop(self) -> None:
        self.model = self.opt = None


def run_model_group(name: str, batch: int, plan: Plan, device, budget: float, compile_fn, peak, peak_source) -> list:
    """timm, ours eager, ours compiled, ours checkpointed on one batch, alternating step by step."""
    short = SHORT.get(name, name)
    labels = ["timm", "ours", "ours compiled", "ours act-ckpt"]
    rows = {lb: {"section": "model", "name": f"{short} {lb}", "model": name, "variant": lb, "batch": batch,
                 "img": plan.img, "status": "ok", "error": None} for lb in labels}
    end = time.perf_counter() + budget
    # every model's compiled blocks share one dynamo cache (keyed on Block.forward's code object):
    # without a reset, a later group's blocks would recompile with dynamic shapes, which is not what
    # a training process (one model) runs
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(batch, 3, plan.img, plan.img, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    live: list[Variant] = []
    for lb in labels:
        try:
            v = Variant(lb, name, plan, device, compile_fn if lb == "ours compiled" else None, lb == "ours act-ckpt")
            t = time.perf_counter()
            for _ in range(plan.warmup):
                v.step(x, y)
            sync(device)
            rows[lb]["warmup_s"] = time.perf_counter() - t
            live.append(v)
        except Exception as e:  # noqa: BLE001
            rows[lb].update(status="error", error=error_text(e))
        if rows[lb]["status"] == "error":  # freed outside `except`: its traceback holds the step's tensors
            v = None
            free_memory(device)
    while live and (time.perf_counter() < end or not all(v.times for v in live)):
        for v in list(live):
            if len(v.times) >= plan.iters:
                continue
            try:
                v.timed_step(x, y)
            except Exception as e:  # noqa: BLE001
                rows[v.label].update(status="error", error=error_text(e))
            if rows[v.label]["status"] == "error":
                live.remove(v)
                v.drop()
                free_memory(device)
        if all(len(v.times) >= plan.iters for v in live):
            break
        if time.perf_counter() > end + plan.overrun:  # a warm-up ate the budget: one step each at most
            break
    model_f, hw_f = train_flops(name, plan.img)
    for v in live:
        r = rows[v.label]
        if not v.times:
            r.update(status="error", error="time budget spent in warm-up")
            continue
        med = statistics.median(v.times)
        ips = batch / med
        hw = hw_f if v.ckpt else model_f
        r.update(iters=len(v.times), step_ms=med * 1e3, img_s=ips, tflops=model_f * ips / 1e12,
                 mfu=model_f * ips / (peak * 1e12) if peak else None,
                 hfu=hw * ips / (peak * 1e12) if peak else None, peak_source=peak_source)
        if device.type == "cuda":
            r.update(peak_mem_gib=(v.peak_delta + state_bytes(v.model, v.opt)) / GIB, mem_kind="cuda_alone")
        else:
            r.update(peak_mem_gib=process_peak_gib(), mem_kind="process_max_rss")
    for v in live:
        v.drop()
    live.clear()
    free_memory(device)
    ours = rows["ours"].get("step_ms")
    for lb in labels:
        if ours and rows[lb].get("step_ms"):
            rows[lb]["step_vs_ours"] = rows[lb]["step_ms"] / ours
        rows[lb].update(predicted(name, batch, plan.img, device, compiled=lb == "ours compiled",
                                  checkpointing=lb == "ours act-ckpt"))
    return [rows[lb] for lb in labels]


def predicted(name: str, batch: int, img: int, device, *, compiled: bool, checkpointing: bool) -> dict:
    """The performance model's img/s and MFU for a row (one GPU, no ZeRO, bf16 autocast over the fp32
    module as ``Variant.step`` runs it), beside the measured ones; nothing on a device the model has
    no entry for (CPUs, unlisted GPUs)."""
    from pretrain.perf import perfmodel
    from pretrain.perf.hardware import gpu_key

    key = gpu_key(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if key is None:
        return {}
    p = perfmodel.predict(perfmodel.Layout(name, key, nodes=1, gpus_per_node=1, micro_batch=batch, img_size=img,
                                           zero=0, precision="bf16-autocast", compile=compiled,
                                           checkpointing=checkpointing))
    return {"pred_img_s": p.images_per_second, "pred_mfu": p.mfu, "pred_gpu": key}


# ------------------------------------------------------------------------------------- ZeRO
# (ZeRO stage, zero.leaf_blocks): ZeRO-1; ZeRO-3 with each block one leaf module (the default) and with
# DeepSpeed's hooks on every module (the performance model's cost per hooked module comes from this row)
ZERO_ROWS = ((1, True), (3, True), (3, False))


def zero_name(model: str, stage: int, leaf_blocks: bool) -> str:
    return f"{SHORT.get(model, model)} ZeRO-{stage}" + ("" if stage < 3 or leaf_blocks else " per-module hooks")


def run_zero(stage: int, plan: Plan, device, budget: float, peak, peak_source, leaf_blocks: bool = True) -> dict:
    """One DeepSpeed engine of ``zero.stage=stage`` (and ``zero.leaf_blocks``) built by
    pretrain.distributed.engine.initialize."""
    from pretrain.config import Config
    from pretrain.config.schema import ModelConfig, OptimConfig, TrainConfig
    from pretrain.distributed.config import ZeroConfig
    from pretrain.distributed.engine import initialize
    from pretrain.distributed.precision import compute_dtype, default_precision
    from pretrain.models.vit import create_model

    name, batch = plan.zero_model, plan.zero_batch
    precision = default_precision()
    row = {"section": "zero", "name": zero_name(name, stage, leaf_blocks), "model": name, "stage": stage,
           "batch": batch, "img": plan.img, "precision": precision, "status": "ok", "error": None}
    engine = None
    end = time.perf_counter() + budget  # the model build and deepspeed.initialize count
    try:
        if device.type == "cuda":
            # what is still allocated before the build (a previous engine not freed would show here)
            row["mem_before_gib"] = torch.cuda.memory_allocated() / GIB
            torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        cfg = Config(model=ModelConfig(name=name, img_size=plan.img), optim=OptimConfig(warmup_steps=0),
                     train=TrainConfig(steps=1000, global_batch_size=batch, micro_batch_size=batch,
                                       precision=precision, activation_checkpointing=False),
                     zero=ZeroConfig(stage=stage, leaf_blocks=leaf_blocks))
        try:  # training's own build: under ZeRO-3 inside deepspeed.zero.Init
            from pretrain.weights.init_from import build_model
        except ImportError:
            build_model = None
        model = build_model(cfg) if build_model else create_model(name, img_size=plan.img, num_classes=1000)
        engine, _ = initialize(model, cfg.optim, cfg.train, cfg.zero, world_size=1)
        x = torch.randn(batch, 3, plan.img, plan.img).to(engine.device, compute_dtype(precision))
        y = torch.randint(0, 1000, (batch,)).to(engine.device)

        def step():
            loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
            engine.backward(loss)
            engine.step()

        for _ in range(plan.warmup):
            step()
        times = []
        while len(times) < plan.iters and (time.perf_counter() < end or not times):
            t = synced_now(device)
            step()
            times.append(synced_now(device) - t)  # as in the model section
        med = statistics.median(times)
        model_f, _ = train_flops(name, plan.img)
        ips = batch / med
        row.update(iters=len(times), step_ms=med * 1e3, img_s=ips, tflops=model_f * ips / 1e12,
                   mfu=model_f * ips / (peak * 1e12) if peak else None, peak_source=peak_source)
        if device.type == "cuda":
            row.update(peak_mem_gib=torch.cuda.max_memory_allocated() / GIB, mem_kind="cuda_engine")
        else:
            row.update(peak_mem_gib=process_peak_gib(), mem_kind="process_max_rss")
    except Exception as e:  # noqa: BLE001
        row.update(status="error", error=error_text(e))
    finally:
        if engine is not None:
            try:
                engine.destroy()
            except Exception:  # noqa: BLE001 - older DeepSpeed has no destroy()
                pass
        engine = model = None
        free_memory(device)
    return row


# ------------------------------------------------------------------------------------ loader
def loader_row(plan: Plan, decode: str) -> dict:
    return {"section": "loader", "name": f"ShardLoader, {decode.upper()} decode", "decode": decode,
            "batch": plan.loader_batch, "workers": plan.loader_workers, "img": plan.loader_img, "status": "ok",
            "error": None}


def run_loader(plan: Plan, device, shards: Path, budget: float, decode: str) -> dict:
    """Images/s of our ShardLoader (decode on ``decode``: 'cpu' (the workers), 'gpu' (nvJPEG,
    data.decode_device=cuda) or 'dali'). A machine without DALI gives a 'skipped' row saying why."""
    from data_pipeline.config import DataConfig

    row = loader_row(plan, decode)
    try:
        from data_pipeline.loading.loader import build_loader

        gpu_decode = "cuda" if device.type == "cuda" else "cpu"
        kw = {"decode_device": {"cpu": "worker", "gpu": gpu_decode, "dali": "dali"}[decode]}
        if decode == "cpu":
            from data_pipeline.shards.crop_decode import resolve

            row["worker_decoder"] = resolve("auto")
            row["name"] += f" ({row['worker_decoder']})"
        else:
            row["decode_device"] = kw["decode_device"]
            if device.type != "cuda":  # smoke: the GPU-decode path's logic, run on the CPU
                row["name"] += " (its CPU code path)"
        if decode == "dali":
            from data_pipeline.loading.dali_decode import unavailable

            why = unavailable()
            if why is not None:
                row.update(status="skipped", error=f"{why} (DALI travels apart from the device kit, in parts: "
                                                   f"make device-kit-nvidia, benchmarks/device_kit.py)")
                return row
        cfg = DataConfig(train_shards=str(shards / "manifest.json"), workers=plan.loader_workers,
                         shuffle_buffer=256, **kw)
        # batches normalised on the device, as training has them (build_loader's device)
        it = iter(build_loader(cfg, batch_size=plan.loader_batch, img_size=plan.loader_img, seed=0, device=device))
        for _ in range(2):  # warm-up: workers started, shuffle buffers filled
            next(it)
        end = time.perf_counter() + budget
        n, t = 0, synced_now(device)
        while time.perf_counter() < end or n == 0:
            images, _ = next(it)
            n += images.shape[0]
        ips = n / (synced_now(device) - t)  # the GPU decode's batches are done when counted
        row.update(images=n, img_s=ips, img_s_per_worker=ips / max(1, plan.loader_workers))
        del it
    except Exception as e:  # noqa: BLE001
        row.update(status="error", error=error_text(e))
    return row


def write_loader_shards(plan: Plan, root: Path) -> Path:
    """Shards as a pre-training set has them: ``plan.loader_sources`` ImageNet-like JPEGs
    (loader_throughput.make_images: 500x375, quality 90, ~100 KB), repeated to
    ``plan.loader_images`` samples and written as ``vit-shards --resize-shorter 256`` does. The
    decode cost per sample is a real photo's; the demo's 64-96 px shapes would measure per-sample
    overhead instead. Returns the shards' folder."""
    from loader_throughput import make_images

    from data_pipeline.shards.sources import Source, imagefolder
    from data_pipeline.shards.writer import write_shards

    make_images(root / "images", plan.loader_sources)
    src = imagefolder(str(root / "images"))
    items = [src.items[i % len(src.items)] for i in range(plan.loader_images)]
    shard_size = max(plan.loader_batch, plan.loader_images // max(4, 2 * plan.loader_workers))
    write_shards(Source(src.description + " (repeated)", src.classes, items), root / "shards",
                 shard_size=shard_size, resize_shorter=256, quality=90,
                 workers=max(1, min(plan.loader_workers, os.cpu_count() or 1)), progress=False)
    return root / "shards"


# ----------------------------------------------------------------------------------- report
def fmt(v, spec: str = ".1f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def table_row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(result: dict) -> str:
    rows, out = result["rows"], []
    out.append(f"Device: {result['device']}; torch {result['torch']}, DeepSpeed {result['deepspeed']}, "
               f"timm {result['timm']}; {result['wall_s']:.0f} s wall"
               + (" (smoke: toy sizes, figures meaningless)" if result["smoke"] else "") + ".\n")
    p = next(r for r in rows if r["section"] == "peak")
    out += [table_row("matmul", "measured TFLOP/s", "data sheet TFLOP/s", "measured / data sheet"),
            "|---|---:|---:|---:|",
            table_row(p["name"], fmt(p.get("measured_tflops")), fmt(p.get("datasheet_tflops"), ".1f", "not in table"),
                      fmt(p.get("measured_over_datasheet"), ".1%")), ""]
    peak_note = f"MFU/HFU against the {result['peak_source']} peak ({result['peak_tflops']:.1f} TFLOP/s)" \
        if result.get("peak_tflops") else "MFU: no peak known"
    out += [f"Training step, bf16 autocast on GPU (fp32 on CPU), AdamW; {peak_note}; step time ratio against ours "
            f"eager in the same run. Compiled: {result['compile']}.", "",
            table_row("model", "variant", "batch", "step ms", "img/s", "TFLOP/s", "MFU", "HFU", "peak GiB",
                      "step / ours", "predicted img/s", "predicted MFU", "note"),
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in (r for r in rows if r["section"] == "model"):
        out.append(table_row(SHORT.get(r["model"], r["model"]), r["variant"], r["batch"], fmt(r.get("step_ms")),
                             fmt(r.get("img_s")), fmt(r.get("tflops"), ".4g"), fmt(r.get("mfu"), ".1%"),
                             fmt(r.get("hfu"), ".1%"), fmt(r.get("peak_mem_gib"), ".2f"),
                             fmt(r.get("step_vs_ours"), ".3f"), fmt(r.get("pred_img_s")), fmt(r.get("pred_mfu"), ".1%"),
                             r["error"] or ""))
    out += ["", table_row("DeepSpeed", "batch", "precision", "step ms", "img/s", "TFLOP/s", "MFU", "peak GiB", "note"),
            "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in (r for r in rows if r["section"] == "zero"):
        note = r["error"] or ""
        if (r.get("mem_before_gib") or 0) >= 0.01:  # left allocated by what ran before: in its peak
            note = (note + "; " if note else "") + f"{r['mem_before_gib']:.2f} GiB allocated before the build"
        out.append(table_row(r["name"], r["batch"], r["precision"], fmt(r.get("step_ms")), fmt(r.get("img_s")),
                             fmt(r.get("tflops"), ".4g"), fmt(r.get("mfu"), ".1%"), fmt(r.get("peak_mem_gib"), ".2f"),
                             note))
    loader = [r for r in rows if r["section"] == "loader"]
    if loader:
        out += ["", f"Loader: train transforms at {loader[0]['img']} px over ImageNet-like JPEGs (500x375, "
                    f"quality 90) pre-resized to shorter side 256; {loader[0]['workers']} workers."]
    out += ["", table_row("loader", "workers", "batch", "px", "img/s", "img/s per worker", "note"),
            "|---|---:|---:|---:|---:|---:|---|"]
    for r in (r for r in rows if r["section"] == "loader"):
        note = "" if r["status"] == "ok" else r["status"] + (f": {r['error']}" if r["error"] else "")
        if r.get("vs_gpu_decode"):
            note = f"{r['vs_gpu_decode']:.2f}x the GPU decode row" + (f"; {note}" if note else "")
        out.append(table_row(r["name"], r["workers"], r["batch"], r["img"], fmt(r.get("img_s")),
                             fmt(r.get("img_s_per_worker")), note))
    mem = {r.get("mem_kind") for r in rows if r.get("mem_kind")}
    if "process_max_rss" in mem:
        out.append("\nPeak memory on CPU is the process's peak resident set so far, not the row's own.")
    if "cuda_alone" in mem:
        out.append("\nPeak GiB of a model row: its parameters and optimizer state plus the largest increase "
                   "during one of its steps (the four models share the GPU while they alternate).")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", default="runs/bench-gpu", help="folder for suite.json and suite.md")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on CPU: checks that every row runs")
    args = ap.parse_args(argv)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    plan = smoke_plan() if args.smoke else Plan()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda and not args.smoke:
        print("no CUDA device: the full suite needs one (try --smoke for the CPU check)", file=sys.stderr)
        return 2
    clock = Clock(plan.total_budget, T_START)
    log = lambda msg: print(f"[{clock.elapsed():6.1f}s] {msg}", flush=True)  # noqa: E731
    if args.smoke:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    import deepspeed
    import timm

    from pretrain.distributed.process import init_distributed

    rows: list[dict] = []
    meta = {
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()}, "
                                                             f"{torch.get_num_threads()} threads)",
        "smoke": args.smoke, "torch": torch.__version__, "deepspeed": deepspeed.__version__, "timm": timm.__version__,
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d %H:%M"), "plan": dataclasses.asdict(plan),
    }

    def save(complete: bool) -> None:
        result = dict(meta, complete=complete, wall_s=clock.elapsed(), rows=rows)
        (out / "suite.json").write_text(json.dumps(result, indent=1))
        (out / "suite.md").write_text(markdown(result))

    sections = 2 + len(plan.models) + 1  # peak, models..., zero, loader (reserve for the later ones)
    peak_row = measure_matmul(plan, device, clock.budget(plan.matmul_budget, sections - 1))
    rows.append(peak_row)
    log(f"matmul: {fmt(peak_row.get('measured_tflops'))} TFLOP/s measured, data sheet "
        f"{fmt(peak_row.get('datasheet_tflops'))}")
    if peak_row.get("datasheet_tflops"):
        peak, peak_source = peak_row["datasheet_tflops"], "datasheet"
    else:
        peak, peak_source = peak_row.get("measured_tflops"), "measured"
    compile_fn, compile_how = compile_helper(plan.compile_backend)
    meta.update(peak_tflops=peak, peak_source=peak_source, compile=compile_how)
    save(complete=False)  # from here on, a run killed at any point leaves what it measured
    done = 1
    for name, batch, budget in plan.models:
        b = clock.budget(budget, sections - done - 1)
        if b <= 0:
            group = [{"section": "model", "name": f"{SHORT.get(name, name)} {lb}", "model": name, "variant": lb,
                      "batch": batch, "img": plan.img, "status": "skipped", "error": "suite out of time"}
                     for lb in ("timm", "ours", "ours compiled", "ours act-ckpt")]
        else:
            group = run_model_group(name, batch, plan, device, b, compile_fn, peak, peak_source)
        rows += group
        done += 1
        for r in group:
            log(f"{r['name']:28s} {r['status']:5s} img/s {fmt(r.get('img_s'))}  MFU {fmt(r.get('mfu'), '.1%')}  "
                f"peak {fmt(r.get('peak_mem_gib'), '.2f')} GiB {r['error'] or ''}")
        save(complete=False)  # after each part, so that a run killed later still leaves its figures

    zb = clock.budget(plan.zero_budget, 1)
    zero_error = None
    try:
        if zb <= 0:
            raise TimeoutError("suite out of time")
        init_distributed()  # a world of one: DeepSpeed wants a process group (gloo on CPU, NCCL on GPUs)
    except Exception as e:  # noqa: BLE001
        zero_error = e
    for stage, leaf_blocks in ZERO_ROWS:
        if zero_error is not None:
            r = {"section": "zero", "name": zero_name(plan.zero_model, stage, leaf_blocks),
                 "model": plan.zero_model, "stage": stage, "batch": plan.zero_batch, "img": plan.img, "precision": "-",
                 "status": "skipped" if isinstance(zero_error, TimeoutError) else "error",
                 "error": str(zero_error) if isinstance(zero_error, TimeoutError) else error_text(zero_error)}
        else:
            r = run_zero(stage, plan, device, zb / len(ZERO_ROWS), peak, peak_source, leaf_blocks)
        rows.append(r)
        log(f"{r['name']:28s} {r['status']:5s} img/s {fmt(r.get('img_s'))}  MFU {fmt(r.get('mfu'), '.1%')}  "
            f"peak {fmt(r.get('peak_mem_gib'), '.2f')} GiB {r['error'] or ''}")
    save(complete=False)

    with tempfile.TemporaryDirectory(prefix="vitscale-suite-") as tmp:
        t = time.perf_counter()
        shards, shard_error = None, None
        try:
            if clock.budget(plan.loader_budget, 0) <= 5:
                raise TimeoutError("suite out of time")
            shards = write_loader_shards(plan, Path(tmp))
            log(f"shards: {plan.loader_images} samples of {plan.loader_sources} ImageNet-like JPEGs "
                f"(shorter side 256) in {time.perf_counter() - t:.1f}s")
        except Exception as e:  # noqa: BLE001
            shard_error = e
        lb = clock.budget(plan.loader_budget, 0) - (time.perf_counter() - t)
        for decode in ("cpu", "gpu", "dali"):
            if shard_error is not None:
                timed_out = isinstance(shard_error, TimeoutError)
                r = dict(loader_row(plan, decode), status="skipped" if timed_out else "error",
                         error=str(shard_error) if timed_out else error_text(shard_error))
            else:
                r = run_loader(plan, device, shards, max(1.0, lb / 3 - 3), decode)
            rows.append(r)
            log(f"{r['name']:28s} {r['status']:5s} img/s {fmt(r.get('img_s'))} {r['error'] or ''}")
        cuda_row, dali_row = rows[-2], rows[-1]
        if cuda_row.get("img_s") and dali_row.get("img_s"):  # DALI against nvJPEG, measured in this run
            dali_row["vs_gpu_decode"] = dali_row["img_s"] / cuda_row["img_s"]
            log(f"DALI decode / nvJPEG decode: {dali_row['vs_gpu_decode']:.2f}")
    save(complete=True)
    import torch.distributed as dist

    if dist.is_initialized():  # NCCL warns at exit about a group never destroyed
        dist.destroy_process_group()
    failed = [r["name"] for r in rows if r["status"] == "error"]
    log(f"wrote {out / 'suite.json'} and {out / 'suite.md'}"
        + (f"; failed rows: {', '.join(failed)}" if failed else ""))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:  # noqa: BLE001 - a failure outside any row: say where
        traceback.print_exc()
        sys.exit(1)
