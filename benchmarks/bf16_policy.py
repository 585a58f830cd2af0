"""DeepSpeed's whole-model bf16 (``train.precision=bf16``) against torch autocast
(``bf16-autocast``), both against fp32: the error of the first update, the time of a training step,
and the loss curves of the demo config.

    python benchmarks/bf16_policy.py                  # about 10 min on 2 loaded CPU cores
    python benchmarks/bf16_policy.py --steps 50 --curve-seeds 1      # a quick look
    python benchmarks/bf16_policy.py --models vit_base_patch16_224 --curve-seeds 0   # parts 1-2 only

1. First update. Our engine (``pretrain.distributed.engine.initialize``, one rank, ZeRO-1, SGD at
   lr 1 without momentum, clipping or weight decay, so the update is minus the gradient) takes one
   step on a batch of random images; the reference is plain PyTorch's fp32 gradient of the same
   model and batch (``torch.autograd``, no DeepSpeed). Per mode: relative error of the whole update
   and its cosine (float64), the worst tensor's relative error, mean over ``--seeds`` batches; the
   update is measured from DeepSpeed's fp32 masters after ``initialize`` (in bf16 they start from
   the bf16-rounded module, so that start offset is reported apart).
2. Step time. The same engines, forward + backward + step on one micro-batch, in interleaved
   rounds (fp32, bf16, bf16-autocast, fp32, ...) so that background load falls on all alike;
   median seconds per step and the ratio to fp32. On CPU bf16 runs in oneDNN's AVX-512 BF16
   kernels where the CPU has them (this one does); a GPU's ratios are another matter.
3. Loss curves. ``python -m pretrain.train --config configs/tiny_cpu.yaml`` on the demo shards
   (built here unless ``--shards`` is given), one process, ``--steps`` steps of ``--batch`` images
   (the config's 64 would take most of an hour here), for each ``train.seed`` in
   ``--curve-seeds``: the modes of one seed start from the same weights and see the same batches.
   The loss of every 10-step window; the final loss (mean of the last 5 windows), its gap to fp32
   of the same seed and the largest gap of any window; fp32's seed-to-seed gap is the scale of
   run-to-run noise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("fp32", "bf16", "bf16-autocast")


def build(name: str, img: int):
    """The model every mode starts from: initialised from one seed, with a head that is not zero so
    that every layer has a gradient at the first step."""
    import torch

    from pretrain.models.vit import create_model

    m = create_model(name, img_size=img, num_classes=10, init_seed=0)
    with torch.no_grad():
        m.head.weight.copy_(torch.randn(m.head.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
    return m


def engine_for(name: str, img: int, mode: str, batch: int):
    from pretrain.config.schema import OptimConfig, TrainConfig
    from pretrain.distributed.config import ZeroConfig
    from pretrain.distributed.engine import initialize

    optim = OptimConfig(name="sgd", lr=1.0, momentum=0.0, weight_decay=0.0, grad_clip=0.0, warmup_steps=0,
                        schedule="constant", min_lr=1.0)
    train = TrainConfig(steps=10 ** 6, global_batch_size=batch, micro_batch_size=batch, precision=mode,
                        activation_checkpointing=False)
    engine, _ = initialize(build(name, img), optim, train, ZeroConfig(stage=1), world_size=1)
    return engine


def masters(engine) -> dict:
    import deepspeed

    out = {}
    for n, p in engine.module.named_parameters():
        m = deepspeed.utils.safe_get_full_fp32_param(p)
        out[n] = (m if m is not None else p).detach().double().clone()
    return out


def batch_of(seed: int, n: int, img: int):
    import torch

    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(n, 3, img, img, generator=g), torch.randint(0, 10, (n,), generator=g)


def step(engine, x, y, mode: str) -> None:
    from pretrain.distributed.precision import compute_dtype
    from pretrain.models.losses import classification_loss

    loss = classification_loss(engine(x.to(compute_dtype(mode))), y, multi_label=False)
    engine.backward(loss)
    engine.step()


def first_updates(args) -> list[dict]:
    """Part 1 and 2 (module docstring), one row per model and mode."""
    import deepspeed
    import torch

    from pretrain.models.losses import classification_loss

    rows = []
    for name in args.models.split(","):
        img = args.img
        ref_model = build(name, img)
        engines = {m: engine_for(name, img, m, args.micro) for m in MODES}
        given = {n: p.detach().double() for n, p in ref_model.named_parameters()}
        acc = {m: {"rel": [], "cos": [], "worst": [], "offset": []} for m in MODES}
        for seed in range(args.seeds):
            x, y = batch_of(seed, args.micro, img)
            ref_model.zero_grad()
            classification_loss(ref_model(x), y, multi_label=False).backward()
            ref = {n: -p.grad.double() for n, p in ref_model.named_parameters()}  # SGD at lr 1
            ref_sq = sum(float(r.pow(2).sum()) for r in ref.values())
            for m, eng in engines.items():
                start = masters(eng)
                step(eng, x, y, m)
                end = masters(eng)
                num = dot = ours_sq = 0.0
                worst = 0.0
                for n, r in ref.items():
                    d = end[n] - start[n]
                    num += float((d - r).pow(2).sum())
                    dot += float((d * r).sum())
                    ours_sq += float(d.pow(2).sum())
                    worst = max(worst, float((d - r).norm() / r.norm().clamp_min(1e-30)))
                acc[m]["rel"].append((num / ref_sq) ** 0.5)
                acc[m]["cos"].append(dot / (ours_sq * ref_sq) ** 0.5)
                acc[m]["worst"].append(worst)
                if seed == 0:  # how far the masters started from the given weights, against one update
                    acc[m]["offset"].append(sum(float((start[n] - given[n]).pow(2).sum()) for n in given) ** 0.5
                                            / ref_sq ** 0.5)
                with torch.no_grad():  # back to the given weights for the next batch
                    for n, p in eng.module.named_parameters():
                        if deepspeed.utils.safe_get_full_fp32_param(p) is not None:
                            deepspeed.utils.safe_set_full_fp32_param(p, given[n].float())
                        p.copy_(given[n].to(p.dtype))
        secs = timed(engines, args, img)
        for m in MODES:
            rows.append({"model": f"{name.split('_patch')[0]}@{img}", "mode": m,
                         "relative_error": statistics.mean(acc[m]["rel"]), "cosine": statistics.mean(acc[m]["cos"]),
                         "worst_tensor": statistics.mean(acc[m]["worst"]), "start_offset": acc[m]["offset"][0],
                         "step_s": secs[m], "step_ratio": secs[m] / secs["fp32"]})
        del engines
    return rows


def timed(engines: dict, args, img: int) -> dict:
    x, y = batch_of(99, args.micro, img)
    for m, eng in engines.items():  # warm-up: first-call allocations, oneDNN primitive creation
        step(eng, x, y, m)
    per: dict = {m: [] for m in engines}
    for _ in range(args.rounds):
        for m, eng in engines.items():
            t = time.perf_counter()
            for _ in range(args.reps):
                step(eng, x, y, m)
            per[m].append((time.perf_counter() - t) / args.reps)
    return {m: statistics.median(v) for m, v in per.items()}


def curves(args, shards: Path, root: Path) -> list[dict]:
    """Part 3: one training run per mode and seed; every 10-step window's loss, seconds per step."""
    rows = []
    for seed in range(args.curve_seeds):
        for m in MODES:
            out = root / f"{m}-{seed}"
            cmd = [sys.executable, "-m", "pretrain.train", "--config", "configs/tiny_cpu.yaml",
                   f"data.train_shards={shards}", f"train.output_dir={out}", f"train.precision={m}",
                   f"train.seed={seed}", f"train.steps={args.steps}", f"train.global_batch_size={args.batch}",
                   f"train.micro_batch_size={args.batch}", "data.workers=0", "logging.wandb.mode=disabled",
                   "train.log_every_steps=10", f"checkpoint.every_steps={10 ** 6}"]
            env = {k: v for k, v in os.environ.items()  # not this process's group: the run makes its own
                   if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
            env.update(OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
            t = time.time()
            r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            if r.returncode:
                sys.exit(f"{m} run failed:\n{r.stderr[-3000:]}")
            logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            windows = [x for x in logged if "loss" in x and "images_per_sec" in x]
            losses = [x["loss"] for x in windows]
            rows.append({"mode": m, "seed": seed, "losses": losses, "final_loss": statistics.mean(losses[-5:]),
                         "wall_s": time.time() - t,
                         "step_s": statistics.median(args.batch / x["images_per_sec"] for x in windows[1:] or windows)})
    ref = {r["seed"]: r for r in rows if r["mode"] == "fp32"}
    for r in rows:
        r["final_gap"] = r["final_loss"] - ref[r["seed"]]["final_loss"]
        r["max_window_gap"] = max(abs(a - b) for a, b in zip(r["losses"], ref[r["seed"]]["losses"]))
    return rows


def demo_shards(root: Path) -> Path:
    out = root / "shards"
    subprocess.run([sys.executable, "-m", "data_pipeline.write_shards", "--source", "demo", "--split", "train",
                    "--output", str(out), "--shard-size", "256", "--quiet"], cwd=REPO, check=True)
    return out / "manifest.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="vit_tiny_patch16_224,vit_small_patch16_224",
                    help="models of parts 1 and 2, comma-separated")
    ap.add_argument("--img", type=int, default=64, help="image size of parts 1 and 2")
    ap.add_argument("--seeds", type=int, default=3, help="batches the first-update error is averaged over")
    ap.add_argument("--micro", type=int, default=16, help="images per batch in parts 1 and 2")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--reps", type=int, default=3, help="steps per timing round")
    ap.add_argument("--steps", type=int, default=200, help="steps of each loss curve")
    ap.add_argument("--batch", type=int, default=16, help="images per step of the loss curves")
    ap.add_argument("--curve-seeds", type=int, default=2, help="train.seed values of the loss curves (0: no curves)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the training runs")
    ap.add_argument("--shards", help="demo manifest.json (default: written to a temporary folder)")
    args = ap.parse_args()

    import torch

    from pretrain.distributed.process import init_distributed

    torch.set_num_threads(args.threads)
    init_distributed()
    t0 = time.time()
    rows = first_updates(args)
    print("\nfirst update against plain PyTorch fp32 (SGD lr 1, ZeRO-1, one rank; mean over "
          f"{args.seeds} batches of {args.micro}); step time: median of {args.rounds} interleaved rounds")
    print("| model | mode | relative error | cosine | worst tensor | masters' start offset | s/step | vs fp32 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['mode']} | {r['relative_error']:.2e} | {r['cosine']:.6f} | {r['worst_tensor']:.2e} "
              f"| {r['start_offset']:.2e} | {r['step_s']:.3f} | {r['step_ratio']:.2f} |")
    print(f"({time.time() - t0:.0f} s)", flush=True)
    if args.curve_seeds < 1:
        return

    with tempfile.TemporaryDirectory(prefix="bf16-policy-") as tmp:
        shards = Path(args.shards) if args.shards else demo_shards(Path(tmp))
        t1 = time.time()
        runs = curves(args, shards, Path(tmp))
    print(f"\nloss curves: configs/tiny_cpu.yaml, {args.steps} steps of {args.batch} images, one process, "
          f"train.seed 0-{args.curve_seeds - 1}; final = mean of the last 5 windows of 10 steps; gaps against fp32 "
          "of the same seed (same initial weights and batches)")
    print("| mode | seed | loss at step 10 / 50 / 100 / end | final | gap to fp32 | largest window gap | s/step |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in runs:
        pick = [r["losses"][i] for i in (0, 4, 9) if i < len(r["losses"])] + [r["losses"][-1]]
        print(f"| {r['mode']} | {r['seed']} | {' / '.join(f'{v:.3f}' for v in pick)} | {r['final_loss']:.4f} "
              f"| {r['final_gap']:+.4f} | {r['max_window_gap']:.4f} | {r['step_s']:.3f} |")
    fp32 = [r["final_loss"] for r in runs if r["mode"] == "fp32"]
    print("mean final gap to fp32 over seeds: " + ", ".join(
        f"{m} {statistics.mean(r['final_gap'] for r in runs if r['mode'] == m):+.4f}" for m in MODES[1:])
          + (f"; fp32 seed to seed: {max(fp32) - min(fp32):.4f}" if len(fp32) > 1 else ""))
    print(f"({time.time() - t1:.0f} s; total {time.time() - t0:.0f} s)")
    print("windows:", json.dumps({f"{r['mode']}/{r['seed']}": [round(v, 4) for v in r["losses"]] for r in runs}))


if __name__ == "__main__":
    main()
