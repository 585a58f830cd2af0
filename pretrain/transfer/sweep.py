"""Hyper-parameter selection, the VTAB-1k way, for any protocol and task.

Every setting of the protocol's grid is fitted on ``task.train`` (VTAB's train800) and scored on
``task.val`` (val200); the best one -- the first of equals, so ties resolve the same way on every
run -- is refitted on ``task.trainval`` (train800val200) and only then scored on ``task.test``.
The test split is touched exactly once, after the choice is made.

A protocol is any object with ``name``, ``grid(sweep) -> [setting dict]`` and
``fit_score(task, fit_split, eval_split, setting) -> (top-1, details)``; ``trains = False`` on one
that fits nothing (``head``) reports no training images; ``metric(setting) -> str``, where present,
names the accuracy a setting scores in the log (``k=1: val 1-NN top-1``; otherwise ``top-1``);
``outputs``, where present, is how many classes a prediction picks among when that is not the
task's count (``head``: its classifier's), and chance is one over it.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from pretrain.transfer.errors import TransferError


@dataclass
class TaskResult:
    task: str
    group: Optional[str]
    accuracy: float  # top-1 on test with the chosen setting, retrained on train+val
    setting: dict
    val_accuracy: list[dict] = field(default_factory=list)  # [{"setting", "accuracy"}] when swept
    details: dict = field(default_factory=dict)
    num_classes: int = 0
    chance: float = 0.0  # 1 / the classes a prediction picks among: the floor an accuracy is read against
    num_train: int = 0
    num_test: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_task(protocol, task, sweep: bool, log: Callable[[str], None] = log_stderr) -> TaskResult:
    t0 = time.time()
    grid = protocol.grid(sweep)
    if not grid:
        raise TransferError(f"{protocol.name}: empty hyper-parameter grid (eval.sweep_*)")
    val_scores: list[dict] = []
    best = grid[0]
    if len(grid) > 1:
        if task.val is None:
            raise TransferError(f"{task.name}: sweeping needs a validation split "
                                "(add a val/ split or eval.sweep=false)")
        best_acc = -1.0
        for setting in grid:
            acc, _ = protocol.fit_score(task, task.train, task.val, setting)
            val_scores.append({"setting": dict(setting), "accuracy": acc})
            log(f"  {task.name} {protocol.name} {_fmt(setting)}: val {_metric(protocol, setting)} {100 * acc:.2f}")
            if acc > best_acc:  # strict: the first of equal settings wins
                best, best_acc = setting, acc
    acc, details = protocol.fit_score(task, task.trainval, task.test, best)
    log(f"  {task.name} {protocol.name} {_fmt(best)}: test {_metric(protocol, best)} {100 * acc:.2f}")
    trained = len(task.trainval) if getattr(protocol, "trains", True) else 0
    classes = getattr(protocol, "outputs", None) or task.num_classes
    chance = 1.0 / classes if classes else 0.0
    return TaskResult(task.name, task.group, acc, dict(best), val_scores, details, task.num_classes,
                      chance, trained, len(task.test), time.time() - t0)


def _metric(protocol, setting: dict) -> str:
    """The protocol's name for its accuracy under ``setting``."""
    return protocol.metric(setting) if hasattr(protocol, "metric") else "top-1"


def _fmt(setting: dict) -> str:
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in setting.items())
