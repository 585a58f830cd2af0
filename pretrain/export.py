"""Export a run's weights to one safetensors file with timm-compatible names.

    python -m pretrain.export RUN_DIR OUT.safetensors [--step N]

Works from any ZeRO stage: DeepSpeed's ``zero_to_fp32`` merges the fp32 master-weight shards of
stages 1-3 (the exact weights the optimizer holds, also when training in bf16); stage 0 stores
the whole module. The file's metadata records the model section of the config, the patch grid,
the step and the W&B run id, so ``load_weights`` and ``vit-transfer`` need nothing else.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Optional

import torch

from data_pipeline.errors import cli_errors
from pretrain import rundir
from pretrain.config import from_dict, image_size
from pretrain.model import model_defaults


class ExportError(ValueError):
    pass


def find_checkpoint(run_dir: str | Path, step: Optional[int] = None) -> Path:
    """A complete, verified checkpoint of a run (``pretrain.rundir.find_checkpoint``); a damaged
    newest one is skipped with a warning on stderr, and left where it is (training owns it)."""
    try:
        return rundir.find_checkpoint(run_dir, step, warn=lambda msg: print(f"vit-export: warning: {msg}",
                                                                             file=sys.stderr, flush=True))
    except LookupError as e:
        raise ExportError(str(e)) from None


def consolidate(ckpt: Path) -> dict[str, torch.Tensor]:
    """fp32 full state dict from one DeepSpeed checkpoint directory, on CPU."""
    info = json.loads((ckpt / "run.json").read_text())
    stage = info["config"]["zero"]["stage"]
    if stage == 0:
        # our own file, written by this program: DeepSpeed's module state is a plain state dict
        states = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        sd = states["module"]
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # it prints per-tensor progress and a progress bar
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
    return {k: v.detach().float().contiguous() for k, v in sd.items()}


def load_run_weights(run_dir: str | Path, step: Optional[int] = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(fp32 state dict, info) of a run. ``info``: model (config section), step, wandb_run_id,
    img_size, grid_size, checkpoint (path)."""
    ckpt = find_checkpoint(run_dir, step)
    run = json.loads((ckpt / "run.json").read_text())
    cfg = from_dict(run["config"])
    img = image_size(cfg.model)
    stride = model_defaults(cfg.model.name)["stride"]
    info = {"model": run["config"]["model"], "step": run["step"], "wandb_run_id": run.get("wandb_run_id"),
            "img_size": img, "grid_size": [img // stride, img // stride], "checkpoint": str(ckpt),
            "run_dir": str(Path(cfg.train.output_dir))}
    return consolidate(ckpt), info


def export(run_dir: str | Path, out: str | Path, step: Optional[int] = None) -> dict:
    from safetensors.torch import save_file

    sd, info = load_run_weights(run_dir, step)
    meta = {"format": "pt", "model_name": info["model"]["name"], "model": json.dumps(info["model"]),
            "grid_size": "x".join(map(str, info["grid_size"])), "img_size": str(info["img_size"]),
            "step": str(info["step"]), "wandb_run_id": info["wandb_run_id"] or ""}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(sd, str(tmp), metadata=meta)
    tmp.replace(out)
    return {**info, "output": str(out), "tensors": len(sd)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="vit-export", description="Consolidate a run's weights into one safetensors file")
    ap.add_argument("run_dir", help="run directory, its checkpoints/ directory, or one checkpoint")
    ap.add_argument("output", help="OUT.safetensors")
    ap.add_argument("--step", type=int, default=None, help="export this step instead of the newest")
    args = ap.parse_args(argv)
    with cli_errors("vit-export", ExportError):
        r = export(args.run_dir, args.output, args.step)
    print(f"vit-export: {r['model']['name']} step {r['step']} from {r['checkpoint']} -> {r['output']} "
          f"({r['tensors']} tensors)", file=sys.stderr)


if __name__ == "__main__":
    main()
