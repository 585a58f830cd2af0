"""A checkpoint's own classifier, scored as it is (``vit-transfer --protocol head``): nothing is
trained, the head the file holds predicts. So ImageNet val, ImageNet-V2 and ReaL are scored as
their users do (timm's ``validate.py``, the DeiT / MAE ``--eval`` runs).

- top-1 / top-5 against the set's labels: an image folder's class folders (sorted names are the
  head's indices, as ImageNet's synset folders; folders named by integers are the indices, as
  ImageNet-V2's ``0``..``999``) or our shards' labels;
- ReaL (Beyer et al. 2020, "Are we done with ImageNet?") with ``eval.real_labels``: a JSON list,
  one list of valid class indices per image in sorted file-name order (``real.json``); an image
  is right when its top-1 (top-5: any of its five) is among its valid labels, and images with an
  empty list are left out, as the paper and timm's ``RealLabelsImagenet`` score. Unlabelled
  folders (ImageNet val as distributed, every JPEG in one folder) are scored by ReaL alone.

One forward pass in evaluation mode (bf16 autocast on GPUs, as the feature protocols); only the
five best classes of each image are kept, so a 21k-class head costs no more memory than 1k.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

import torch

from pretrain.distributed.precision import autocast_bf16
from pretrain.observability.progress import Progress
from pretrain.transfer.data import FileImages
from pretrain.transfer.errors import TransferError

TOPK = 5


def read_real_labels(path: str) -> list[list[int]]:
    """ImageNet-ReaL's ``real.json``: a list of lists of class indices."""
    p = Path(path)
    if not p.is_file():
        raise TransferError(f"eval.real_labels={path}: file not found")
    try:
        doc = json.loads(p.read_text())
    except ValueError as e:
        raise TransferError(f"eval.real_labels={path}: not JSON ({e})") from None
    if not isinstance(doc, list) or not all(isinstance(v, list) and all(isinstance(c, int) for c in v) for v in doc):
        raise TransferError(f"eval.real_labels={path}: expected a list with one list of class indices per image "
                            "(ImageNet-ReaL's real.json)")
    return doc


def real_for(split, labels: list[list[int]], where: str) -> list[list[int]]:
    """The ReaL labels of each image of ``split`` (an image folder), in the split's order: the
    labels file lists the images sorted by file name."""
    if not isinstance(split, FileImages):
        raise TransferError(f"eval.real_labels={where}: needs an image folder (the file names give the order), "
                            f"not {split.name}")
    names = [os.path.basename(p) for p in split.paths]
    if len(set(names)) != len(names):
        raise TransferError(f"eval.real_labels={where}: file names repeat in {split.name}; ReaL orders images by "
                            "file name")
    if len(names) != len(labels):
        raise TransferError(f"eval.real_labels={where}: {len(labels)} entries for {len(names)} images in {split.name}")
    rank = {n: i for i, n in enumerate(sorted(names))}
    return [labels[rank[n]] for n in names]


def real_accuracy(top: torch.Tensor, real: list[list[int]]) -> tuple[float, float, int]:
    """(ReaL top-1, ReaL top-5, images scored): ``top`` holds each image's best classes, best first."""
    hits1 = hits5 = n = 0
    for pred, valid in zip(top.tolist(), real):
        if not valid:
            continue
        n += 1
        hits1 += pred[0] in valid
        hits5 += any(p in valid for p in pred[:TOPK])
    return (hits1 / n, hits5 / n, n) if n else (0.0, 0.0, 0)


