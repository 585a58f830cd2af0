"""The pre-training loss: one definition for training and for evaluation.

Single-label data (ImageNet-1k, CIFAR): softmax cross-entropy, with label smoothing in training
and soft targets (Mixup / CutMix) accepted. Multi-label data (ImageNet-21k, JFT): sigmoid
cross-entropy summed over classes, averaged over images, as big_vision's ``sigmoid_xent``: the
loss of one image is the sum of its per-class terms, so its size does not shrink with the number
of classes.

``reduction="sum"`` returns the sum of the per-image losses, so that an evaluation can add batches
and ranks together and divide once by the image count: the result equals ``"mean"`` over the same
images, and the evaluation of a training batch (no augmentation, no smoothing) reports the
training loss.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F


def classification_loss(logits: torch.Tensor, targets: torch.Tensor, *, multi_label: bool,
                        smoothing: float = 0.0, reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor:
    """Per-image loss, averaged (``mean``) or summed (``sum``) over the batch, computed in fp32.

    ``targets``: class indices (N,) or soft / multi-hot targets (N, C)."""
    logits = logits.float()
    if multi_label:
        per_image_sum = F.binary_cross_entropy_with_logits(logits, targets.float(), reduction="sum")
        return per_image_sum if reduction == "sum" else per_image_sum / logits.shape[0]
    return F.cross_entropy(logits, targets, label_smoothing=smoothing, reduction=reduction)
