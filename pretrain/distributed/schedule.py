"""Learning-rate schedules as step -> factor functions (for ``torch.optim.lr_scheduler.LambdaLR``).

Plain arguments, no config types: pre-training (``engine.py``) and transfer fine-tuning
(``transfer/protocols/finetune.py``) both build theirs here.
"""
from __future__ import annotations

import math
from typing import Callable

SCHEDULES = ("linear", "cosine", "constant")


def lr_multiplier(schedule: str, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> Callable[[int], float]:
    """Step -> factor on the base LR: linear warmup from 0 over ``warmup_steps``, then linear or
    cosine decay to ``min_ratio`` at ``total_steps`` (the paper: 10k warmup steps, linear decay),
    or constant."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant" or total_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            decay = 1.0 - progress
        return min_ratio + (1.0 - min_ratio) * decay

    return f
