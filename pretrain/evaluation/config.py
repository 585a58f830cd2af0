"""The two evaluation sections of an experiment config, each with its checks: ``eval:`` (transfer
evaluation of a checkpoint, ``vit-transfer`` in ``pretrain/transfer``, whose flags override it) and
``validation:`` (evaluation while pre-training, ``pretrain/evaluation/in_training.py``). Both run the
few-shot probe on a transfer suite, so they share its settings, defined once here.

``pretrain.config`` composes the experiment schema from the sections and names the file in its errors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional

__all__ = ["EvalConfig", "FEWSHOT_DEFAULTS", "SUITE_NEEDS_ROOT", "ValidationConfig", "check_eval",
           "check_validation"]

# transfer suites by name, and whether each needs a folder (eval.data_root, NAME:PATH); the
# builders of each are pretrain/transfer/suites.py, which registers exactly these names
SUITE_NEEDS_ROOT = {"cifar100": True, "vtab1k": True, "demo": False, "imagefolder": True, "shards": True}

# The few-shot probe and its minival split, read both by vit-transfer (``eval.*``) and by the probes
# while pre-training (``validation.*``): each setting's default is defined once, here; each section's
# field docstring says what the key means there.
FEWSHOT_DEFAULTS = {"tasks": [], "fewshot_shots": [1, 5, 10, 25], "fewshot_seeds": 3, "fewshot_l2": 1024.0,
                    "minival_fraction": 0.02, "seed": 0}


def _fewshot_field(name: str) -> Any:
    """The dataclass field of the shared setting ``name`` with its default (a fresh list per config)."""
    default = FEWSHOT_DEFAULTS[name]
    if isinstance(default, list):
        return field(default_factory=lambda: list(default))
    return field(default=default)


def _check_fewshot(cfg: Any, section: str, fail: Callable[[str, str], None]) -> None:
    """Impossible values of the shared few-shot settings of ``cfg``, named ``{section}.{key}``."""
    if not (cfg.fewshot_shots and all(k > 0 for k in cfg.fewshot_shots)):
        fail(f"{section}.fewshot_shots", f"must be positive shot counts, got {cfg.fewshot_shots}")
    if not cfg.fewshot_seeds > 0:
        fail(f"{section}.fewshot_seeds", f"must be positive, got {cfg.fewshot_seeds}")
    if not cfg.fewshot_l2 > 0:
        fail(f"{section}.fewshot_l2", f"must be > 0, got {cfg.fewshot_l2}")
    if not 0 < cfg.minival_fraction < 1:
        fail(f"{section}.minival_fraction", f"must be in (0, 1), got {cfg.minival_fraction}")


@dataclass
class EvalConfig:
    """Transfer evaluation of a checkpoint (``vit-transfer``, ``pretrain/transfer``); evaluation
    while pre-training is ``ValidationConfig``. Plain keys are the settings
    used without a sweep; ``sweep_*`` are the grids searched on train -> val when sweeping."""
    suite: str = "cifar100"
    """vit-transfer's suite: a name in `pretrain.transfer.suites.SUITES`."""
    protocol: Literal["finetune", "linear", "fewshot"] = "linear"
    """vit-transfer's protocol: `finetune`, `linear` or `fewshot`."""
    data_root: Optional[str] = None
    """The suite's data folder (`--data-root`)."""
    tasks: list[str] = _fewshot_field("tasks")
    """VTAB-1k: run only these tasks (empty: all present)."""
    img_size: Optional[int] = None
    """Evaluation resolution; null: the checkpoint's resolution, else the position embedding is
    resized."""
    pool: Literal["model", "token", "avg"] = "model"
    """Frozen features: `model` = the model's own pooling (`model.global_pool`: [class] token, mean
    or MAP) and pre-logits layer, `token` (the [class] token; a model without one refuses it) or
    `avg` (mean of the patch tokens, registers left out)."""
    batch_size: int = 64
    """Images per batch."""
    workers: int = 2
    """Data-loading worker processes."""
    seed: int = _fewshot_field("seed")
    """Seed of the new head, the fine-tune data order and the minival split."""
    steps: int = 500
    """Fine-tune steps (ViT paper / big_vision: SGD momentum 0.9, no weight decay, cosine +
    warmup)."""
    lr: float = 0.01
    """Fine-tune learning rate."""
    warmup_steps: int = 100
    """Fine-tune warmup steps."""
    grad_clip: float = 1.0
    """Fine-tune global-norm clipping; 0 disables clipping."""
    train_augment: Optional[bool] = None
    """Fine-tune with random crops and flips; null: off for vtab1k (flips change structured
    labels), on otherwise."""
    linear_l2: float = 1e-4
    """Linear probe (multinomial logistic regression): L2 penalty on the weights."""
    fewshot_shots: list[int] = _fewshot_field("fewshot_shots")
    """Few-shot (big_vision's regularised least squares to +-1 targets): shots per class."""
    fewshot_seeds: int = _fewshot_field("fewshot_seeds")
    """Few-shot: seeds (draws of the examples), averaged."""
    fewshot_l2: float = _fewshot_field("fewshot_l2")
    """Few-shot ridge penalty (big_vision's l2_reg = 2**10)."""
    sweep: Optional[bool] = None
    """Hyper-parameter sweep: select on train -> val, retrain on train+val, report test; null: on
    for vtab1k (train800 -> val200), off otherwise."""
    sweep_lr: list[float] = field(default_factory=lambda: [0.001, 0.003, 0.01, 0.03])
    """Fine-tune learning rates searched when sweeping."""
    sweep_linear_l2: list[float] = field(default_factory=lambda: [1e-5, 1e-4, 1e-3, 1e-2, 1e-1])
    """Linear-probe L2 penalties searched when sweeping."""
    sweep_fewshot_l2: list[float] = field(default_factory=lambda: [64.0, 256.0, 1024.0, 4096.0])
    """Few-shot ridge penalties searched when sweeping."""
    minival_fraction: float = _fewshot_field("minival_fraction")
    """The val split cut from train where a suite has none (big_vision)."""
    wandb: bool = False
    """Log the results into the pre-training W&B run (same id, at the checkpoint's step)."""
    watch_poll_s: float = 30.0
    """`--watch`: seconds between looks for new checkpoints."""
    watch_idle_timeout_s: Optional[float] = None
    """`--watch`: stop after this long without a new checkpoint; null: never."""


