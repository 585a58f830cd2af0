"""Two pieces of big_vision's ViT beyond the paper's: multi-head attention pooling (MAP) and the
fixed 2-D sin-cos position embedding.

``AttentionPool`` computes big_vision's ``MAPHead`` (``big_vision/models/vit.py``; Zhai et al. 2022,
"Scaling Vision Transformers"): one learned probe attends over the tokens with the model's head
count, then a residual MLP on the LayerNorm of the result. Its parameters carry the names and
shapes of timm's ``AttentionPoolLatent`` (``latent``, ``q``, ``kv`` with key and value stacked,
``proj``, ``norm``, ``mlp.fc1`` / ``mlp.fc2``), so ``global_pool='map'`` weights load into timm and
back. Its cost is mostly the keys and values of every patch token (one more D x 2D projection per
token); the probe's one attention row and the MLP on one token are small: for ViT-B/16 at 224 px
1.4 % of the forward (``pretrain.models.arch.map_head_macs``).

``sincos_2d`` is big_vision's ``posemb_sincos_2d`` (MoCo v3's): a quarter of the channels each for
sin and cos of the column, then of the row, at frequencies ``10000 ** -(i / (D/4 - 1))``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class AttentionPool(nn.Module):
    """MAP over (B, N, D) tokens -> (B, D). ``mlp`` and ``norm`` are the model's own layer types
    (the encoder's MLP width, its LayerNorm eps), built by the caller."""

    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, norm: nn.Module):
        super().__init__()
        assert dim % num_heads == 0, f"embed dim {dim} not divisible by {num_heads} heads"
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))  # big_vision's "probe"
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = norm
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q = self.q(self.latent.expand(B, -1, -1)).reshape(B, 1, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        x = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, 1, C)
        x = self.proj(x)
        x = x + self.mlp(self.norm(x))
        return x[:, 0]


def sincos_2d(grid: tuple[int, int], dim: int, temperature: float = 10_000.0,
              device: Optional[torch.device] = None) -> torch.Tensor:
    """(H*W, dim) fixed position embedding of an H x W patch grid, row-major as the patches are
    flattened; computed in float64 on ``device`` (the host by default), returned as float32."""
    if dim % 4:
        raise ValueError(f"the sin-cos position embedding needs a width divisible by 4, got {dim}")
    h, w = grid
    f64 = dict(dtype=torch.float64, device=device)
    y, x = torch.meshgrid(torch.arange(h, **f64), torch.arange(w, **f64), indexing="ij")
    omega = 1.0 / temperature ** (torch.arange(dim // 4, **f64) / max(1, dim // 4 - 1))
    y, x = y.flatten()[:, None] * omega, x.flatten()[:, None] * omega
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1).float()


def sincos_pos_embed(grid: tuple[int, int], dim: int, prefix: int,
                     device: Optional[torch.device] = None) -> torch.Tensor:
    """(1, prefix + H*W, dim): :func:`sincos_2d` after ``prefix`` zero rows, the layout of timm's
    ``pos_embed`` for a model whose [class] and register tokens get no position (big_vision's)."""
    return torch.cat([torch.zeros(prefix, dim, device=device), sincos_2d(grid, dim, device=device)])[None]
