"""Opening shard bytes by URL, and the folders the shard writer writes into.

``open_shard``: a buffered read stream of a local file, an ``http(s)://`` file (``storage.http``),
an ``s3://`` object (``storage.s3``) or any other URL webdataset's ``gopen`` reads (``pipe:``...).

``open_place``: the writer's output, a local folder (``LocalFolder``) or ``s3://bucket/prefix``
(``storage.s3.S3Prefix``), with one interface: ``read_text``/``read_bytes``/``write_text`` (whole
small files, atomic), ``stat`` (size, and the store's ETag), ``create`` (a stream that becomes the
file only on ``commit``: temp name + fsync + rename, or a completed multipart upload; ``abort``
leaves nothing), ``remove``, ``names``, ``clean_unfinished``. Readers use it too, to look for a
file in a folder or prefix (``stat``). Any other URL scheme is a one-line ``DataError``: no local
folder is ever named after a URL.
"""
from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Optional, Union

from data_pipeline.errors import DataError
from data_pipeline.files import write_atomic
from data_pipeline.storage.http import HTTPShard
from data_pipeline.storage.retry import RemotePolicy
from data_pipeline.storage.s3 import S3Object, S3Prefix
from data_pipeline.storage.urls import is_http, is_remote, is_s3, local_path
from data_pipeline.tally import Tally


def open_shard(url: str, name: str = "", tally: Optional[Tally] = None, policy: Optional[RemotePolicy] = None):
    name = name or url.rsplit("/", 1)[-1]
    if is_http(url):
        return io.BufferedReader(HTTPShard(url, name, policy or RemotePolicy(), tally), 1 << 20)
    if is_s3(url):
        return io.BufferedReader(S3Object(url, name, policy or RemotePolicy(), tally), 1 << 20)
    if is_remote(url):  # allowed only when data.allow_remote was checked in resolve_shards
        from webdataset.gopen import gopen

        return gopen(url, "rb")
    return open(local_path(url), "rb", buffering=1 << 20)


class LocalOutput(io.RawIOBase):
    """A file written under ``.<name>.tmp-<pid>`` beside ``path``; ``commit`` fsyncs and renames it
    to ``path`` and returns ``{"bytes"}``, ``abort`` removes it."""

    def __init__(self, path: Path):
        super().__init__()
        self.path, self.tmp = path, path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self.f = open(self.tmp, "wb")

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        return self.f.write(b)

    def commit(self) -> dict:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)
        super().close()
        return {"bytes": self.path.stat().st_size}

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)
        super().close()

    def close(self) -> None:
        if not self.closed:
            self.abort()


class LocalFolder:
    """A local folder as the writer's output (created by ``prepare``)."""

    def __init__(self, path: Union[str, Path]):
        self.root = Path(path)

    def url(self, name: str) -> str:
        return str(self.root / name)

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def read_bytes(self, name: str) -> Optional[bytes]:
        p = self.root / name
        return p.read_bytes() if p.exists() else None

    def read_text(self, name: str) -> Optional[str]:
        p = self.root / name
        return p.read_text() if p.exists() else None

    def write_text(self, name: str, text: str) -> str:
        return str(write_atomic(self.root / name, text))

    def stat(self, name: str) -> Optional[dict]:
        p = self.root / name
        return {"bytes": p.stat().st_size} if p.is_file() else None

    def create(self, name: str) -> LocalOutput:
        return LocalOutput(self.root / name)

    def remove(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def names(self, pattern: str = "*") -> list[str]:
        return sorted(p.name for p in self.root.glob(pattern))

    def clean_unfinished(self, own: "re.Pattern") -> None:
        """Remove the temp files of names ``own`` matches that a killed run left."""
        tmp = re.compile(rf"\.(?:{own.pattern})\.tmp-\d+")
        for stale in self.root.glob(".*.tmp-*"):
            if tmp.fullmatch(stale.name):
                stale.unlink()


def open_place(url: Union[str, Path], option: str = "--output",
               policy: Optional[RemotePolicy] = None) -> Union[LocalFolder, S3Prefix]:
    """The folder or ``s3://bucket/prefix`` ``url`` names (an ``s3://`` one retried under ``policy``);
    another scheme is an error: nothing can be written there."""
    text = str(url)
    if is_s3(text):
        return S3Prefix(text, policy or RemotePolicy())
    if is_remote(text):
        scheme = text.split(":", 1)[0]
        raise DataError(f"{option} {text}: cannot write to {scheme}: URLs; give a local folder or "
                        "s3://bucket/prefix (S3 and S3-compatible stores: set AWS_ENDPOINT_URL for those)")
    return LocalFolder(local_path(text))
