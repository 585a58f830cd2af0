"""The model a training run starts from: built from ``train.seed`` on every rank and ZeRO stage
alike, or from existing weights (``model.init_from``)."""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from pretrain.config import Config, ConfigError
from pretrain.distributed.engine import deepspeed_config
from pretrain.distributed.precision import compute_dtype
from pretrain.models.arch import model_defaults
from pretrain.models.init import init_generator
from pretrain.models.vit import create_model
from pretrain.perf import levers
from pretrain.weights.load import WeightsError, load_weights


def build_model(cfg: Config) -> torch.nn.Module:
    """The configured model, initialised from ``train.seed`` through one CPU generator: the same
    weights on every rank, device, ZeRO stage and world size. Under ZeRO-3 it is built inside
    ``deepspeed.zero.Init``: each layer's parameters are partitioned over the ranks as soon as that
    layer exists, so no rank ever holds the whole fp32 model (a rank's peak is one layer plus its
    1/N share); the initialisation then runs module by module under
    ``GatheredParameters(modifier_rank=0)``, on partitioned parameters it would otherwise change
    nothing."""
    m = cfg.model
    kw = dict(num_classes=m.num_classes, img_size=m.img_size, drop_rate=m.drop_rate,
              drop_path_rate=m.drop_path_rate, patch_drop_rate=m.patch_drop_rate,
              representation_size=m.representation_size, global_pool=m.global_pool, qk_norm=m.qk_norm,
              init_values=m.init_values, reg_tokens=m.reg_tokens, class_token=m.class_token, pos_embed=m.pos_embed)
    if cfg.zero.stage != 3:
        return create_model(m.name, init_seed=cfg.train.seed, **kw)
    import deepspeed

    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg, _ = levers.resolve(cfg, world)  # `auto` buckets sized as training sizes them (a no-op once decided)
    ds_cfg = deepspeed_config(cfg.optim, cfg.train, cfg.zero, world, cfg.deepspeed)  # its dtype for the shards
    with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
        model = create_model(m.name, defer_init=True, **kw)
    model.init_weights(gather=lambda params: deepspeed.zero.GatheredParameters(params, modifier_rank=0),
                       generator=init_generator(cfg.train.seed))
    return model


def load_init_weights(model: torch.nn.Module, cfg: Config, say: Callable[[str], None],
                      classes: Optional[tuple[str, ...]] = None) -> dict:
    """``model.init_from``: existing weights into the freshly built model, read by the loader
    ``vit-transfer`` uses (run directories, safetensors / timm files, transformers ViT folders).
    Position embeddings are resized to ``model.img_size``; head and pre-logits layer are loaded
    when their shapes fit, else keep their initialisation (the new task's classes). Where both the
    file and the training shards name their classes (``classes``: the shards' in label order), a head
    of the same classes in another order has its rows put in the shards' order, and a head of other
    classes is new too. Under ZeRO-3
    the parameters are gathered, rank 0 loads, and the partitions are updated from it.

    Returns what :func:`set_masters` needs after ``deepspeed.initialize``: where the module is
    16-bit (``bf16``, ``fp16``), the file's fp32 value of every loaded trainable parameter
    (DeepSpeed makes its fp32 masters from the 16-bit module, which dropped the file's low bits);
    under ZeRO-3 on rank 0 only, which loaded them. Where the module is fp32 (``fp32``,
    ``bf16-autocast``) nothing: DeepSpeed's masters are copies of the loaded fp32 module."""
    from pretrain.weights.pretrained import CheckpointError, load_pretrained

    try:
        pre = load_pretrained(cfg.model.init_from, prog="vit-train")
    except CheckpointError as e:
        raise ConfigError(f"model.init_from={cfg.model.init_from}: {e}") from None
    if pre.arch["name"] != cfg.model.name and model_defaults(pre.arch["name"])["embed_dim"] != \
            model_defaults(cfg.model.name)["embed_dim"]:
        raise ConfigError(f"model.init_from={cfg.model.init_from}: holds a {pre.arch['name']}, which does not fit "
                          f"model.name={cfg.model.name}")
    shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()}
    drop = tuple(f"{k.rsplit('.', 1)[0]}." for k in ("head.weight", "pre_logits.fc.weight")
                 if k in pre.state_dict and tuple(pre.state_dict[k].shape) != shapes.get(k))
    state, why = head_for_classes(pre.state_dict, pre.classes, classes) if "head." not in drop else (pre.state_dict, "")
    if state is None:  # the same number of outputs for other classes
        state, drop = pre.state_dict, drop + ("head.",)
    gather = contextlib.nullcontext()
    if cfg.zero.stage == 3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0)
    loads = not (cfg.zero.stage == 3 and dist.is_initialized() and dist.get_rank() != 0)  # ZeRO-3: rank 0 alone
    with gather:
        if loads:
            try:
                report = load_weights(model, state, strict=True, exclude=drop, old_grid=pre.grid)
            except WeightsError as e:
                raise ConfigError(f"model.init_from={cfg.model.init_from}: {e}") from None
            say(f"initialised from {pre.source} ({pre.kind}" + (f", step {pre.step}" if pre.step else "") + ")"
                + (f"; {', '.join(report.resized)}" if report.resized else "")
                + (f"; new {' and '.join(d.rstrip('.') for d in drop)} for {cfg.model.num_classes} classes"
                   if drop else "") + (f" ({why})" if why else ""))
    if compute_dtype(cfg.train.precision) == torch.float32 or not loads:
        return {}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {n: v.detach().float() for n, v in report.values.items() if n in trainable}


