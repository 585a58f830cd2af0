"""Checkpoints: save / auto-resume of training runs (weights alone load with ``pretrain.weights.load``).

A checkpoint directory (layout: ``pretrain/checkpointing/rundir.py``) holds DeepSpeed's engine state (module,
ZeRO optimizer shards, LR schedule), ``rank_<R>.json`` per rank (data-loader position, Python /
NumPy / torch RNG), with ``train.ema_decay`` ``ema_rank_<R>.safetensors`` (each rank's pieces of the
weights' moving average: ``pretrain/distributed/ema.py``), ``run.json`` (step, resolved config, W&B
run id, world size) and, last, the
``COMPLETE`` marker that rank 0 writes after every rank finished, listing every file's size and
checksum. A crash or ``kill -9`` mid-save leaves the previous checkpoint as the one to resume
from; half-written directories are removed by the next successful save. Resume verifies the files
against the marker and falls back past a damaged checkpoint (set aside under ``damaged/``, with a
warning). Nothing here is unpickled except DeepSpeed's own files.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from data_pipeline.errors import ConfigError
from data_pipeline.files import unwritable, write_atomic
from pretrain.checkpointing.rundir import (
    COMPLETE,
    LATEST,
    latest_complete,
    list_complete,
    marker,
    pick,
    step_of,
    tag_for,
)
from pretrain.distributed import ema as weight_ema
from pretrain.distributed.rng import resume_streams, rng_state

__all__ = ["save", "resume",
           "latest_complete", "list_complete", "tag_for", "COMPLETE", "check_writable", "config_changes"]

# Keys whose change makes a checkpoint unloadable into this run (tensor shapes, parameter names,
# optimizer state layout, ZeRO shard files). Others (lr, steps, drop rates, data) may change.
RESUME_KEYS = ("model.name", "model.num_classes", "model.img_size", "model.representation_size",
               "model.global_pool", "model.qk_norm", "model.init_values", "model.reg_tokens", "model.class_token",
               "model.pos_embed", "optim.name", "zero.stage", "train.precision",
               "optim.layer_decay")  # the parameter groups, and each group's base LR kept by the schedule's state
# keys added later: absent from older runs' configs
_RESUME_DEFAULTS = {"model.qk_norm": False, "model.reg_tokens": 0, "model.class_token": True,
                    "model.pos_embed": "learned", "optim.layer_decay": 1.0}


def check_writable(folder: str | Path, key: str) -> None:
    """ConfigError naming ``key`` and the folder unless a file can be created there
    (``data_pipeline.files.unwritable``)."""
    why = unwritable(folder)
    if why:
        raise ConfigError(f"{key}={folder}: {why}; choose a writable folder")


# ---------------------------------------------------------------------------------- save/resume
def _write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj))


def _ema_file(path: Path, rank: int) -> Path:
    return path / weight_ema.FILE.format(rank)


def _ema_meta(meta: dict, step: int) -> dict:
    import torch.distributed as dist

    return {**meta, "step": str(step), "world_size": str(dist.get_world_size())}


def save(engine, ckpt_dir: str | Path, step: int, *, rank_state: dict, run_info: dict, keep_last: int,
         ema=None) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory. ``ema``: the weights'
    moving average (``pretrain.distributed.ema.WeightEma``), written beside as each rank's pieces."""
    import torch.distributed as dist

    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(step)
    path = ckpt_dir / tag
    if (path / COMPLETE).exists() and dist.get_rank() == 0:
        (path / COMPLETE).unlink()  # re-saving the same step (e.g. SIGTERM right after a save)
    dist.barrier()
    # DeepSpeed logs a failed makedirs and goes on; torch.save then fails with a RuntimeError. Made
    # here, an unwritable folder is an OSError naming the errno (the caller's one line)
    path.mkdir(parents=True, exist_ok=True)
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False)  # ends with a barrier
    except RuntimeError as e:  # torch.save's writer fails with a RuntimeError, e.g. on a full disk
        raise as_os_error(e, path) from None
    rank = dist.get_rank()
    if ema is not None and ema.owns_pieces():
        tensors, meta = ema.pieces()
        weight_ema.write_pieces(_ema_file(path, rank), tensors, _ema_meta(meta, step))
    _write_json(path / f"rank_{rank:05d}.json", {**rank_state, "rng": rng_state(), "step": step})
    if rank == 0:
        _write_json(path / "run.json", {**run_info, "step": step, "world_size": dist.get_world_size()})
    dist.barrier()
    if rank == 0:
        write_atomic(path / COMPLETE, marker(step, path))
        write_atomic(ckpt_dir / LATEST, tag)
        _prune(ckpt_dir, keep_last)
    dist.barrier()
    return path


