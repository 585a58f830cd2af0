"""Shard and manifest locations: which are remote URLs and what a ``file://`` URL names."""
from __future__ import annotations

import re

_REMOTE = re.compile(r"^(pipe:|[a-zA-Z][a-zA-Z0-9+.-]*://)")


def is_remote(url: str) -> bool:
    return bool(_REMOTE.match(url)) and not url.startswith("file://")


def is_http(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def local_path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url
