"""The ``logging:`` section of an experiment config (metrics sinks, W&B): its schema and its checks.

``MetricsLogger`` (``pretrain/observability/metrics.py``) consumes it; ``pretrain.config`` composes
the experiment schema from the sections and names the file in its errors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

__all__ = ["LoggingConfig", "WandbConfig", "check_logging"]


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
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases."""
    jsonl: bool = True
    """Write `metrics.jsonl` in the run directory."""


def check_logging(cfg: LoggingConfig, fail: Callable[[str, str], None]) -> None:
    """Impossible values of the section; ``fail(key, message)`` raises the error naming the file."""
    if cfg.wandb.init_timeout_s <= 0:
        fail("logging.wandb.init_timeout_s", f"must be positive, got {cfg.wandb.init_timeout_s}")