def check_eval(ev: EvalConfig, fail: Callable[[str, str], None]) -> None:
    """Impossible values of the section; ``fail(key, message)`` raises the error naming the file."""
    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            fail(f"eval.{key}", msg)

    need(ev.suite in SUITE_NEEDS_ROOT, "suite",
         f"unknown suite {ev.suite!r}; choose one of {', '.join(SUITE_NEEDS_ROOT)}")
    need(ev.batch_size > 0, "batch_size", f"must be positive, got {ev.batch_size}")
    need(ev.workers >= 0, "workers", f"must be >= 0, got {ev.workers}")
    need(ev.img_size is None or ev.img_size > 0, "img_size", f"must be positive, got {ev.img_size}")
    if ev.protocol == "finetune":
        need(ev.steps > 0, "steps", f"must be positive, got {ev.steps}")
        need(0 <= ev.warmup_steps < ev.steps, "warmup_steps",
             f"must be in [0, eval.steps={ev.steps}), got {ev.warmup_steps}")
        need(ev.lr > 0 and all(v > 0 for v in ev.sweep_lr), "lr", "learning rates must be positive")
        need(ev.grad_clip >= 0, "grad_clip", f"must be >= 0, got {ev.grad_clip}")
    need(ev.linear_l2 >= 0 and all(v >= 0 for v in ev.sweep_linear_l2), "linear_l2", "must be >= 0")
    need(ev.fewshot_l2 > 0 and all(v > 0 for v in ev.sweep_fewshot_l2), "fewshot_l2", "must be > 0")
    _check_fewshot(ev, "eval", fail)
    need(ev.watch_poll_s > 0, "watch_poll_s", f"must be positive, got {ev.watch_poll_s}")


@dataclass
class ValidationConfig:
    """Evaluation while pre-training (``pretrain/evaluation/in_training.py``): validation loss / top-k over
    ``data.val_shards`` and few-shot probes, every ``every_steps`` steps."""
    every_steps: int = 0
    """Evaluate while pre-training every N steps and at the last one; 0 = off (see
    pretrain/evaluation/EVALUATION.md)."""
    fewshot_suites: list[str] = field(default_factory=list)
    """Few-shot probes while pre-training: vit-transfer suite names, `NAME` or `NAME:PATH` (e.g.
    `demo`, `cifar100:/data/cifar-100-python`, `imagefolder:/data/pets`)."""
    fewshot_shots: list[int] = _fewshot_field("fewshot_shots")
    """The probes' shots per class."""
    fewshot_seeds: int = _fewshot_field("fewshot_seeds")
    """The probes' seeds (draws of the few-shot examples), averaged."""
    fewshot_l2: float = _fewshot_field("fewshot_l2")
    """The probes' ridge penalty (big_vision's l2_reg = 2**10)."""
    tasks: list[str] = _fewshot_field("tasks")
    """VTAB-1k tasks to probe (empty: all present)."""
    minival_fraction: float = _fewshot_field("minival_fraction")
    """The val split cut from train where a suite has none (big_vision)."""
    seed: int = _fewshot_field("seed")
    """Seed of that split."""


def check_validation(val: ValidationConfig, fail: Callable[[str, str], None]) -> None:
    """Impossible values of the section; ``fail(key, message)`` raises the error naming the file."""
    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            fail(f"validation.{key}", msg)

    need(val.every_steps >= 0, "every_steps", f"must be >= 0 (0: no evaluation while training), got {val.every_steps}")
    for spec in val.fewshot_suites:
        name = spec.partition(":")[0]
        need(name in SUITE_NEEDS_ROOT, "fewshot_suites",
             f"unknown suite {name!r} in {spec!r}; choose one of {', '.join(SUITE_NEEDS_ROOT)}")
        need(not SUITE_NEEDS_ROOT[name] or ":" in spec, "fewshot_suites", f"{spec!r}: suite {name} needs NAME:PATH")
    _check_fewshot(val, "validation", fail)