def head_for_classes(state: dict, names: Optional[tuple[str, ...]],
                     classes: Optional[tuple[str, ...]]) -> tuple[Optional[dict], str]:
    """``state`` with its head's rows in the order of ``classes`` (the training shards' names in
    label order) where its own ``names`` are the same classes in another order; None where they are
    other classes; ``state`` itself where they agree or either is unknown. With what was done, in
    words."""
    if not names or not classes or tuple(names) == tuple(classes) or "head.weight" not in state:
        return state, ""
    if sorted(names) != sorted(classes):
        return None, "its classes are not the shards'"
    where = {n: i for i, n in enumerate(names)}
    order = torch.tensor([where[c] for c in classes])
    rows = {k: state[k][order] for k in ("head.weight", "head.bias") if k in state}
    return {**state, **rows}, "its head's rows put in the shards' class order"


def set_masters(engine, values: dict) -> None:
    """Sets each named parameter's fp32 master weight in ``engine`` from ``values`` (from
    :func:`load_init_weights`): the file's fp32 values, not the bf16-rounded module's. Under ZeRO-3
    a collective: every rank calls it (rank 0 with the values)."""
    params = dict(engine.module.named_parameters())
    if engine.zero_optimization_stage() == 3:
        _set_partitioned_masters(params, values)
        return
    if not values:
        return
    from deepspeed.utils import safe_set_full_fp32_param

    for name, p in params.items():
        if name in values:
            safe_set_full_fp32_param(p, values[name].to(p.device))


def _set_partitioned_masters(params: dict, values: dict) -> None:
    """ZeRO-3: rank 0 sends each value to every rank, one parameter at a time, and each rank writes
    its own slice into its fp32 partition (``safe_set_local_fp32_param``). DeepSpeed's whole-tensor
    setter cuts its slice at ``partition size x rank`` without the padding of a last partition
    whose parameter does not split evenly, and fails there."""
    from deepspeed.utils import safe_set_local_fp32_param

    rank0 = dist.get_rank() == 0
    names = [sorted(values) if rank0 else None]
    dist.broadcast_object_list(names, src=0)
    for name in names[0]:
        p = params[name]
        device = p.ds_tensor.device
        full = (values[name].to(device, torch.float32).contiguous() if rank0
                else torch.empty(tuple(p.ds_shape), dtype=torch.float32, device=device))
        dist.broadcast(full, src=0)
        n, r = p.ds_tensor.numel(), dist.get_rank(group=getattr(p, "ds_process_group", None))
        part = full.flatten()[r * n:(r + 1) * n]
        safe_set_local_fp32_param(p, torch.nn.functional.pad(part, (0, n - part.numel())))


def num_params(model: torch.nn.Module) -> int:
    """Parameter count, also of a ZeRO-3 partitioned model (whose tensors are empty placeholders)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
