"""The performance model's two tables for benchmarks/RESULTS.md and the README: its error against
the published runs (pretrain/perf/published_runs.json), and the best layouts of ViT-L/16 and ViT-H/14 on
8, 64 and 256 H100s (DGX H100 network) with the paper's compute budgets turned into days.

    python benchmarks/perf_model_table.py          # well under a second per layout
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.perf import perfmodel  # noqa: E402
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
            best = perfmodel.search(base)[0]
            worst = max(worst, time.perf_counter() - t0)
            lay = best.layout
            days = budget * 1e18 / (best.images_per_second * best.train_flops_per_image) / 86400
            print(f"| {model} | {gpus} | ZeRO-{lay['zero']}, {lay['micro_batch']}, "
                  f"{'on' if lay['checkpointing'] else 'off'}, {lay['hpz_partition_size']}, "
                  f"{'on' if lay['quantized_weights'] else 'off'} | {best.images_per_second:,.0f} | {best.mfu:.1%} | "
                  f"{best.memory_gb_per_gpu['total']:.1f} | {best.bottleneck} | {budget:,} EF | {days:,.1f} |")
    print(f"\nslowest --search: {worst:.3f} s")


if __name__ == "__main__":
    main()
