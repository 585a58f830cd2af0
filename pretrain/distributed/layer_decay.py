"""Layer-wise learning-rate decay (ELECTRA, BEiT; the MAE and DeiT III fine-tunes): parameter
groups whose learning rate shrinks by ``layer_decay`` per Transformer block below the head.

A pure function over named parameters, so pre-training (``optim.layer_decay``) and the transfer
fine-tune (``eval.layer_decay``) share it, and a test holds it equal to timm's
``param_groups_layer_decay`` for every ViT of ours (same names as timm's models):

- layers, from the input: 0 = the stem (``cls_token``, ``reg_token``, ``pos_embed``,
  ``patch_embed.*``, ``norm_pre``); ``i + 1`` = ``blocks.i``; the final ``norm`` joins the last
  block; everything else (``fc_norm``, ``pre_logits``, ``head``) is the top layer;
- only the layers present are counted (a model without a head has no top layer), and layer ``l``
  of ``L`` gets ``lr_scale = layer_decay ** (L - 1 - l)``: the head 1, the stem the smallest;
- no weight decay on 1-D parameters (biases, norms) and on the names the model lists in
  ``no_weight_decay()`` (shell patterns, as timm matches them).

Each group carries ``lr_scale``; the caller sets ``lr = base_lr * lr_scale`` (a ``LambdaLR`` then
scales every group from its own starting value, as MAE's ``lr_sched`` and timm's schedulers do).
"""
from __future__ import annotations

import fnmatch
import math
import re
from typing import Collection, Iterable

import torch

__all__ = ["layer_decay_groups", "layer_of"]

_STEM = re.compile(r"^cls_token|reg_token|pos_embed|patch_embed|norm_pre")
_BLOCK = re.compile(r"^blocks\.(\d+)")
_FINAL_NORM = re.compile(r"^norm")
_WITH_PREVIOUS = 99999.0  # timm's MATCH_PREV_GROUP: the final norm shares the last block's layer


def _order(name: str) -> tuple:
    """The sort key of ``name``'s layer, in timm's ``group_matcher`` terms for ViTs."""
    if _STEM.match(name):
        return (0.0,)
    m = _BLOCK.match(name)
    if m:
        return (1.0, float(m.group(1)))
    if _FINAL_NORM.match(name):
        return (1.0, _WITH_PREVIOUS)
    return (math.inf,)


def layer_of(names: Iterable[str]) -> dict[str, int]:
    """``{name: layer}`` with layers numbered 0.. over the layers present."""
    names = list(names)
    keys = {n: _order(n) for n in names}
    layer, ids = -1, {}
    for k in sorted(set(keys.values())):
        if layer < 0 or k[-1] != _WITH_PREVIOUS:
            layer += 1
        ids[k] = layer
    return {n: ids[keys[n]] for n in names}


def layer_decay_groups(named_params: Iterable[tuple[str, torch.nn.Parameter]], *, weight_decay: float,
                       layer_decay: float, no_weight_decay: Collection[str] = ()) -> list[dict]:
    """Optimizer groups ``{"name": "layer_3_decay", "params", "lr_scale", "weight_decay"}``, in
    the order their first parameter appears. Parameters without ``requires_grad`` are left out of
    the groups but still count as layers (as timm counts them). ZeRO-3 stubs (zero.Init) are
    judged by their full shape (``ds_shape``)."""
    params = list(named_params)
    layers = layer_of(n for n, _ in params)
    top = max(layers.values(), default=0)
    groups: dict[str, dict] = {}
    for name, p in params:
        if not p.requires_grad:
            continue
        ndim = len(getattr(p, "ds_shape", p.shape))
        skip = ndim <= 1 or any(fnmatch.fnmatch(name, pat) for pat in no_weight_decay)
        layer = layers[name]
        key = f"layer_{layer}_{'no_decay' if skip else 'decay'}"
        if key not in groups:
            groups[key] = {"name": key, "params": [], "lr_scale": layer_decay ** (top - layer),
                           "weight_decay": 0.0 if skip else weight_decay}
        groups[key]["params"].append(p)
    return list(groups.values())
