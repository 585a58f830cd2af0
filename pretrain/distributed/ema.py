"""Exponential moving average of the weights (``train.ema_decay``), kept where ZeRO keeps the
master weights: each rank averages its own fp32 master partition, in place, after every optimizer
step, with no communication and no gather.

Semantics are timm's ``ModelEmaV3`` updated with the step count (timm's ``train.py``: ``update(model,
step=num_updates)``): :func:`decay_at` is its ``get_decay`` (the first step copies the weights;
``train.ema_warmup`` is its ``use_warmup`` with gamma 1 and power 2/3), the update its
``lerp_(weights, 1 - decay)``. What it costs: one read of the masters and one read and write of the
average per step, 4 B/param spread over the ranks (pretrain/perf/PERFORMANCE.md).

Checkpoints hold it as one safetensors file per rank (:data:`FILE`): each piece of a parameter
that rank holds, named ``<parameter>@<first element>``, with every parameter's shape in the
metadata. Pieces are addressed by parameter and element, not by rank or partition, so a
checkpoint loads on any world size (:meth:`WeightEma.load` fills this rank's pieces from whichever
files hold them) and ``vit-export --ema`` assembles whole tensors from the files alone
(:func:`read_full`). Which piece of which parameter a rank holds: ``ds_masters.master_shards``.
"""
from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Iterator

import torch

from pretrain.distributed import ds_masters

FILE = "ema_rank_{:05d}.safetensors"  # one per rank that holds pieces, in the checkpoint directory
GLOB = "ema_rank_*.safetensors"
WARMUP_GAMMA, WARMUP_POWER = 1.0, 2 / 3  # timm ModelEmaV3's defaults


def decay_at(step: int, decay: float, warmup: bool) -> float:
    """The decay of the update after optimizer step ``step`` (counted from 1): timm ModelEmaV3's
    ``get_decay(step)`` with ``update_after_step=0`` and ``min_decay=0``."""
    step = max(0, step - 1)
    if step <= 0:
        return 0.0
    if warmup:
        return max(min(1 - (1 + step / WARMUP_GAMMA) ** -WARMUP_POWER, decay), 0.0)
    return decay


def _key(name: str, start: int) -> str:
    return f"{name}@{start}"


def _parse(key: str) -> tuple[str, int]:
    name, _, start = key.rpartition("@")
    return name, int(start)


