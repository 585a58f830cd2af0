"""Read one tar shard into raw samples (bytes only), surviving missing, truncated and hostile shards.

A sample is the run of consecutive members sharing a key (``000042.jpg``, ``000042.cls``), split
with webdataset's own ``base_plus_ext`` so we group exactly as a stock ``wds.WebDataset`` does.
Only members whose extension the decoder understands are read; ``.pyd/.pickle/.pth`` and friends
are skipped *unread* and counted, so nothing in a shard can reach ``pickle`` or ``torch.load``.
Nothing is extracted to disk, so member names like ``../../x`` or symlinks cannot escape.

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
import itertools
import re
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Iterator, Optional

from webdataset.tariterators import base_plus_ext

from data_pipeline.errors import DataError
from data_pipeline.manifest import MANIFEST_NAME, Shard, is_remote, local_path
from data_pipeline.tally import Tally

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
LABEL_EXTS = ("cls", "json", "txt")
# Extensions stock webdataset decoders would unpickle / torch.load: refused, counted as unsafe.
UNSAFE_EXTS = frozenset({"pyd", "pickle", "pkl", "pth", "pt", "ckpt", "npy", "npz", "joblib", "mp"})
MAX_MEMBER_BYTES = 64 << 20  # larger members are skipped unread: no image we train on is that big


@dataclass
class RawSample:
    shard: Shard
    index: int  # position of the sample within its shard
    key: str
    members: dict = field(default_factory=dict)  # extension -> bytes
    lost: bool = False  # a placeholder for a sample the tar did not deliver (counted as lost_in_shard)


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
    per (re)connect; no byte is read twice from the caller's point of view."""

    def __init__(self, url: str, name: str, policy: RemotePolicy, tally: Optional[Tally] = None):
        super().__init__()
        self.url, self.name, self.policy, self.tally = url, name, policy, tally
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
            if self.name != MANIFEST_NAME:
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


def is_http(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def open_shard(url: str, name: str = "", tally: Optional[Tally] = None, policy: Optional[RemotePolicy] = None):
    if is_http(url):
        return io.BufferedReader(HTTPShard(url, name or url.rsplit("/", 1)[-1], policy or RemotePolicy(), tally),
                                 1 << 20)
    if is_remote(url):  # allowed only when data.allow_remote was checked in resolve_shards
        from webdataset.gopen import gopen

        return gopen(url, "rb")
    return open(local_path(url), "rb", buffering=1 << 20)


def read_shard(shard: Shard, tally: Tally, ranges=None, policy: Optional[RemotePolicy] = None) -> Iterator[RawSample]:
    """Yield one item per wanted sample of ``shard``, in order: samples ``lo <= index < hi`` for
    each of ``ranges`` (sorted, disjoint; default the whole shard as the manifest counts it).
    Samples before and between the ranges are skipped unread (headers only); reading stops once the
    last range ends. Whatever the manifest promised in the ranges and the tar did not deliver
    (missing file, truncation, garbage) is counted as ``lost_in_shard`` and comes out as a
    placeholder (``lost=True``, no members): a slot's arrivals are then exactly its planned
    positions, which elastic resume (``rest.py``) relies on. An HTTP shard the server refuses or
    stays away for (``policy``) raises ``RemoteShardError`` instead."""
    ranges = [(0, shard.samples)] if ranges is None else [(lo, hi) for lo, hi in ranges if hi > lo]
    wanted = sum(hi - lo for lo, hi in ranges)
    if not wanted:
        return
    yielded = 0
    failed = False
    try:
        stream = open_shard(shard.url, shard.name, tally, policy)
    except RemoteShardError:
        raise
    except (OSError, ValueError):
        tally.add("missing_shard")
        stream = None
    if stream is not None:
        try:
            for sample in _grouped(stream, shard, tally, ranges):
                yield sample
                yielded += 1
        except RemoteShardError:
            raise
        except (tarfile.TarError, OSError, EOFError, ValueError):
            # Truncated or garbled tar: the partial sample in flight is dropped with the rest.
            failed = True
        finally:  # also runs when the consumer stops early (GeneratorExit): then nothing is counted
            try:
                stream.close()
            except Exception:  # a remote pipe reports its exit status on close; counted below
                failed = True
        if failed or yielded < wanted:
            tally.add("truncated_tar")
    if yielded < wanted:
        tally.bad("lost_in_shard", shard.name, wanted - yielded)
        # the tar delivers in index order, so what is missing is the tail of the wanted indices
        for index in itertools.islice((i for lo, hi in ranges for i in range(lo, hi)), yielded, None):
            yield RawSample(shard=shard, index=index, key="", lost=True)


def _grouped(stream, shard: Shard, tally: Tally, ranges) -> Iterator[RawSample]:
    """Group members into samples; yields a wanted sample once the next key starts (or the tar
    ends). Members of unwanted samples are neither read nor counted."""
    tar = tarfile.open(fileobj=stream, mode="r|*")
    sample, key_now, index, r = None, None, -1, 0
    stop = ranges[-1][1]
    for info in tar:
        tar.members = []  # streaming: do not keep every TarInfo of a 10k-sample shard in memory
        if not info.isreg():
            continue
        key, ext = base_plus_ext(info.name)
        if key is None:
            continue
        if key != key_now:
            if sample is not None:
                yield sample
            index += 1
            if index >= stop:
                return
            while ranges[r][1] <= index:
                r += 1
            key_now = key
            sample = RawSample(shard=shard, index=index, key=key) if ranges[r][0] <= index else None
        if sample is None:  # outside the ranges: the tar skips the member's bytes
            continue
        ext = ext.lower()
        if ext in UNSAFE_EXTS:
            tally.add("unsafe_member")
        elif ext not in IMAGE_EXTS and ext not in LABEL_EXTS:
            tally.add("unknown_member")
        elif info.size > MAX_MEMBER_BYTES:
            tally.add("oversized_member")
        else:
            sample.members[ext] = tar.extractfile(info).read()
    if sample is not None:
        yield sample
