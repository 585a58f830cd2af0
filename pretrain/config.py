"""Typed experiment configuration: YAML files with ``base:`` inheritance and ``a.b=c`` overrides.

Every key is checked against the dataclass schema below. An unknown key, a value of the wrong
type or an impossible combination raises :class:`ConfigError` whose message names the key, the
file it came from and, for unknown keys, the closest valid key. CLIs turn that into one line on
stderr and exit code 2 (see :func:`cli_errors`).

Each component receives only its own section: ``build_loader(cfg.data, ...)``,
``create_model(**cfg.model...)``, ``deepspeed_config(cfg.optim, cfg.train, cfg.zero)``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from data_pipeline.config import AugmentConfig, DataConfig, check_data
from data_pipeline.errors import ConfigError, cli_errors

__all__ = ["Config", "ConfigError", "cli_errors", "load_config", "raw_tree", "to_dict", "from_dict",
           "save_config", "image_size", "check_world_size", "DataConfig", "AugmentConfig"]


# --------------------------------------------------------------------------------------- schema
@dataclass
class ModelConfig:
    name: str = "vit_base_patch16_224"
    num_classes: int = 1000
    img_size: Optional[int] = None  # None: the resolution in the model name
    drop_rate: float = 0.0
    drop_path_rate: float = 0.0
    representation_size: Optional[int] = None  # tanh pre-logits layer (the paper's pre-training head)
    global_pool: Literal["token", "avg"] = "token"
    # stability past ViT-H (timm's options of the same names): LayerNorm over each head's queries
    # and keys; LayerScale on both residual branches, initialised at init_values (null: none)
    qk_norm: bool = False
    init_values: Optional[float] = None
    # start pre-training from existing weights (a run directory, an exported or timm safetensors
    # file, a transformers ViT folder): position embeddings resized, the head kept when its shape
    # fits num_classes, else freshly initialised. A resumed run ignores it (the checkpoint wins).
    init_from: Optional[str] = None


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    momentum: float = 0.9  # sgd only
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    warmup_steps: int = 10_000
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    min_lr: float = 0.0
    label_smoothing: float = 0.0


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps
    global_batch_size: int = 4096
    micro_batch_size: int = 64  # per rank, per forward/backward
    seed: int = 0
    precision: Literal["bf16", "fp32"] = "bf16"
    # dtype of gradient accumulation and of the gradient reduction across ranks under bf16:
    # fp32 keeps small gradients that a bf16 sum of many ranks rounds away, at 2x the bytes on the wire
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # start-up (DeepSpeed init, a universal-checkpoint conversion, the first collectives) may take this
    # long before the job ends naming the phase; larger than any step-time bound
    startup_timeout_s: float = 3600.0
    activation_checkpointing: bool = False
    log_every_steps: int = 10
    max_nonfinite_steps: int = 5  # this many non-finite losses in a row stop the run
    output_dir: str = "runs/default"
    # a rank without progress this long dumps its stacks to <output_dir>/hang/ and ends the job
    # (the first step and checkpoints get 3x); 0 disables the watchdog
    hang_timeout_s: float = 600.0
    pg_timeout_s: float = 1800.0  # process-group (gloo / NCCL) collective timeout
    # the loop reads the device (stop agreement across ranks, the non-finite verdict) only at log
    # and checkpoint steps and every this many steps: a signal stops the run within this many steps
    sync_every_steps: int = 10
    # compile each Transformer block's forward (regional torch.compile; every ZeRO stage, see README)
    compile: bool = False
    # a rank whose batch reading + forward takes this many times the other ranks' median, in this
    # many logging windows in a row, is named as a straggler (metrics straggler/*, one line)
    straggler_factor: float = 1.5
    straggler_windows: int = 3


@dataclass
class ZeroConfig:
    stage: int = 1
    offload_optimizer: bool = False
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    # ZeRO++ (stage 3 only): hpZ keeps a secondary weight partition inside groups of this many GPUs
    # (one node), qwZ all-gathers int8 weights, qgZ reduces int4 gradients (both need CUDA kernels)
    hpz_partition_size: int = 1
    quantized_weights: bool = False
    quantized_gradients: bool = False


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # None: <train.output_dir>/checkpoints
    every_steps: int = 1000
    keep_last: int = 3
    resume: bool = True  # resume automatically from the latest complete checkpoint
    # write in the background while training goes on (pretrain/async_save.py); YAML key
    # `checkpoint.async` (a Python keyword, so the field is named async_save)
    async_save: bool = False


@dataclass
class WandbConfig:
    mode: Literal["online", "offline", "disabled"] = "offline"
    project: str = "vitscale"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    # online only: how long wandb.init may wait for the server (or a missing API key) before the
    # run goes on offline; training never stalls or dies for W&B
    init_timeout_s: float = 30.0


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    jsonl: bool = True


@dataclass
class ValidationConfig:
    """Evaluation while pre-training (``pretrain/evaluator.py``): validation loss / top-k over
    ``data.val_shards`` and few-shot probes, every ``every_steps`` steps."""
    every_steps: int = 0  # 0: off
    # few-shot probes: vit-transfer suite names, NAME or NAME:PATH
    # (e.g. demo, cifar100:/data/cifar-100-python, imagefolder:/data/pets)
    fewshot_suites: list[str] = field(default_factory=list)
    fewshot_shots: list[int] = field(default_factory=lambda: [1, 5, 10, 25])
    fewshot_seeds: int = 3
    fewshot_l2: float = 1024.0  # big_vision's l2_reg = 2**10
    tasks: list[str] = field(default_factory=list)  # vtab1k: probe only these (empty: all present)
    minival_fraction: float = 0.02  # val split cut from train where a suite has none (big_vision)
    seed: int = 0


# keys that moved: a config naming the old key gets one line naming the new one; a config stored
# in an older checkpoint is read with the value moved
MOVED = {"eval.every_steps": "validation.every_steps", "eval.fewshot": "validation.fewshot_suites"}


@dataclass
class EvalConfig:
    """Transfer evaluation of a checkpoint (``vit-transfer``, ``pretrain/transfer``); evaluation
    while pre-training is ``ValidationConfig``. Plain keys are the settings
    used without a sweep; ``sweep_*`` are the grids searched on train -> val when sweeping."""
    suite: str = "cifar100"  # a name in pretrain.transfer.suites.SUITES
    protocol: Literal["finetune", "linear", "fewshot"] = "linear"
    data_root: Optional[str] = None
    tasks: list[str] = field(default_factory=list)  # vtab1k: run only these (empty: all present)
    img_size: Optional[int] = None  # None: the checkpoint's resolution; else pos-embed resized
    pool: Literal["model", "token", "avg"] = "model"  # frozen features: model = its pre-logits
    batch_size: int = 64
    workers: int = 2
    seed: int = 0
    # fine-tune (ViT paper / big_vision): SGD momentum 0.9, no weight decay, cosine + warmup
    steps: int = 500
    lr: float = 0.01
    warmup_steps: int = 100
    grad_clip: float = 1.0  # 0 disables clipping
    train_augment: Optional[bool] = None  # None: off for vtab1k (flips change structured labels)
    # linear probe: multinomial logistic regression, L2 penalty on the weights
    linear_l2: float = 1e-4
    # few-shot: big_vision's regularised least squares to +-1 targets
    fewshot_shots: list[int] = field(default_factory=lambda: [1, 5, 10, 25])
    fewshot_seeds: int = 3
    fewshot_l2: float = 1024.0  # big_vision's l2_reg = 2**10
    # hyper-parameter sweep: select on train -> val, retrain on train+val, report test
    sweep: Optional[bool] = None  # None: on for vtab1k (train800 -> val200), off otherwise
    sweep_lr: list[float] = field(default_factory=lambda: [0.001, 0.003, 0.01, 0.03])
    sweep_linear_l2: list[float] = field(default_factory=lambda: [1e-5, 1e-4, 1e-3, 1e-2, 1e-1])
    sweep_fewshot_l2: list[float] = field(default_factory=lambda: [64.0, 256.0, 1024.0, 4096.0])
    minival_fraction: float = 0.02  # val split cut from train where a suite has none (big_vision)
    # results: log into the pre-training W&B run (same id, at the checkpoint's step)
    wandb: bool = False
    watch_poll_s: float = 30.0  # --watch: seconds between looks for new checkpoints
    watch_idle_timeout_s: Optional[float] = None  # --watch: stop after this long without one
    # in-training evaluation (pretrain/evaluator.py): data.val_shards loss/top-1/top-5 and few-shot
    # probes every this many steps (0: off); uses fewshot_shots / fewshot_seeds / fewshot_l2


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)


# ------------------------------------------------------------------------------------- loading
def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} invalid YAML: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _merge(base: dict, over: dict, origin: dict | None, src: str, prefix: str = "") -> dict:
    """Deep-merge ``over`` into a copy of ``base``; record in ``origin`` (if given) where keys came from."""
    out = dict(base)
    for k, v in over.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v, origin, src, key + ".")
        else:
            out[k] = v
            if origin is not None:
                _record(origin, key, v, src)
    return out


def _record(origin: dict, key: str, value: Any, src: str) -> None:
    origin[key] = src
    if isinstance(value, dict):
        for k, v in value.items():
            _record(origin, f"{key}.{k}", v, src)


def _load_tree(path: Path, origin: dict, seen: tuple = ()) -> dict:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: 'base:' inheritance cycle through {' -> '.join(map(str, seen))}")
    raw = _read_yaml(path)
    base_ref = raw.pop("base", None)
    tree: dict = {}
    if base_ref is not None:
        refs = base_ref if isinstance(base_ref, list) else [base_ref]
        for ref in refs:
            if not isinstance(ref, str):
                raise ConfigError(f"{path}: 'base' must be a file name or a list of them, got {ref!r}")
            # keys from a base keep the base file as their origin
            tree = _merge(tree, _load_tree(path.parent / ref, origin, seen + (path,)), None, str(path))
    return _merge(tree, raw, origin, str(path))


def parse_override(text: str) -> tuple[list[str], Any]:
    """``optim.lr=3e-4`` -> (["optim", "lr"], 0.0003). Values are YAML scalars (or flow lists)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. optim.lr=3e-4")
    key, value = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        parsed = yaml.safe_load(value) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
    # YAML 1.1 reads "3e-4" as a string; accept it as a float as users expect.
    if isinstance(parsed, str):
        with contextlib.suppress(ValueError):
            parsed = float(parsed) if any(c in parsed for c in ".eE") and parsed.strip() else parsed
    return key.split("."), parsed


