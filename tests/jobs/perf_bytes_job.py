"""Run by the deepspeed runner from test_perfmodel: for ZeRO 0-3 (and ZeRO-1 and 3 once more under
``train.precision=bf16-autocast``, keys ``1-bf16-autocast`` and ``3-bf16-autocast``), a real engine built by
``pretrain.distributed.engine.initialize`` on a small ViT takes optimizer steps while DeepSpeed's own comms
logger records every collective; also the element counts and dtypes of what each rank's
optimizer holds. With ``timed`` (benchmarks/perf_model_cpu.py), last, the timed steps of a plain
fp32 ZeRO-1 job with the CPU's measured matmul rate, memory bandwidth and gloo bandwidth for the
performance model.

    deepspeed --num_gpus 2 --module tests.jobs.perf_bytes_job OUT.json [0123|none] [timed]"""
import json
import os
import sys
import time

import deepspeed.comm as dist
import torch
from deepspeed.comm.comm import comms_logger

from pretrain.config.schema import OptimConfig, TrainConfig
from pretrain.distributed.config import ZeroConfig
from pretrain.distributed.engine import initialize
from pretrain.distributed.process import init_distributed
from pretrain.models.vit import create_model

MODEL, IMG, CLASSES, MICRO, GAS, STEPS = "vit_tiny_patch16_224", 32, 10, 2, 2, 2
BUCKET = 1_000_000  # elements: several gradient / gather buckets per step


def run_steps(engine, steps: int, micro: int, img: int, gen: torch.Generator) -> None:
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x = torch.randn(micro, 3, img, img, generator=gen)
        y = torch.randint(0, CLASSES, (micro,), generator=gen)
        if engine.bfloat16_enabled():
            x = x.bfloat16()
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()


def optimizer_tensors(engine) -> dict[str, list]:
    """What the rank's optimizer holds, by role, as [numel, dtype] pairs: fp32 master weights,
    Adam moments, fp32 gradient buffers. Each DeepSpeed optimizer keeps its masters under its own
    attribute (BF16_Optimizer, ZeRO-1/2, ZeRO-3; without ZeRO the module's weights are the masters)."""
    opt = engine.optimizer
    masters = (getattr(opt, "fp32_groups_flat_partition", None) or getattr(opt, "single_partition_of_fp32_groups", None)
               or getattr(opt, "fp32_partitioned_groups_flat", None))
    inner = getattr(opt, "optimizer", opt)
    if masters is None:  # stage 0: torch's optimizer steps the module's own fp32 weights
        masters = [p for g in inner.param_groups for p in g["params"]]
    out = {"master": [[m.numel(), str(m.dtype)] for m in masters], "moments": [],
           "grad_buffers": [[g.numel(), str(g.dtype)] for g in getattr(opt, "fp32_groups_gradients_flat", [])]}
    for m in masters:
        for v in inner.state.get(m, {}).values():
            if torch.is_tensor(v) and v.numel() > 1:
                out["moments"].append([v.numel(), str(v.dtype)])
    return out


args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
out_path = args[0]
rank, _, world = init_distributed()
torch.manual_seed(0)
results = {"world": world, "stages": {}}
STAGES = [int(s) for s in next((a for a in args[1:] if a.isdigit()), "" if "none" in args else "0123")]
TIMED = "timed" in args[1:]
RUNS = [(stage, "fp32" if stage == 0 else "bf16", str(stage)) for stage in STAGES]  # bf16 needs ZeRO
RUNS += [(stage, "bf16-autocast", f"{stage}-bf16-autocast") for stage in STAGES if stage in (1, 3)]
for stage, precision, key in RUNS:
    train = TrainConfig(steps=10, global_batch_size=MICRO * GAS * world, micro_batch_size=MICRO, precision=precision)
    zero = ZeroConfig(stage=stage, reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET)
    model = create_model(MODEL, img_size=IMG, num_classes=CLASSES, init_seed=0)
    engine, _ = initialize(model, OptimConfig(name="adamw", lr=1e-4), train, zero, world)
    gen = torch.Generator().manual_seed(rank)
    run_steps(engine, 1, MICRO, IMG, gen)  # first step: buffers, hooks, lazy state
    dist.configure(enabled=True, prof_all=True, verbose=False)
    comms_logger.comms_dict = {}
    run_steps(engine, STEPS, MICRO, IMG, gen)
    dist.configure(enabled=False)
    ops = {}
    for name, sizes in comms_logger.comms_dict.items():
        for size, rec in sizes.items():
            o = ops.setdefault(name, {"calls": 0, "bytes": 0})
            o["calls"] += rec[0]
            o["bytes"] += rec[0] * size
            o.setdefault("sizes", {})[size] = rec[0]
    per_step = {k: {"calls": v["calls"] / STEPS, "bytes": v["bytes"] / STEPS, "sizes": v["sizes"]}
                for k, v in ops.items()}
    results["stages"][key] = {"ops": per_step,
                                "optimizer": optimizer_tensors(engine),
                                "optimizer_class": type(engine.optimizer).__name__,
                                "params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())}
    del engine, model
    dist.barrier()

# --- the CPU as a "GPU type": measured matmul rate, memory bandwidth, gloo bus bandwidth, then timed steps


def timed_cpu() -> dict:
    torch.manual_seed(1)
    a, b = torch.randn(2048, 192), torch.randn(192, 768)
    for _ in range(3):
        a @ b
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    mm = 20 * 2 * 2048 * 192 * 768 / (time.perf_counter() - t0)
    x = torch.randn(8_000_000)
    y = x + 1
    t0 = time.perf_counter()
    for _ in range(10):
        torch.add(x, 1, out=y)
    bw = 10 * 2 * 4 * x.numel() / (time.perf_counter() - t0)
    buf = torch.randn(4_000_000)
    dist.all_reduce(buf)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(buf)
    ar = (time.perf_counter() - t0) / 5
    busbw = buf.numel() * 4 * 2 * (world - 1) / world / ar
    TIMED_IMG, TIMED_MICRO = 224, 4
    train = TrainConfig(steps=10, global_batch_size=TIMED_MICRO * world, micro_batch_size=TIMED_MICRO, precision="fp32")
    model = create_model(MODEL, img_size=TIMED_IMG, num_classes=CLASSES, init_seed=0)
    engine, _ = initialize(model, OptimConfig(name="adamw", lr=1e-4), train, ZeroConfig(stage=1), world)
    gen = torch.Generator().manual_seed(rank)
    run_steps(engine, 2, TIMED_MICRO, TIMED_IMG, gen)
    dist.barrier()
    t0 = time.perf_counter()
    run_steps(engine, 4, TIMED_MICRO, TIMED_IMG, gen)
    dist.barrier()
    step = (time.perf_counter() - t0) / 4
    return {"matmul_flops": mm, "mem_bytes_per_s": bw, "gloo_busbw": busbw, "step_seconds": step,
            "img": TIMED_IMG, "micro": TIMED_MICRO}


if TIMED:
    results["cpu"] = timed_cpu()
if rank == 0:
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)
dist.barrier()
dist.destroy_process_group()

# End here, before the interpreter's teardown: there, destructors of the engines' C++ threads can find
# one still joinable and abort the rank (SIGABRT, "terminate called without an active exception")
# after its results are written, which the runner reports as a failed job.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