def save_async(engine, saver, ckpt_dir: str | Path, step: int, *, rank_state: dict, run_info: dict,
               ema=None) -> Path:
    """Collective, like :func:`save`, but returns once this rank's state is snapshotted: the
    files are written by ``saver``'s background writer and the checkpoint becomes complete
    (``COMPLETE``, ``latest``, pruning) when every rank has written and synced them
    (``pretrain.checkpointing.async_save.Saver``). A save still in flight is completed first."""
    import torch.distributed as dist

    saver.wait()
    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / tag_for(step)
    if (path / COMPLETE).exists() and dist.get_rank() == 0:
        (path / COMPLETE).unlink()
    dist.barrier()
    path.mkdir(parents=True, exist_ok=True)
    engine.save_checkpoint(str(ckpt_dir), tag=tag_for(step), save_latest=False)  # snapshots, then queues
    rank = dist.get_rank()
    if ema is not None and ema.owns_pieces():  # copied on the device, snapshotted to the host, written behind
        tensors, meta = ema.pieces()
        meta = _ema_meta(meta, step)
        saver.writer.save_with(tensors, str(_ema_file(path, rank)),
                               lambda snap, f: weight_ema.write_pieces(f, snap, meta))
    small = {path / f"rank_{rank:05d}.json": {**rank_state, "rng": rng_state(), "step": step}}
    if rank == 0:
        small[path / "run.json"] = {**run_info, "step": step, "world_size": dist.get_world_size()}
    for f, obj in small.items():
        saver.writer.submit(_write_json, f, obj)
    saver.start(step, path)
    return path


def finish_async(keep_last: int) -> Callable[[int, Path], None]:
    """What rank 0's writer does once every rank's files of a checkpoint are durable: checksum
    them into ``COMPLETE``, point ``latest`` at it, prune."""
    def finish(step: int, path: Path) -> None:
        write_atomic(path / COMPLETE, marker(step, path))
        write_atomic(path.parent / LATEST, path.name)
        _prune(path.parent, keep_last)
    return finish


def as_os_error(err: RuntimeError, path: Path) -> Exception:
    """torch.save's writer reports a failed write as a RuntimeError ("PytorchStreamWriter failed
    writing file", "[enforce fail at inline_container.cc] unexpected pos"): an OSError for the
    caller's one line, ENOSPC when the folder has no space left; other errors unchanged."""
    msg = str(err).splitlines()[0] if str(err) else repr(err)
    if not any(k in msg for k in ("PytorchStreamWriter", "inline_container", "does not exist")):
        return err
    try:
        full = shutil.disk_usage(path if path.exists() else path.parent).free < 2 ** 20
    except OSError:
        full = False
    if full:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return OSError(errno.EIO, f"{path}: {msg}")


def save_failed(ckpt_dir: str | Path, step: int, err: OSError) -> str:
    """After a save of ``step`` failed on this rank (a full or read-only disk): remove what it left
    (without its COMPLETE marker it never counts, but it holds the space) and say in one line the
    folder, why, what was free and what a checkpoint needs (the last complete one's size), and the
    last complete checkpoint, verified."""
    from pretrain.checkpointing.rundir import verify

    ckpt_dir = Path(ckpt_dir)
    partial = ckpt_dir / tag_for(step)
    if partial.is_dir() and not (partial / COMPLETE).exists():
        shutil.rmtree(partial, ignore_errors=True)
    last = latest_complete(ckpt_dir)
    try:
        free = f"{shutil.disk_usage(ckpt_dir).free / 2 ** 20:.0f} MB free"
    except OSError:
        free = "free space unknown"
    if last is not None:
        need = sum(f.stat().st_size for f in Path(last).iterdir() if f.is_file())
        bad = verify(last)
        kept = f"the last complete checkpoint is {last} ({'verified' if bad is None else 'damaged: ' + bad})"
        sizes = f"{free}, a checkpoint needs about {need / 2 ** 20:.0f} MB"
    else:
        kept, sizes = "no complete checkpoint yet", free
    return (f"cannot save checkpoint {tag_for(step)} in {ckpt_dir} ({err.strerror or err}): {sizes}; {kept}; "
            "free space or set checkpoint.dir to a larger or writable folder, then run the same command to resume")