def apply_overrides(tree: dict, overrides, origin: dict) -> dict:
    for text in overrides:
        parts, value = parse_override(text)
        node = tree
        for p in parts[:-1]:
            nxt = node.get(p)
            if not isinstance(nxt, dict):
                nxt = {}
                node[p] = nxt
            node = nxt
        node[parts[-1]] = value
        _record(origin, ".".join(parts), value, "command line")
    return tree


# ---------------------------------------------------------------------------------- validation
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None)) + " or null"
    if origin is list:
        (inner,) = typing.get_args(tp)
        return f"list of {_type_name(inner)}"
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, key: str, where: str) -> Any:
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{where}: {key}: expected {_type_name(tp)}, got {value!r}")
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, key, where)
            except ConfigError:
                continue
        raise bad
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise bad
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise bad
        return [_coerce(inner, v, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key}: expected a mapping (section), got {value!r}")
        return _build(tp, value, key + ".", {}, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise bad


# YAML keys that are Python keywords -> the dataclass field that holds them
ALIASES = {"checkpoint.async": "async_save"}


def _build(cls: type, tree: dict, prefix: str, origin: dict, default_where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        where = origin.get(key, default_where)
        if key in ALIASES:
            k = ALIASES[key]
            key = f"{prefix}{k}"
        if key in MOVED:
            raise ConfigError(f"{where}: '{key}' is now '{MOVED[key]}'")
        if k not in names:
            valid = [f"{prefix}{n}" for n in names]
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(valid)}"
            raise ConfigError(f"{where}: unknown key '{key}'{hint}")
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            if not isinstance(v, dict):
                raise ConfigError(f"{where}: {key}: expected a section (mapping), got {v!r}")
            kwargs[k] = _build(tp, v, key + ".", origin, default_where)
        else:
            kwargs[k] = _coerce(tp, v, key, where)
    return cls(**kwargs)


def _check(cfg: Config, origin: dict, src: str) -> None:
    """Impossible values; each message names the key and the file that set it."""

    def fail(key: str, msg: str):
        raise ConfigError(f"{origin.get(key, src)}: {key}: {msg}")

    from pretrain.arch import list_models, model_defaults

    m = cfg.model
    if m.name not in list_models():
        close = difflib.get_close_matches(m.name, list_models(), n=1, cutoff=0.4)
        fail("model.name", f"unknown model {m.name!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
    d = model_defaults(m.name)
    img = m.img_size or d["img_size"]
    if img <= 0:
        fail("model.img_size", f"must be positive, got {img}")
    patch = d["stride"]
    if img % patch:
        fail("model.img_size", f"patch size {patch} of {m.name} does not divide image size {img}")
    if m.num_classes < 0:
        fail("model.num_classes", f"must be >= 0, got {m.num_classes}")
    for key, val in (("model.drop_rate", m.drop_rate), ("model.drop_path_rate", m.drop_path_rate)):
        if not 0.0 <= val < 1.0:
            fail(key, f"must be in [0, 1), got {val}")
    if m.init_values is not None and not m.init_values > 0:
        fail("model.init_values", f"must be > 0 or null (no LayerScale), got {m.init_values}")
    if cfg.data.img_size is not None and cfg.data.img_size != img:
        fail("data.img_size", f"{cfg.data.img_size} differs from the model's image size {img}")
    check_data(cfg.data, fail)
    t = cfg.train
    if t.steps < 0:
        fail("train.steps", f"must be >= 0, got {t.steps}")
    if t.micro_batch_size <= 0:
        fail("train.micro_batch_size", f"must be positive, got {t.micro_batch_size}")
    if t.global_batch_size <= 0:
        fail("train.global_batch_size", f"must be positive, got {t.global_batch_size}")
    if t.micro_batch_size > 0 and t.global_batch_size > 0:
        try:  # one rank here; the launch checks the real world size with the same function
            check_world_size(t, 1)
        except ConfigError as e:
            fail("train.global_batch_size", str(e))
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
    if t.log_every_steps <= 0:
        fail("train.log_every_steps", f"must be positive, got {t.log_every_steps}")
    if t.sync_every_steps <= 0:
        fail("train.sync_every_steps", f"must be positive, got {t.sync_every_steps}")
    o = cfg.optim
    if o.lr <= 0:
        fail("optim.lr", f"must be positive, got {o.lr}")
    if o.warmup_steps < 0:
        fail("optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        fail("optim.betas", f"must be two numbers in [0, 1), got {o.betas}")
    if o.weight_decay < 0 or o.grad_clip < 0:
        fail("optim.weight_decay" if o.weight_decay < 0 else "optim.grad_clip", "must be >= 0")
    if not 0 <= o.label_smoothing < 1:
        fail("optim.label_smoothing", f"must be in [0, 1), got {o.label_smoothing}")
    if cfg.zero.stage not in (0, 1, 2, 3):
        fail("zero.stage", f"must be 0, 1, 2 or 3, got {cfg.zero.stage}")
    if cfg.zero.hpz_partition_size < 1:
        fail("zero.hpz_partition_size", f"must be >= 1, got {cfg.zero.hpz_partition_size}")
    for key in ("hpz_partition_size", "quantized_weights", "quantized_gradients"):
        if getattr(cfg.zero, key) not in (1, False) and cfg.zero.stage != 3:
            fail(f"zero.{key}", f"is ZeRO++, which DeepSpeed runs only with zero.stage=3 (got stage {cfg.zero.stage})")
    if cfg.checkpoint.every_steps <= 0:
        fail("checkpoint.every_steps", f"must be positive, got {cfg.checkpoint.every_steps}")
    if cfg.checkpoint.keep_last < 1:
        fail("checkpoint.keep_last", f"must be >= 1, got {cfg.checkpoint.keep_last}")
    if cfg.logging.wandb.init_timeout_s <= 0:
        fail("logging.wandb.init_timeout_s", f"must be positive, got {cfg.logging.wandb.init_timeout_s}")
    _check_eval(cfg.eval, fail)
    _check_validation(cfg.validation, fail)


def _check_eval(ev: EvalConfig, fail) -> None:
    from pretrain.transfer.suites import SUITES  # the registry; imports nothing of this module

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            fail(f"eval.{key}", msg)

    need(ev.suite in SUITES, "suite", f"unknown suite {ev.suite!r}; choose one of {', '.join(SUITES)}")
    need(ev.batch_size > 0, "batch_size", f"must be positive, got {ev.batch_size}")
    need(ev.workers >= 0, "workers", f"must be >= 0, got {ev.workers}")
    need(ev.img_size is None or ev.img_size > 0, "img_size", f"must be positive, got {ev.img_size}")
    if ev.protocol == "finetune":
        need(ev.steps > 0, "steps", f"must be positive, got {ev.steps}")
        need(0 <= ev.warmup_steps < ev.steps, "warmup_steps", f"must be in [0, eval.steps={ev.steps}), got {ev.warmup_steps}")
        need(ev.lr > 0 and all(v > 0 for v in ev.sweep_lr), "lr", "learning rates must be positive")
        need(ev.grad_clip >= 0, "grad_clip", f"must be >= 0, got {ev.grad_clip}")
    need(ev.linear_l2 >= 0 and all(v >= 0 for v in ev.sweep_linear_l2), "linear_l2", "must be >= 0")
    need(ev.fewshot_l2 > 0 and all(v > 0 for v in ev.sweep_fewshot_l2), "fewshot_l2", "must be > 0")
    need(bool(ev.fewshot_shots) and all(k > 0 for k in ev.fewshot_shots), "fewshot_shots",
         f"must be positive shot counts, got {ev.fewshot_shots}")
    need(ev.fewshot_seeds > 0, "fewshot_seeds", f"must be positive, got {ev.fewshot_seeds}")
    need(0 < ev.minival_fraction < 1, "minival_fraction", f"must be in (0, 1), got {ev.minival_fraction}")
    need(ev.watch_poll_s > 0, "watch_poll_s", f"must be positive, got {ev.watch_poll_s}")


def _check_validation(val: ValidationConfig, fail) -> None:
    from pretrain.transfer.suites import SUITES

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            fail(f"validation.{key}", msg)

    need(val.every_steps >= 0, "every_steps", f"must be >= 0 (0: no evaluation while training), got {val.every_steps}")
    for spec in val.fewshot_suites:
        name = spec.partition(":")[0]
        need(name in SUITES, "fewshot_suites", f"unknown suite {name!r} in {spec!r}; choose one of {', '.join(SUITES)}")
        need(not SUITES[name].needs_root or ":" in spec, "fewshot_suites", f"{spec!r}: suite {name} needs NAME:PATH")
    need(bool(val.fewshot_shots) and all(k > 0 for k in val.fewshot_shots), "fewshot_shots",
         f"must be positive shot counts, got {val.fewshot_shots}")
    need(val.fewshot_seeds > 0, "fewshot_seeds", f"must be positive, got {val.fewshot_seeds}")
    need(val.fewshot_l2 > 0, "fewshot_l2", f"must be > 0, got {val.fewshot_l2}")
    need(0 < val.minival_fraction < 1, "minival_fraction", f"must be in (0, 1), got {val.minival_fraction}")


def check_world_size(train: TrainConfig, world_size: int) -> int:
    """Gradient-accumulation steps for this world size (the global batch is kept: accumulation
    adapts), or a ConfigError naming the batch keys and the nearest settings that work."""
    per_step = train.micro_batch_size * world_size
    if train.global_batch_size % per_step:
        g = train.global_batch_size
        micro = [m for m in range(train.micro_batch_size, 0, -1) if g % (m * world_size) == 0][:1]
        near = sorted({round(g / per_step) * per_step, max(1, g // per_step) * per_step, (g // per_step + 1) * per_step})
        hint = (f"; e.g. train.micro_batch_size={micro[0]}" if micro else "") + \
               f" or train.global_batch_size={' / '.join(str(n) for n in near if n > 0)}"
        raise ConfigError(
            f"train.global_batch_size={g} is not divisible by "
            f"train.micro_batch_size x world size = {train.micro_batch_size} x {world_size} = {per_step}{hint}")
    return train.global_batch_size // per_step


def _resolve(path: str | Path | None, overrides) -> tuple[dict, dict[str, str]]:
    """(merged YAML tree, where each key came from): ``base:`` files, then overrides."""
    origin: dict[str, str] = {}
    tree = _load_tree(Path(path), origin) if path is not None else {}
    return apply_overrides(tree, list(overrides), origin), origin


def raw_tree(path: str | Path | None, overrides=()) -> dict:
    """The merged tree before defaults and validation: tells which keys a user actually set."""
    return _resolve(path, overrides)[0]


def load_config(path: str | Path | None, overrides=()) -> Config:
    """Load ``path`` (following ``base:``), apply ``a.b=c`` overrides, return a validated Config."""
    src = str(path) if path is not None else "defaults"
    tree, origin = _resolve(path, overrides)
    cfg = _build(Config, tree, "", origin, src)
    _check(cfg, origin, src)
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved config (every key, defaults included) as YAML."""
    from data_pipeline.files import write_atomic

    return write_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def from_dict(tree: dict) -> Config:
    """Rebuild a Config from ``to_dict`` output (e.g. the copy stored in a checkpoint)."""
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    old = tree.get("eval") or {}
    if "every_steps" in old or "fewshot" in old:  # saved before the validation section existed
        val = tree.setdefault("validation", {})
        val.setdefault("every_steps", old.pop("every_steps", 0))
        val.setdefault("fewshot_suites", (old.pop("fewshot", None) or {}).get("suites", []))
        for k in ("fewshot_shots", "fewshot_seeds", "fewshot_l2", "tasks", "minival_fraction", "seed"):
            if k in old:
                val.setdefault(k, old[k])
    return _build(Config, tree, "", {}, "stored config")


def image_size(model: ModelConfig) -> int:
    """The model's input resolution: ``model.img_size`` or the one in the model's name."""
    from pretrain.arch import model_defaults

    return model.img_size or model_defaults(model.name)["img_size"]


def main(argv=None) -> None:
    """``vit-config --config FILE [a.b=c ...] [--output resolved.yaml]``: validate and print."""
    import argparse

    ap = argparse.ArgumentParser(prog="vit-config", description="Validate a config and print it resolved")
    ap.add_argument("--config", required=True, help="YAML experiment file")
    ap.add_argument("--output", help="write the resolved config here instead of printing it")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4")
    args = ap.parse_args(argv)
    with cli_errors("vit-config"):
        cfg = load_config(args.config, args.overrides)
    if args.output:
        save_config(cfg, args.output)
    else:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")


if __name__ == "__main__":
    main()
