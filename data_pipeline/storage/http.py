"""``http(s)://`` files read with retries (``storage.retry``) and ranged resume.

``http://`` / ``https://`` shards (``data.allow_remote``) are read by ``HTTPShard``: a dropped
connection, a timeout, a refused connect or a 408/429/5xx answer is retried with exponential
backoff until the outage has lasted ``data.remote_retry_s`` (``storage.retry``; a 429 or 503 with
``Retry-After``, seconds or an HTTP-date, is tried again no sooner than it says), and the read
resumes at the byte it stopped at with an HTTP ``Range`` request, so the tar stream goes on with no
sample repeated or skipped (the file must keep its length, ETag and Last-Modified: a shard rewritten
mid-read is an error, not a mix of two files). Each retry is counted as ``remote_retries``. A server
still away past the policy raises ``StoreUnreachable``, a 404 and any other refusal ``RemoteShardError`` (one line
naming the URL and the shard), and so are a TLS certificate the client does not trust and a URL
that is not one (a port that is no port); the stream
stops the run with it rather than count the shard's samples as lost.
"""
from __future__ import annotations

import datetime
import email.utils
import http.client
import re
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request

from data_pipeline.storage.retry import RemoteShardError, ResumableRead, RetryAfter

_VALIDATORS = ("ETag", "Last-Modified")  # what says a resumed answer is of the same file


def _transient(status: int) -> bool:
    """An answer that asking again later may change: 408, 429 and every 5xx (a CDN's 520-524 too)."""
    return status in (408, 429) or 500 <= status < 600


def _retry_after_s(value: str) -> float:
    """The wait a ``Retry-After`` header asks for (RFC 9110 10.2.3: delay-seconds or an HTTP-date);
    0 for a date already past or a value that is neither (the backoff alone then)."""
    value = value.strip()
    if re.fullmatch(r"[0-9]+", value):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return 0.0
    if when.tzinfo is None:  # "-0000": UTC, as HTTP-dates always are
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, when.timestamp() - time.time())


def _bad_port(url: str) -> str | None:
    """The port ``url`` names when it is no TCP port (not a number, or outside 1-65535), else None.
    Asking would not fail cleanly: ``http.client`` calls a word a transient ``InvalidURL`` and
    getaddrinfo wraps 99999 round to 34463, another server's port or a refused one."""
    host = urllib.parse.urlsplit(url).netloc.rpartition("@")[2]
    port = host.rpartition("]")[2] if host.startswith("[") else host  # [v6 address]:port
    port = port.partition(":")[2]
    return port if port and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536) else None


class HTTPShard(ResumableRead):
    """One HTTP(S) file, resumed with ``Range: bytes=pos-``; a server that ignores ``Range``
    answers 200 and the bytes already read are skipped. One request per (re)connect. A resumed
    answer of another file (length, ETag or Last-Modified changed) is a ``RemoteShardError``."""

    validators: dict = {}  # ETag / Last-Modified of the first answer

    def _read(self, b) -> int:
        return self.body.readinto(b)

    def _connect(self) -> None:
        port = _bad_port(self.url)
        if port is not None:  # the user's mistake: asking again cannot fix it
            raise RemoteShardError(f"{self.url}: not a valid URL (port {port!r} is not a number from 1 to 65535)")
        headers = {"Range": f"bytes={self.pos}-"} if self.pos else {}
        try:
            resp = urllib.request.urlopen(urllib.request.Request(self.url, headers=headers),
                                          timeout=self.policy.timeout_s)
        except urllib.error.HTTPError as e:
            e.close()
            after = e.headers.get("Retry-After") if e.code in (429, 503) and e.headers else None
            if after:  # the server (or a CDN) says when to ask again
                raise RetryAfter(f"HTTP {e.code} {e.reason} (Retry-After: {after})", _retry_after_s(after)) from None
            if _transient(e.code):
                raise ConnectionError(f"HTTP {e.code} {e.reason}") from None
            what = "not on the server" if e.code in (404, 410) else "refused by the server"
            if self.kind == "shard":
                what = f"shard {self.name} is listed in the manifest but {what}"
            raise RemoteShardError(f"{self.url}: HTTP {e.code} {e.reason}: {what}") from None
        except http.client.InvalidURL as e:  # a control character, ...: no answer will ever come
            raise RemoteShardError(f"{self.url}: not a valid URL ({e})") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, ssl.SSLCertVerificationError):  # the same answer however long we wait
                raise RemoteShardError(f"{self.url}: TLS certificate not trusted ({e.reason.verify_message}); "
                                       "put the CA that signed it in SSL_CERT_FILE, or use the URL the "
                                       "certificate names") from None
            raise
        if self.pos:
            self._check_same_file(resp)
        if self.pos and resp.status == 206:
            self._check_resumed(resp.headers.get("Content-Range"), resp, "the server")
        elif self.pos:  # 200: the whole file again (no Range support); skip what was read
            left = self.pos
            while left:
                chunk = resp.read(min(left, 1 << 20))
                if not chunk:
                    raise http.client.IncompleteRead(b"", left)
                left -= len(chunk)
        else:
            self.validators = {h: resp.headers[h] for h in _VALIDATORS if resp.headers.get(h)}
            if resp.headers.get("Content-Length", "").isdigit():
                self.size = int(resp.headers["Content-Length"])
        self.body = resp

    def _check_same_file(self, resp) -> None:
        """A resumed answer must be of the file the first answer began: the same length and, where
        the server gives them, the same ETag and Last-Modified. Else the tar would go on with the bytes
        of another file (a shard rewritten mid-read); that is one line, not a mix."""
        if resp.status == 206:
            m = re.fullmatch(r"bytes \d+-\d+/(\d+)", resp.headers.get("Content-Range", "").strip())
            total = int(m.group(1)) if m else None
        else:
            length = resp.headers.get("Content-Length", "")
            total = int(length) if length.isdigit() else None
        changed = [f"{self.size} bytes, now {total}"] if None not in (self.size, total) and total != self.size else []
        changed += [f"{h} {v!r}, now {resp.headers[h]!r}" for h, v in self.validators.items()
                    if resp.headers.get(h) and resp.headers[h] != v]
        if changed:
            resp.close()
            raise RemoteShardError(f"{self.url}: the {self.kind} {self.name} changed on the server while it was "
                                   f"being read at byte {self.pos} ({'; '.join(changed)}); rerun once it stays put")
