"""ResNet backbone of the paper's hybrid ViT (section 3.1): BiT-style ResNet-50 with Group Norm and
Weight Standardisation, stage 4 removed and its blocks moved to stage 3, total stride 16.

Names follow timm's ``ResNetV2(preact=False, stem_type='same')`` so hybrid checkpoints load with
``strict=True``: ``stem.conv``, ``stem.norm``, ``stages.i.blocks.j.{conv1..3,norm1..3,downsample}``.
Convolutions and the stem's max-pool use TensorFlow 'SAME' padding, as the JAX original.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.models.arch import stem_stride
from pretrain.models.init import fill


def _same_pad(x: torch.Tensor, k: int, s: int, value: float = 0.0) -> torch.Tensor:
    """TF 'SAME' padding: output = ceil(input / stride); the extra pixel goes right/bottom."""
    ih, iw = x.shape[-2:]
    ph = max((math.ceil(ih / s) - 1) * s + k - ih, 0)
    pw = max((math.ceil(iw / s) - 1) * s + k - iw, 0)
    if ph or pw:
        x = F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2], value=value)
    return x


class StdConv2dSame(nn.Conv2d):
    """Weight-standardised convolution (Qiao et al. 2019): each filter is normalised to zero mean
    and unit variance before use, which makes Group Norm train as well as Batch Norm."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, eps: float = 1e-8):
        super().__init__(cin, cout, k, stride=stride, padding=0, bias=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        flat = w.reshape(w.shape[0], -1)
        var, mean = torch.var_mean(flat, dim=1, unbiased=False, keepdim=True)
        w = ((flat - mean) / torch.sqrt(var + self.eps)).reshape_as(w)
        x = _same_pad(x, self.kernel_size[0], self.stride[0])
        return F.conv2d(x, w, None, self.stride)


class GroupNormAct(nn.GroupNorm):
    def __init__(self, channels: int, act: bool = True, groups: int = 32):
        super().__init__(groups, channels, eps=1e-5)
        self.act = nn.ReLU(inplace=True) if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


class Downsample(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv = StdConv2dSame(cin, cout, 1, stride=stride)
        self.norm = GroupNormAct(cout, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (strided) -> 1x1 with a projection shortcut where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        mid = cout // 4
        self.downsample = Downsample(cin, cout, stride) if (stride != 1 or cin != cout) else None
        self.conv1 = StdConv2dSame(cin, mid, 1)
        self.norm1 = GroupNormAct(mid)
        self.conv2 = StdConv2dSame(mid, mid, 3, stride=stride)
        self.norm2 = GroupNormAct(mid)
        self.conv3 = StdConv2dSame(mid, cout, 1)
        self.norm3 = GroupNormAct(cout, act=False)
        self.act3 = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = self.downsample(x) if self.downsample is not None else x
        x = self.norm1(self.conv1(x))
        x = self.norm2(self.conv2(x))
        x = self.norm3(self.conv3(x))
        return self.act3(x + shortcut)


class _Stage(nn.Module):
    def __init__(self, cin: int, cout: int, depth: int, stride: int):
        super().__init__()
        self.blocks = nn.Sequential(*[
            Bottleneck(cin if i == 0 else cout, cout, stride if i == 0 else 1) for i in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class _Stem(nn.Module):
    def __init__(self, in_chans: int, width: int):
        super().__init__()
        self.conv = StdConv2dSame(in_chans, width, 7, stride=2)
        self.norm = GroupNormAct(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.conv(x))
        # 3x3/2 max-pool with 'SAME' padding by -inf, so padding never wins the max
        return F.max_pool2d(_same_pad(x, 3, 2, value=float("-inf")), 3, 2)


class ResNetStem(nn.Module):
    """(B, 3, H, W) -> (B, 256 * 2**(len(layers)-1), H/stride, W/stride) feature map."""

    def __init__(self, layers: tuple[int, ...] = (3, 4, 9), in_chans: int = 3, width: int = 64,
                 defer_init: bool = False):
        super().__init__()
        self.stem = _Stem(in_chans, width)
        chans = [256 * 2 ** i for i in range(len(layers))]
        cin, stages = width, []
        for i, (depth, cout) in enumerate(zip(layers, chans)):
            stages.append(_Stage(cin, cout, depth, stride=1 if i == 0 else 2))
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.out_channels = cin
        self.stride = stem_stride(layers)
        if not defer_init:  # deferred: the caller runs init_weights(gather) (ZeRO-3 partitioned build)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, gather=None, generator: torch.Generator | None = None) -> None:
        """``gather(params)``: a context making one module's partitioned parameters whole;
        ``generator``: the CPU generator every draw comes from (``pretrain.models.init.fill``)."""

        gather = gather or (lambda params: contextlib.nullcontext())
        for name, m in self.named_modules():
            if isinstance(m, nn.Conv2d):
                with gather([m.weight]):
                    fill(m.weight, lambda t: nn.init.kaiming_normal_(t, mode="fan_out", nonlinearity="relu",
                                                                     generator=generator))
            elif isinstance(m, nn.GroupNorm):
                with gather([m.weight, m.bias]):
                    nn.init.ones_(m.weight)
                    nn.init.zeros_(m.bias)
        for m in self.modules():
            if isinstance(m, Bottleneck):  # each residual branch starts as identity (BiT, Goyal et al.)
                with gather([m.norm3.weight]):
                    nn.init.zeros_(m.norm3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))
