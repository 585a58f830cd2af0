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
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

from data_pipeline.errors import cli_errors
from pretrain import rundir
from pretrain.config import from_dict, image_size
from pretrain.model import model_defaults


class ExportError(ValueError):
    pass


class ExportRescued(RuntimeError):
    """The output could not be written at the end; the weights went elsewhere (the message says where)."""


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
    else:  # ZeRO's fp32 master weights; BF16_Optimizer's files too (ZeRO-1, bf16, fp32 accumulation)
        from pretrain.ds_compat import fp32_state_dict

        sd = fp32_state_dict(ckpt)
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


def _umask() -> int:
    mask = os.umask(0o022)  # the only portable way to read it: set and put back
    os.umask(mask)
    return mask


def write_safetensors(sd: dict[str, torch.Tensor], out: Path, meta: dict) -> Path:
    """Atomically (temp file beside ``out``, then rename), with the mode of a normal new file:
    safetensors writes through a 0600 temp file, which would keep other users from the weights."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        save_file(sd, str(tmp), metadata=meta)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _rescue_dirs(run_dir: str | Path) -> list[Path]:
    """Where the weights go when OUT cannot be written at the end: the run directory (not inside a
    checkpoint), then $TMPDIR."""
    p = Path(run_dir).absolute()
    if (p / rundir.COMPLETE).is_file():  # one checkpoint: its run directory holds the checkpoints
        p = p.parent
    if p.name == "checkpoints" and (p.parent / "config.yaml").is_file():
        p = p.parent
    return [p, Path(tempfile.gettempdir())]


def export(run_dir: str | Path, out: str | Path, step: Optional[int] = None) -> dict:
    from pretrain.checkpoint import check_writable

    out = Path(out)
    if out.is_dir():
        raise ExportError(f"{out} is a folder; name the file, e.g. {out / 'model.safetensors'}")
    check_writable(out.parent, "output folder")  # before consolidating (minutes for a large ZeRO-3 run)
    sd, info = load_run_weights(run_dir, step)
    meta = {"format": "pt", "model_name": info["model"]["name"], "model": json.dumps(info["model"]),
            "grid_size": "x".join(map(str, info["grid_size"])), "img_size": str(info["img_size"]),
            "step": str(info["step"]), "wandb_run_id": info["wandb_run_id"] or ""}
    try:
        write_safetensors(sd, out, meta)
    except OSError as e:
        why = f"cannot write {out} ({e.strerror or e})"
        for d in _rescue_dirs(run_dir):
            try:
                saved = write_safetensors(sd, d / out.name, meta)
            except OSError:
                continue
            raise ExportRescued(f"{why}; the weights were saved to {saved} instead") from None
        raise ExportRescued(f"{why}, nor in {' or '.join(map(str, _rescue_dirs(run_dir)))}") from None
    return {**info, "output": str(out), "tensors": len(sd)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="vit-export", description="Consolidate a run's weights into one safetensors file")
    ap.add_argument("run_dir", help="run directory, its checkpoints/ directory, or one checkpoint")
    ap.add_argument("output", help="OUT.safetensors")
    ap.add_argument("--step", type=int, default=None, help="export this step instead of the newest")
    args = ap.parse_args(argv)
    with cli_errors("vit-export", ExportError):
        try:
            r = export(args.run_dir, args.output, args.step)
        except ExportRescued as e:  # not a user mistake (the folder passed the check): exit 1, one line
            print(f"vit-export: error: {e}", file=sys.stderr)
            raise SystemExit(1) from None
    print(f"vit-export: {r['model']['name']} step {r['step']} from {r['checkpoint']} -> {r['output']} "
          f"({r['tensors']} tensors)", file=sys.stderr)


if __name__ == "__main__":
    main()
