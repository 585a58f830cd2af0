"""The two evaluation sections of an experiment config, each with its checks: ``eval:`` (transfer
evaluation of a checkpoint, ``vit-transfer`` in ``pretrain/transfer``, whose flags override it) and
``validation:`` (evaluation while pre-training, ``pretrain/evaluation/in_training.py``). Both run the
few-shot and kNN probes on a transfer suite, so they share their settings, defined once here.

``pretrain.config`` composes the experiment schema from the sections and names the file in its errors.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional

__all__ = ["EvalConfig", "FEWSHOT_DEFAULTS", "KNN_DEFAULTS", "PROTOCOL_KEYS", "SUITE_NEEDS_ROOT", "SUITES_OF_TASKS",
           "ValidationConfig", "check_eval", "check_validation", "lower_is_better", "names_tasks", "target_metrics",
           "target_problem", "unread_keys_note"]

# transfer suites by name, and whether each needs a folder (eval.data_root, NAME:PATH); the
# builders of each are pretrain/transfer/suites.py, which registers exactly these names
SUITE_NEEDS_ROOT = {"cifar100": True, "vtab1k": True, "demo": False, "imagefolder": True, "shards": True}
# suites of several tasks: their probes' metrics name each task (eval/fewshot/vtab1k/dtd/10shot)
SUITES_OF_TASKS = ("vtab1k",)
SEED_LIMIT = 2**63  # every seed key is below it: torch's generators take a 64-bit seed


def names_tasks(specs: list[str]) -> dict[str, bool]:
    """Whether each probe suite spec's metrics name its task after the suite (``vtab1k/dtd``,
    ``imagefolder/pets``): a suite of several tasks, or a suite name two specs share."""
    names = [spec.partition(":")[0] for spec in specs]
    return {spec: name in SUITES_OF_TASKS or names.count(name) > 1 for spec, name in zip(specs, names)}


def lower_is_better(metric: str) -> bool:
    """A loss is reached from above; an accuracy from below (``validation.target_metric``)."""
    return metric.endswith("/loss")

# The few-shot probe, read both by vit-transfer (``eval.*``) and by the probes while pre-training
# (``validation.*``), and the minival split only a sweep of vit-transfer selects on (the probes fit
# the whole train split and score test): each setting's default is defined once, here; each
# section's field docstring says what the key means there.
FEWSHOT_DEFAULTS = {"tasks": [], "fewshot_shots": [1, 5, 10, 25], "fewshot_seeds": 3, "fewshot_l2": 1024.0,
                    "minival_fraction": 0.02, "seed": 0}


# The kNN probe's settings, read by vit-transfer (``eval.knn_*``) and the kNN probes while
# pre-training (``validation.knn_*``): DINOv2's k values and temperature.
KNN_DEFAULTS = {"knn_k": [10, 20, 100, 200], "knn_temperature": 0.07}


def _shared_field(default: Any) -> Any:
    """A dataclass field with ``default`` (a fresh list per config)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default))
    return field(default=default)


def _fewshot_field(name: str) -> Any:
    """The dataclass field of the shared few-shot setting ``name`` with its default."""
    return _shared_field(FEWSHOT_DEFAULTS[name])


def _knn_field(name: str) -> Any:
    """The dataclass field of the shared kNN setting ``name`` with its default."""
    return _shared_field(KNN_DEFAULTS[name])


def _check_fewshot(cfg: Any, section: str, suites: list[str], fail: Callable[[str, str], None]) -> None:
    """Impossible values of the shared few-shot settings of ``cfg``, named ``{section}.{key}``;
    ``suites``: the names of the suites the section runs (``tasks`` is read by ``vtab1k`` alone)."""
    from pretrain.transfer.vtab import canonical, unknown_task

    for name in cfg.tasks:
        if canonical(name) is None:
            fail(f"{section}.tasks", unknown_task(name))
    if cfg.tasks and "vtab1k" not in suites:
        fail(f"{section}.tasks", f"{cfg.tasks} would be ignored: only suite vtab1k reads it, and {section} runs "
                                 f"{', '.join(suites) or 'no suite'}")
    if not (cfg.fewshot_shots and all(k > 0 for k in cfg.fewshot_shots)):
        fail(f"{section}.fewshot_shots", f"must be positive shot counts, got {cfg.fewshot_shots}")
    if not cfg.fewshot_seeds > 0:
        fail(f"{section}.fewshot_seeds", f"must be positive, got {cfg.fewshot_seeds}")
    if not cfg.fewshot_l2 > 0:
        fail(f"{section}.fewshot_l2", f"must be > 0, got {cfg.fewshot_l2}")


