"""The training step: micro-batches to one optimizer step, with non-finite micro-batches dropped.

``train_step`` is the algorithm and nothing else: read a batch, forward, agree with the other
ranks whether the loss is finite, backward, step, until DeepSpeed reaches its gradient-accumulation
boundary. Timing and the hang watchdog attach at its phase boundaries (``clock.enter``); nothing
in it reads the device on the host, so on a GPU the host queues the next micro-batch while the
device still computes.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.distributed as dist

from pretrain.observability.clock import StepClock


class NonFiniteLoss(RuntimeError):
    pass


class NonFiniteGuard:
    """Drops micro-batches whose loss is non-finite on any rank, with no host sync inside a step;
    K in a row stop the run, naming the steps.

    Each micro-batch's finite flag is all-reduced (MIN) on the device, so every rank drops the same
    micro-batches, and gates every parameter's gradient in a hook that runs before the gradient is
    accumulated: ``torch.where(ok, grad, 0)`` *selects*, so NaN / inf gradients become exact zeros
    (``grad * 0`` would stay NaN, and zeroing the loss is not enough: the backward through NaN
    activations is NaN whatever the upstream gradient). Every rank still runs the backward and
    the step, so ZeRO's collectives and DeepSpeed's accumulation counter stay in step; the dropped
    micro-batch adds nothing to its step's gradient and the step counts. The flags wait on the
    device and are read at the next sync point (``verdict``, one ``tolist``).

    Costs: one elementwise select per gradient per micro-batch (memory-bound, far below the
    step's matmuls). A step whose micro-batches were all dropped still steps the optimizer with
    zero gradients (AdamW's momentum and weight decay move the weights slightly: no NaN reaches
    them), and a streak of K stops the run at the next sync point, up to
    ``train.sync_every_steps`` steps later, before any checkpoint of those steps is written.
    """

    def __init__(self, limit: int, params=(), device="cpu"):
        self.limit, self.in_a_row, self.total, self.first_step = limit, 0, 0, None
        self.ok = torch.ones((), dtype=torch.bool, device=device)  # the current micro-batch's gate
        self.pending: list[tuple[int, torch.Tensor]] = []  # (step, flag) not yet read
        self._hooks = [p.register_hook(self._gate) for p in params if p.requires_grad]

    def _gate(self, grad: torch.Tensor) -> torch.Tensor:
        return torch.where(self.ok, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))

    def agree(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """This micro-batch's verdict on every rank, as a device bool (a collective, no sync)."""
        finite = torch.isfinite(loss.detach()).float()
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        ok = finite.bool()
        self.ok.copy_(ok)
        self.pending.append((step, ok))
        return ok

    def verdict(self) -> None:
        """Read the pending flags (a sync point): count them; K in a row raise NonFiniteLoss."""
        if not self.pending:
            return
        flags = torch.stack([f for _, f in self.pending]).tolist()
        steps = [s for s, _ in self.pending]
        self.pending.clear()
        for finite, step in zip(flags, steps):
            self.check(finite, step)

    def check(self, finite: bool, step: int) -> bool:
        if finite:
            self.in_a_row, self.first_step = 0, None
            return True
        self.total += 1
        self.in_a_row += 1
        self.first_step = step if self.first_step is None else self.first_step
        if self.in_a_row >= self.limit:
            raise NonFiniteLoss(f"{self.in_a_row} non-finite losses in a row at steps "
                                f"{self.first_step}-{step}; lower optim.lr or check the data")
        return False

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def train_step(engine, batches: Iterator, guard: NonFiniteGuard, clock: StepClock, step: int,
               loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """One optimizer step (``step``, counted from 1). Returns (a device tensor [sum of the kept
    micro-batch losses, their count], images this rank used): no host read."""
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
    return acc, images
