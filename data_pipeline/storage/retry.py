"""The one retry policy of every remote reader and writer (``http(s)://``, ``s3://``).

A transient failure (a refused connect, a reset or stalled read, a 408/429/5xx answer, S3's
``SlowDown``) starts an *outage*: retried with exponential backoff (``data_pipeline.config.backoff_s``:
0.25 s doubling, at most 8 s) until it has lasted ``RemotePolicy.retry_s`` (``data.remote_retry_s``),
the last try at that bound; a try that waits out ``timeout_s`` makes an outage end at most that much
later. An answer that names its own wait (``RetryAfter``: HTTP ``Retry-After``) is waited for at
least that long, never past the bound. The count of failures is a guard only
(``RemotePolicy.retries``, by default as many as the backoff takes to fill ``retry_s``). Each retry
counts as ``remote_retries``; a line on stderr says when an outage starts and when it ends (how
long, how many retries). The readers resume at the byte they stopped at, so the caller never sees a
byte twice or misses one.

An outage past the bound raises ``StoreUnreachable`` (an ``Unavailable`` service: exit 69, which
``vit-launch --max-restarts`` restarts and a requeueing sbatch script requeues). A refusal that
waiting cannot fix (missing file, no permission, bad credentials) is a ``RemoteShardError`` (a user
error, exit 2). Both are one line naming the URL and what to check.
"""
from __future__ import annotations

import http.client
import io
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

from data_pipeline.config import backoff_s, outage_retries
from data_pipeline.errors import DataError, Unavailable
from data_pipeline.tally import Tally

TRANSIENT = (OSError, http.client.HTTPException)  # what ``retrying`` retries: URLError, timeouts, resets, short reads
T = TypeVar("T")


@dataclass(frozen=True)
class RemotePolicy:
    """How long a remote read or write keeps trying (``data.remote_*``)."""
    retry_s: float = 120.0  # an outage is retried until it has lasted this long (waits included)
    timeout_s: float = 30.0  # a connect or a read waiting this long counts as a failure
    retries: Optional[int] = None  # guard: failures of one outage at most; None: ``outage_retries(retry_s)``

    @classmethod
    def of(cls, data_cfg) -> "RemotePolicy":
        return cls(getattr(data_cfg, "remote_retry_s", cls.retry_s),
                   getattr(data_cfg, "remote_timeout_s", cls.timeout_s),
                   getattr(data_cfg, "remote_retries", cls.retries))

    def guard(self) -> int:
        """The failures one outage may count: never fewer than the backoff takes to fill ``retry_s``."""
        return max(self.retries or 0, outage_retries(self.retry_s))


class RetryAfter(ConnectionError):
    """A transient answer that says how long to wait before the next try (``wait_s`` seconds)."""

    def __init__(self, message: str, wait_s: float):
        super().__init__(message)
        self.wait_s = wait_s


class RemoteShardError(DataError):
    """A remote file the server refused (404, 403, bad credentials, ...): waiting cannot fix it; the
    message is one line naming the URL and the file."""


class StoreUnreachable(Unavailable):
    """An outage of a server or store that lasted past ``RemotePolicy.retry_s``; one line naming the
    URL, the bound and the last error."""


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def retrying(op: Callable[[], T], *, policy: RemotePolicy, url: str, name: str,
             tally: Optional[Tally] = None, drop: Callable[[], None] = lambda: None,
             say: Callable[[str], None] = _say) -> T:
    """``op()``; after a transient failure (``TRANSIENT``: the reader turns a retryable answer into
    a ``ConnectionError``), ``drop()`` the broken connection, back off (a ``RetryAfter``: at least
    its ``wait_s``) and try again until this outage has lasted ``policy.retry_s`` (then
    ``StoreUnreachable``). ``say`` gets a line when the
    outage starts and one when it ends. A ``RemoteShardError`` from ``op`` passes through at once."""
    failures, first = 0, 0.0
    while True:
        try:
            result = op()
        except RemoteShardError:
            raise
        except TRANSIENT as e:
            drop()
            now = time.monotonic()
            reason = getattr(e, "reason", None) or e
            if not failures:
                first = now
                say(f"{url}: unreachable ({reason}); retrying {name} for up to {policy.retry_s:g} s "
                    "(data.remote_retry_s)")
            failures += 1
            left = policy.retry_s - (now - first)
            if left <= 0.01 or failures > policy.guard():  # 0.01: a sleep may end a hair early
                raise StoreUnreachable(
                    f"{url}: server unreachable, gave up on {name} after {failures - 1} retries over "
                    f"{now - first:.1f} s (data.remote_retry_s={policy.retry_s:g}); last error: {reason}; "
                    "the same command resumes once it is back") from None
            if tally is not None:
                tally.add("remote_retries")
            time.sleep(min(max(backoff_s(failures), getattr(e, "wait_s", 0.0)), left))
        else:
            if failures:
                say(f"{url}: reachable again after {time.monotonic() - first:.1f} s and {failures} "
                    f"retr{'y' if failures == 1 else 'ies'}; {name} goes on")
            return result


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

    def _check_resumed(self, content_range: Optional[str], body, sender: str) -> None:
        """A resumed answer (asked from byte ``pos`` on) must say it begins there: else ``body`` is
        closed and a ConnectionError (retried) names what ``sender`` sent instead."""
        m = re.match(r"bytes (\d+)-", content_range or "")
        if not m or int(m.group(1)) != self.pos:
            body.close()
            raise ConnectionError(f"resumed at byte {self.pos} but {sender} sent Content-Range {content_range!r}")

    def _retrying(self, op):
        return retrying(op, policy=self.policy, url=self.url, name=self.name, tally=self.tally, drop=self._drop)
