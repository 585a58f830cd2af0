"""Impossible values and combinations in a typed config: each message names the key and the file
that set it. The checks of the model, train and optim sections are here; each other section's sit
beside its dataclass (``check_data``, ``check_zero``, ...). ``check_world_size`` is also what the
launcher and the training ranks call with the real world size."""
from __future__ import annotations

import difflib
from typing import Optional

from data_pipeline.config import check_data
from data_pipeline.errors import ConfigError
from pretrain.checkpointing.config import check_checkpoint
from pretrain.config.phases import check_schedule
from pretrain.config.schema import Config, ModelConfig, TrainConfig
from pretrain.distributed.config import check_zero
from pretrain.evaluation.config import SEED_LIMIT, check_eval, check_validation, target_metrics, target_problem
from pretrain.observability.config import check_logging


def check_config(cfg: Config, origin: dict, src: str) -> None:
    """Impossible values; each message names the key and the file that set it."""

    def fail(key: str, msg: str):
        raise ConfigError(f"{origin.get(key, src)}: {key}: {msg}")

    from pretrain.models.arch import img_size_problem, list_models, model_defaults

    m = cfg.model
    if m.name not in list_models():
        close = difflib.get_close_matches(m.name, list_models(), n=1, cutoff=0.4)
        fail("model.name", f"unknown model {m.name!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
    d = model_defaults(m.name)
    img = d["img_size"] if m.img_size is None else m.img_size  # 0 is not "the name's": it is refused
    problem = img_size_problem(m.name, img)
    if problem:
        fail("model.img_size", f"{img} {problem}")
    if m.num_classes < 0:
        fail("model.num_classes", f"must be >= 0, got {m.num_classes}")
    if m.representation_size is not None and m.representation_size <= 0:
        fail("model.representation_size", f"must be a positive width or null (no pre-logits layer), "
             f"got {m.representation_size}")
    for key, val in (("model.drop_rate", m.drop_rate), ("model.drop_path_rate", m.drop_path_rate),
                     ("model.patch_drop_rate", m.patch_drop_rate)):
        if not 0.0 <= val < 1.0:
            fail(key, f"must be in [0, 1), got {val}")
    if m.init_values is not None and not m.init_values > 0:
        fail("model.init_values", f"must be > 0 or null (no LayerScale), got {m.init_values}")
    if m.reg_tokens < 0:
        fail("model.reg_tokens", f"must be >= 0, got {m.reg_tokens}")
    if not m.class_token and m.global_pool == "token":
        fail("model.class_token", "false needs model.global_pool=avg or map (token pooling reads the [class] token)")
    if m.pos_embed == "sincos2d" and d["embed_dim"] % 4:
        fail("model.pos_embed", f"sincos2d needs a width divisible by 4; {m.name} is {d['embed_dim']} wide")
    if cfg.data.img_size is not None and cfg.data.img_size != img:
        fail("data.img_size", f"{cfg.data.img_size} differs from the model's image size {img}")
    check_data(cfg.data, fail)
    t = cfg.train
    if t.steps < 0:
        fail("train.steps", f"must be >= 0, got {t.steps}")
    if t.seed < 0:
        fail("train.seed", f"must be >= 0 (numpy's generators take no negative seed), got {t.seed}")
    if t.seed >= SEED_LIMIT:
        fail("train.seed", f"must be below 2**63 (torch's generators take a 64-bit seed), got {t.seed}")
    if not t.output_dir.strip():
        fail("train.output_dir", "is empty; name the run's folder (an empty one would put the run in the "
             "current folder)")
    if t.max_nonfinite_steps < 1:
        fail("train.max_nonfinite_steps", f"must be >= 1 (the run stops at that many in a row), got "
             f"{t.max_nonfinite_steps}")
    if t.micro_batch_size <= 0:
        fail("train.micro_batch_size", f"must be positive, got {t.micro_batch_size}")
    if t.global_batch_size <= 0:
        fail("train.global_batch_size", f"must be positive, got {t.global_batch_size}")
    check_schedule(t, m.name, fail)
    if t.micro_batch_size > 0 and t.global_batch_size > 0:
        try:  # one rank here; the launch checks the real world size with the same function
            check_world_size(t, 1)
        except ConfigError as e:
            key = "train.resolution_schedule"
            if str(e).startswith(key):
                fail(key, str(e).removeprefix(key).lstrip())
            # it names its keys and values (train.global_batch_size=65 ...): not the key again
            key = "train.global_batch_size"
            raise ConfigError(f"{origin.get(key, src)}: {e}") from None
    ac = t.activation_checkpointing
    if isinstance(ac, int) and not isinstance(ac, bool) and ac < 0:
        fail("train.activation_checkpointing", f"must be true, false, auto, selective or a number of blocks >= 0, "
             f"got {ac}")
    if t.hang_timeout_s < 0:
        fail("train.hang_timeout_s", f"must be >= 0 (0 disables the watchdog), got {t.hang_timeout_s}")
    if t.pg_timeout_s <= 0:
        fail("train.pg_timeout_s", f"must be positive, got {t.pg_timeout_s}")
    if t.startup_timeout_s < 0:
        fail("train.startup_timeout_s", f"must be >= 0 (0: no start-up bound), got {t.startup_timeout_s}")
    if t.straggler_factor <= 1.0:
        fail("train.straggler_factor", f"must be > 1, got {t.straggler_factor}")
    if t.straggler_windows < 1:
        fail("train.straggler_windows", f"must be >= 1, got {t.straggler_windows}")
    if t.straggler_span_s < 0:
        fail("train.straggler_span_s", f"must be >= 0, got {t.straggler_span_s}")
    if t.log_every_steps <= 0:
        fail("train.log_every_steps", f"must be positive, got {t.log_every_steps}")
    if t.sync_every_steps <= 0:
        fail("train.sync_every_steps", f"must be positive, got {t.sync_every_steps}")
    o = cfg.optim
    if o.lr <= 0:
        fail("optim.lr", f"must be positive, got {o.lr}")
    if not o.eps > 0:
        fail("optim.eps", f"must be > 0, got {o.eps:g}")
    if not 0 <= o.momentum < 1:
        fail("optim.momentum", f"must be in [0, 1), got {o.momentum:g}")
    if not 0 <= o.min_lr <= o.lr:
        fail("optim.min_lr", f"must be in [0, optim.lr={o.lr:g}] (the rate the decay ends at), got {o.min_lr:g}")
    if o.warmup_steps < 0:
        fail("optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        fail("optim.betas", f"must be two numbers in [0, 1), got {o.betas}")
    if o.weight_decay < 0 or o.grad_clip < 0:
        fail("optim.weight_decay" if o.weight_decay < 0 else "optim.grad_clip", "must be >= 0")
    if not 0 <= o.label_smoothing < 1:
        fail("optim.label_smoothing", f"must be in [0, 1), got {o.label_smoothing}")
    if not 0 < o.layer_decay <= 1:
        fail("optim.layer_decay", f"must be in (0, 1] (1.0: off), got {o.layer_decay}")
    if o.bce_target_threshold is not None and o.loss != "bce":
        fail("optim.bce_target_threshold", f"applies to optim.loss=bce only, got optim.loss={o.loss}")
    if o.bce_target_threshold is not None and not 0 <= o.bce_target_threshold < 1:
        fail("optim.bce_target_threshold", f"must be in [0, 1) or null, got {o.bce_target_threshold}")
    if o.label_smoothing and cfg.data.multi_label:
        fail("optim.label_smoothing", "data.multi_label=true trains on the labels as they are (sigmoid cross-entropy, "
                                      "no smoothing); remove it")
    if o.loss == "bce" and cfg.data.multi_label:
        fail("optim.loss", "data.multi_label=true always trains with sigmoid cross-entropy summed over classes; "
                           "optim.loss=bce is for single-label data: remove it")
    if not 0 <= t.ema_decay < 1:
        fail("train.ema_decay", f"must be in [0, 1) (0: no EMA), got {t.ema_decay}")
    if t.ema_warmup and not t.ema_decay:
        fail("train.ema_warmup", "warms up the EMA's decay: set train.ema_decay too (e.g. 0.9999)")
    check_zero(cfg.zero, fail)
    check_checkpoint(cfg.checkpoint, fail)
    check_logging(cfg.logging, fail)
    check_eval(cfg.eval, fail)
    check_validation(cfg.validation, fail)
    if problem := target_check(cfg):
        fail(*problem)


def target_check(cfg: Config, labels: Optional[dict[str, list[str]]] = None) -> Optional[tuple[str, str]]:
    """(key, message) when ``validation.target_*`` asks what the config's evaluations cannot log
    (``evaluation.config.target_problem``); ``labels``: the probe suites' metric names once read
    (``in_training.probe_tasks``: at start-up and in ``vit-launch check``), None at load."""
    metrics = target_metrics(cfg.validation, val_shards=bool(cfg.data.val_shards), multi_label=cfg.data.multi_label,
                             ema=cfg.train.ema_decay > 0, labels=labels)
    return target_problem(cfg.validation, metrics)


def check_world_size(train: TrainConfig, world_size: int) -> int:
    """Gradient-accumulation steps for this world size (the global batch is kept: accumulation
    adapts), or a ConfigError naming the batch keys and the nearest settings that work; the micro
    batch of each ``train.resolution_schedule`` phase must divide the global batch the same way."""
    from pretrain.config.phases import batch_unit

    g = train.global_batch_size
    unit = batch_unit(train) * world_size  # every micro batch (each phase's too) x world size divides it
    near = sorted({n for n in (round(g / unit) * unit, g // unit * unit, (g // unit + 1) * unit) if n > 0})
    globals_ = f"train.global_batch_size={' / '.join(str(n) for n in near)}"
    for i, e in enumerate(train.resolution_schedule):
        micro = int(e[2]) if len(e) > 2 else None
        if micro and g % (micro * world_size):
            fits = [m for m in range(micro, 0, -1) if g % (m * world_size) == 0][:1]
            raise ConfigError(f"train.resolution_schedule entry {i}: micro batch {micro} x world size {world_size} = "
                              f"{micro * world_size} does not divide train.global_batch_size={g}; e.g. "
                              + (f"micro batch {fits[0]} or " if fits else "") + globals_)
    per_step = train.micro_batch_size * world_size
    if train.global_batch_size % per_step:
        micro = [m for m in range(train.micro_batch_size, 0, -1) if g % (m * world_size) == 0][:1]
        hint = "; e.g. " + " or ".join([f"train.micro_batch_size={m}" for m in micro] + [globals_])
        raise ConfigError(
            f"train.global_batch_size={g} is not divisible by "
            f"train.micro_batch_size x world size = {train.micro_batch_size} x {world_size} = {per_step}{hint}")
    return train.global_batch_size // per_step


def image_size(model: ModelConfig) -> int:
    """The model's input resolution: ``model.img_size`` or the one in the model's name."""
    from pretrain.models.arch import model_defaults

    return model.img_size or model_defaults(model.name)["img_size"]


def checkpoint_count(value, depth: int) -> Optional[int]:
    """Blocks whose forward the backward runs again whole for a ``train.activation_checkpointing``
    value: ``true`` all, ``false`` none, ``N`` the first ``N`` (at most ``depth``), ``selective``
    none (no matmul is repeated: ``selective_checkpointing``); None for ``auto``, which
    ``pretrain.perf.levers.resolve`` decides from the memory model."""
    if value == "auto":
        return None
    if value == "selective":
        return 0
    if isinstance(value, bool):
        return depth if value else 0
    return max(0, min(int(value), depth))


def selective_checkpointing(value) -> bool:
    """``train.activation_checkpointing: selective``: every block checkpointed op by op
    (``pretrain.models.recompute``)."""
    return value == "selective"


def compile_mode(value, zero_stage: int = 0) -> str:
    """``train.compile`` as one word: ``""`` (off), ``"blocks"`` (``true`` too) or ``"model"``; with
    ``zero_stage``, what training compiles: at ZeRO-3 ``model`` compiles the blocks (their module
    hooks would split a whole-model graph at every gathered module)."""
    if value is True:
        return "blocks"
    if value == "model" and zero_stage == 3:
        return "blocks"
    return value or ""