class WeightEma:
    """The average of ``engine``'s master weights, one fp32 tensor per flat master tensor of this
    rank (ZeRO partitions; at ZeRO-0 the module's parameters), starting as a copy of them."""

    def __init__(self, engine, decay: float, warmup: bool = False):
        self.engine, self.decay, self.warmup = engine, decay, warmup
        self.values = [f.detach().clone() for f in ds_masters.master_flats(engine)]

    def update(self, step: int) -> None:
        """After optimizer step ``step``: ``ema = lerp(ema, masters, 1 - decay)``, on the device,
        no host read."""
        d = decay_at(step, self.decay, self.warmup)
        torch._foreach_lerp_(self.values, ds_masters.master_flats(self.engine), 1.0 - d)

    @torch.no_grad()
    def reset(self) -> None:
        """The average set to the weights (a resume from a checkpoint saved without it)."""
        for v, f in zip(self.values, ds_masters.master_flats(self.engine)):
            v.copy_(f)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Collective: the module computes with the average inside the block, with its own weights
        again after it (bit for bit). The masters and the average trade places one flat tensor at a
        time (one partition of extra memory) and DeepSpeed's own after-step copy
        (``ds_masters.publish_masters``) makes the module's weights from them, both ways."""
        flats = ds_masters.master_flats(self.engine)
        _exchange(flats, self.values)
        try:
            ds_masters.publish_masters(self.engine)
            yield
        finally:
            _exchange(flats, self.values)
            ds_masters.publish_masters(self.engine)

    # ----------------------------------------------------------------------------- files
    def owns_pieces(self) -> bool:
        """Whether this rank writes a file: ZeRO ranks hold different pieces; at ZeRO-0 every rank
        holds everything and rank 0 writes it."""
        import torch.distributed as dist

        return self.engine.zero_optimization_stage() > 0 or not dist.is_initialized() or dist.get_rank() == 0

    def pieces(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(this rank's pieces as separate tensors on their device, the file's metadata). Copies
        made on the device: training may go on while they are written."""
        shards = ds_masters.master_shards(self.engine)
        tensors, shapes = {}, {}
        for shard, values in zip(shards, self.values):
            shapes.update(zip(shard.names, shard.shapes))
            for f in shard.fragments:
                tensors[_key(f.name, f.start)] = values[f.offset:f.offset + f.numel].clone()
        meta = {"format": "vitscale-ema", "shapes": json.dumps({n: list(s) for n, s in shapes.items()}),
                "decay": repr(self.decay), "warmup": str(self.warmup)}
        return tensors, meta

    @torch.no_grad()
    def load(self, ckpt: str | Path) -> bool:
        """Fill this rank's pieces from the checkpoint's files, whatever world size or layout wrote
        them; False when it has none (saved without an EMA). ValueError naming the checkpoint when a
        piece is missing or a shape differs."""
        from safetensors import safe_open

        ckpt = Path(ckpt)
        files = sorted(ckpt.glob(GLOB))
        if not files:
            return False
        saved: dict[str, list] = {}  # name -> [(open file, key, start, length)]
        shapes: dict[str, list] = {}
        with contextlib.ExitStack() as stack:
            for path in files:  # headers only: a piece's values are read where this rank needs them
                h = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                shapes.update(json.loads(h.metadata()["shapes"]))
                for key in h.keys():
                    name, start = _parse(key)
                    saved.setdefault(name, []).append((h, key, start, h.get_slice(key).get_shape()[0]))
            for shard, values in zip(ds_masters.master_shards(self.engine), self.values):
                for name, shape in zip(shard.names, shard.shapes):
                    if list(shapes.get(name, [])) != list(shape):
                        raise ValueError(f"{ckpt}: its EMA has {name} of shape {shapes.get(name)}, the model "
                                         f"{list(shape)}")
                for f in shard.fragments:
                    filled = 0
                    for h, key, start, length in saved.get(f.name, []):
                        lo, hi = max(start, f.start), min(start + length, f.start + f.numel)
                        if lo < hi:
                            piece = h.get_slice(key)[lo - start:hi - start]
                            values[f.offset + lo - f.start:f.offset + hi - f.start].copy_(piece)
                            filled += hi - lo
                    if filled != f.numel:
                        raise ValueError(f"{ckpt}: its EMA files hold {filled} of the {f.numel} values of {f.name} "
                                         f"from element {f.start} that this rank needs")
        return True


def write_pieces(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """One rank's file: ``tensors`` (:meth:`WeightEma.pieces`, or a host snapshot of them) with
    ``meta``, written and synced to disk (an OSError when it cannot be)."""
    import os

    from safetensors.torch import save

    data = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata=meta)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _exchange(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """Swap the contents of ``a[i]`` and ``b[i]``, one pair at a time."""
    with torch.no_grad():
        for x, y in zip(a, b):
            tmp = x.clone()
            x.copy_(y)
            y.copy_(tmp)
            del tmp


def read_full(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """The whole EMA of a checkpoint directory, on the CPU, from its files alone (any ZeRO stage or
    world size). LookupError when it has none; ValueError when a value is missing."""
    from safetensors import safe_open

    ckpt = Path(ckpt)
    files = sorted(ckpt.glob(GLOB))
    if not files:
        raise LookupError(f"{ckpt} holds no EMA of the weights (trained without train.ema_decay)")
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as h:
            shapes = json.loads(h.metadata()["shapes"])
            for key in h.keys():
                name, start = _parse(key)
                piece = h.get_tensor(key)
                flat = out.setdefault(name, torch.empty(math.prod(shapes[name]), dtype=torch.float32))
                flat[start:start + piece.numel()] = piece
                filled[name] = filled.get(name, 0) + piece.numel()
    for name, flat in out.items():
        if filled[name] != flat.numel():
            raise ValueError(f"{ckpt}: its EMA files hold {filled[name]} of the {flat.numel()} values of {name}")
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise ValueError(f"{ckpt}: its EMA files hold nothing of {', '.join(missing[:3])}")
    return {name: flat.view(shapes[name]) for name, flat in out.items()}