def _check_knn(cfg: Any, section: str, fail: Callable[[str, str], None]) -> None:
    """Impossible values of the shared kNN settings of ``cfg``, named ``{section}.{key}``."""
    if not (cfg.knn_k and all(k > 0 for k in cfg.knn_k)):
        fail(f"{section}.knn_k", f"must be positive neighbour counts, got {cfg.knn_k}")
    if not cfg.knn_temperature > 0:
        fail(f"{section}.knn_temperature", f"must be > 0, got {cfg.knn_temperature}")


@dataclass
class EvalConfig:
    """Transfer evaluation of a checkpoint (``vit-transfer``, ``pretrain/transfer``); evaluation
    while pre-training is ``ValidationConfig``. Plain keys are the settings
    used without a sweep; ``sweep_*`` are the grids searched on train -> val when sweeping."""
    suite: str = "cifar100"
    """vit-transfer's suite: a name in `pretrain.transfer.suites.SUITES`."""
    protocol: Literal["finetune", "linear", "fewshot", "knn", "head"] = "linear"
    """vit-transfer's protocol: `finetune`, `linear`, `fewshot`, `knn` (DINOv2's weighted
    nearest-neighbour vote on frozen features) or `head` (the checkpoint's own classifier, nothing
    trained)."""
    recipe: Literal["paper", "deit"] = "paper"
    """Fine-tune recipe (`--recipe`): `paper` = the ViT paper / big_vision (SGD momentum 0.9, no
    weight decay, clip 1, cosine); `deit` = DeiT / MAE (AdamW, weight decay 0.05, layer decay,
    label smoothing, Mixup / CutMix, drop path, EMA). The fine-tune keys below left null take the
    recipe's value (pretrain/transfer/protocols/recipes.py)."""
    data_root: Optional[str] = None
    """The suite's data folder (`--data-root`)."""
    tasks: list[str] = _fewshot_field("tasks")
    """VTAB-1k: run only these tasks, by paper or folder name (empty: all present); set only with
    `eval.suite: vtab1k`."""
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
    """Fine-tune steps (linear warmup, then cosine decay)."""
    lr: Optional[float] = None
    """Fine-tune peak learning rate; null: the recipe's (paper 0.01; deit 5e-4 x
    eval.batch_size / 512, DeiT's scaling rule)."""
    min_lr: Optional[float] = None
    """Fine-tune: the learning rate the cosine ends at; null: the recipe's (paper 0, deit 1e-6 as
    MAE)."""
    warmup_steps: int = 100
    """Fine-tune warmup steps."""
    grad_clip: Optional[float] = None
    """Fine-tune global-norm clipping, 0 = none; null: the recipe's (paper 1, deit none)."""
    weight_decay: Optional[float] = None
    """Fine-tune weight decay (AdamW's decoupled one; SGD's under the paper recipe), none on
    biases, norms, position embedding and [class] token; null: the recipe's (paper 0, deit
    0.05)."""
    layer_decay: Optional[float] = None
    """Fine-tune layer-wise lr decay: the head trains at lr, the last block at layer_decay x lr,
    each block below at one more factor, the embeddings at the smallest (timm's
    `param_groups_layer_decay`); 1 = none; null: the recipe's (paper 1; deit 0.65 up to 12 blocks,
    0.75 deeper, as MAE's ViT-B and ViT-L/H)."""
    label_smoothing: Optional[float] = None
    """Fine-tune label smoothing; null: the recipe's (paper 0, deit 0.1)."""
    mixup_alpha: Optional[float] = None
    """Fine-tune Mixup alpha, 0 = off (with CutMix on too, each batch takes one of the two at even
    odds); null: the recipe's (paper 0, deit 0.8)."""
    cutmix_alpha: Optional[float] = None
    """Fine-tune CutMix alpha, 0 = off; null: the recipe's (paper 0, deit 1.0)."""
    drop_path_rate: Optional[float] = None
    """Fine-tune stochastic depth (the last block's rate, linear from 0); null: the recipe's (paper
    `model.drop_path_rate`, deit 0.1)."""
    ema_decay: Optional[float] = None
    """Fine-tune EMA of the weights (timm's ModelEmaV3), 0 = none; with an EMA the task's accuracy
    is the EMA weights' and `details.accuracy_no_ema` the trained weights'; null: the recipe's
    (paper 0, deit 0.99996 as DeiT)."""
    ema_warmup: bool = True
    """The EMA's decay after step t grows as 1 - t^(-2/3) up to `eval.ema_decay` (timm's `use_warmup`),
    so a fine-tune of a few hundred steps averages its last tens of steps; false: `eval.ema_decay`
    from the second step on (DeiT)."""
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
    sweep_lr: Optional[list[float]] = None
    """Fine-tune learning rates searched when sweeping; null: the recipe's (paper [0.001, 0.003,
    0.01, 0.03], deit [1e-4, 2.5e-4, 5e-4, 1e-3])."""
    sweep_linear_l2: list[float] = field(default_factory=lambda: [1e-5, 1e-4, 1e-3, 1e-2, 1e-1])
    """Linear-probe L2 penalties searched when sweeping."""
    sweep_fewshot_l2: list[float] = field(default_factory=lambda: [64.0, 256.0, 1024.0, 4096.0])
    """Few-shot ridge penalties searched when sweeping."""
    knn_k: list[int] = _knn_field("knn_k")
    """kNN: neighbour counts scored (DINOv2's 10, 20, 100, 200); the task's accuracy is 20-NN top-1
    (the largest k when 20 is absent), or with `eval.sweep` the k best on val, every k under
    details."""
    knn_temperature: float = _knn_field("knn_temperature")
    """kNN: the temperature T of the vote weights exp(cosine / T) (DINO, DINOv2: 0.07)."""
    real_labels: Optional[str] = None
    """`head`: a labels file in ImageNet-ReaL's layout (real.json: a list with one list of valid
    class indices per image, images in sorted file-name order; an empty list leaves the image
    out); adds ReaL top-1 / top-5 for an image-folder suite."""
    minival_fraction: float = _fewshot_field("minival_fraction")
    """The val split a sweep selects on, cut from train where a suite has none (big_vision):
    cifar100, an imagefolder without `val/`, the drawn demo. Shard splits cut none: `shards`
    sweeps only with a `val/`, `demo` with `eval.data_root` not at all."""
    wandb: bool = False
    """Log the results into the pre-training W&B run (same id, at the checkpoint's step)."""
    watch_poll_s: float = 30.0
    """`--watch`: seconds between looks for new checkpoints."""
    watch_idle_timeout_s: Optional[float] = None
    """`--watch`: stop after this long without a new checkpoint; null: never."""


