"""The performance model against a real 2-rank run on this CPU: the machine treated as a "GPU
type" whose matmul rate, memory bandwidth and gloo bus bandwidth are measured in the same job
(efficiency 1), predicting the timed fp32 ZeRO-1 step of a ViT-Ti/16 at 224 (micro-batch 4 per
rank). Prints the measured rates, the predicted and the measured step time, and their ratio.
The model has no term for Python, autograd and the unfused CPU kernels it does not name, which
on a CPU are a larger share than on a GPU.

Run it on an otherwise idle machine (it times steps; a second load changes the answer):

    python benchmarks/perf_model_cpu.py            # about 1 minute on 2 vCPU
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launch.runner import deepspeed_executable  # noqa: E402
from pretrain.distributed.process import free_port  # noqa: E402
from pretrain.perf import collectives  # noqa: E402
from pretrain.perf.perfmodel import Layout, predict  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cpu.json"
        cmd = [deepspeed_executable(), "--num_gpus", "2", "--master_port", str(free_port()), "--module",
               "tests.jobs.perf_bytes_job", str(out), "none", "timed"]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        if r.returncode != 0:
            sys.exit(f"perf_model_cpu: the job failed:\n{r.stderr[-3000:]}")
        got = json.loads(out.read_text())
    cpu, world = got["cpu"], got["world"]
    lay = Layout("vit_tiny_patch16_224", "cpu", nodes=1, gpus_per_node=world, micro_batch=cpu["micro"],
                 img_size=cpu["img"], num_classes=10, zero=1, precision="fp32", efficiency=1.0,
                 peak_tflops=cpu["matmul_flops"] / 1e12, hbm_gbs=cpu["mem_bytes_per_s"] / 1e9, memory_gb=24,
                 intra_node_gbps=cpu["gloo_busbw"] * 8 / 1e9 / collectives.LINK_EFFICIENCY["intra"])
    pred = predict(lay).step_seconds
    print(f"measured: matmul {cpu['matmul_flops'] / 1e9:.1f} GFLOP/s, memory {cpu['mem_bytes_per_s'] / 1e9:.1f} GB/s, "
          f"gloo bus {cpu['gloo_busbw'] / 1e9:.2f} GB/s")
    print(f"step (ViT-Ti/16 @ {cpu['img']}, micro {cpu['micro']}, {world} ranks, ZeRO-1 fp32): "
          f"predicted {pred:.3f} s, measured {cpu['step_seconds']:.3f} s, ratio measured/predicted "
          f"{cpu['step_seconds'] / pred:.2f}")


if __name__ == "__main__":
    main()
