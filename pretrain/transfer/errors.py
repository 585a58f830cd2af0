"""The one exception of the transfer harness for user mistakes.

``TransferError`` subclasses :class:`pretrain.config.ConfigError` on purpose: a missing VTAB task, an
unreadable checkpoint or a malformed split line is a user mistake like a wrong config key, so
``cli_errors`` prints it as one line and exits 2 without a traceback.
"""
from __future__ import annotations

from data_pipeline.errors import ConfigError


class TransferError(ConfigError):
    """A user-level mistake in transfer evaluation; the message is one line and names the file,
    task or key at fault."""
