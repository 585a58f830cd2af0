"""Elastic resume of model and optimizer: load a checkpoint saved on another world size through
DeepSpeed's universal checkpointing (ZeRO stages 1-3, bf16 and fp32).

    python -m pretrain.checkpointing.elastic CHECKPOINT            # convert ahead of time (optional)

Layout: the universal copy lives *inside* the checkpoint it came from::

    step_00001000/
        ...                    DeepSpeed's files, run.json, rank_*.json, COMPLETE
        universal/             DeepSpeed universal checkpoint of the same step
            UNIVERSAL          marker: written last, before the directory is renamed into place
            mp_rank_00_model_states.pt | zero_pp_rank_*_model_states.pt   (copied: LR schedule,
                               global step, ...)
            zero/<param name>/{fp32,exp_avg,exp_avg_sq[,step]}.pt, zero/optimizer_state.pt

DeepSpeed loads ``load_dir/tag``, so a universal copy is loaded with ``load_dir=step_00001000``
and ``tag="universal"``. Inside the checkpoint (not a sibling ``step_00001000.universal``) so that
pruning a checkpoint prunes its copy, ``COMPLETE`` still marks the whole directory, and nothing
else in ``checkpoint.dir`` matches the ``step_N`` pattern. The copy is converted into a hidden
temp directory beside it and renamed when complete, so a crash mid-conversion never leaves a
half copy that looks usable; the next resume converts again.

Conversion runs ``python -m deepspeed.checkpoint.ds_to_universal`` in a child process (DeepSpeed
has no public Python API for it; its ``main(args)`` takes an argparse namespace). A child because
the converter holds the unsharded fp32 weights plus both Adam moments (16 bytes per parameter:
10 GB for ViT-H) which a training rank should not keep, its worker pool must not fork a rank that
holds gloo/NCCL threads, and a crash there (an assert, the OOM killer) becomes a one-line error.

What the load relies on (DeepSpeed internals, kept in ``pretrain/distributed/ds_compat.py``):

- the universal flag is read only inside ``load_checkpoint``, so the engine is built as usual and
  the flag is set around the one load (``ds_compat.universal_loading``), then restored: later
  loads and saves take the normal path (the tests check every rank's files after such a save);
- ``--inject_missing_state`` is passed for ZeRO-1/2: a plain ``nn.Module`` carries no
  ``universal_checkpoint_info``, which the stage-1/2 converter asserts on; the injected value is
  the format version, all a pure data-parallel job needs;
- Adam's ``step`` continues: ZeRO-1/2 restore it per group; ZeRO-3 restores rank 0's step into
  every sub-group, right because all sub-groups step together, after its loader defects are
  undone (``ds_compat.fix_zero3_universal_load``);
- the LR schedule (our ``LambdaLR``) comes back from the copied model-states file.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from data_pipeline.errors import Parser, path_arg
from pretrain.distributed import ds_compat

UNIVERSAL = "universal"          # subdirectory (and DeepSpeed tag) of the universal copy
MARKER = "UNIVERSAL"             # written inside the copy before it is renamed into place
LOAD_PATCH = {"checkpoint": {"load_universal": True}}


class ElasticError(RuntimeError):
    """A checkpoint could not be made loadable on this world size; the message is one line."""


def saved_world_size(ckpt: str | Path) -> int:
    ckpt = Path(ckpt)
    try:
        return int(json.loads((ckpt / "run.json").read_text())["world_size"])
    except (OSError, ValueError, KeyError) as e:
        raise ElasticError(f"{ckpt}: cannot read the saved world size from run.json ({e})") from None


def universal_dir(ckpt: str | Path) -> Path:
    return Path(ckpt) / UNIVERSAL


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def _default_workers() -> int:
    # each worker loads one rank's optimizer shard; one per two cores, at most 8
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def to_universal(ckpt_path: str | Path, workers: Optional[int] = None, timeout: float = 3600) -> Path:
    """Convert one checkpoint directory into its universal copy ``<ckpt>/universal`` (reused when
    present). Not collective: call it on one process. Raises ElasticError naming the checkpoint."""
    ckpt = Path(ckpt_path)
    out = universal_dir(ckpt)
    if (out / MARKER).is_file():
        return out
    if not ckpt.is_dir():
        raise ElasticError(f"{ckpt}: checkpoint directory not found")
    for stale in ckpt.glob(f".{UNIVERSAL}.tmp-*"):  # left by a conversion that was killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = ckpt / f".{UNIVERSAL}.tmp-{os.getpid()}"
    n = workers or _default_workers()
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt),
           "--output_folder", str(tmp), "--num_extract_workers", str(n), "--num_merge_workers", str(n),
           "--inject_missing_state"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ElasticError(f"{ckpt}: conversion to a universal checkpoint took over {timeout:.0f} s") from None
    # the converter writes a `latest_universal` pointer beside its output; we pass tags explicitly
    (ckpt / "latest_universal").unlink(missing_ok=True)
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ElasticError(f"{ckpt}: conversion to a universal checkpoint failed "
                           f"(exit {r.returncode}): {_one_line(r.stderr or r.stdout)}")
    if not (tmp / "zero" / "optimizer_state.pt").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        raise ElasticError(f"{ckpt}: universal conversion wrote no zero/optimizer_state.pt "
                           "(was the checkpoint saved with ZeRO stage 1-3?)")
    import deepspeed

    (tmp / MARKER).write_text(json.dumps({"source_world_size": saved_world_size(ckpt),
                                          "deepspeed": deepspeed.__version__}))
    if (out / MARKER).is_file():  # another process finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    if out.exists():  # a copy without its marker: never complete, replace it
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def prepare(ckpt_path: str | Path, world_size: int, rank: int, timeout: float = 3600) -> tuple[str, str, dict]:
    """Collective. What ``engine.load_checkpoint`` needs for this checkpoint on this world size:
    ``(load_dir, tag, ds_config_patch)``. Same world size: the checkpoint itself and no patch
    (today's bit-exact path). Otherwise rank 0 converts (or reuses) the universal copy while the
    others wait; success or the one-line failure is broadcast, so no rank hangs on a failure."""
    import torch.distributed as dist

    ckpt = Path(ckpt_path)
    if saved_world_size(ckpt) == world_size or not any(ckpt.glob("*optim_states.pt")):
        # no ZeRO shards (ZeRO-0 in fp32 keeps the whole optimizer in the model-states file,
        # which every rank reads): the normal load works on any world size
        return str(ckpt.parent), ckpt.name, {}
    status = [None]
    if rank == 0:
        try:
            to_universal(ckpt, timeout=timeout)
            status = ["ok"]
        except Exception as e:  # reported on every rank below
            msg = str(e) if isinstance(e, ElasticError) else f"{ckpt}: {type(e).__name__}: {e}"
            status = [msg.splitlines()[0] if msg else repr(e)]
    dist.broadcast_object_list(status, src=0)  # the others wait here while rank 0 converts
    if status[0] != "ok":
        raise ElasticError(status[0])
    if not (universal_dir(ckpt) / MARKER).is_file():
        raise ElasticError(f"{ckpt}: rank 0 converted it, but rank {rank} cannot see {universal_dir(ckpt)} "
                           "(checkpoint.dir must be on storage shared by all nodes)")
    return str(ckpt), UNIVERSAL, LOAD_PATCH


def load_checkpoint(engine, ckpt_path: str | Path, timeout: float = 3600) -> str:
    """Collective. Load one of our checkpoint directories into ``engine`` (model, optimizer, LR
    schedule, step), whatever world size it was saved on. Returns DeepSpeed's load path."""
    import torch.distributed as dist

    ckpt = Path(ckpt_path)
    load_dir, tag, patch = prepare(ckpt, dist.get_world_size(), dist.get_rank(), timeout)
    with ds_compat.universal_loading(engine, bool(patch)):
        load_path, _ = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
    if load_path is None:
        raise ElasticError(f"{ckpt}: DeepSpeed could not load this checkpoint")
    if patch and engine.zero_optimization_stage() == 3:
        _fix_zero3_universal_load(engine, universal_dir(ckpt))
    return load_path


def _fix_zero3_universal_load(engine, universal: Path) -> None:
    """ZeRO-3's universal loader defects (``ds_compat.fix_zero3_universal_load``), undone with the
    param groups the converter saved."""
    import torch

    saved = torch.load(universal / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False)
    groups = saved.get("param_groups") or saved["optimizer_state_dict"]["param_groups"]
    try:
        ds_compat.fix_zero3_universal_load(engine, groups)
    except ValueError as e:
        raise ElasticError(f"{universal}: {e}") from None


def main(argv=None) -> None:
    ap = Parser(prog="vit-elastic", description="Write the universal copy of a checkpoint "
                "(done automatically on a resume with another world size)")
    ap.add_argument("checkpoint", type=path_arg, help="one checkpoint directory, e.g. runs/x/checkpoints/step_00001000")
    ap.add_argument("--workers", type=int, default=None, help="converter processes (default: cores / 2, <= 8)")
    args = ap.parse_args(argv)
    if args.workers is not None and args.workers < 1:  # 0 is not "the default": DeepSpeed's converter needs one
        ap.error(f"--workers {args.workers}: must be >= 1")
    try:
        out = to_universal(args.checkpoint, workers=args.workers)
    except ElasticError as e:
        print(f"vit-elastic: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"vit-elastic: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
