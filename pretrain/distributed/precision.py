"""The precision policy: which dtype a run computes in, and where bf16 is available.

One owner for the bf16 / fp32 decision that pre-training, fine-tuning, feature extraction and
the demo all make.
"""
from __future__ import annotations

import torch

from data_pipeline.errors import ConfigError


def bf16_supported() -> bool:
    """bf16 where the hardware has it: any recent GPU, or a CPU with AVX-512 BF16 / AMX."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def default_precision() -> str:
    return "bf16" if bf16_supported() else "fp32"


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype inputs are cast to for a DeepSpeed engine of this ``train.precision``."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def autocast_bf16(device: torch.device, precision: str = "bf16") -> bool:
    """Whether plain (non-DeepSpeed) code autocasts to bf16 on ``device``: only on GPUs, where it
    is native and roughly halves the time of a pass; on CPU such passes stay fp32."""
    return precision == "bf16" and device.type == "cuda" and torch.cuda.is_bf16_supported()


def check_precision(precision: str, key: str = "train.precision") -> None:
    """A ConfigError when ``precision`` is bf16 and DeepSpeed's accelerator cannot do it."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if precision == "bf16" and not acc.is_bf16_supported():
        raise ConfigError(f"{key}=bf16: this {acc.device_name()} device does not support bf16; use {key}=fp32")
