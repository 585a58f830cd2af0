"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning"), ``optim.name: lamb``:
timm's ``timm.optim.Lamb`` with its defaults (the NVIDIA ``FusedLAMB`` variant), written for ZeRO.

Per parameter ``w`` with gradient ``g`` (already clipped: DeepSpeed clips the global norm at
``optim.grad_clip``, which plays timm's ``max_grad_norm``), at step ``t``::

    m = beta1 m + (1 - beta1) g          v = beta2 v + (1 - beta2) g^2
    u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + wd w      (wd: the group's decay)
    r = ||w|| / ||u||  (1 where either norm is 0), only in groups with wd > 0; else r = 1
    w = w - lr r u

The trust ratio ``r`` is per whole parameter tensor. Under ZeRO the optimizer steps flat
partitions holding pieces of many parameters, a parameter's pieces spread over ranks: each rank
sums the squares of its pieces of ``w`` and ``u`` per parameter and one all-reduce over the ZeRO
group (two floats per parameter of the group) gives every rank the whole norms, so the update is
timm's exactly. Which piece is where comes from ``ds_masters.master_shards`` (:meth:`Lamb.shard`);
an unknown flat tensor under sharding is an error, never a per-piece ratio. State per parameter:
``exp_avg``, ``exp_avg_sq`` and ``step`` (a CPU tensor, as torch's AdamW), so checkpoints and
DeepSpeed's universal conversion treat it as Adam's. No host read of device values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


@dataclass
class ShardLayout:
    """How one flat tensor splits into pieces of parameters: ``lengths`` of its consecutive segments
    (padding included), ``ids`` the group-wide parameter index of each segment (-1: padding),
    ``count`` the parameters in the group, ``group`` the process group holding the other pieces."""
    lengths: list[int]
    ids: torch.Tensor
    count: int
    group: Any
    device: torch.device  # where the per-parameter sums are all-reduced
    sizes: Optional[torch.Tensor] = None  # ``lengths`` on the flat tensor's device, made once (no copy per step)

    @classmethod
    def of(cls, shard, device: torch.device) -> "ShardLayout":
        """From a ``ds_masters.MasterShard``."""
        index = {n: i for i, n in enumerate(shard.names)}
        lengths, ids, at = [], [], 0
        for f in sorted(shard.fragments, key=lambda f: f.offset):
            if f.offset > at:
                lengths.append(f.offset - at)
                ids.append(-1)
            lengths.append(f.numel)
            ids.append(index[f.name])
            at = f.offset + f.numel
        if at < shard.flat.numel():
            lengths.append(shard.flat.numel() - at)
            ids.append(-1)
        at = shard.flat.device
        return cls(lengths, torch.tensor(ids, dtype=torch.int64, device=at), len(shard.names), shard.group, device,
                   torch.tensor(lengths, dtype=torch.int64, device=at))


def trust_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor) -> torch.Tensor:
    """``||w|| / ||u||``, 1 where either is 0 (timm's ``_lamb_trust_ratio`` without trust clipping)."""
    return torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))


class Lamb(torch.optim.Optimizer):
    """LAMB with timm's defaults (module docstring): bias correction, gradient averaging, L2 weight
    decay added to the update, the trust ratio only where a group decays, no trust clipping, no
    clipping inside (the engine clips)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self._layouts: dict = {}  # flat tensor -> ShardLayout
        self._sharding: Optional[Callable[[], dict]] = None

    def shard(self, layouts: Callable[[], dict]) -> None:
        """Step flat ZeRO partitions: ``layouts()`` maps each flat tensor the optimizer steps to its
        :class:`ShardLayout`; asked again when a flat tensor is new (DeepSpeed may rebuild them)."""
        self._sharding = layouts
        self._layouts = layouts()

    def _layout(self, p: torch.Tensor) -> Optional[ShardLayout]:
        if self._sharding is None:
            return None
        if p not in self._layouts:
            self._layouts = self._sharding()
        if p not in self._layouts:
            raise RuntimeError(f"LAMB under ZeRO: a flat tensor of {p.numel()} elements that no ZeRO partition "
                               "map names; its trust ratios would be per piece, not per parameter")
        return self._layouts[p]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = float(state["step"])  # a CPU tensor: no device read
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                u = (m / (1 - beta1 ** t)).div_((v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps))
                if wd != 0:
                    u.add_(p, alpha=wd)
                    u.mul_(self._ratio(p, u))
                p.add_(u, alpha=-lr)
        return loss

    def _ratio(self, p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The trust ratio of ``p``'s update ``u``: a 0-d tensor for a whole parameter, else one value
        per element of the flat partition (each piece's parameter's ratio)."""
        layout = self._layout(p)
        if layout is None:
            return trust_ratio(p.norm(2.0), u.norm(2.0))
        import torch.distributed as dist

        pieces_w = torch._foreach_norm(list(p.split(layout.lengths)))
        pieces_u = torch._foreach_norm(list(u.split(layout.lengths)))
        keep = layout.ids >= 0
        sums = torch.zeros(2, layout.count, dtype=torch.float32, device=p.device)
        squares = torch.stack([torch.stack(pieces_w), torch.stack(pieces_u)]).float().square()
        sums.index_add_(1, layout.ids[keep], squares[:, keep])
        if layout.group is not None and dist.get_world_size(layout.group) > 1:
            # ZeRO-Offload under NCCL: the CPU partitions' sums go through the GPU and back (a host read)
            sums = sums.to(layout.device)
            dist.all_reduce(sums, group=layout.group)
            sums = sums.to(p.device)
        ratio = trust_ratio(sums[0].sqrt(), sums[1].sqrt())
        per_piece = torch.where(keep, ratio[layout.ids.clamp(min=0)], torch.ones_like(keep, dtype=ratio.dtype))
        return torch.repeat_interleave(per_piece.to(u.dtype), layout.sizes, output_size=p.numel())
