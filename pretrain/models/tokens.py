"""How an image becomes the encoder's tokens, and how a step trains on fewer of them: the patch
embedding (one strided convolution, or the hybrid's CNN feature map), the position embeddings'
patch grid resampled to another grid, and patch dropout.

``resize_pos_embed`` is timm's ``resample_abs_pos_embed`` (bicubic, antialiased, the prefix rows
kept): the model uses it in the forward at another resolution (``train.resolution_schedule``, as
timm's ``dynamic_img_size``), the weight loaders when fine-tuning at another size. ``PatchDropout``
is timm's (FLIP): in training each image keeps a random subset of its patch tokens, every prefix
token ([class], registers) always. Neither has parameters: the state dict and exports are the
plain model's.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.models.arch import patch_keep

Size = Union[int, tuple[int, int]]  # an image size: one side, or (height, width)


def _pair(x: Size) -> tuple[int, int]:
    return (x, x) if isinstance(x, int) else (int(x[0]), int(x[1]))


class PatchEmbed(nn.Module):
    """Image -> (B, N, D) tokens with one strided convolution (a linear map of each patch)."""

    def __init__(self, img_size: Size, patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        self.img_size = _pair(img_size)
        self.patch_size = (patch_size, patch_size)
        self.grid_size = (self.img_size[0] // patch_size, self.img_size[1] // patch_size)
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)

    def grid_of(self, h: int, w: int) -> tuple[int, int]:
        """The patch grid of an ``h`` x ``w`` input."""
        return h // self.patch_size[0], w // self.patch_size[1]


class HybridEmbed(nn.Module):
    """Section 3.1 hybrid: a CNN feature map is the patch grid (patch size 1 on the feature map)."""

    def __init__(self, backbone: nn.Module, img_size: Size, embed_dim: int):
        super().__init__()
        self.backbone = backbone
        self.img_size = _pair(img_size)
        s = backbone.stride
        self.patch_size = (s, s)
        self.grid_size = (self.img_size[0] // s, self.img_size[1] // s)
        self.proj = nn.Conv2d(backbone.out_channels, embed_dim, kernel_size=1, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.backbone(x)).flatten(2).transpose(1, 2)

    def grid_of(self, h: int, w: int) -> tuple[int, int]:
        """The feature map of an ``h`` x ``w`` input (the stem's 'SAME' padding keeps partial positions)."""
        s = self.patch_size[0]
        return -(-h // s), -(-w // s)


@torch.compiler.disable  # eager under train.compile too: the same draws from the same generator state
def _kept_indices(batch: int, tokens: int, keep: int, device: torch.device) -> torch.Tensor:
    """Per image, ``keep`` of ``tokens`` positions uniformly at random: timm's ``PatchDropout`` draw
    (``argsort`` of one standard normal per token), from this device's default generator, which is
    the rank's own stream and which checkpoints save and restore (``pretrain.distributed.rng``)."""
    return torch.argsort(torch.randn(batch, tokens, device=device), dim=-1)[:, :keep]


class PatchDropout(nn.Module):
    """Patch dropout in training (FLIP, Li et al. 2023; timm's ``PatchDropout``): each image keeps a
    random subset of ``patch_keep(L, p)`` of its ``L`` patch tokens (timm's ``max(1, int(L * (1 -
    p)))``), the prefix tokens always; identity in evaluation. The blocks then run on the kept
    tokens only: attention costs fall with their square, the rest in proportion. No parameters: the
    state dict and exports are those of the model without it."""

    def __init__(self, p: float, num_prefix_tokens: int = 1):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"patch dropout rate must be in [0, 1), got {p}")
        self.p, self.num_prefix_tokens = p, num_prefix_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        n = self.num_prefix_tokens
        prefix, patches = x[:, :n], x[:, n:]
        keep = _kept_indices(x.shape[0], patches.shape[1], patch_keep(patches.shape[1], self.p), x.device)
        patches = patches.gather(1, keep.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        return torch.cat([prefix, patches], dim=1) if n else patches


# ------------------------------------------------------------------------ position embeddings
def resize_pos_embed(posemb: torch.Tensor, new_grid: tuple[int, int],
                     old_grid: Optional[tuple[int, int]] = None, num_prefix_tokens: int = 1) -> torch.Tensor:
    """Resize (1, prefix + H*W, D) position embeddings to a new patch grid by 2-D bicubic
    interpolation of the grid part; the prefix tokens' embeddings ([class] and registers,
    ``num_prefix_tokens`` of them) are kept unchanged (as in the paper's fine-tuning at higher
    resolution). Non-square grids work when ``old_grid`` is given;
    without it the old grid is taken as square."""
    prefix, grid = posemb[:, :num_prefix_tokens], posemb[:, num_prefix_tokens:]
    n_old = grid.shape[1]
    if old_grid is None:
        side = int(math.isqrt(n_old))
        if side * side != n_old:
            raise ValueError(f"position embedding has {n_old} grid tokens, not a square; pass old_grid")
        old_grid = (side, side)
    if old_grid[0] * old_grid[1] != n_old:
        raise ValueError(f"old_grid {old_grid} does not match {n_old} grid tokens")
    if tuple(old_grid) == tuple(new_grid):
        return posemb
    dim = grid.shape[-1]
    orig_dtype = grid.dtype
    grid = grid.reshape(1, old_grid[0], old_grid[1], dim).permute(0, 3, 1, 2).float()
    grid = F.interpolate(grid, size=tuple(new_grid), mode="bicubic", align_corners=False, antialias=True)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(orig_dtype)
    return torch.cat([prefix, grid], dim=1)
