"""The pre-training loss: one definition for training and for evaluation.

Single-label data (ImageNet-1k, CIFAR), ``optim.loss``:

- ``ce``: softmax cross-entropy, with label smoothing in training and soft targets (Mixup / CutMix)
  accepted.
- ``bce``: sigmoid binary cross-entropy averaged over images and classes (DeiT III), as timm's
  ``BinaryCrossEntropy``: class indices become targets ``smoothing / C`` off and
  ``1 - smoothing + smoothing / C`` on; soft (Mixup / CutMix) targets are used as mixed; with a
  ``target_threshold`` every target above it becomes 1 and the others 0.

Multi-label data (ImageNet-21k, JFT): sigmoid cross-entropy summed over classes, averaged over
images, as big_vision's ``sigmoid_xent``: the loss of one image is the sum of its per-class terms,
so its size does not shrink with the number of classes.

``reduction="sum"`` returns the sum of the per-image losses, so that an evaluation can add batches
and ranks together and divide once by the image count: the result equals ``"mean"`` over the same
images, and the evaluation of a training batch (no augmentation, no smoothing) reports the
training loss.
"""
from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.nn.functional as F


def bce_targets(targets: torch.Tensor, num_classes: int, smoothing: float = 0.0,
                threshold: Optional[float] = None) -> torch.Tensor:
    """timm ``BinaryCrossEntropy``'s targets: class indices (N,) smoothed into (N, C) rows, soft
    (N, C) targets as they are; then binarised above ``threshold`` when one is given."""
    if targets.ndim == 1:
        off = smoothing / num_classes
        rows = torch.full((targets.shape[0], num_classes), off, device=targets.device, dtype=torch.float32)
        targets = rows.scatter_(1, targets.long().view(-1, 1), 1.0 - smoothing + off)
    targets = targets.float()
    if threshold is not None:
        targets = targets.gt(threshold).float()
    return targets


def classification_loss(logits: torch.Tensor, targets: torch.Tensor, *, multi_label: bool,
                        smoothing: float = 0.0, reduction: Literal["mean", "sum"] = "mean",
                        loss: Literal["ce", "bce"] = "ce", target_threshold: Optional[float] = None) -> torch.Tensor:
    """Per-image loss, averaged (``mean``) or summed (``sum``) over the batch, computed in fp32.

    ``targets``: class indices (N,) or soft / multi-hot targets (N, C). ``loss`` and
    ``target_threshold``: single-label data's (``optim.loss``, ``optim.bce_target_threshold``)."""
    logits = logits.float()
    if multi_label:
        per_image_sum = F.binary_cross_entropy_with_logits(logits, targets.float(), reduction="sum")
        return per_image_sum if reduction == "sum" else per_image_sum / logits.shape[0]
    if loss == "bce":  # each image's loss is its mean over the classes: the batch mean is timm's mean over both
        t = bce_targets(targets, logits.shape[1], smoothing, target_threshold)
        total = F.binary_cross_entropy_with_logits(logits, t, reduction="sum") / logits.shape[1]
        return total if reduction == "sum" else total / logits.shape[0]
    return F.cross_entropy(logits, targets, label_smoothing=smoothing, reduction=reduction)
