"""Shard and manifest locations: which are remote URLs and what a ``file://`` URL names."""
from __future__ import annotations

import posixpath
import re
from pathlib import Path

_REMOTE = re.compile(r"^(pipe:|[a-zA-Z][a-zA-Z0-9+.-]*://)")


def is_remote(url: str) -> bool:
    return bool(_REMOTE.match(url)) and not url.startswith("file://")


def is_http(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def local_path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def is_s3(url: str) -> bool:
    return url.startswith("s3://")


def split_s3(url: str) -> tuple[str, str]:
    """``s3://bucket/key/of/object`` -> ``("bucket", "key/of/object")`` (the key may be empty)."""
    bucket, _, key = url[len("s3://"):].partition("/")
    return bucket, key


def last_part(url: str) -> str:
    """A folder's or an ``s3://`` prefix's own name (its last part; a trailing slash ignored)."""
    return posixpath.basename(url.rstrip("/")) if is_remote(url) else Path(local_path(url)).name
