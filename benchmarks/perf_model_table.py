"""The performance model's tables (benchmarks/results/perf-model-tables.md): its error
against the published runs (pretrain/perf/published_runs.json), the best layouts of ViT-L/16 and ViT-H/14
on 8, 64 and 256 H100s (DGX H100 network) with the paper's compute budgets turned into days, the best
layout per micro batch at a fixed global batch, and the single-H100 steps the GPU suite measured.

    python benchmarks/perf_model_table.py          # well under a second per layout
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.perf import advice, perfmodel  # noqa: E402
from pretrain.perf.published import published_table  # noqa: E402

# ViT paper (Dosovitskiy et al. 2021), Table 2 / Figure 5: pre-training compute on JFT-300M
BUDGET_EXAFLOPS = {"vit_large_patch16_224": 1567, "vit_huge_patch14_224": 4262}


def main() -> None:
    print("| published run | metric | published | predicted | error | tolerance |")
    print("|---|---|---:|---:|---:|---:|")
    for r in published_table():
        cal = " (calibration point)" if r.get("calibration") else ""
        fmt = "{:,.0f}" if r["metric"] == "images_per_second" else "{:.2f}"
        print(f"| {r['name']}{cal} | {r['metric']} | {fmt.format(r['published'])} | {fmt.format(r['predicted'])} | "
              f"{r['error']:+.1%} | {r['tolerance']:.0%} |")
    print()
    print("| model | H100s | best layout (ZeRO, micro batch, checkpointing, hpZ, qwZ) | img/s | MFU | "
          "GB/GPU | bottleneck | paper budget | days |")
    print("|---|---:|---|---:|---:|---:|---|---:|---:|")
    worst = 0.0
    for model, budget in BUDGET_EXAFLOPS.items():
        for gpus in (8, 64, 256):
            base = perfmodel.Layout(model, "h100-sxm", nodes=gpus // 8, gpus_per_node=8, global_batch=4096,
                                    network="dgx-h100")
            t0 = time.perf_counter()
            best = advice.search(base)[0]
            worst = max(worst, time.perf_counter() - t0)
            lay = best.layout
            days = budget * 1e18 / (best.images_per_second * best.train_flops_per_image) / 86400
            print(f"| {model} | {gpus} | ZeRO-{lay['zero']}, {lay['micro_batch']}, "
                  f"{'on' if lay['checkpointing'] else 'off'}, {lay['hpz_partition_size']}, "
                  f"{'on' if lay['quantized_weights'] else 'off'} | {best.images_per_second:,.0f} | {best.mfu:.1%} | "
                  f"{best.memory_gb_per_gpu['total']:.1f} | {best.bottleneck} | {budget:,} EF | {days:,.1f} |")
    print(f"\nslowest --search: {worst:.3f} s")
    print()
    per_micro_batch()
    print()
    gpu_suite()


def per_micro_batch() -> None:
    """The best layout of each micro batch at global batch 4096 (what --search ranks)."""
    print("| model | H100s | micro batch | best layout (ZeRO, checkpointing) | img/s | MFU | waiting for launches | "
          "bottleneck |")
    print("|---|---:|---:|---|---:|---:|---:|---|")
    for model in ("vit_base_patch16_224", "vit_large_patch16_224"):
        for gpus in (8, 64):
            rows = advice.search(perfmodel.Layout(model, "h100-sxm", nodes=gpus // 8, global_batch=4096,
                                                     network="dgx-h100"), micro_batches=(8, 16, 32, 64, 128))
            best = {}
            for p in rows:
                best.setdefault(p.layout["micro_batch"], p)
            for mb, p in sorted(best.items()):
                lay = p.layout
                print(f"| {model} | {gpus} | {mb} | ZeRO-{lay['zero']}, {'on' if lay['checkpointing'] else 'off'} | "
                      f"{p.images_per_second:,.0f} | {p.mfu:.1%} | {p.launch_seconds / p.step_seconds:.0%} | "
                      f"{p.bottleneck} |")


# benchmarks/results/gpu-suite-h100.md (one H100 80GB HBM3): measured img/s of ours eager,
# compiled and with activation checkpointing; bf16 autocast over the fp32 module, AdamW, no DeepSpeed
# (priced as train.precision=bf16-autocast)
SUITE_H100 = {("vit_base_patch16_224", 128): (2424.1, 2992.9, 1749.3),
              ("vit_large_patch16_224", 64): (819.0, 985.2, 562.6),
              ("vit_huge_patch14_224", 32): (307.6, 339.9, 201.6)}


def gpu_suite() -> None:
    """Single-GPU steps measured on one H100 against the model (not a calibration point)."""
    print("| model | batch | variant | measured img/s | predicted img/s | measured / predicted |")
    print("|---|---:|---|---:|---:|---:|")
    for (model, batch), measured in SUITE_H100.items():
        for variant, kw, got in zip(("eager", "compiled", "act-ckpt"), ({}, {"compile": True},
                                                                       {"checkpointing": True}), measured):
            p = perfmodel.predict(perfmodel.Layout(model, "h100-sxm", nodes=1, gpus_per_node=1, micro_batch=batch,
                                                   zero=0, precision="bf16-autocast", **kw))
            print(f"| {model} | {batch} | {variant} | {got:,.0f} | {p.images_per_second:,.0f} | "
                  f"{got / p.images_per_second:.2f} |")
    # the suite's DeepSpeed rows (bf16, AdamW; ZeRO-3 with DeepSpeed's per-module hooks, zero.leaf_blocks=false);
    # ZeRO-3 is the calibration point of the model's host cost of ZeRO-3 hooks (pretrain/perf/kernels.py)
    for variant, zero, got in (("DeepSpeed ZeRO-1", 1, 800.7), ("DeepSpeed ZeRO-3, per-module hooks", 3, 163.9)):
        p = perfmodel.predict(perfmodel.Layout("vit_large_patch16_224", "h100-sxm", nodes=1, gpus_per_node=1,
                                               micro_batch=64, zero=zero, leaf_blocks=False))
        print(f"| vit_large_patch16_224 | 64 | {variant} | {got:,.0f} | {p.images_per_second:,.0f} | "
              f"{got / p.images_per_second:.2f} |")
    p = perfmodel.predict(perfmodel.Layout("vit_large_patch16_224", "h100-sxm", nodes=1, gpus_per_node=1,
                                           micro_batch=64, zero=3))
    print(f"| vit_large_patch16_224 | 64 | DeepSpeed ZeRO-3, leaf blocks (zero.leaf_blocks) | not measured | "
          f"{p.images_per_second:,.0f} | |")


if __name__ == "__main__":
    main()
