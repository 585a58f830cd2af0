"""Atomic file writes: a reader, a crash or a ``kill -9`` never sees half a file."""
from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to a hidden per-process temp file beside ``path``, then rename it over
    ``path`` (atomic on POSIX file systems, so concurrent writers never interleave)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
