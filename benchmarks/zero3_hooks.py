"""What a ZeRO-3 step costs beyond a ZeRO-1 step on the host, per hooked module, per partitioned
tensor and per parameter byte, with and without ``zero.leaf_blocks``; and the performance model's
term for it beside the measurement.

    python benchmarks/zero3_hooks.py                       # about 2 min on 2 CPU cores
    python benchmarks/zero3_hooks.py --models vit_tiny_patch16_224,vit_base_patch16_224 --rounds 9

One process, a world of one (DeepSpeed on its CPU accelerator, gloo), so no collective crosses a link
and what ZeRO-3 adds is its hooks' bookkeeping (each hooked module's pre/post forward and backward
hooks), each partitioned tensor's fetch and release, and its copies of the parameters and gradients.
Per model, five engines (fp32, SGD) step the same micro-batch in interleaved rounds, so background
load falls on all alike: ZeRO-1; ZeRO-3 with DeepSpeed's hooks on every module
(``zero.leaf_blocks=false``) and with each Transformer block one leaf module (the default), each at
the config's persistence threshold and at 0 (every tensor partitioned). The extra time of the
ZeRO-3 engines of all models over their ZeRO-1 is fitted by least squares as
``a x hooked modules + b x partitioned tensors + c x parameter bytes``; the table shows the fit
beside each measurement, then the model's term (``pretrain.perf.kernels.zero3_hook_seconds``, one
constant per module: ``b`` comes out near zero, and ``c`` is memory traffic a GPU's HBM makes
negligible) for per-module hooks and leaf blocks of each model with this CPU's ``a``.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def engines(model: str, img: int, micro: int, threshold: int) -> dict:

    from pretrain.config.schema import OptimConfig, TrainConfig
    from pretrain.distributed.config import ZeroConfig
    from pretrain.distributed.engine import initialize
    from pretrain.models.vit import create_model

    train = TrainConfig(steps=10 ** 6, global_batch_size=micro, micro_batch_size=micro, precision="fp32",
                        activation_checkpointing=False)
    optim = OptimConfig(name="sgd", lr=0.01)
    specs = {"zero1": dict(stage=1),
             "zero3 per-module": dict(stage=3, leaf_blocks=False, stage3_param_persistence_threshold=threshold),
             "zero3 leaf blocks": dict(stage=3, leaf_blocks=True, stage3_param_persistence_threshold=threshold),
             "zero3 per-module thr0": dict(stage=3, leaf_blocks=False, stage3_param_persistence_threshold=0),
             "zero3 leaf blocks thr0": dict(stage=3, leaf_blocks=True, stage3_param_persistence_threshold=0)}
    out = {}
    for name, z in specs.items():
        m = create_model(model, img_size=img, num_classes=10, init_seed=0)
        out[name] = initialize(m, optim, train, ZeroConfig(**z), world_size=1)[0]
    return out


def solve(rows: list, n: int) -> list:
    """Least squares ``y = sum(c_i x_i)`` over ``rows`` of ``(x_1..x_n, y)`` (normal equations)."""
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    aty = [sum(r[i] * r[n] for r in rows) for i in range(n)]
    for c in range(n):  # Gauss-Jordan with partial pivoting
        piv = max(range(c, n), key=lambda r: abs(ata[r][c]))
        ata[c], ata[piv], aty[c], aty[piv] = ata[piv], ata[c], aty[piv], aty[c]
        for r in range(n):
            if r != c:
                f = ata[r][c] / ata[c][c]
                ata[r] = [a - f * b for a, b in zip(ata[r], ata[c])]
                aty[r] -= f * aty[c]
    return [aty[i] / ata[i][i] for i in range(n)]


def measure(model: str, args, threshold: int) -> dict:
    """Median seconds per step of each engine of :func:`engines`, interleaved rounds."""
    import torch

    eng = engines(model, args.img, args.micro, threshold)
    x = torch.randn(args.micro, 3, args.img, args.img)
    y = torch.randint(0, 10, (args.micro,))

    def step(e):
        e.backward(torch.nn.functional.cross_entropy(e(x), y))
        e.step()

    for e in eng.values():  # warm-up: first-call allocations, DeepSpeed's trace of the module order
        step(e)
        step(e)
    per: dict = {k: [] for k in eng}
    for _ in range(args.rounds):
        for k, e in eng.items():
            t = time.perf_counter()
            for _ in range(args.reps):
                step(e)
            per[k].append((time.perf_counter() - t) / args.reps)
    out = {k: statistics.median(v) for k, v in per.items()}
    del eng, e
    gc.collect()  # the next model's engines do not share the memory with these
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="vit_tiny_patch16_224,vit_small_patch16_224")
    ap.add_argument("--img", type=int, default=32, help="small images: the step is mostly hooks, not math")
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    import torch

    from pretrain.distributed.config import ZeroConfig
    from pretrain.distributed.process import init_distributed
    from pretrain.models.arch import param_count
    from pretrain.perf import kernels
    from pretrain.perf.collectives import partitioned, zero3_hooked
    from pretrain.perf.perfmodel import Layout

    init_distributed()  # a world of one on a free port, the accelerator's backend
    torch.set_num_threads(1)
    threshold = ZeroConfig().stage3_param_persistence_threshold
    rows = []  # (model, engine, modules, tensors, parameter bytes, extra seconds, zero1 seconds)
    for model in args.models.split(","):
        sec = measure(model, args, threshold)
        nbytes = 4 * param_count(model, args.img, 10)[0]
        for k in sec:
            if k == "zero1":
                continue
            lay = Layout(model, "cpu", gpus_per_node=1, micro_batch=args.micro, img_size=args.img, num_classes=10,
                         zero=3, leaf_blocks="leaf" in k, persistence_threshold=0 if "thr0" in k else threshold)
            m, t = zero3_hooked(lay), len(partitioned(lay))
            rows.append((model, k, m, t, nbytes, sec[k] - sec["zero1"], sec["zero1"]))
    a, b, c = solve([(m, t, n, e) for _, _, m, t, n, e, _ in rows], 3)

    print(f"{args.models} at {args.img} px, micro-batch {args.micro}, fp32, one process (CPU, gloo); "
          f"median of {args.rounds} rounds x {args.reps} steps")
    print(f"{'model':<22s} {'engine':<24s} {'zero1 ms':>8s} {'extra ms':>9s} {'modules':>8s} {'tensors':>8s} "
          f"{'MB':>6s} {'fit ms':>7s}")
    for model, k, m, t, n, e, z1 in rows:
        print(f"{model:<22s} {k:<24s} {z1 * 1e3:8.1f} {e * 1e3:9.1f} {m:8d} {t:8d} {n / 1e6:6.0f} "
              f"{(a * m + b * t + c * n) * 1e3:7.1f}")
    print(f"fit: {a * 1e6:.0f} us per hooked module, {b * 1e6:.0f} us per partitioned tensor, "
          f"{c * 1e12:.0f} us per MB of fp32 parameters (the model's GPU machine, an H200: "
          f"{kernels.ZERO3_MODULE_SECONDS * 1e6:.0f} us per hooked module, with kernels.zero3_work_seconds beside it)")
    h = kernels.zero3_hook_seconds
    for model, k, m, t, n, e, _ in rows:
        if "thr0" not in k:
            print(f"{model} {k}: hooks (measured less the fit's tensor and byte terms) "
                  f"{(e - b * t - c * n) * 1e3:.1f} ms, model with this CPU's a {h(m, False, module_s=a) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
