"""Tokens to accuracy: the same model on the same shards to the same number of epochs four ways
(every step at the model's resolution; a resolution schedule; patch dropout; both), over seeds:
the training FLOPs, the wall time and the final validation accuracy of each; and, as the control at
equal compute, every step at the model's resolution for only as many steps as the schedule's FLOPs
buy (``fixed-equal-flops``: fewer epochs, its own warmup and cosine decay).

    python benchmarks/tokens_to_accuracy.py --out /tmp/t2a --markdown t2a.md    # about 45 min on 2 loaded cores
    python benchmarks/tokens_to_accuracy.py --out /tmp/t2a-toy --toy             # every way at toy size, 4 min

The task is the demo set's harder split (``data_pipeline/shards/demo_data.py``, ``shapes-train`` /
``shapes-val``: colour narrows an image down to about three classes, shape and texture tell the
rest, and the textures are fine enough that a small resolution blurs them), written once into
``--out``. Every run is ``python -m pretrain.train --config configs/tiny_cpu.yaml`` (ViT-Ti/16,
one process, bf16 at ZeRO-1, AdamW with warmup and cosine decay) with the same steps, batches and
seed for the four ways; only ``train.resolution_schedule`` and ``model.patch_drop_rate`` differ.
Accuracy is the in-training validation top-1 at the last step, at the model's resolution over the
whole validation split. FLOPs are the run's own: each logging window's TFLOP/s over its img/s (the
model FLOPs per image at that window's resolution and kept tokens) times its images, summed. Wall
time is the training loop's, less the evaluation. The goal: the schedule within 1 point of the
fixed run's accuracy with at most 0.6x its training FLOPs (mean over the seeds).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WAYS = ("fixed", "schedule", "patch-drop", "both", "fixed-equal-flops")
GOAL_POINTS, GOAL_FLOPS = 1.0, 0.6
MODEL = "vit_tiny_patch16_224"


def shards(out: Path, train_images: int, val_images: int) -> tuple[Path, Path]:
    """The harder demo splits as shards in ``out`` (written once)."""
    from data_pipeline.shards.writer import write_demo_shards

    made = []
    for split, n in (("shapes-train", train_images), ("shapes-val", val_images)):
        where = out / f"{split}-{n}"
        if not (where / "manifest.json").is_file():
            write_demo_shards(where, split=split, n=n, shard_size=512, workers=2)
        made.append(where / "manifest.json")
    return made[0], made[1]


def schedule_share(args, steps: int) -> float:
    """The schedule's training FLOPs over the fixed run's (analytic: each phase's steps at its size)."""
    import yaml

    from pretrain.config.phases import resolution_phases
    from pretrain.config.schema import TrainConfig
    from pretrain.models.arch import analytic_flops

    train = TrainConfig(steps=steps, resolution_schedule=yaml.safe_load(args.schedule))
    per = {p.img_size: analytic_flops(MODEL, p.img_size, 10) for p in resolution_phases(train, args.img)}
    return sum(p.steps * per[p.img_size] for p in resolution_phases(train, args.img)) / (
        steps * analytic_flops(MODEL, args.img, 10))


def overrides(args, way: str, seed: int, steps: int, train: Path, val: Path, run: Path) -> list[str]:
    extra = {"fixed": [], "fixed-equal-flops": [], "schedule": [f"train.resolution_schedule={args.schedule}"],
             "patch-drop": [f"model.patch_drop_rate={args.patch_drop}"],
             "both": [f"train.resolution_schedule={args.schedule}", f"model.patch_drop_rate={args.patch_drop}"]}
    return [f"data.train_shards={train}", f"data.val_shards={val}", f"model.img_size={args.img}",
            "model.num_classes=10", f"train.steps={steps}", f"train.global_batch_size={args.batch}",
            f"train.micro_batch_size={args.batch}", "train.precision=bf16", "zero.stage=1", f"train.seed={seed}",
            f"optim.lr={args.lr}", f"optim.warmup_steps={max(1, steps // 20)}", "optim.schedule=cosine",
            f"train.log_every_steps={args.log_every}", f"validation.every_steps={steps}",
            f"checkpoint.every_steps={steps}", "data.workers=1", "logging.wandb.mode=disabled",
            f"train.output_dir={run}", *extra[way]]


def logged_flops(records: list[dict], global_batch: int) -> float:
    """Training FLOPs as the run logged them: per window, TFLOP/s per device over img/s per device
    (the model FLOPs of one image at the window's resolution and kept tokens) times its images."""
    total, last = 0.0, 0
    for r in records:
        if "tflops_per_device" not in r:
            continue
        total += r["tflops_per_device"] * 1e12 / r["images_per_sec_per_device"] * (r["step"] - last) * global_batch
        last = r["step"]
    return total


def run_one(args, way: str, seed: int, steps: int, train: Path, val: Path) -> dict:
    run = args.out / f"{way}-seed{seed}"
    if way == "fixed-equal-flops":
        steps = round(steps * schedule_share(args, steps))
    if (run / "result.json").is_file():  # a finished run is kept: the benchmark resumes where it stopped
        return json.loads((run / "result.json").read_text())
    cmd = [sys.executable, "-m", "pretrain.train", "--config", str(REPO / "configs/tiny_cpu.yaml"),
           *overrides(args, way, seed, steps, train, val, run)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.time()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if r.returncode != 0:
        raise SystemExit(f"{way} seed {seed} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    final = [rec for rec in records if "eval/top1" in rec][-1]
    summary = json.loads((run / "summary.json").read_text())
    sizes = [rec["img_size"] for rec in records if "img_size" in rec]
    out = {"way": way, "seed": seed, "steps": steps, "top1": 100.0 * final["eval/top1"],
           "flops": logged_flops(records, args.batch), "train_seconds": summary["seconds"] - final["eval/seconds"],
           "process_seconds": wall, "img_sizes": sorted(set(sizes)),
           "final_loss": [rec["loss"] for rec in records if "loss" in rec][-1]}
    (run / "result.json").write_text(json.dumps(out, indent=1))
    print(f"  {way:>10} seed {seed}: top-1 {out['top1']:.2f} %, {out['flops'] / 1e12:.2f} TFLOP, "
          f"{out['train_seconds']:.0f} s training ({wall:.0f} s in all)", flush=True)
    return out


def table(results: list[dict]) -> str:
    fixed = {r["seed"]: r for r in results if r["way"] == "fixed"}
    lines = ["| way | seed | steps | resolutions (px) | train TFLOP | vs fixed | train s | vs fixed | val top-1 % | "
             "vs fixed |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        f = fixed[r["seed"]]
        sizes = ", ".join(map(str, r["img_sizes"]))
        lines.append(f"| {r['way']} | {r['seed']} | {r['steps']} | {sizes} | {r['flops'] / 1e12:.2f} | "
                     f"{r['flops'] / f['flops']:.2f}x | {r['train_seconds']:.0f} | "
                     f"{r['train_seconds'] / f['train_seconds']:.2f}x | {r['top1']:.2f} | "
                     f"{r['top1'] - f['top1']:+.2f} |")
    lines += ["", "| way | mean val top-1 % | vs fixed (points) | train FLOPs vs fixed | train time vs fixed |",
              "|---|---:|---:|---:|---:|"]
    for way in WAYS:
        rows = [r for r in results if r["way"] == way]
        if not rows:
            continue
        top1 = statistics.mean(r["top1"] for r in rows)
        gap = statistics.mean(r["top1"] - fixed[r["seed"]]["top1"] for r in rows)
        flops = statistics.mean(r["flops"] / fixed[r["seed"]]["flops"] for r in rows)
        secs = statistics.mean(r["train_seconds"] / fixed[r["seed"]]["train_seconds"] for r in rows)
        lines.append(f"| {way} | {top1:.2f} | {gap:+.2f} | {flops:.2f}x | {secs:.2f}x |")
    return "\n".join(lines)


def verdict(results: list[dict]) -> str:
    by = {(r["way"], r["seed"]): r for r in results}
    rows = [r for r in results if r["way"] == "schedule"]
    if not rows:
        return ""
    gap = statistics.mean(r["top1"] - by["fixed", r["seed"]]["top1"] for r in rows)
    flops = statistics.mean(r["flops"] / by["fixed", r["seed"]]["flops"] for r in rows)
    met = gap >= -GOAL_POINTS and flops <= GOAL_FLOPS
    out = (f"goal (the schedule within {GOAL_POINTS:g} point of the fixed run with at most {GOAL_FLOPS:g}x its "
           f"FLOPs): {gap:+.2f} points at {flops:.2f}x the FLOPs -> {'met' if met else 'NOT met'}")
    same = [r for r in rows if ("fixed-equal-flops", r["seed"]) in by]
    if same:
        at_equal = statistics.mean(r["top1"] - by["fixed-equal-flops", r["seed"]]["top1"] for r in same)
        out += f"; against the fixed run of equal FLOPs: {at_equal:+.2f} points"
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="working folder: shards, one run folder per way and seed")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    ap.add_argument("--train-images", type=int, default=4096)
    ap.add_argument("--val-images", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--img", type=int, default=64, help="the model's resolution (model.img_size)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--schedule", default="[[0,32],[0.4,48],[0.75,64]]", help="train.resolution_schedule")
    ap.add_argument("--patch-drop", type=float, default=0.5, help="model.patch_drop_rate")
    ap.add_argument("--log-every", type=int, default=16)
    ap.add_argument("--toy", action="store_true", help="2 epochs of 512 images, one seed: a rehearsal")
    ap.add_argument("--markdown", type=Path, help="write the tables here too")
    args = ap.parse_args(argv)
    if args.toy:
        args.epochs, args.train_images, args.val_images, args.seeds = 2, 512, 256, args.seeds[:1]
    args.out.mkdir(parents=True, exist_ok=True)
    train, val = shards(args.out, args.train_images, args.val_images)
    steps = args.epochs * args.train_images // args.batch
    print(f"tokens to accuracy: ViT-Ti/16 at {args.img} px, {args.epochs} epochs of {args.train_images} images "
          f"= {steps} steps of {args.batch}; schedule {args.schedule} ({schedule_share(args, steps):.2f}x the FLOPs), "
          f"patch dropout {args.patch_drop}", flush=True)
    t0 = time.time()
    results = [run_one(args, way, seed, steps, train, val) for seed in args.seeds for way in args.ways]
    import torch

    where = (f"{time.time() - t0:.0f} s for the whole benchmark; {platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}")
    text = "\n\n".join(filter(None, [table(results), verdict(results), where]))
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
