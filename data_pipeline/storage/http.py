"""``http(s)://`` files read with retries (``storage.retry``) and ranged resume.

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
import urllib.error
import urllib.request
from typing import Optional

from data_pipeline.storage.retry import RemotePolicy, RemoteShardError, retrying
from data_pipeline.tally import Tally

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # the server may answer later


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
        return retrying(op, policy=self.policy, url=self.url, name=self.name, tally=self.tally, drop=self._drop)
