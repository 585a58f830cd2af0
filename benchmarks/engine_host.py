"""What vit-train's DeepSpeed engine costs the host per micro-step beyond plain PyTorch, at ZeRO-1
and ZeRO-2, in DeepSpeed's bf16 and in torch autocast, with and without ``zero.overlap_comm``.

    python benchmarks/engine_host.py                  # about 3 minutes on 2 CPU cores
    python benchmarks/engine_host.py --model vit_base_patch16_224 --rounds 9

The model has the named variant's blocks and parameter tensors (ViT-L/16: 24 blocks, 296 tensors)
at a trivial width (``--width``) and 32 px images, so the math takes microseconds and what is timed
is the host: Python, the dispatcher, autograd, and DeepSpeed's gradient hooks, bucket copies and
accumulation. Each engine runs in a process of its own (a world of one, DeepSpeed's CPU
accelerator, gloo, one thread) beside a plain step of the same model in the engine's dtype path (for
``bf16`` a bf16 module without autocast, for ``bf16-autocast`` an fp32 module under bf16 autocast;
AdamW, the gradients accumulated by autograd), the two interleaved round by round, ``--accumulation``
micro-batches per optimizer step; the medians of the rounds, per micro-step, by phase. The last
column is the engine's extra host time per parameter tensor. Beside the table: the performance
model's GPU time for the same micro-step of the full-width model on one H200 at micro batch 64
(``pretrain.perf.compute.compute_seconds``) and its host time for that micro-step (issuing its
kernels, DeepSpeed's gradient handling: ``pretrain.perf.kernels.ENGINE_HOOK_SECONDS``, from this
script's per-tensor column).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# name -> (train.precision, zero.stage, zero.overlap_comm)
ENGINES = {"bf16 ZeRO-1": ("bf16", 1, True), "bf16 ZeRO-2": ("bf16", 2, True),
           "bf16 ZeRO-2 no overlap": ("bf16", 2, False), "bf16-autocast ZeRO-1": ("bf16-autocast", 1, True),
           "bf16-autocast ZeRO-1 no overlap": ("bf16-autocast", 1, False),
           "bf16-autocast ZeRO-2 no overlap": ("bf16-autocast", 2, False)}
PHASES = ("forward", "backward", "step")


def measure(name: str, args) -> dict:
    """In this process: the engine ``name`` and the plain step, interleaved; ms per micro-step."""
    import torch
    import torch.nn.functional as F

    from pretrain.config.schema import OptimConfig, TrainConfig
    from pretrain.distributed.config import ZeroConfig
    from pretrain.distributed.engine import initialize
    from pretrain.distributed.precision import compute_dtype
    from pretrain.distributed.process import init_distributed
    from pretrain.models.vit import create_model

    init_distributed()  # a world of one on a free port, the accelerator's backend (gloo on a CPU)
    torch.set_num_threads(1)
    precision, stage, overlap = ENGINES[name]
    micro, acc = args.micro, args.accumulation
    shape = dict(embed_dim=args.width, num_heads=2, mlp_ratio=2.0)

    def model():
        return create_model(args.model, img_size=32, num_classes=10, init_seed=0, **shape)

    train = TrainConfig(steps=10 ** 6, global_batch_size=micro * acc, micro_batch_size=micro, precision=precision,
                        activation_checkpointing=False)
    zero = ZeroConfig(stage=stage, overlap_comm=overlap)
    engine = initialize(model(), OptimConfig(name="adamw", lr=1e-4), train, zero, world_size=1)[0]
    # the plain step runs the engine's dtype path: DeepSpeed's bf16 a bf16 module and bf16 inputs, no
    # autocast; bf16-autocast an fp32 module under autocast. Only the engine's own work differs.
    dtype = compute_dtype(precision)
    plain = model().to(dtype)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    x, y = torch.randn(micro, 3, 32, 32).to(dtype), torch.randint(0, 10, (micro,))

    def plain_forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-autocast"):
            return F.cross_entropy(plain(x).float(), y)

    def plain_step(i: int) -> None:
        if i == acc - 1:  # autograd accumulated the micro-batches' gradients
            opt.step()
            opt.zero_grad(set_to_none=True)

    def timed(forward, backward, step):
        def one_step(t: list) -> None:  # the optimizer step's micro-batches, seconds added by phase
            for i in range(acc):
                t0 = time.perf_counter()
                loss = forward()
                t1 = time.perf_counter()
                backward(loss)
                t2 = time.perf_counter()
                step(i)
                t3 = time.perf_counter()
                for j, d in enumerate((t1 - t0, t2 - t1, t3 - t2)):
                    t[j] += d
        return one_step

    runs = {"plain": timed(plain_forward, lambda loss: loss.backward(), plain_step),
            "engine": timed(lambda: F.cross_entropy(engine(x).float(), y), engine.backward,
                            lambda i: engine.step())}
    for f in runs.values():  # warm-up: first-call allocations, DeepSpeed's buffers
        for _ in range(2):
            f([0.0, 0.0, 0.0])
    per = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k, f in runs.items():
            t = [0.0, 0.0, 0.0]
            f(t)
            per[k].append([v / acc * 1e3 for v in t])
    out = {k: {p: statistics.median(r[i] for r in v) for i, p in enumerate(PHASES)} for k, v in per.items()}
    out["tensors"] = sum(1 for _ in plain.parameters())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="vit_large_patch16_224", help="the variant whose blocks and tensors are kept")
    ap.add_argument("--width", type=int, default=32, help="embedding width of the stand-in (trivial math)")
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--accumulation", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # one engine, in this process: prints its JSON
    args = ap.parse_args()
    if args.engine:
        print("ENGINE_HOST " + json.dumps(measure(args.engine, args)), flush=True)
        return
    rows = {}
    for name in ENGINES:
        cmd = [sys.executable, __file__, "--engine", name, "--model", args.model, "--width", str(args.width),
               "--micro", str(args.micro), "--accumulation", str(args.accumulation), "--rounds", str(args.rounds)]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        line = [x for x in r.stdout.splitlines() if x.startswith("ENGINE_HOST ")]
        if r.returncode or not line:
            raise SystemExit(f"engine_host.py: {name} failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")
        rows[name] = json.loads(line[0].split(" ", 1)[1])

    print(f"{args.model}'s blocks at width {args.width}, 32 px, micro-batch {args.micro}, {args.accumulation} "
          f"micro-batches a step; one process per engine, one thread; median of {args.rounds} rounds; "
          "ms per micro-step")
    print("| engine | plain ms | engine ms | forward | backward | step | extra ms | extra us per tensor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        p, e = sum(r["plain"].values()), sum(r["engine"].values())
        print(f"| {name} | {p:.2f} | {e:.2f} | {r['engine']['forward']:.2f} | {r['engine']['backward']:.2f} | "
              f"{r['engine']['step']:.2f} | {e - p:.2f} | {(e - p) / r['tensors'] * 1e3:.0f} |")
    from pretrain.perf import kernels
    from pretrain.perf.compute import compute_seconds
    from pretrain.perf.perfmodel import Layout

    for mode in ("", "model"):
        lay = Layout(args.model, "h200", gpus_per_node=1, micro_batch=64, zero=2, compile=mode)
        c = compute_seconds(lay, 64)
        print(f"the plan, {args.model} on one H200 at micro 64, {'compiled whole' if mode else 'eager'}: GPU "
              f"{c['gpu'] * 1e3:.1f} ms a micro-step; host {c['host'] * 1e3:.1f} ms (its {c['kernels']} kernels at "
              f"{kernels.HOST_SECONDS_PER_KERNEL * 1e6:.0f} us, ZeRO-2's gradient handling at "
              f"{kernels.ENGINE_HOOK_SECONDS[('bf16', 2)] * 1e6:.0f} us a tensor)")


if __name__ == "__main__":
    main()
