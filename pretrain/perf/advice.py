"""What to change: the layouts that fit, best first (``vit-launch plan --search``), and each speed
lever of one layout turned the other way with its predicted gain (the plan's "other levers" line).
Arithmetic over ``pretrain.perf.perfmodel.predict``; no torch."""
from __future__ import annotations

from dataclasses import replace

from pretrain.config import compile_mode
from pretrain.perf import buckets, kernels
from pretrain.perf.perfmodel import Layout, Prediction, predict


def search(base: Layout, micro_batches=(8, 16, 32, 64, 128, 256), stages=(1, 2, 3)) -> list[Prediction]:
    """Layouts that fit, best predicted throughput first: ZeRO stage x micro batch x activation
    checkpointing (none, op-level, every block) x ZeRO++ (hpZ within a node, qwZ; stage 3 only).
    The global batch stays ``base.global_batch`` (when given), so micro batches that do not divide
    it are skipped."""
    out = []
    for stage in stages:
        pp = [(1, False)]
        if stage == 3:
            pp += ([(base.gpus_per_node, False), (1, True), (base.gpus_per_node, True)] if base.nodes > 1
                   else [(1, True)])
        for mb in micro_batches:
            for ckpt in (False, "selective", True):
                for hpz, qw in pp:
                    lay = replace(base, zero=stage, micro_batch=mb, checkpointing=ckpt, hpz_partition_size=hpz,
                                  quantized_weights=qw, quantized_gradients=base.quantized_gradients and stage == 3)
                    try:
                        lay.accumulation
                    except ValueError:
                        continue
                    p = predict(lay)
                    if p.fits:
                        out.append(p)
    # best img/s first; an exact tie goes to the larger micro batch, then the smaller memory
    out.sort(key=lambda p: (-p.images_per_second, -p.layout["micro_batch"], p.memory_gb_per_gpu["total"]))
    return out


def lever_gains(layout: Layout) -> list[tuple[str, float]]:
    """Each speed lever turned the other way from ``layout``, with its predicted img/s relative to
    ``layout``'s (1.10: 10 % faster), best first; alternatives that do not fit are left out.
    The levers: the ZeRO stage (1-3; ZeRO++ is ZeRO-3's alone; ZeRO-3 compiles blocks where the
    layout compiles, and a compile leaving ZeRO-3 is the whole model's), activation checkpointing
    (none, every block, op-level), ``train.compile`` (off and model; at ZeRO-3 off and blocks), the
    reduction bucket (DeepSpeed's 5e8 against the one ``auto`` picks) and the micro batch (half and
    double, the global batch kept).

    ``train.compile=blocks`` is not offered at ZeRO 0-2: the model prices it close to ``model``
    (fused element-wise work, and gradients ready block by block for the reduction to overlap), but
    through vit-train on one H200 it measured 0.80x ``model`` (both with ``auto`` buckets) and below
    eager (``benchmarks/results/vit-train-h200.md``), for a reason the model does not hold."""
    base = predict(layout).images_per_second
    shape = layout.shape()
    depth = shape.depth
    now = "selective" if layout.checkpointing == "selective" else kernels.recomputed_blocks(depth, layout.checkpointing)
    written, mode = compile_mode(layout.compile), compile_mode(layout.compile, layout.zero)
    trials = []
    for stage in (1, 2, 3):
        if stage == layout.zero:
            continue
        text, other = f"zero.stage={stage}", {}
        if stage < 3:  # (ZeRO-3 compiles blocks where the layout compiles: compile_mode, as predict asks it)
            other = dict(hpz_partition_size=1, quantized_weights=False, quantized_gradients=False)
            if mode == "blocks" and layout.zero == 3:  # off ZeRO-3 the compile offered is the whole model's
                other["compile"] = "model"
                text += "" if written == "model" else " train.compile=model"
        trials.append((text, replace(layout, zero=stage, **other)))
    trials += [(f"train.activation_checkpointing={v}", replace(layout, checkpointing=c))
               for v, c in (("false", 0), ("true", depth), ("selective", "selective")) if c != now]
    compiles = (("false", ""), ("blocks", "blocks")) if layout.zero == 3 else (("false", ""), ("model", "model"))
    trials += [(f"train.compile={v}", replace(layout, compile=c)) for v, c in compiles if c != mode]
    params = shape.params
    auto = buckets.auto_bucket(params, 2 if layout.reduce_dtype == "bf16" else 4, layout.world,
                               gpus_per_node=layout.gpus_per_node, gpu=layout.gpu, network=layout.network)
    for v in (500_000_000, auto):
        if v != layout.reduce_bucket_size:
            trials.append((f"zero.reduce_bucket_size={'auto' if v == auto else v}",
                           replace(layout, reduce_bucket_size=v)))
    for mb in (layout.micro_batch // 2, layout.micro_batch * 2):
        trial = replace(layout, micro_batch=max(1, mb))
        try:
            trial.accumulation
        except ValueError:
            continue
        trials.append((f"train.micro_batch_size={trial.micro_batch}", trial))
    out = []
    for text, trial in trials:
        p = predict(trial)
        if p.fits:
            out.append((text, p.images_per_second / base))
    return sorted(out, key=lambda t: -t[1])
