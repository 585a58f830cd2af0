"""An exponential moving average of a model's weights for the fine-tune: timm's ``ModelEmaV3``
semantics in plain PyTorch (a test holds the two equal step by step).

After optimizer step ``t`` (1, 2, ...) every average moves as ``ema.lerp_(w, 1 - d(t))`` with
``d(t) = 0`` for ``t <= 1`` (the first update copies the weights) and else ``decay``, or with the
warm-up ``min(decay, 1 - t^(-2/3))`` (timm's ``use_warmup``, ``warmup_gamma`` 1).
The ViT has no buffers, so the parameters are the whole state timm averages.

The averages are fp32 copies of the full weights on every rank (timm's ``dtype=torch.float32``
for a 16-bit model): 4 bytes a parameter, a ViT-H's 2.5 GB. Under ZeRO-3 each update gathers the
weights one parameter at a time (``gather``): the traffic of one more forward's gathers per step.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Sequence

import torch

WARMUP_POWER = 2 / 3  # timm ModelEmaV3's default warmup_power (warmup_gamma 1)

Gather = Callable[[list[torch.nn.Parameter], bool], ContextManager]  # (params, writes) -> context


def _no_gather(params, writes: bool) -> ContextManager:
    return contextlib.nullcontext()


def ema_decay(step: int, decay: float, warmup: bool) -> float:
    """timm ``ModelEmaV3.get_decay(step)`` with ``update_after_step`` 0 and ``min_decay`` 0."""
    step = max(0, step - 1)
    if step <= 0:
        return 0.0
    if warmup:
        return max(min(1 - (1 + step) ** -WARMUP_POWER, decay), 0.0)
    return decay


class WeightEma:
    """fp32 averages of ``params`` (a list, in a fixed order). ``gather(params, writes)``: the
    context in which the full values of ``params`` are readable (``writes``: and written back to
    every rank), ``deepspeed.zero.GatheredParameters`` under ZeRO-3."""

    def __init__(self, params: Sequence[torch.nn.Parameter], decay: float, warmup: bool, gather: Gather = _no_gather):
        self.params, self.decay, self.warmup, self.gather = list(params), decay, warmup, gather
        self.shadow = []
        for p in self.params:
            with self.gather([p], False):
                self.shadow.append(p.detach().float().clone())

    @torch.no_grad()
    def update(self, step: int) -> float:
        """Moves every average towards the weights after optimizer step ``step``; returns the decay used."""
        d = ema_decay(step, self.decay, self.warmup)
        if self.gather is _no_gather and all(p.dtype == torch.float32 for p in self.params):
            torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1.0 - d)
            return d
        for s, p in zip(self.shadow, self.params):
            with self.gather([p], False):
                s.lerp_(p.detach().float(), 1.0 - d)
        return d

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Writes the averages into the model's weights (what it then evaluates). Under ZeRO-3 a
        collective: each parameter is gathered, set and partitioned again."""
        for s, p in zip(self.shadow, self.params):
            with self.gather([p], True):
                p.copy_(s.to(p.dtype))

    def state(self) -> list[torch.Tensor]:
        return self.shadow