def _prune(ckpt_dir: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints; drop older ones and any incomplete
    directory left by a crash (never the newest complete one)."""
    done = list_complete(ckpt_dir)
    keep = {p.name for p in done[-keep_last:]}
    newest = step_of(done[-1]) if done else -1
    for p in ckpt_dir.iterdir():
        if not p.is_dir() or step_of(p) is None or p.name in keep:
            continue
        if (p / COMPLETE).exists() or step_of(p) < newest:
            shutil.rmtree(p, ignore_errors=True)


def _warn(msg: str) -> None:
    print(f"vit-train: warning: {msg}", file=sys.stderr, flush=True)


def choose(ckpt_dir: str | Path) -> Optional[Path]:
    """Collective: the newest complete checkpoint whose files verify. Rank 0 verifies, sets the
    damaged ones aside (``damaged/``, one warning each; ``rundir.pick``) and tells the others."""
    import torch.distributed as dist

    chosen = [None]
    if dist.get_rank() == 0:
        path = pick(ckpt_dir, _warn)
        chosen = [str(path) if path is not None else None]
    dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0]) if chosen[0] is not None else None


def _resume_view(config: dict) -> dict:
    """The RESUME_KEYS of a config dict (``to_dict`` form), the image size resolved from the name."""
    from pretrain.models.arch import model_defaults

    view = {}
    for key in RESUME_KEYS:
        section, name = key.split(".")
        view[key] = (config.get(section) or {}).get(name, _RESUME_DEFAULTS.get(key))
    if view["model.img_size"] is None:
        try:
            view["model.img_size"] = model_defaults(view["model.name"])["img_size"]
        except (KeyError, ValueError, TypeError):
            pass
    return view


def config_changes(saved: dict, current: dict) -> list[str]:
    """``key=saved->current`` for each RESUME_KEYS entry that differs between two configs."""
    a, b = _resume_view(saved), _resume_view(current)
    return [f"{k}={a[k]}->{b[k]}" for k in RESUME_KEYS if a[k] != b[k]]


def _refuse_changes(path: Path, run_info: dict, config: dict) -> None:
    changed = config_changes(run_info.get("config") or {}, config)
    if changed:
        raise ConfigError(f"{path} was saved with other settings ({', '.join(changed)}); to start a new run use "
                          "another train.output_dir (and checkpoint.dir, if set); to resume, put the old values back")


def check_resumable(ckpt_dir: str | Path, config: dict) -> Optional[Path]:
    """Before any model is built: a ConfigError when the newest complete checkpoint in ``ckpt_dir``
    was saved with other RESUME_KEYS than ``config`` (``to_dict`` form); reads its run.json only.
    Returns that checkpoint (None: nothing to resume)."""
    path = latest_complete(ckpt_dir)
    if path is None:
        return None
    try:
        run_info = json.loads((Path(path) / "run.json").read_text())
    except (OSError, ValueError):
        return path  # a damaged checkpoint: resume verifies it and falls back past it
    _refuse_changes(Path(path), run_info, config)
    return path


def resume(engine, ckpt_dir: str | Path, config: Optional[dict] = None,
           ema=None) -> Optional[tuple[dict, list[dict]]]:
    """Load the newest intact complete checkpoint into ``engine``; returns (run_info, the per-rank
    states of *every* rank that saved it, in rank order) or None when there is nothing to resume.
    Collective. Saved on another world size, model and optimizer come through DeepSpeed's universal
    checkpointing (``pretrain/checkpointing/elastic.py``, converted once by rank 0 and kept beside the
    checkpoint); the data loader continues the interrupted epoch from all old ranks' states.
    With ``config`` (this run's, ``to_dict`` form) a change of a RESUME_KEYS entry against the
    checkpoint's run.json is a one-line ConfigError before anything is loaded. ``ema``: filled from
    the checkpoint's pieces on any world size, or started from the resumed weights when it has none."""
    import torch.distributed as dist

    from pretrain.checkpointing import elastic

    path = choose(ckpt_dir)
    if path is None:
        return None
    run_info = json.loads((path / "run.json").read_text())
    if config is not None:  # before DeepSpeed reads anything: its size-mismatch traceback is 178 lines
        _refuse_changes(path, run_info, config)
    saved_world, rank = int(run_info["world_size"]), dist.get_rank()
    if saved_world != dist.get_world_size() and rank == 0:
        print(f"vit-train: {path.name} was saved on {saved_world} rank(s), resuming on {dist.get_world_size()}: "
              "model and optimizer through a universal checkpoint, data from every old rank's position",
              file=sys.stderr, flush=True)
    try:
        elastic.load_checkpoint(engine, path)
    except elastic.ElasticError as e:
        raise ConfigError(str(e)) from None
    if ema is not None:
        try:
            found = ema.load(path)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not found:
            ema.reset()
            if rank == 0:
                _warn(f"{path.name} holds no EMA of the weights: train.ema_decay starts it from the resumed weights")
    states = [json.loads((path / f"rank_{r:05d}.json").read_text()) for r in range(saved_world)]
    # RNG streams continue exactly on the same layout; on another one each rank takes the saved
    # stream of its own rank number where there was one, else a stream of its own
    seed = int(((config or {}).get("train") or {}).get("seed", 0))
    resume_streams(states, rank, seed, int(run_info["step"]))
    return run_info, states