# The eval keys only some protocols read, and which: one config serves every protocol, so a key set
# for one is no error under another, but a changed value the chosen protocol never reads is said
# (``unread_keys_note``). Every other key is read by every protocol (``tasks`` by one suite).
_FINETUNE_KEYS = ("recipe", "steps", "lr", "min_lr", "warmup_steps", "grad_clip", "weight_decay", "layer_decay",
                  "label_smoothing", "mixup_alpha", "cutmix_alpha", "drop_path_rate", "ema_decay", "ema_warmup",
                  "train_augment", "sweep_lr")
PROTOCOL_KEYS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(_FINETUNE_KEYS, ("finetune",)),
    "pool": ("linear", "fewshot", "knn"),  # frozen features; a fine-tune and the own head pool as the model does
    "linear_l2": ("linear",), "sweep_linear_l2": ("linear",),
    "fewshot_shots": ("fewshot",), "fewshot_seeds": ("fewshot",), "fewshot_l2": ("fewshot",),
    "sweep_fewshot_l2": ("fewshot",),
    "knn_k": ("knn",), "knn_temperature": ("knn",),
    "real_labels": ("head",),
}


def unread_keys_note(ev: EvalConfig) -> Optional[str]:
    """One line naming the keys of ``PROTOCOL_KEYS`` that ``ev`` sets away from their defaults
    (in a config file or an override: the schema's defaults are the only other source) while
    ``ev.protocol`` does not read them, each with the protocols that do; None when there are none."""
    defaults = EvalConfig()
    by_readers: dict[tuple[str, ...], list[str]] = {}
    for key, readers in PROTOCOL_KEYS.items():
        if ev.protocol not in readers and getattr(ev, key) != getattr(defaults, key):
            by_readers.setdefault(readers, []).append(f"eval.{key}")
    if not by_readers:
        return None
    said = "; ".join(f"{', '.join(keys)} (read by {' / '.join(readers)})" for readers, keys in by_readers.items())
    return f"eval.protocol={ev.protocol} ignores {said}"


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
        need(ev.lr is None or ev.lr > 0, "lr", f"must be positive, got {ev.lr}")
        need(ev.sweep_lr is None or (len(ev.sweep_lr) > 0 and all(v > 0 for v in ev.sweep_lr)), "sweep_lr",
             f"must list positive learning rates, got {ev.sweep_lr}")
        for name, peak in (("eval.lr", ev.lr), ("the least of eval.sweep_lr", min(ev.sweep_lr or (), default=None))):
            # the cosine decays from the peak to min_lr, as optim.min_lr's
            if ev.min_lr is not None and peak is not None:
                need(ev.min_lr <= peak, "min_lr", f"must be in [0, {name}={peak:g}], got {ev.min_lr:g}")
        for key in ("min_lr", "grad_clip", "weight_decay", "label_smoothing", "mixup_alpha", "cutmix_alpha",
                    "drop_path_rate"):
            need(getattr(ev, key) is None or getattr(ev, key) >= 0, key, f"must be >= 0, got {getattr(ev, key)}")
        need(ev.layer_decay is None or 0 < ev.layer_decay <= 1, "layer_decay",
             f"must be in (0, 1] (1: no layer decay), got {ev.layer_decay}")
        need(ev.label_smoothing is None or ev.label_smoothing < 1, "label_smoothing",
             f"must be < 1, got {ev.label_smoothing}")
        need(ev.drop_path_rate is None or ev.drop_path_rate < 1, "drop_path_rate",
             f"must be < 1, got {ev.drop_path_rate}")
        need(ev.ema_decay is None or 0 <= ev.ema_decay < 1, "ema_decay",
             f"must be in [0, 1) (0: no EMA), got {ev.ema_decay}")
    _check_knn(ev, "eval", fail)
    need(ev.linear_l2 >= 0, "linear_l2", f"must be >= 0, got {ev.linear_l2}")
    need(ev.fewshot_l2 > 0, "fewshot_l2", f"must be > 0, got {ev.fewshot_l2}")
    # the grids a sweep searches: at least one value each, as their single keys
    need(len(ev.sweep_linear_l2) > 0 and all(v >= 0 for v in ev.sweep_linear_l2), "sweep_linear_l2",
         f"must list L2 penalties >= 0, got {ev.sweep_linear_l2}")
    need(len(ev.sweep_fewshot_l2) > 0 and all(v > 0 for v in ev.sweep_fewshot_l2), "sweep_fewshot_l2",
         f"must list ridge penalties > 0, got {ev.sweep_fewshot_l2}")
    _check_fewshot(ev, "eval", [ev.suite], fail)
    need(0 < ev.minival_fraction < 1, "minival_fraction", f"must be in (0, 1), got {ev.minival_fraction}")
    need(ev.seed >= 0, "seed", f"must be >= 0 (numpy's generators take no negative seed), got {ev.seed}")
    need(ev.seed < SEED_LIMIT, "seed", f"must be below 2**63 (torch's generators take a 64-bit seed), got {ev.seed}")
    need(ev.watch_poll_s > 0, "watch_poll_s", f"must be positive, got {ev.watch_poll_s}")
    need(ev.watch_idle_timeout_s is None or ev.watch_idle_timeout_s >= 0, "watch_idle_timeout_s",
         f"must be >= 0 (0: evaluate what is there, then stop) or null, got {ev.watch_idle_timeout_s}")


