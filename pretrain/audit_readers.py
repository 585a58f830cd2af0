"""Evaluation-set readers for ``vit-audit`` (``data_pipeline.audit``), built on the transfer
suites' own readers so that the audit sees exactly the images, splits and labels vit-transfer
evaluates on.

``data_pipeline`` may not import ``pretrain`` (lower floors never look up); these functions reach
it through the ``vitscale.audit_readers`` entry-point group declared in setup.py. Each takes the
PATH of ``--eval SUITE:PATH`` and yields ``data_pipeline.audit.EvalImage`` items with IDs:
``split/index`` for CIFAR-100, the file path relative to the set's root for folder sets.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from data_pipeline.audit import EvalImage
from pretrain.transfer import suites
from pretrain.transfer.data import Concat, FileImages, ImageSet


def _image_set(set_name: str, split: str, images: ImageSet, ids) -> Iterator[EvalImage]:
    for i, image_id in enumerate(ids):
        yield EvalImage(set_name, split, image_id, lambda images=images, i=i: images.image(i))


def _files(images: ImageSet) -> list:
    """(FileImages, row) for every image of a FileImages or a Concat of them."""
    if isinstance(images, Concat):
        return [fr for part in images.parts for fr in _files(part)]
    assert isinstance(images, FileImages), type(images)
    return [(images, i) for i in range(len(images))]


def cifar100(path: str) -> Iterator[EvalImage]:
    """The official cifar-100-python folder: splits train and test, IDs ``train/123``."""
    task = suites.cifar100(path, minival_fraction=0.02, seed=0)
    for split, images in (("train", task.trainval), ("test", task.test)):
        yield from _image_set("cifar100", split, images, (f"{split}/{i}" for i in range(len(images))))


def vtab1k(path: str) -> Iterator[EvalImage]:
    """Every VTAB-1k task folder present: set ``vtab1k/<task>``, splits train800 / val200 / test
    (and train800val200 rows that are in neither train800 nor val200), IDs relative to PATH."""
    root = Path(path)
    tasks, _missing = suites.vtab1k(path, [])
    for task in tasks:
        seen = set()
        for split, images in (("train800", task.train), ("val200", task.val), ("test", task.test),
                              ("train800val200", task.trainval)):
            for files, i in _files(images):
                rel = os.path.relpath(files.paths[i], root)
                if rel in seen:
                    continue
                seen.add(rel)
                yield EvalImage(f"vtab1k/{task.name}", split, rel, lambda f=files, i=i: f.image(i))


def imagefolder(path: str) -> Iterator[EvalImage]:
    """ROOT/train, ROOT/test [ROOT/val] class folders: set ``imagefolder/<ROOT name>``, the split
    is the first folder of the ID (the path relative to ROOT)."""
    root = Path(path)
    task = suites.imagefolder(path, minival_fraction=0.02, seed=0)
    for images in (task.trainval, task.test):
        for files, i in _files(images):
            rel = os.path.relpath(files.paths[i], root)
            yield EvalImage(f"imagefolder/{root.name}", Path(rel).parts[0], rel, lambda f=files, i=i: f.image(i))
