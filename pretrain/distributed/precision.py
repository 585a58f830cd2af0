"""The precision policy: which dtype a run computes in, and where bf16 / fp16 are available.

One owner for the decision that pre-training, fine-tuning, feature extraction and the demo all
make. ``train.precision`` names one of four modes; what each asks of DeepSpeed is
``pretrain.distributed.engine.precision_sections``:

- ``fp32``: everything in fp32.
- ``bf16``: DeepSpeed's ``bf16`` mode: the whole module in bf16 (weights, activations, norms,
  residual adds, the logits; the loss is computed in fp32), fp32 master weights in the optimizer,
  as Megatron's bf16 does.
- ``bf16-autocast``: torch autocast (DeepSpeed's ``torch_autocast``): the module, its gradients
  and the optimizer stay fp32; the forward runs under ``torch.autocast(bfloat16)``, which casts the
  inputs of matmuls, convolutions and attention to bf16 and keeps LayerNorm, the residual stream
  and (on GPUs) softmax in fp32, as timm's AMP recipes do.
- ``fp16``: DeepSpeed's ``fp16`` mode: the whole module in fp16 with fp32 master weights and
  dynamic loss scaling, for GPUs without bf16 (V100, T4).
"""
from __future__ import annotations

from typing import Optional

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


def low_precision_dtype(precision: str) -> Optional[torch.dtype]:
    """The 16-bit dtype a mode computes its matmuls in; None for fp32."""
    return {"bf16": torch.bfloat16, "bf16-autocast": torch.bfloat16, "fp16": torch.float16}.get(precision)


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype of the module DeepSpeed trains, and so of its inputs: bf16 / fp16 in DeepSpeed's
    16-bit modes, fp32 under autocast (which casts inside the forward) and in fp32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def plain_autocast_dtype(device: torch.device, precision: str) -> Optional[torch.dtype]:
    """The autocast dtype of plain (non-DeepSpeed) code on ``device``: only on GPUs, where it is
    native and roughly halves the time of a pass (on CPU such passes stay fp32). Both bf16 modes
    autocast here (plain PyTorch keeps the module fp32); fp16 autocasts to fp16, which needs a
    gradient scaler for training (``needs_grad_scaler``)."""
    if device.type != "cuda":
        return None
    dtype = low_precision_dtype(precision)
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return None
    return dtype


def autocast_bf16(device: torch.device, precision: str = "bf16") -> bool:
    """Whether plain (non-DeepSpeed) code autocasts to bf16 on ``device`` (:func:`plain_autocast_dtype`)."""
    return plain_autocast_dtype(device, precision) == torch.bfloat16


def needs_grad_scaler(dtype: Optional[torch.dtype]) -> bool:
    """fp16's 5 exponent bits underflow small gradients: training in it scales the loss."""
    return dtype == torch.float16


def check_precision(precision: str, key: str = "train.precision") -> None:
    """A ConfigError when DeepSpeed's accelerator cannot compute in ``precision``'s 16-bit dtype.
    DeepSpeed's CPU accelerator has fp16 only where oneDNN does (AVX-512 FP16 / AMX-FP16)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    dtype = low_precision_dtype(precision)
    ok = {torch.bfloat16: acc.is_bf16_supported, torch.float16: acc.is_fp16_supported}.get(dtype, lambda: True)
    if not ok():
        name = "bf16" if dtype == torch.bfloat16 else "fp16"
        alt = "bf16 or fp32" if dtype == torch.float16 and acc.is_bf16_supported() else "fp32"
        raise ConfigError(f"{key}={precision}: this {acc.device_name()} device does not support {name}; "
                          f"use {key}={alt}")
