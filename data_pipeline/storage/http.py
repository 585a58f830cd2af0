"""Where shard bytes are read from: local files, ``http(s)://`` with retries, other schemes.

``http://`` / ``https://`` shards (``data.allow_remote``) are read by ``HTTPShard``: a dropped
connection, a timeout, a refused connect or a 408/429/5xx answer is retried with exponential
backoff (``RemotePolicy``: ``data.remote_retries`` failures in a row, ``data.remote_retry_s``
seconds of one outage at most), and the read resumes at the byte it stopped at with an HTTP
``Range`` request, so the tar stream goes on with no sample repeated or skipped. Each retry is
counted as ``remote_retries``. A server still failing past the policy, a 404 and any other
refusal raise ``RemoteShardError`` (one line naming the URL and the shard); the stream stops the
run with it rather than count the shard's samples as lost.
"""
from __future__ import annotations

import http.client
import io
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional

from data_pipeline.errors import DataError
from data_pipeline.storage.urls import is_http, is_remote, local_path
from data_pipeline.tally import Tally

BACKOFF_FIRST_S = 0.25  # first wait after a failure; doubles per failure in a row
BACKOFF_MAX_S = 8.0  # longest single wait
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # the server may answer later


@dataclass(frozen=True)
class RemotePolicy:
    """How long an HTTP shard read keeps trying (``data.remote_*``)."""
    retries: int = 8  # failures in a row before giving up
    retry_s: float = 120.0  # the longest one outage is retried (waits included)
    timeout_s: float = 30.0  # a connect or a read waiting this long counts as a failure

    @classmethod
    def of(cls, data_cfg) -> "RemotePolicy":
        return cls(getattr(data_cfg, "remote_retries", cls.retries),
                   getattr(data_cfg, "remote_retry_s", cls.retry_s),
                   getattr(data_cfg, "remote_timeout_s", cls.timeout_s))


class RemoteShardError(DataError):
    """An HTTP shard the server refused (404, 403, ...) or stayed unreachable for past the
    ``RemotePolicy``; the message is one line naming the URL and the shard."""


class HTTPShard(io.RawIOBase):
    """A read-only stream of one HTTP(S) file that survives server restarts: every failure is
    retried under ``policy`` and the read resumes at byte ``pos`` (``Range: bytes=pos-``; a server
    that ignores ``Range`` answers 200 and the bytes already read are skipped). Costs one request
    per (re)connect; no byte is read twice from the caller's point of view. ``kind``: what the
    file is to the user (a ``shard`` listed in a manifest, or the ``manifest`` itself), for errors."""

    def __init__(self, url: str, name: str, policy: RemotePolicy, tally: Optional[Tally] = None,
                 kind: str = "shard"):
        super().__init__()
        self.url, self.name, self.policy, self.tally, self.kind = url, name, policy, tally, kind
        self.pos, self.size, self.resp = 0, None, None
        self._retrying(self._connect)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        def once():
            if self.resp is None:
                self._connect()
            n = self.resp.readinto(b)
            if not n and len(b) and self.size is not None and self.pos < self.size:  # closed early
                raise http.client.IncompleteRead(b"", self.size - self.pos)
            return n
        n = self._retrying(once)
        self.pos += n
        return n

    def close(self) -> None:
        self._drop()
        super().close()

    def _drop(self) -> None:
        if self.resp is not None:
            try:
                self.resp.close()
            except Exception:
                pass
            self.resp = None

    def _connect(self) -> None:
        headers = {"Range": f"bytes={self.pos}-"} if self.pos else {}
        try:
            resp = urllib.request.urlopen(urllib.request.Request(self.url, headers=headers),
                                          timeout=self.policy.timeout_s)
        except urllib.error.HTTPError as e:
            e.close()
            if e.code in _RETRY_STATUS:
                raise ConnectionError(f"HTTP {e.code} {e.reason}") from None
            what = "not on the server" if e.code in (404, 410) else "refused by the server"
            if self.kind == "shard":
                what = f"shard {self.name} is listed in the manifest but {what}"
            raise RemoteShardError(f"{self.url}: HTTP {e.code} {e.reason}: {what}") from None
        if self.pos and resp.status == 206:
            m = re.match(r"bytes (\d+)-", resp.headers.get("Content-Range", ""))
            if not m or int(m.group(1)) != self.pos:
                resp.close()
                raise ConnectionError(f"resumed at byte {self.pos} but the server sent "
                                      f"Content-Range {resp.headers.get('Content-Range')!r}")
        elif self.pos:  # 200: the whole file again (no Range support); skip what was read
            left = self.pos
            while left:
                chunk = resp.read(min(left, 1 << 20))
                if not chunk:
                    raise http.client.IncompleteRead(b"", left)
                left -= len(chunk)
        elif resp.headers.get("Content-Length", "").isdigit():
            self.size = int(resp.headers["Content-Length"])
        self.resp = resp

    def _retrying(self, op):
        """``op()``; after a transient failure, reconnect after a backoff and try again, until
        ``policy.retries`` failures in a row or ``policy.retry_s`` seconds of this outage."""
        failures, first = 0, None
        while True:
            try:
                return op()
            except RemoteShardError:
                raise
            except (OSError, http.client.HTTPException) as e:  # URLError, timeouts, resets, short reads
                self._drop()
                now = time.monotonic()
                first = now if first is None else first
                failures += 1
                delay = min(BACKOFF_FIRST_S * 2 ** (failures - 1), BACKOFF_MAX_S)
                if failures > self.policy.retries or now - first + delay > self.policy.retry_s:
                    reason = getattr(e, "reason", None) or e
                    raise RemoteShardError(
                        f"{self.url}: server unreachable, gave up on {self.name} after {failures - 1} "
                        f"retries over {now - first:.1f} s (data.remote_retries={self.policy.retries}, "
                        f"data.remote_retry_s={self.policy.retry_s:g}); last error: {reason}") from None
                if self.tally is not None:
                    self.tally.add("remote_retries")
                time.sleep(delay)


def open_shard(url: str, name: str = "", tally: Optional[Tally] = None, policy: Optional[RemotePolicy] = None):
    if is_http(url):
        return io.BufferedReader(HTTPShard(url, name or url.rsplit("/", 1)[-1], policy or RemotePolicy(), tally),
                                 1 << 20)
    if is_remote(url):  # allowed only when data.allow_remote was checked in resolve_shards
        from webdataset.gopen import gopen

        return gopen(url, "rb")
    return open(local_path(url), "rb", buffering=1 << 20)