@dataclass
class ValidationConfig:
    """Evaluation while pre-training (``pretrain/evaluation/in_training.py``): validation loss / top-k over
    ``data.val_shards`` and few-shot and kNN probes, every ``every_steps`` steps."""
    every_steps: int = 0
    """Evaluate while pre-training every N steps and at the last one; 0 = off (see
    pretrain/evaluation/EVALUATION.md)."""
    fewshot_suites: list[str] = field(default_factory=list)
    """Few-shot probes while pre-training: vit-transfer suite names, `NAME` or `NAME:PATH` (e.g.
    `demo`, `cifar100:/data/cifar-100-python`, `imagefolder:/data/pets`): big_vision's ridge on the
    features the model's head sees (its own pooling and pre-logits layer), the images prepared with
    `data.augment.eval_crop_pct` and `data.augment.mean` / `std`, as vit-transfer prepares them."""
    batch_size: int = 0
    """Images per evaluation forward on each rank, for validation, few-shot and kNN alike; 0 = the
    training micro batch (which always fits: an evaluation keeps no activations for a backward).
    Larger evaluation batches take fewer forwards, and under ZeRO-3 fewer parameter gathers, for
    the same figures up to rounding."""
    knn_suites: list[str] = field(default_factory=list)
    """kNN probes while pre-training (DINOv2's weighted vote of the whole train split on the test
    split), suites named as `validation.fewshot_suites`. Their images are read at every
    evaluation (a forward pass over train and test each time), not kept: pick a small suite."""
    knn_k: list[int] = _knn_field("knn_k")
    """The kNN probes' neighbour counts."""
    knn_temperature: float = _knn_field("knn_temperature")
    """The kNN probes' vote temperature."""
    fewshot_shots: list[int] = _fewshot_field("fewshot_shots")
    """The probes' shots per class."""
    fewshot_seeds: int = _fewshot_field("fewshot_seeds")
    """The probes' seeds (draws of the few-shot examples), averaged."""
    fewshot_l2: float = _fewshot_field("fewshot_l2")
    """The probes' ridge penalty (big_vision's l2_reg = 2**10)."""
    tasks: list[str] = _fewshot_field("tasks")
    """VTAB-1k tasks to probe, by paper or folder name (empty: all present); set only with a
    `vtab1k` suite among the probes'."""
    target_metric: str = ""
    """A metric these evaluations log, named as logged (`eval/top1`, `eval/ema/top1`, `eval/loss`,
    `eval/fewshot/demo/10shot`, `eval/knn/vtab1k/dtd/20nn`); the first evaluation where it reaches
    `validation.target_value` (at most, for a loss; at least, otherwise) is recorded with the step,
    device-hours, images and model FLOPs the run took to get there (a line, `target_reached` in
    summary.json and in each later checkpoint's run.json); empty: no target."""
    target_value: float = 0.0
    """The value `validation.target_metric` is to reach: an accuracy as a fraction (0.75), or a loss."""
    stop_at_target: bool = False
    """End the run at the evaluation that reaches the target, with a checkpoint and exit 0 (time to
    accuracy, as MLPerf Training measures it); started again, it trains nothing."""


