"""Seconds each checkpoint save holds the training thread: synchronous against asynchronous
(``checkpoint.async``), in one run, on the same data and layout.

    python benchmarks/ckpt_blocking.py                  # ViT-B/16 @ 64 px, 2 CPU ranks, ZeRO-2: ~6 min
    python benchmarks/ckpt_blocking.py --model vit_small_patch16_224 --steps 6

Both jobs train the same steps with a save every ``--every`` steps and write their per-save
blocked seconds (``checkpoint_blocked_seconds`` in summary.json: from the save call to the
training thread's return, the final save's wait for the writer included). Prints each save's
blocked seconds, their means and ``ratio = sync / async`` (goal >= 5), the checkpoint size, the
step time of each job, and whether the last checkpoints hold the same tensors (same files up to
torch's random serialization id).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def members(path: Path) -> dict:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist() if not n.endswith("serialization_id")}


def run(kind: str, root: Path, shards: Path, args) -> dict:
    out = root / kind
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(args.port),
           "--module", "pretrain.train", "--config", "configs/tiny_cpu.yaml", f"data.train_shards={shards}",
           f"train.output_dir={out}", f"model.name={args.model}", "model.img_size=64", "model.num_classes=10",
           "train.global_batch_size=8", "train.micro_batch_size=4", "data.workers=1", "logging.wandb.mode=disabled",
           "zero.stage=2", f"train.steps={args.steps}", "train.log_every_steps=1",
           f"checkpoint.every_steps={args.every}", "checkpoint.keep_last=10", "optim.warmup_steps=1",
           f"checkpoint.async={'true' if kind == 'async' else 'false'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{kind} job failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rate = [s["images_per_sec"] for s in steps if "images_per_sec" in s][1:]
    return {"out": out, "blocked": summary["checkpoint_blocked_seconds"], "img_s": statistics.median(rate),
            "waited": summary.get("checkpoint_waited_seconds") or []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vit_base_patch16_224")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--port", type=int, default=29621)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        root = Path(tmp)
        shards = root / "shards"
        subprocess.run([sys.executable, "-m", "data_pipeline.write_shards", "--source", "demo", "--split", "train",
                        "--output", str(shards), "--shard-size", "64", "--quiet"], cwd=REPO, check=True)
        res = {k: run(k, root, shards / "manifest.json", args) for k in ("sync", "async")}
        last = f"step_{args.steps:08d}"
        files = sorted(p.name for p in (res["sync"]["out"] / "checkpoints" / last).glob("*.pt"))
        same = all(members(res["sync"]["out"] / "checkpoints" / last / f)
                   == members(res["async"]["out"] / "checkpoints" / last / f)
                   for f in files)
        size = sum(p.stat().st_size for p in (res["sync"]["out"] / "checkpoints" / last).iterdir()) / 2 ** 20
    print(f"{args.model} @ 64 px, 2 CPU ranks, ZeRO-2, checkpoint {size:,.0f} MiB, a save every {args.every} steps")
    for k, r in res.items():
        print(f"  {k:5s} blocked per save (s): {', '.join(f'{b:.2f}' for b in r['blocked'])}; "
              f"mean {statistics.mean(r['blocked']):.2f}; median img/s {r['img_s']:.1f}"
              + (f"; of which waiting for the writer: {', '.join(f'{w:.2f}' for w in r['waited'])}"
                 if r["waited"] else ""))
    ratio = statistics.mean(res["sync"]["blocked"]) / statistics.mean(res["async"]["blocked"])
    steady = slice(1, -1)  # after the first (which allocates the host buffers), before the last (which waits)
    s_sync, s_async = res["sync"]["blocked"][steady] or res["sync"]["blocked"], res["async"]["blocked"][steady] \
        or res["async"]["blocked"]
    print(f"ratio = sync / async blocked seconds, steady-state saves: "
          f"{statistics.mean(s_sync) / statistics.mean(s_async):.1f}x "
          f"(goal >= 5); all saves, the first's buffer allocation and the last's wait for the writer included: "
          f"{ratio:.1f}x")
    print(f"last checkpoints hold the same tensors: {same}")


if __name__ == "__main__":
    main()
