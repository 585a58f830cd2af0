"""The training step: micro-batches to one optimizer step, with non-finite micro-batches dropped.

``train_step`` is the algorithm and nothing else: read a batch, forward, agree with the other
ranks whether the loss is finite, backward, step, until DeepSpeed reaches its gradient-accumulation
boundary; then the weights' moving average (``train.ema_decay``) takes the new weights in.
Timing and the hang watchdog attach at its phase boundaries (``clock.enter``); nothing
in it reads the device on the host, so on a GPU the host queues the next micro-batch while the
device still computes.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch

from pretrain.distributed.ema import WeightEma
from pretrain.observability.clock import StepClock
from pretrain.resilience.nonfinite import NonFiniteGuard


def train_step(engine, batches: Iterator, guard: NonFiniteGuard, clock: StepClock, step: int,
               loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               dtype: torch.dtype, ema: Optional[WeightEma] = None) -> tuple[torch.Tensor, int]:
    """One optimizer step (``step``, counted from 1), then ``ema``'s update from the stepped
    masters. Returns (a device tensor [sum of the kept micro-batch losses, their count], images
    this rank used): no host read."""
    device = engine.device
    acc = torch.zeros(2, device=device)
    images, done = 0, False
    while not done:
        clock.enter("data")
        x, y = next(batches)
        clock.enter("forward")
        x = x.to(device, dtype, non_blocking=True)
        loss = loss_of(engine(x), y.to(device, non_blocking=True))
        clock.enter("agree")  # every rank drops a non-finite micro-batch (zero gradients, on the device)
        ok = guard.agree(loss, step)
        clock.enter("backward")
        done = engine.is_gradient_accumulation_boundary()
        engine.backward(loss)
        clock.enter("step")
        engine.step()
        acc += torch.stack([torch.where(ok, loss.detach(), 0.0), ok.float()])
        images += x.shape[0]
    if ema is not None:  # inside the step phase: one pass over this rank's master partition
        ema.update(step)
    return acc, images