def target_metrics(val: ValidationConfig, *, val_shards: bool, multi_label: bool, ema: bool,
                   labels: Optional[dict[str, list[str]]] = None) -> list[str]:
    """The metric names an evaluation of the ``validation`` section ``val`` logs: validation's with
    ``data.val_shards`` (``multi_label``: precision@1 for top-k), the probes' for each suite spec, all
    again under ``eval/ema/`` with ``train.ema_decay`` (``ema``). ``labels``: each probe spec's names as
    start-up reads them (``in_training.probe_tasks``); None: as the config alone says them, a suite's
    folder or task written ``<folder>`` or ``<task>`` (``target_problem`` matches them as a pattern)."""
    if labels is None:  # as in_training.probe_tasks names them
        labels = {}
        for spec, own in names_tasks(list(dict.fromkeys(val.fewshot_suites + val.knn_suites))).items():
            name = spec.partition(":")[0]
            labels[spec] = [f"{name}/<{'task' if name in SUITES_OF_TASKS else 'folder'}>" if own else name]
    names = (["loss", "prec@1"] if multi_label else ["loss", "top1", "top5"]) if val_shards else []
    if val.every_steps > 0:
        names += [f"fewshot/{label}/{n}shot" for spec in val.fewshot_suites for label in labels.get(spec, [])
                  for n in val.fewshot_shots]
        names += [f"knn/{label}/{k}nn" for spec in val.knn_suites for label in labels.get(spec, []) for k in val.knn_k]
    return [f"eval/{p}{n}" for p in ("", "ema/")[:1 + ema] for n in names]


