"""Non-finite losses: micro-batches whose loss is NaN or inf on any rank are dropped on the device,
with no host sync inside a step; ``train.max_nonfinite_steps`` in a row stop the run.

Under ``train.precision=fp16`` DeepSpeed's dynamic loss scaler works beside the guard, on another
signal: the guard reads the *loss* (the unscaled forward value), the scaler the *gradients* of the
scaled loss. A step whose scaled gradients overflow has a finite loss: the guard keeps its
micro-batches and the scaler skips the step and lowers the scale (``overflow_skipped_steps`` in the
metrics, not ``nonfinite_skipped``). A non-finite loss is an overflow of the forward, which no loss
scale cures: the guard zeroes its gradients (so the scaler sees no overflow and keeps its scale) and
counts it. The scaler's own end, an overflow at its minimum scale, becomes :class:`NonFiniteLoss`
(:func:`scale_floor_as_error`)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

# what DeepSpeed's DynamicLossScaler.update_scale raises (a bare Exception) when the gradients
# overflow at fp16.min_loss_scale
SCALE_FLOOR_MESSAGE = "Current loss scale already at minimum"


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


@contextlib.contextmanager
def scale_floor_as_error(step: int):
    """Around a step: DeepSpeed's "loss scale already at minimum" exception (fp16 gradients that
    overflow at ``min_loss_scale``) as a one-line :class:`NonFiniteLoss` naming the step."""
    try:
        yield
    except Exception as e:  # noqa: BLE001  DeepSpeed raises a bare Exception
        if SCALE_FLOOR_MESSAGE not in str(e):
            raise
        raise NonFiniteLoss(f"fp16 gradients overflow at the smallest loss scale at step {step}; lower optim.lr, "
                            "or use train.precision=bf16 or fp32") from None
