"""Exceptions of the data pipeline.

``DataError`` subclasses :class:`pretrain.config.ConfigError` on purpose: a wrong shard pattern or a
missing manifest is a user mistake like a wrong config key, so ``cli_errors`` prints it as one line
and exits 2 without a traceback, in ``vit-shards`` as in ``pretrain.train``.
"""
from __future__ import annotations

from pretrain.config import ConfigError


class DataError(ConfigError):
    """A user-level data mistake: no shards match, manifest missing or inconsistent, remote URL
    without ``data.allow_remote``. The message is one line and names the file or key."""


class TooManyCorruptSamples(DataError):
    """The share of bad samples in an epoch exceeded ``data.max_corrupt_rate``; the message names
    the worst shards."""