def target_problem(val: ValidationConfig, metrics: list[str]) -> Optional[tuple[str, str]]:
    """(key, message) when ``validation.target_*`` asks what ``metrics`` (``target_metrics``) cannot
    give; None when it is sound or unset."""
    import fnmatch
    import math

    if not val.target_metric:
        if val.stop_at_target:
            return "validation.stop_at_target", "stops at validation.target_metric: set it too"
        return None
    if val.every_steps <= 0:
        return "validation.target_metric", "is read at an evaluation: set validation.every_steps too, or clear this key"
    patterns = [re.sub(r"<(task|folder)>", "*", m) for m in metrics]
    if not any(fnmatch.fnmatchcase(val.target_metric, p) for p in patterns):
        shown = ", ".join(metrics[:12]) + (", ..." if len(metrics) > 12 else "")
        return "validation.target_metric", (f"{val.target_metric!r} is not a metric these evaluations log; they log "
                                            f"{shown or 'nothing (no data.val_shards and no probe suites)'}")
    v = val.target_value
    if lower_is_better(val.target_metric):
        if not (math.isfinite(v) and v > 0):
            return "validation.target_value", f"a loss to reach must be positive, got {v:g}"
    elif not 0 < v <= 1:
        return "validation.target_value", f"an accuracy to reach is a fraction in (0, 1] (e.g. 0.75), got {v:g}"
    return None


def check_validation(val: ValidationConfig, fail: Callable[[str, str], None]) -> None:
    """Impossible values of the section; ``fail(key, message)`` raises the error naming the file."""
    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            fail(f"validation.{key}", msg)

    need(val.every_steps >= 0, "every_steps", f"must be >= 0 (0: no evaluation while training), got {val.every_steps}")
    need(val.batch_size >= 0, "batch_size", f"must be >= 0 (0: the training micro batch), got {val.batch_size}")
    for key in ("fewshot_suites", "knn_suites"):
        for spec in getattr(val, key):
            name = spec.partition(":")[0]
            need(name in SUITE_NEEDS_ROOT, key,
                 f"unknown suite {name!r} in {spec!r}; choose one of {', '.join(SUITE_NEEDS_ROOT)}")
            need(not SUITE_NEEDS_ROOT[name] or ":" in spec, key, f"{spec!r}: suite {name} needs NAME:PATH")
    names = dict.fromkeys(spec.partition(":")[0] for spec in val.fewshot_suites + val.knn_suites)
    _check_fewshot(val, "validation", list(names), fail)
    _check_knn(val, "validation", fail)
