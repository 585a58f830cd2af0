"""The ``checkpoint:`` section of an experiment config: its schema and its checks.

The Checkpointer (``pretrain/checkpointing/checkpointer.py``) and the resume path read it;
``pretrain.config`` composes the experiment schema from the sections and names the file in its errors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["CheckpointConfig", "check_checkpoint"]


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    """Where checkpoints go; null: `<train.output_dir>/checkpoints`."""
    every_steps: int = 1000
    """Save every this many steps (and at the end, and on SIGTERM)."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted."""
    resume: bool = True
    """Resume automatically from the newest complete checkpoint; false: start from scratch, the
    checkpoints already in the folder moved into its `earlier-K/` (kept whole)."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on
    (`pretrain/checkpointing/async_save.py`). YAML key `checkpoint.async` (a Python keyword, so
    the field is named async_save; `checkpoint.async_save` is also accepted); see
    pretrain/checkpointing/CHECKPOINTS.md."""


def check_checkpoint(ckpt: CheckpointConfig, fail: Callable[[str, str], None]) -> None:
    """Impossible values of the section; ``fail(key, message)`` raises the error naming the file."""
    if ckpt.every_steps <= 0:
        fail("checkpoint.every_steps", f"must be positive, got {ckpt.every_steps}")
    if ckpt.keep_last < 1:
        fail("checkpoint.keep_last", f"must be >= 1, got {ckpt.keep_last}")
