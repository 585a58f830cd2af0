"""The two fine-tune recipes of ``vit-transfer --protocol finetune --recipe paper|deit``.

``paper`` (the default): the ViT paper / big_vision -- SGD with momentum 0.9, no weight decay,
global-norm clipping at 1, cosine to 0 after a linear warmup, lr 0.01.

``deit``: the fine-tune DeiT (Touvron et al. 2021, ``main.py``) and MAE (He et al. 2022,
``main_finetune.py``, FINETUNE.md) report: AdamW (betas 0.9 / 0.999, eps 1e-8), weight decay 0.05,
layer-wise lr decay 0.65 for up to 12 blocks (MAE's ViT-B) and 0.75 for deeper models (its L/H),
label smoothing 0.1, Mixup 0.8 and CutMix 1.0 (one of the two per batch, even odds), drop path
0.1, an EMA of the weights at 0.99996 (DeiT), no clipping, lr 5e-4 x batch / 512 (DeiT's linear
scaling rule) with cosine to 1e-6 (MAE's min_lr) after the warmup. Left out: RandAugment,
random erasing and repeated augmentation (data-side pieces of the ImageNet-scale runs).

Every ``eval.*`` key of a recipe that is null in the config takes the recipe's value here; a key
the user sets wins, under either recipe.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

MOMENTUM = 0.9  # SGD (paper)
BETAS, EPS = (0.9, 0.999), 1e-8  # AdamW (deit): torch's defaults, which DeiT and MAE keep
DEIT_BATCH = 512  # DeiT scales its lr 5e-4 by batch / 512
DEIT_LR = 5e-4


@dataclass(frozen=True)
class Recipe:
    """A fine-tune recipe with every value decided."""
    name: str
    optimizer: str  # "sgd" or "adamw"
    lr: float
    sweep_lr: tuple
    min_lr: float
    grad_clip: float  # 0: none
    weight_decay: float
    layer_decay: float  # 1: none
    label_smoothing: float
    mixup_alpha: float
    cutmix_alpha: float
    drop_path_rate: float
    ema_decay: float  # 0: none
    ema_warmup: bool

    @property
    def mixes(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0


def _defaults(name: str, depth: int, batch_size: int, model_drop_path: float) -> dict:
    if name == "paper":
        return dict(optimizer="sgd", lr=0.01, sweep_lr=(0.001, 0.003, 0.01, 0.03), min_lr=0.0, grad_clip=1.0,
                    weight_decay=0.0, layer_decay=1.0, label_smoothing=0.0, mixup_alpha=0.0, cutmix_alpha=0.0,
                    drop_path_rate=model_drop_path, ema_decay=0.0)
    if name == "deit":
        return dict(optimizer="adamw", lr=DEIT_LR * batch_size / DEIT_BATCH, sweep_lr=(1e-4, 2.5e-4, 5e-4, 1e-3),
                    min_lr=1e-6, grad_clip=0.0, weight_decay=0.05, layer_decay=0.65 if depth <= 12 else 0.75,
                    label_smoothing=0.1, mixup_alpha=0.8, cutmix_alpha=1.0, drop_path_rate=0.1, ema_decay=0.99996)
    raise ValueError(f"unknown fine-tune recipe {name!r}")


def resolve(ev, *, depth: int, model_drop_path: float = 0.0) -> Recipe:
    """The recipe ``ev.recipe`` for a model of ``depth`` blocks, with the ``eval`` section's
    explicit (non-null) keys over its defaults. ``model_drop_path``: ``model.drop_path_rate``,
    which the paper recipe fine-tunes with."""
    d = _defaults(ev.recipe, depth, ev.batch_size, model_drop_path)
    given: dict[str, Optional[object]] = {k: getattr(ev, k) for k in d if k != "optimizer"}
    d.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in given.items() if v is not None})
    return Recipe(name=ev.recipe, ema_warmup=ev.ema_warmup, **d)