@torch.no_grad()
def predict(model: torch.nn.Module, split, view, *, batch_size: int, device: torch.device, workers: int = 0,
            desc: str = "head") -> tuple[torch.Tensor, torch.Tensor]:
    """(the ``TOPK`` best classes of every image, best first, int64 (N, TOPK); labels (N,)) on the CPU."""
    model.eval().to(device)
    amp = autocast_bf16(device)
    tops, labels = [], []
    with Progress(len(split), f"  {desc}", "img") as bar:
        for x, y in split.batches(view, batch_size=batch_size, train=False, workers=workers, device=device):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(x.to(device, non_blocking=True)).float()
            tops.append(logits.topk(min(TOPK, logits.shape[1]), dim=1).indices.cpu())
            labels.append(y.cpu())
            bar.update(len(y))
    if not tops:
        return torch.zeros(0, TOPK, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    return torch.cat(tops), torch.cat(labels).long()


def class_mismatch(names: Optional[tuple[str, ...]], head: Optional[tuple[str, ...]], whose: str) -> Optional[str]:
    """Where the evaluated set's class list ``names`` (label i's name) is not ``head``'s (output i's
    name), in words; None where they agree or either is unknown."""
    if not names or not head or tuple(names) == tuple(head):
        return None
    for i, (a, b) in enumerate(zip(names, head)):
        if a != b:
            return f"label {i} is {a!r} here, output {i} of {whose} is {b!r}"
    return f"{len(names)} classes here, {len(head)} outputs of {whose}"


class OwnHead:
    """The protocol: ``model`` is the checkpoint's classifier (``build_classifier``)."""

    name = "head"
    trains = False  # nothing is fitted: the task's "train" count is 0

    def __init__(self, model: torch.nn.Module, view_of: Callable, *, batch_size: int, device: torch.device,
                 workers: int = 0, real_labels: Optional[str] = None, log: Callable[[str], None] = lambda m: None,
                 head_classes: Optional[tuple[str, ...]] = None, source: str = "the checkpoint"):
        self.model, self.view_of, self.batch_size, self.device = model, view_of, batch_size, device
        self.head_classes, self.source = head_classes, source
        self.workers = workers
        self.real_path = real_labels
        self.real = read_real_labels(real_labels) if real_labels else None
        self.log = log

    @property
    def outputs(self) -> int:
        """The classes a prediction picks among: the head's, however many the set has (a folder of 4
        of its 10 classes, a flat folder of no classes), so chance is one over it."""
        return self.model.num_classes

    def metric(self, setting: dict) -> str:
        return "top-1 of the checkpoint's head"

    def grid(self, sweep: bool) -> list[dict]:
        return [{}]  # nothing to choose

    def fit_score(self, task, fit, evaluate, setting: dict) -> tuple[float, dict]:
        classes = self.model.num_classes
        if problem := class_mismatch(task.class_names, self.head_classes, f"{self.source}'s head"):
            raise TransferError(f"{evaluate.name}: {problem}; --protocol head scores label i against output i: "
                                "evaluate a set of the training classes, every one, in their order")
        real = real_for(evaluate, self.real, self.real_path) if self.real is not None else None
        self.log(f"  {task.name} head: {len(evaluate)} images of {evaluate.name} through the checkpoint's "
                 f"{classes}-class head ...")
        top, y = predict(self.model, evaluate, self.view_of(task), batch_size=self.batch_size, device=self.device,
                         workers=self.workers, desc=f"head {evaluate.name}")
        labelled = y >= 0
        details: dict = {"head_classes": classes, "labelled": int(labelled.sum())}
        if labelled.any():
            if int(y[labelled].max()) >= classes:
                raise TransferError(f"{evaluate.name}: label {int(y[labelled].max())} is outside the checkpoint's "
                                    f"{classes} classes")
            hit = top[labelled] == y[labelled].view(-1, 1)
            details.update(top1=float(hit[:, 0].double().mean()), top5=float(hit.any(1).double().mean()))
        if real is not None:
            r1, r5, n = real_accuracy(top, real)
            details.update(real_top1=r1, real_top5=r5, real_scored=n)
        if "top1" not in details and real is None:
            raise TransferError(f"{evaluate.name}: no labelled images (class folders, shard labels or "
                                "eval.real_labels) to score the head against")
        acc = details["top1"] if "top1" in details else details["real_top1"]
        return acc, details

