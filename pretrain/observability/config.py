"""The ``logging:`` section of an experiment config (metrics sinks, W&B): its schema and its checks.

``MetricsLogger`` (``pretrain/observability/metrics.py``) consumes it; ``pretrain.config`` composes
the experiment schema from the sections and names the file in its errors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

__all__ = ["LoggingConfig", "ProfileConfig", "WandbConfig", "check_logging"]


@dataclass
class WandbConfig:
    mode: Literal["online", "offline", "disabled"] = "offline"
    """`online`, `offline` or `disabled`."""
    project: str = "vitscale"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (user or team); null: W&B's default."""
    group: Optional[str] = None
    """W&B group; `vit-launch sweep` sets one shared by its runs."""
    name: Optional[str] = None
    """W&B run name; null: W&B's."""
    tags: list[str] = field(default_factory=list)
    """W&B tags."""
    init_timeout_s: float = 30.0
    """`online`: the longest wait for W&B at start-up (no API key, no network); then the run logs
    offline and says how to `wandb sync`. Training never stalls or dies for W&B."""


@dataclass
class ProfileConfig:
    start_step: int = 0
    """The first step recorded with `torch.profiler` (host ops; on a GPU also every kernel and
    copy); 0 = off. Pick one after compilation and warm-up, e.g. in the second logging window.
    Writes a Chrome trace, an op table and a summary (the share of the step the device was busy,
    the attention kernel, the top ops) under `<output_dir>/profile/`
    (`pretrain/observability/profile.py`); the window holding the steps logs `profiled_steps`."""
    steps: int = 1
    """Steps recorded from `start_step` on, in one trace."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """Ranks that record (each its own files); `[]`: every rank."""


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases."""
    jsonl: bool = True
    """Write `metrics.jsonl` in the run directory."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Steps recorded with `torch.profiler`."""


def check_logging(cfg: LoggingConfig, fail: Callable[[str, str], None]) -> None:
    """Impossible values of the section; ``fail(key, message)`` raises the error naming the file."""
    if cfg.wandb.init_timeout_s <= 0:
        fail("logging.wandb.init_timeout_s", f"must be positive, got {cfg.wandb.init_timeout_s}")
    p = cfg.profile
    if p.start_step < 0:
        fail("logging.profile.start_step", f"must be a step number (1 or more) or 0 (off), got {p.start_step}")
    if p.steps < 1:
        fail("logging.profile.steps", f"must be 1 or more, got {p.steps}")
    if any(r < 0 for r in p.ranks):
        fail("logging.profile.ranks", f"must be rank numbers (0 or more), got {p.ranks}")
