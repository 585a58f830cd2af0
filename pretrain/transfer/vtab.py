"""VTAB-1k: the 19 tasks, their 3 groups, class counts, folder names, and the group arithmetic.

Task names are those of the VTAB paper (Zhai et al. 2019). The PyTorch VTAB-1k literature (VPT,
NOAH, SSF...) stores each task in a folder with a shorter name (``cifar``, ``clevr_dist``,
``kitti``, ``dsprites_loc``...); both are accepted, the paper's name is what results carry.

Scores: a group's score is the mean over its tasks; the overall VTAB score is the mean over all
tasks (not over groups), as the VTAB paper and the ViT paper's Table 9 report it.
"""
from __future__ import annotations

from typing import Mapping, Optional

GROUPS: dict[str, list[str]] = {
    "natural": ["caltech101", "cifar100", "dtd", "oxford_flowers102", "oxford_iiit_pet", "sun397", "svhn"],
    "specialized": ["patch_camelyon", "eurosat", "resisc45", "diabetic_retinopathy"],
    "structured": ["clevr_count", "clevr_distance", "dmlab", "kitti_distance", "dsprites_location",
                   "dsprites_orientation", "smallnorb_azimuth", "smallnorb_elevation"],
}
TASKS: list[str] = [t for ts in GROUPS.values() for t in ts]
GROUP_OF: dict[str, str] = {t: g for g, ts in GROUPS.items() for t in ts}

# Class counts of the VTAB task definitions; 1000 training examples need not cover every class
# (sun397 has 397), so the label space cannot be read off the split files.
NUM_CLASSES: dict[str, int] = {
    "caltech101": 102, "cifar100": 100, "dtd": 47, "oxford_flowers102": 102, "oxford_iiit_pet": 37,
    "sun397": 397, "svhn": 10, "patch_camelyon": 2, "eurosat": 10, "resisc45": 45,
    "diabetic_retinopathy": 5, "clevr_count": 8, "clevr_distance": 6, "dmlab": 6, "kitti_distance": 4,
    "dsprites_location": 16, "dsprites_orientation": 16, "smallnorb_azimuth": 18, "smallnorb_elevation": 9,
}

# Folder names used by the PyTorch VTAB-1k releases, tried after the paper's name.
FOLDER_ALIASES: dict[str, list[str]] = {
    "cifar100": ["cifar"], "clevr_distance": ["clevr_dist"], "kitti_distance": ["kitti"],
    "dsprites_location": ["dsprites_loc"], "dsprites_orientation": ["dsprites_ori"],
    "smallnorb_azimuth": ["smallnorb_azi"], "smallnorb_elevation": ["smallnorb_ele"],
}

# The four split files of a task folder, by their role in the protocol.
SPLIT_FILES = {"train": "train800.txt", "val": "val200.txt", "trainval": "train800val200.txt",
               "test": "test.txt"}


def canonical(name: str) -> Optional[str]:
    """The paper's task name for a paper or folder name; None for a name of no VTAB-1k task."""
    if name in NUM_CLASSES:
        return name
    return next((task for task, aliases in FOLDER_ALIASES.items() if name in aliases), None)


def unknown_task(name: str) -> str:
    """The line for a name of no VTAB-1k task (after the key or file that gave it)."""
    return f"unknown VTAB-1k task {name!r}; known: {', '.join(TASKS)}"


def folder_names(task: str) -> list[str]:
    return [task] + FOLDER_ALIASES.get(task, [])


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def summarize(accuracy: Mapping[str, float]) -> dict:
    """Group means and the overall mean of per-task top-1 accuracies (tasks may be a subset).

    Returns ``{"groups": {g: {"mean", "tasks", "of"}}, "mean", "tasks", "of", "missing"}``; a
    group with no task present has mean None. With tasks missing the means are over the tasks
    present, and ``missing`` lists the others so nobody mistakes a partial score for VTAB's."""
    unknown = [t for t in accuracy if t not in GROUP_OF]
    if unknown:
        raise ValueError(f"not VTAB-1k tasks: {unknown}")
    groups = {}
    for g, ts in GROUPS.items():
        present = [accuracy[t] for t in ts if t in accuracy]
        groups[g] = {"mean": _mean(present), "tasks": len(present), "of": len(ts)}
    return {"groups": groups, "mean": _mean([accuracy[t] for t in TASKS if t in accuracy]),
            "tasks": len(accuracy), "of": len(TASKS), "missing": [t for t in TASKS if t not in accuracy]}
