"""The fp32 master weights inside DeepSpeed's optimizers, as the weight EMA
(``pretrain/distributed/ema.py``) and LAMB's whole-parameter norms (``lamb.py``) read them.

Like ``ds_compat``, this reads DeepSpeed code that is not public API, written against and tested
with the releases in ``ds_compat.TESTED`` (``ds_compat.check_version`` warns at start-up outside
them): the fp32 master weights each rank's optimizer holds (ZeRO-1/2's
``single_partition_of_fp32_groups``, ``BF16_Optimizer``'s ``fp32_groups_flat_partition``, ZeRO-3's
``fp32_partitioned_groups_flat``; at ZeRO-0 the fp32 module's own parameters), which piece of which
parameter each holds (ZeRO-1/2's ``_hp_mapping``, ZeRO-3's ``grad_position``), and DeepSpeed's own
copy of the masters into the module after a step (``update_lp_params``; ZeRO-3's partition refresh
as around its checkpoint saves).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Fragment:
    """A piece of one parameter held in a flat master tensor: elements ``start .. start + numel`` of
    the parameter (flattened) are elements ``offset .. offset + numel`` of the flat tensor."""
    name: str
    start: int
    numel: int
    offset: int


@dataclass
class MasterShard:
    """One flat fp32 master tensor of this rank (live: the optimizer steps it in place), the pieces
    of parameters it holds (in ``offset`` order; the rest of it is padding), every parameter of the
    group it belongs to (``names``, in the group's order, ``shapes`` beside) and the process group
    whose ranks hold the other pieces (None: every parameter is whole here)."""
    flat: Any
    fragments: list[Fragment]
    names: list[str]
    shapes: list[tuple[int, ...]]
    group: Any = None


def _kind(opt) -> str:
    if hasattr(opt, "fp32_partitioned_groups_flat"):
        return "zero3"
    if hasattr(opt, "fp32_groups_flat_partition"):
        return "bf16"  # BF16_Optimizer (ZeRO-1 with bf16 weights and fp32 accumulation)
    if hasattr(opt, "single_partition_of_fp32_groups"):
        return "zero12"
    return "plain"  # ZeRO-0: the client optimizer steps the fp32 module's own parameters


def master_flats(engine) -> list:
    """This rank's flat fp32 master tensors, cheaply (no fragment map): the same objects, in the
    same order, as :func:`master_shards`' ``flat``."""
    opt = engine.optimizer
    kind = _kind(opt)
    if kind == "zero3":
        return list(opt.fp32_partitioned_groups_flat)
    if kind == "bf16":
        return list(opt.fp32_groups_flat_partition)
    if kind == "zero12":
        return list(opt.single_partition_of_fp32_groups)
    return [p.data.view(-1) for p in engine.module.parameters() if p.requires_grad]


def master_shards(engine) -> list[MasterShard]:
    """This rank's flat fp32 master tensors and what each holds (:class:`MasterShard`)."""
    import torch.distributed as dist

    opt = engine.optimizer
    kind = _kind(opt)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = []
    if kind == "plain":
        for n, p in engine.module.named_parameters():
            if p.requires_grad:
                out.append(MasterShard(p.data.view(-1), [Fragment(n, 0, p.numel(), 0)], [n], [tuple(p.shape)]))
        return out
    if kind == "zero3":
        rank = dist.get_rank(group=opt.dp_process_group)
        for i, params in enumerate(opt.fp16_groups):
            frags = []
            for p in params:
                part = p.partition_numel()
                start = rank * part
                numel = max(0, min(part, p.ds_numel - start))
                if numel:
                    frags.append(Fragment(names[id(p)], start, numel, opt.grad_position[opt.get_param_id(p)][1]))
            out.append(MasterShard(opt.fp32_partitioned_groups_flat[i], frags, [names[id(p)] for p in params],
                                   [tuple(p.ds_shape) for p in params], opt.dp_process_group))
        return out
    flats, lps = ((opt.fp32_groups_flat_partition, opt.bf16_groups) if kind == "bf16"
                  else (opt.single_partition_of_fp32_groups, opt.bit16_groups))
    for i, (flat, params) in enumerate(zip(flats, lps)):
        frags = []
        for p in params:
            m = getattr(p, "_hp_mapping", None)
            if m is not None:
                frags.append(Fragment(names[id(p)], m.lp_fragment_address.start, m.hp_fragment_address.numel,
                                      m.hp_fragment_address.start))
        frags.sort(key=lambda f: f.offset)
        out.append(MasterShard(flat, frags, [names[id(p)] for p in params], [tuple(p.shape) for p in params],
                               opt.real_dp_process_group[i]))
    return out


def publish_masters(engine) -> None:
    """Collective: the module's weights made from the fp32 masters again, as DeepSpeed does after each
    optimizer step (ZeRO-1/2: each rank's partition cast into the 16-bit module and all-gathered;
    ZeRO-3: the partitions recast, gathered copies released, persistent parameters gathered again).
    ZeRO-0: the masters are the module's parameters; nothing to do."""
    opt = engine.optimizer
    kind = _kind(opt)
    if kind in ("zero12", "bf16"):
        opt.update_lp_params()
    elif kind == "zero3":
        opt._partition_all_parameters()
        for i in range(len(opt.fp16_groups)):
            opt._reassign_or_swap_out_partitioned_parameters(i)
        opt.invalidate_secondary_tensor()
        if opt.persistent_parameters:
            opt.persistent_parameters[0].all_gather(opt.persistent_parameters)


def collective_device(engine):
    """Where a small collective over the ranks' tensors must live: the engine's device under NCCL
    (ZeRO-Offload's CPU masters cannot be all-reduced there), else the CPU."""
    import torch
    import torch.distributed as dist

    return engine.device if dist.is_initialized() and dist.get_backend() == "nccl" else torch.device("cpu")
