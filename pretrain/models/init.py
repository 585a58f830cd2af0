"""Initialisation helpers shared by every model of the family: one CPU generator, drawn into CPU
tensors and copied to wherever the parameters live (any device, dtype or ZeRO-3 partition)."""
from __future__ import annotations

from typing import Callable, Optional

import torch


def init_generator(seed: Optional[int]) -> torch.Generator:
    """The CPU generator an initialisation draws from: seeded by ``seed``, or (None) by a number
    drawn from torch's global CPU generator."""
    if seed is None:
        seed = int(torch.randint(0, 2 ** 62, (), device="cpu"))
    return torch.Generator(device="cpu").manual_seed(seed)


def fill(p: torch.Tensor, draw: Callable[[torch.Tensor], object]) -> None:
    """``draw`` into a CPU fp32 tensor of ``p``'s shape, then copy it into ``p`` (any device and
    dtype). Meta tensors (a build without memory) are left alone."""
    if p.is_meta:
        return
    t = torch.empty(p.shape, dtype=torch.float32, device="cpu")
    draw(t)
    p.copy_(t)
