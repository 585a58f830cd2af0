"""Atomic file writes: a reader, a crash or a ``kill -9`` never sees half a file.

The one place files that others read (manifests, checkpoint markers, run summaries, results) are
written; everything above imports it from here.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

from data_pipeline.errors import ConfigError


def write_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to a hidden per-process temp file beside ``path``, then rename it over
    ``path`` (atomic on POSIX file systems, so concurrent writers never interleave)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only left behind when the write or rename failed
    return path


def write_json(path: str | Path, obj: Any, indent: int | None = None) -> Path:
    """``obj`` as JSON, atomically (see ``write_atomic``)."""
    return write_atomic(path, json.dumps(obj, indent=indent) + ("\n" if indent is not None else ""))


def unwritable(folder: str | Path) -> Optional[str]:
    """Why no file can be created in ``folder`` (or in its nearest existing parent, when it does
    not exist yet: writers create the rest), or None. Tries a real file: permission bits say
    nothing for root, on NFS or under ``chattr +i``. Call before expensive work starts."""
    anc = Path(folder).absolute()
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir():
        return f"{anc} is a file, not a folder"
    try:
        with tempfile.NamedTemporaryFile(dir=anc, prefix=".vitscale-write-check-"):
            pass
    except OSError as e:
        return f"cannot write in {anc} ({e.strerror})"
    return None


def check_output_dir(path: str | Path, flag: str = "--output", inside: tuple[str, ...] = ()) -> None:
    """ConfigError (one line naming ``flag`` and ``path``) when a command could not write into the
    folder ``path`` or the subfolders ``inside`` it that it writes: a file there or on its way, or no
    file can be created in it (or in its nearest existing parent). Commands call it before any work."""
    for folder in (Path(path), *(Path(path) / sub for sub in inside)):
        why = unwritable(folder)
        if why:
            raise ConfigError(f"{flag} {path}: {why}; choose a writable {flag} folder")


def check_output_file(path: str | Path, reads: Optional[dict[str, str | Path]] = None, flag: str = "--output") -> None:
    """ConfigError (one line) when a command could not write its output file ``path`` (the option
    ``flag``): a folder there, no file can be created in its folder, or it is a file the command
    reads (``reads``: option -> path, e.g. ``{"--config": ...}``), which writing would replace.
    Commands call it before any work."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path}: a folder, not a file; name the file to write")
    for source_flag, source in (reads or {}).items():
        if source is not None and p.exists() and Path(source).exists() and os.path.samefile(p, source):
            raise ConfigError(f"{flag} {path}: is the {source_flag} file this command reads; writing would "
                              f"replace it: choose another {flag}")
    why = unwritable(p.parent)
    if why:
        raise ConfigError(f"{flag} {path}: {why}; choose a writable {flag}")
