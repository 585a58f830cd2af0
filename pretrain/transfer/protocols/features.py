"""Frozen features: one forward pass per split, cached for every setting and seed that follows.

Linear probe and few-shot only ever see (N, D) feature matrices; a sweep over regularisation or
three few-shot seeds costs no extra forward pass. Features of a :class:`Subset` (CIFAR's minival)
are rows of its parent's, of a :class:`Concat` (VTAB's train800val200) the parts' stacked.

Extraction is most of a linear probe's time (CIFAR-100's 60k images through ViT-B on one GPU:
tens of seconds), so each pass says what it does in a log line, and counts its images on stderr
(``progress.Progress``): a tqdm bar on a terminal, a line every ``VITSCALE_PROGRESS_S`` seconds
(default 10) in a log file or pipe.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from pretrain.distributed.precision import autocast_bf16
from pretrain.observability.progress import Progress
from pretrain.transfer.data import Concat, Split, Subset, View


def pooled(model: torch.nn.Module, tokens: torch.Tensor, pool: str) -> torch.Tensor:
    """``model``: the model's own pooling ([class] token, mean or MAP) and pre-logits layer
    (big_vision's ``pre_logits``); ``token``: the [class] token after the final norm; ``avg``: mean
    of the patch tokens (registers left out)."""
    if pool == "model":
        return model.forward_head(tokens, pre_logits=True)
    if pool == "token":
        return tokens[:, 0]
    return tokens[:, model.num_prefix_tokens:].mean(dim=1)


@torch.no_grad()  # not inference_mode: the linear probe takes gradients through these features
def extract(model: torch.nn.Module, split: Split, view: View, *, batch_size: int, pool: str, device: torch.device,
            workers: int = 0, desc: str = "features") -> tuple[torch.Tensor, torch.Tensor]:
    """(features float32 (N, D), labels int64 (N,)) on the CPU, rows in split order (a shard split's
    manifest order) whatever ``workers`` is: few-shot draws pick rows by position."""
    model.eval().to(device)
    feats, labels, rows = [], [], []
    amp = autocast_bf16(device)  # features leave as float32

    with Progress(len(split), f"  {desc}", "img") as bar:  # indented as the log lines around it
        for x, y, at in split.indexed_batches(view, batch_size=batch_size, workers=workers, device=device):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                f = pooled(model, model.forward_features(x.to(device, non_blocking=True)), pool)
            feats.append(f.float().cpu())
            labels.append(y.cpu())
            rows.append(at)
            bar.update(len(y))
    if not feats:
        return torch.zeros(0, getattr(model, "num_features", 0)), torch.zeros(0, dtype=torch.int64)
    X, y, at = torch.cat(feats), torch.cat(labels).long(), torch.cat(rows)
    if bool((at[1:] < at[:-1]).any()):  # batches arrived out of order (shards read by several workers)
        order = at.argsort()
        X, y = X[order], y[order]
    return X, y


class FeatureCache:
    """Features of splits under one frozen model; ``view_of(split)`` gives each split's View."""

    def __init__(self, model: torch.nn.Module, *, batch_size: int, pool: str, device: torch.device, workers: int = 0,
                 log: Callable[[str], None] = lambda msg: None):
        self.model, self.batch_size, self.pool, self.device, self.workers = model, batch_size, pool, device, workers
        self.log = log
        self._cache: dict[int, tuple[Split, torch.Tensor, torch.Tensor]] = {}  # id -> (split kept alive, X, y)
        self.passes = 0  # forward passes over whole splits: what the cache saves

    def get(self, split: Split, view: View) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self._cache.get(id(split))
        if hit is not None:
            return hit[1], hit[2]
        if isinstance(split, Subset):
            X, y = self.get(split.parent, view)
            idx = torch.from_numpy(split.indices)
            X, y = X[idx], y[idx]
        elif isinstance(split, Concat):
            parts = [self.get(p, view) for p in split.parts]
            X, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        else:
            t0 = time.time()
            self.log(f"  features of {split.name}: {len(split)} images on {self.device.type} ...")
            X, y = extract(self.model, split, view, batch_size=self.batch_size, pool=self.pool,
                           device=self.device, workers=self.workers, desc=f"features {split.name}")
            dt = time.time() - t0
            self.log(f"  features of {split.name}: {tuple(X.shape)} in {dt:.1f} s ({len(y) / max(dt, 1e-9):.0f} img/s)")
            self.passes += 1
        self._cache[id(split)] = (split, X, y)
        return X, y


ViewOf = Callable[[object], View]  # task -> View


class FrozenFeatureProtocol:
    """Base of the protocols on frozen features (linear probe, few-shot): features come from the
    shared cache, and the one hyper-parameter they sweep is the L2 penalty."""

    name = ""

    def __init__(self, features: FeatureCache, view_of, l2: float, grid: list[float]):
        self.features, self.view_of, self.l2, self.sweep_grid = features, view_of, l2, grid
        self._said: set[str] = set()

    def say_once(self, line: str) -> None:
        """Log ``line`` the first time only: a sweep fits the same split once per setting."""
        if line not in self._said:
            self._said.add(line)
            self.features.log(line)

    def grid(self, sweep: bool) -> list[dict]:
        return [{"l2": v} for v in self.sweep_grid] if sweep else [{"l2": self.l2}]

    def splits(self, task, fit, evaluate):
        """(X_fit, y_fit, X_eval, y_eval) for ``task``'s view."""
        view = self.view_of(task)
        return (*self.features.get(fit, view), *self.features.get(evaluate, view))
