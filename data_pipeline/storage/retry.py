"""The one retry policy of every remote reader and writer (``http(s)://``, ``s3://``).

A transient failure (a refused connect, a reset or stalled read, a 408/429/5xx answer, S3's
``SlowDown``) is retried with exponential backoff (``BACKOFF_FIRST_S`` doubling, at most
``BACKOFF_MAX_S``) until ``RemotePolicy.retries`` failures in a row or ``RemotePolicy.retry_s``
seconds of one outage; each retry is counted as ``remote_retries``. The readers resume at the byte
they stopped at, so the caller never sees a byte twice or misses one. Past the policy, and for any
refusal that waiting cannot fix (missing file, no permission, bad credentials), the error is a
``RemoteShardError``: one line naming the URL and what to check.
"""
from __future__ import annotations

import http.client
import io
import time
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

from data_pipeline.errors import DataError
from data_pipeline.tally import Tally

BACKOFF_FIRST_S = 0.25  # first wait after a failure; doubles per failure in a row
BACKOFF_MAX_S = 8.0  # longest single wait
TRANSIENT = (OSError, http.client.HTTPException)  # what ``retrying`` retries: URLError, timeouts, resets, short reads
T = TypeVar("T")


@dataclass(frozen=True)
class RemotePolicy:
    """How long a remote shard read keeps trying (``data.remote_*``)."""
    retries: int = 8  # failures in a row before giving up
    retry_s: float = 120.0  # the longest one outage is retried (waits included)
    timeout_s: float = 30.0  # a connect or a read waiting this long counts as a failure

    @classmethod
    def of(cls, data_cfg) -> "RemotePolicy":
        return cls(getattr(data_cfg, "remote_retries", cls.retries),
                   getattr(data_cfg, "remote_retry_s", cls.retry_s),
                   getattr(data_cfg, "remote_timeout_s", cls.timeout_s))


class RemoteShardError(DataError):
    """A remote file the server refused (404, 403, bad credentials, ...) or stayed unreachable for
    past the ``RemotePolicy``; the message is one line naming the URL and the file."""


def retrying(op: Callable[[], T], *, policy: RemotePolicy, url: str, name: str,
             tally: Optional[Tally] = None, drop: Callable[[], None] = lambda: None) -> T:
    """``op()``; after a transient failure (``TRANSIENT``: the reader turns a retryable answer into
    a ``ConnectionError``), ``drop()`` the broken connection, back off and try again, until
    ``policy.retries`` failures in a row or ``policy.retry_s`` seconds of this outage. A
    ``RemoteShardError`` from ``op`` passes through at once."""
    failures, first = 0, None
    while True:
        try:
            return op()
        except RemoteShardError:
            raise
        except TRANSIENT as e:
            drop()
            now = time.monotonic()
            first = now if first is None else first
            failures += 1
            delay = min(BACKOFF_FIRST_S * 2 ** (failures - 1), BACKOFF_MAX_S)
            if failures > policy.retries or now - first + delay > policy.retry_s:
                reason = getattr(e, "reason", None) or e
                raise RemoteShardError(
                    f"{url}: server unreachable, gave up on {name} after {failures - 1} "
                    f"retries over {now - first:.1f} s (data.remote_retries={policy.retries}, "
                    f"data.remote_retry_s={policy.retry_s:g}); last error: {reason}") from None
            if tally is not None:
                tally.add("remote_retries")
            time.sleep(delay)


class ResumableRead(io.RawIOBase):
    """A read-only stream of one remote file that survives outages: every transient failure is
    retried under ``policy`` (``retrying``) and the read resumes at byte ``pos``, so no byte is
    read twice or skipped from the caller's point of view. A subclass opens the file at ``pos``
    (``_connect``: sets ``self.body``, and ``self.size`` on the first connect) and reads from it
    (``_read``). ``kind``: what the file is to the user (a ``shard`` listed in a manifest, or the
    ``manifest`` itself), for errors."""

    def __init__(self, url: str, name: str, policy: RemotePolicy, tally: Optional[Tally] = None,
                 kind: str = "shard"):
        super().__init__()
        self.url, self.name, self.policy, self.tally, self.kind = url, name, policy, tally, kind
        self.pos, self.size, self.body = 0, None, None
        self._retrying(self._connect)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        def once():
            if self.body is None:
                self._connect()
            n = self._read(b)
            if not n and len(b) and self.size is not None and self.pos < self.size:  # closed early
                raise ConnectionError(f"connection closed at byte {self.pos} of {self.size}")
            return n
        n = self._retrying(once)
        self.pos += n
        return n

    def close(self) -> None:
        self._drop()
        super().close()

    def _drop(self) -> None:
        if self.body is not None:
            try:
                self.body.close()
            except Exception:
                pass
            self.body = None

    def _retrying(self, op):
        return retrying(op, policy=self.policy, url=self.url, name=self.name, tally=self.tally, drop=self._drop)
