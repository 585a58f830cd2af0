"""`make demo`: the whole system on one machine in a few minutes.

1. writes the built-in demo shards (pre-training classes, and held-out classes for transfer)
2. pre-trains ViT-Tiny/16 at 64 px on 2 local ranks through the deepspeed runner
   (ZeRO-2, bf16 where the CPU or GPU supports it, W&B offline)
3. evaluates transfer on the held-out classes (linear probe on frozen features)
4. draws the loss / throughput curves and prints where everything is

Every step is a real command a user could type (printed before it runs). Re-running after an
interruption resumes: finished shards are kept and training continues from its last checkpoint.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from data_pipeline.errors import Parser, cli_errors, path_arg
from launch.runner import LaunchSpec, deepspeed_command
from pretrain.distributed.precision import default_precision

BIN = Path(sys.executable).parent
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"  # the checkout's, from any folder


def step(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


def run(cmd: list[str], env: dict | None = None) -> None:
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    r = subprocess.run(cmd, env=env)
    if r.returncode != 0:
        sys.exit(f"demo: step failed with exit code {r.returncode}: {cmd[0]} ... (re-run `make demo` to resume)")


def write_shards(out: Path, samples: int, transfer_samples: int | None) -> dict[str, Path]:
    test_n = transfer_samples // 2 if transfer_samples else None
    splits = {"train": ("demo", "train", samples), "transfer-train": ("demo-transfer", "train", transfer_samples),
              "transfer-test": ("demo-transfer", "test", test_n)}
    paths = {}
    for name, (source, split, n) in splits.items():
        d = out / "shards" / name
        paths[name] = d
        if (d / "manifest.json").is_file():
            print(f"{d}: already written", flush=True)
            continue
        cmd = [sys.executable, "-m", "data_pipeline.write_shards", "--source", source, "--split", split,
               "--output", str(d), "--shard-size", "256", "--quiet"]
        if n:
            cmd += ["--limit", str(n)]
        run(cmd)
    return paths


def pretrain(out: Path, train_manifest: Path, steps: int, ranks: int, precision: str, extra: list[str],
             fewshot_root: Path) -> Path:
    import torch

    run_dir = out / "run"
    gpus = torch.cuda.device_count()
    spec = LaunchSpec(config=str(CONFIG), gpus_per_node=min(gpus, ranks) if gpus else ranks, overrides=[
        f"data.train_shards={train_manifest}", f"train.output_dir={run_dir}", f"train.steps={steps}",
        f"train.precision={precision}", "zero.stage=2", "logging.wandb.mode=offline",
        f"checkpoint.every_steps={max(10, steps // 4)}", *probes(steps, f"demo:{fewshot_root}"), *extra])
    cmd = deepspeed_command(spec)
    # the venv first on PATH: DeepSpeed JIT-builds its CPU op with the `ninja` it finds there
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    run(cmd, env)
    return run_dir


def transfer(out: Path, run_dir: Path, shards: dict[str, Path]) -> dict:
    result = out / "transfer.json"
    run([sys.executable, "-m", "pretrain.transfer", "--checkpoint", str(run_dir), "--suite", "demo",
         "--protocol", "linear", "--data-root", str(shards["transfer-train"].parent), "--output", str(result)])
    return json.loads(result.read_text())


FEWSHOT_KEY = "eval/fewshot/demo/10shot"
TARGET = 0.95  # of FEWSHOT_KEY: about 60 of the default 200 steps on 2 CPU ranks


def probes(steps: int, suite: str) -> list[str]:
    """Few-shot probes on the held-out shapes (``suite``) while training: the plot shows them rise as
    the loss falls, and the run records what it took to reach TARGET (time to accuracy)."""
    return [f"validation.every_steps={max(5, steps // 10)}", f"validation.fewshot_suites=[{suite}]",
            f"validation.target_metric={FEWSHOT_KEY}", f"validation.target_value={TARGET}"]


def plot(run_dir: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs, evals = {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        # a step re-logged after a resume keeps its last value; evaluation records share the step
        (recs if "loss" in r else evals)[r["step"]] = r
    steps = sorted(recs)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(steps, [recs[s]["loss"] for s in steps], marker=".", color="tab:blue")
    a.set(xlabel="optimizer step", ylabel="training loss", title="loss and few-shot accuracy")
    key = FEWSHOT_KEY
    es = sorted(s for s in evals if key in evals[s])
    if es:
        a2 = a.twinx()
        a2.plot(es, [100 * evals[s][key] for s in es], marker="o", color="tab:orange")
        a2.set_ylabel("10-shot accuracy on held-out shapes (%)", color="tab:orange")
    b.plot(steps, [recs[s]["images_per_sec"] for s in steps], marker=".")
    b.set(xlabel="optimizer step", ylabel="images / s (all ranks)", title="throughput")
    fig.tight_layout()
    path = out / "plots" / "training.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summarise(run_dir: Path, tr: dict, plot_path: Path, out: Path) -> str:
    s = json.loads((run_dir / "summary.json").read_text())
    every = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in every if "loss" in r]
    shots = [r for r in every if FEWSHOT_KEY in r]
    from launch.plot_scaling import PlotError, load_run
    from pretrain.checkpointing.rundir import latest_complete

    try:  # the windows after warm-up (plot_scaling.load_run): their images over their seconds
        ips = load_run(run_dir).images_per_sec
    except PlotError:  # a single window: its own
        ips = recs[-1]["images_per_sec"]

    ckpt = latest_complete(s["checkpoint_dir"])
    wandb_runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    task = next(iter(tr["tasks"].values()))
    acc, chance = task["accuracy"], task["chance"]
    lines = [
        "", "vitscale demo: done", "",
        f"  pre-training   {s['step']} steps on {s['world_size']} ranks"
        + (f" (resumed from step {s['resumed_from']})" if s.get("resumed_from") else ""),
        f"  loss           {recs[0]['loss']:.3f} (step {recs[0]['step']}) -> "
        f"{recs[-1]['loss']:.3f} (step {recs[-1]['step']})",
        f"  throughput     {ips:.1f} images/s over all ranks",
        (f"  few-shot       10-shot on the held-out shapes while training: {shots[0][FEWSHOT_KEY]:.1%} (step "
         f"{shots[0]['step']}) -> {shots[-1][FEWSHOT_KEY]:.1%} (step {shots[-1]['step']})") if shots else
        "  few-shot       (no evaluation logged)",
        f"  transfer       linear probe on {task['num_classes']} held-out classes: top-1 {acc:.1%} "
        f"(chance {chance:.1%}), step {tr['step']} checkpoint",
        f"  cost           {_cost(s)}",
        "",
        f"  checkpoint     {ckpt}",
        f"  metrics        {run_dir / 'metrics.jsonl'}",
        f"  W&B (offline)  {wandb_runs[-1] if wandb_runs else '(disabled)'}",
        f"                 upload with: wandb sync {run_dir / 'wandb'}/offline-run-*",
        f"  plots          {plot_path}",
        f"  transfer json  {out / 'transfer.json'}",
        f"  export         python -m pretrain.export {run_dir} {out / 'vit_tiny_demo.safetensors'}",
    ]
    return "\n".join(lines)


def _cost(s: dict) -> str:
    """What pre-training cost, and what it took to reach the run's target (validation.target_metric)."""
    hours = s.get("device_seconds")
    total = "device-hours unknown" if hours is None else f"{hours / 3600:.3g} device-hours of pre-training"
    rec = s.get("target_reached")
    if not s.get("target"):
        return total
    if rec is None:
        return f"{total}; {s['target']} not reached in {s['step']} steps"
    at = "" if rec.get("device_hours") is None or hours is None else f", after {rec['device_hours']:.3g} of them"
    return f"{total}; {s['target']} at step {rec['step']}{at}"


