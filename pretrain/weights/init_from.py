"""The model a training run starts from: built from ``train.seed`` on every rank and ZeRO stage
alike, or from existing weights (``model.init_from``)."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from pretrain.config import Config, ConfigError
from pretrain.distributed.engine import deepspeed_config
from pretrain.models.arch import model_defaults
from pretrain.models.init import init_generator
from pretrain.models.vit import create_model
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
    kw = _model_kwargs(cfg)
    if cfg.zero.stage != 3:
        return create_model(m.name, init_seed=cfg.train.seed, **kw)
    import deepspeed

    world = dist.get_world_size() if dist.is_initialized() else 1
    ds_cfg = deepspeed_config(cfg.optim, cfg.train, cfg.zero, world)  # its dtype (bf16 / fp32) for the shards
    with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
        model = create_model(m.name, defer_init=True, **kw)
    model.init_weights(gather=lambda params: deepspeed.zero.GatheredParameters(params, modifier_rank=0),
                       generator=init_generator(cfg.train.seed))
    return model


def _model_kwargs(cfg: Config) -> dict:
    m = cfg.model
    return dict(num_classes=m.num_classes, img_size=m.img_size, drop_rate=m.drop_rate,
                drop_path_rate=m.drop_path_rate, representation_size=m.representation_size,
                global_pool=m.global_pool, qk_norm=m.qk_norm, init_values=m.init_values)


def load_init_weights(model: torch.nn.Module, cfg: Config, say: Callable[[str], None]) -> None:
    """``model.init_from``: existing weights into the freshly built model, read by the loader
    ``vit-transfer`` uses (run directories, safetensors / timm files, transformers ViT folders).
    Position embeddings are resized to ``model.img_size``; head and pre-logits layer are loaded
    when their shapes fit, else keep their initialisation (the new task's classes). Under ZeRO-3
    the parameters are gathered, rank 0 loads, and the partitions are updated from it."""
    pre, drop = _read_init(model, cfg)
    gather = contextlib.nullcontext()
    if cfg.zero.stage == 3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0)
    with gather:
        if not dist.is_initialized() or dist.get_rank() == 0 or cfg.zero.stage != 3:
            try:
                report = load_weights(model, pre.state_dict, strict=True, exclude=drop, old_grid=pre.grid)
            except WeightsError as e:
                raise ConfigError(f"model.init_from={cfg.model.init_from}: {e}") from None
            say(f"initialised from {pre.source} ({pre.kind}" + (f", step {pre.step}" if pre.step else "") + ")"
                + (f"; {', '.join(report.resized)}" if report.resized else "")
                + (f"; new {' and '.join(d.rstrip('.') for d in drop)} for {cfg.model.num_classes} classes" if drop else ""))


def _read_init(model: torch.nn.Module, cfg: Config):
    """The ``model.init_from`` weights, checked against the model, and the layers they leave out
    (head and pre-logits layer whose shapes do not fit: the new task's classes)."""
    from pretrain.weights.pretrained import CheckpointError, load_pretrained

    try:
        pre = load_pretrained(cfg.model.init_from)
    except CheckpointError as e:
        raise ConfigError(f"model.init_from={cfg.model.init_from}: {e}") from None
    if pre.arch["name"] != cfg.model.name and model_defaults(pre.arch["name"])["embed_dim"] != \
            model_defaults(cfg.model.name)["embed_dim"]:
        raise ConfigError(f"model.init_from={cfg.model.init_from}: holds a {pre.arch['name']}, which does not fit "
                          f"model.name={cfg.model.name}")
    shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()}
    drop = tuple(f"{k.rsplit('.', 1)[0]}." for k in ("head.weight", "pre_logits.fc.weight")
                 if k in pre.state_dict and tuple(pre.state_dict[k].shape) != shapes.get(k))
    return pre, drop


def masters_from_init_file(engine, cfg: Config) -> int:
    """bf16 at ZeRO-1/2: DeepSpeed makes its fp32 master weights from the module after casting it
    to bf16, so a ``model.init_from`` file's low 16 bits were gone before the first step (the first
    update's direction fell from cosine 0.9998 to 0.988 against an fp32 reference when the step is
    small). Reads the file again into an fp32 copy of the model (the same resizing and head rule)
    and sets every master it holds from it; layers the file leaves out keep theirs. Each rank holds
    one fp32 copy of the model for the duration. Returns how many parameters were set.

    ZeRO-3 is left as it is: DeepSpeed 0.19's ``set_full_hp_param`` cannot set a partition that
    is padded (a parameter whose size the ranks do not divide)."""
    from deepspeed.utils import safe_set_full_fp32_param

    if cfg.train.precision != "bf16" or cfg.zero.stage not in (1, 2):
        return 0
    plain = create_model(cfg.model.name, init_seed=cfg.train.seed, **_model_kwargs(cfg))
    pre, drop = _read_init(plain, cfg)
    try:
        load_weights(plain, pre.state_dict, strict=True, exclude=drop, old_grid=pre.grid)
    except WeightsError as e:
        raise ConfigError(f"model.init_from={cfg.model.init_from}: {e}") from None
    values = dict(plain.named_parameters())
    count = 0
    for name, p in engine.module.named_parameters():
        if p.requires_grad and not any(name.startswith(d) for d in drop):
            safe_set_full_fp32_param(p, values[name].detach().to(p.device))
            count += 1
    return count


def num_params(model: torch.nn.Module) -> int:
    """Parameter count, also of a ZeRO-3 partitioned model (whose tensors are empty placeholders)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
