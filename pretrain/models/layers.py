"""The encoder block of ``pretrain.models.vit`` and its pieces: multi-head self-attention (with
optional QK LayerNorm), the MLP, LayerScale, stochastic depth, and the pre-norm block that joins
them. Their parameter names are timm's (``attn.qkv``, ``mlp.fc1``, ``ls1.gamma``, ...): the model's
state dict, its exports and timm's loading depend on them. ``Block`` is the unit ZeRO-3 fetches
whole (``pretrain.distributed.engine.LEAF_BLOCK_CLASS`` names it) and activation checkpointing
recomputes.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pretrain.models.recompute import selective_context


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample (Huang et al. 2016). The
    per-image mask is scaled, then multiplies the branch once (timm's ``drop_path``: the same
    numbers, one pass over the activations forward and one backward)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = 1.0 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask.div_(keep)


class Attention(nn.Module):
    """Multi-head self-attention. ``qk_norm``: LayerNorm over each head's queries and keys before
    the dot product (Dehghani et al. 2023, ViT-22B), which keeps attention logits from growing
    without bound at large width; adds 4 * head_dim parameters."""

    def __init__(self, dim: int, num_heads: int, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 qk_norm: bool = False, norm_layer: Optional[Callable[[int], nn.Module]] = None):
        super().__init__()
        assert dim % num_heads == 0, f"embed dim {dim} not divisible by {num_heads} heads"
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = attn_drop
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        # Fused kernel (flash / memory-efficient) on GPUs; the math path on CPU.
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class LayerScale(nn.Module):
    """Per-channel scale of a residual branch, initialised small (CaiT, Touvron et al. 2021):
    each block starts close to the identity, which steadies very deep models."""

    def __init__(self, dim: int, init_values: float):
        super().__init__()
        self.init_values = init_values
        self.gamma = nn.Parameter(torch.full((dim,), init_values))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    """Pre-norm encoder block: x + MSA(LN(x)), then x + MLP(LN(x)); with ``init_values`` each
    branch is scaled by a LayerScale (``ls1`` / ``ls2``, absent when it is None or 0, as timm).
    ``checkpoint_ops``: the forward checkpointed op by op (``pretrain.models.recompute``), inside
    the block's own ``forward``: a compiled block (``train.compile: blocks``) traces the checkpoint
    and its policy with it (around a compiled call, the policy's dispatch mode would run the block
    eagerly)."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, drop: float, attn_drop: float,
                 drop_path: float, norm_layer: Callable[[int], nn.Module], qk_norm: bool = False,
                 init_values: Optional[float] = None):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, num_heads, attn_drop=attn_drop, proj_drop=drop, qk_norm=qk_norm,
                              norm_layer=norm_layer)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path)
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path)
        self.checkpoint_ops = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_ops and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False, context_fn=selective_context)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