def main(argv=None) -> None:
    ap = Parser(prog="vit-demo", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="demo_out", type=path_arg, help="where shards, run and results go")
    ap.add_argument("--steps", type=int, default=200, help="pre-training optimizer steps")
    ap.add_argument("--ranks", type=int, default=2, help="local ranks (processes)")
    ap.add_argument("--samples", type=int, default=4096, help="pre-training images to generate")
    ap.add_argument("--transfer-samples", type=int, default=None,
                    help="held-out-class training images (test gets half); default: the full split")
    ap.add_argument("overrides", nargs="*", help="extra training overrides, e.g. optim.lr=3e-3")
    args = ap.parse_args(argv)
    for flag, value, least in (("--steps", args.steps, 1), ("--ranks", args.ranks, 1), ("--samples", args.samples, 1),
                               ("--transfer-samples", args.transfer_samples, 2)):  # 2: the test split gets half
        if value is not None and value < least:  # 0 is no count: not "the full split", not the runner's error
            ap.error(f"{flag} {value}: must be >= {least}")
    with cli_errors("vit-demo"):  # --out, the config and the overrides, before any shard is written
        from data_pipeline.files import check_output_dir
        from pretrain.config import load_config

        check_output_dir(args.out, "--out")  # else each step's child says it, then "step failed", exit 1

        if not CONFIG.is_file():
            raise FileNotFoundError(f"{CONFIG}: the demo's config is not there; vit-demo runs from a checkout "
                                    "(make demo)")
        load_config(CONFIG, [*probes(args.steps, "demo"), *args.overrides])  # as the run will read them
    out = Path(args.out)
    t0 = time.time()
    precision = default_precision()
    step("1/4 demo shards")
    shards = write_shards(out, args.samples, args.transfer_samples)
    step(f"2/4 pre-training ViT-Tiny/16 @ 64 px, {args.ranks} ranks, ZeRO-2, {precision}")
    run_dir = pretrain(out, shards["train"] / "manifest.json", args.steps, args.ranks, precision, args.overrides,
                       fewshot_root=shards["transfer-train"].parent)
    step("3/4 transfer: linear probe on the held-out demo classes")
    tr = transfer(out, run_dir, shards)
    step("4/4 plots")
    p = plot(run_dir, out)
    print(summarise(run_dir, tr, p, out))
    print(f"\n  total time     {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
