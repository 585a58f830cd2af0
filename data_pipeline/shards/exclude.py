"""Exclusion lists: pre-training sample keys to leave out (written by ``vit-audit``, honoured by
``vit-shards --exclude FILE`` and the loader's ``data.exclude_keys: FILE``).

Format: one ``__key__`` per line; ``#`` lines are comments. ``vit-audit`` writes one header line per
shard set it audited, ``# shards MANIFEST job=JOB``, naming the ``vit-shards`` job whose keys
follow. A key is the writer's position of the sample in that job's (shuffled) sample order
(``000004242``), so rerunning the same ``vit-shards`` command with ``--exclude`` writes the same
keys minus the listed ones, and the loader can skip the listed ones in the old shards: both act on
one key space. Keys are unique within one job; a list that names several jobs is applied as the
union (the loader skips a listed key in every shard set it reads: it errs towards excluding).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from data_pipeline.errors import DataError
from data_pipeline.files import write_atomic

_HEADER = re.compile(r"^#\s*shards\s+(?P<manifest>.+?)\s+job=(?P<job>\S*)\s*$")


@dataclass(frozen=True)
class Exclusion:
    keys: frozenset
    jobs: tuple = ()  # the vit-shards jobs the keys belong to (from the header lines); () unknown
    path: str = ""


def read_exclusion(path, key: str = "--exclude") -> Exclusion:
    """Read an exclusion list; a missing or unreadable file is a one-line ``DataError`` naming
    ``key`` (the flag or config key that gave the path)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: exclusion list not found ({key})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read exclusion list ({key}): {e}") from None
    keys, jobs = set(), []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            m = _HEADER.match(line)
            if m and m["job"]:
                jobs.append(m["job"])
            continue
        if any(c.isspace() for c in line):
            raise DataError(f"{path}:{n}: expected one sample key per line, got {line!r} ({key})")
        keys.add(line)
    return Exclusion(frozenset(keys), tuple(jobs), str(path))


@dataclass
class ExclusionWriter:
    """Keys grouped by the shard set (manifest + job) they belong to."""
    groups: dict = field(default_factory=dict)  # (manifest, job) -> set of keys

    def add(self, manifest: str, job: str, key: str) -> None:
        self.groups.setdefault((manifest, job), set()).add(key)

    def write(self, path, comment: str = "") -> Path:
        lines = [f"# {c}" for c in comment.splitlines()] if comment else []
        for (manifest, job), keys in self.groups.items():
            lines.append(f"# shards {manifest} job={job}")
            lines.extend(sorted(keys))
        return write_atomic(Path(path), "\n".join(lines) + "\n")
