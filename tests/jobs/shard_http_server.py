"""A small real HTTP file server for the remote-shard tests, run as its own process:

    python tests/jobs/shard_http_server.py DIR PORT [--rate BYTES_PER_S] [--die-after NAME:BYTES]
                                               [--no-range] [--range-early BYTES]
                                               [--busy N [--busy-status CODE]
                                                [--retry-after S [--retry-after-date]]]

Serves the files of DIR on 127.0.0.1:PORT with ``Range: bytes=A-`` / ``A-B`` support (206 with
``Content-Range``), an ``ETag`` and ``Last-Modified`` made of the file's mtime and size, 404 for
anything else, one thread per connection. ``--rate`` paces every response body to about that many
bytes per second (a rate-limited object store). ``--die-after`` ends the whole process
(``os._exit``, as a crash would) once BYTES bytes of file NAME's body are sent, mid-transfer; a
restart without the flag serves normally. ``--no-range`` ignores ``Range`` (200 and the whole file,
as some servers do); ``--range-early BYTES`` answers a range from that many bytes before the one
asked (a misaligned answer, its ``Content-Range`` saying so); ``--busy N`` answers the first N
requests with 503 (or ``--busy-status``), with ``Retry-After: S`` when ``--retry-after`` is given
(``--retry-after-date``: as the HTTP-date S seconds after the answer, rounded up to the second).
Each request is logged to stderr as ``GET /NAME range=... -> STATUS``.
"""
from __future__ import annotations

import argparse
import email.utils
import math
import os
import re
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CHUNK = 4096


class Handler(BaseHTTPRequestHandler):
    root: Path
    rate: float | None = None
    die: tuple[str, int] | None = None
    no_range = False
    range_early = 0  # bytes before the asked range that an answer starts at
    busy = 0  # requests still to refuse with busy_status
    busy_status = 503
    retry_after: int | None = None  # seconds a busy answer asks the client to wait
    retry_after_date = False  # say them as an HTTP-date rather than a number of seconds
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # one line per request, see do_GET
        pass

    def do_GET(self):
        name = self.path.lstrip("/").split("?")[0]
        path = self.root / name
        asked = self.headers.get("Range")  # logged as asked; honoured unless --no-range
        rng = None if self.no_range else asked
        if Handler.busy > 0:
            Handler.busy -= 1
            self._log(name, asked, Handler.busy_status)
            self._busy()
            return
        if "/" in name or not path.is_file():
            self._log(name, asked, 404)
            self.send_error(404, "Not Found")
            return
        data, st = path.read_bytes(), path.stat()
        start, end = 0, len(data) - 1
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if not m or int(m.group(1)) >= len(data):
                self._log(name, asked, 416)
                self.send_error(416, "Range Not Satisfiable")
                return
            start, end = int(m.group(1)), min(int(m.group(2) or len(data) - 1), len(data) - 1)
            start = max(0, start - self.range_early)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{st.st_mtime_ns:x}-{st.st_size:x}"')  # as nginx makes them
        self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        self.end_headers()
        self._log(name, asked, 206 if rng else 200)
        pos, t0 = start, time.monotonic()
        while pos <= end:
            n = min(CHUNK, end + 1 - pos)
            if self.die and self.die[0] == name and pos + n > self.die[1]:
                self.wfile.write(data[pos:self.die[1]])
                self.wfile.flush()
                print(f"dying mid-transfer of {name} at byte {self.die[1]}", file=sys.stderr, flush=True)
                os._exit(17)
            self.wfile.write(data[pos:pos + n])
            pos += n
            if self.rate:
                ahead = (pos - start) / self.rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)

    def _busy(self):
        self.send_response(Handler.busy_status)
        if Handler.retry_after is not None:
            after = Handler.retry_after
            if Handler.retry_after_date:
                after = email.utils.formatdate(math.ceil(time.time() + after), usegmt=True)
            self.send_header("Retry-After", str(after))
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _log(self, name, rng, status):
        print(f"GET /{name} range={rng} -> {status}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("port", type=int)
    ap.add_argument("--rate", type=float)
    ap.add_argument("--die-after")
    ap.add_argument("--no-range", action="store_true")
    ap.add_argument("--range-early", type=int, default=0)
    ap.add_argument("--busy", type=int, default=0)
    ap.add_argument("--busy-status", type=int, default=503)
    ap.add_argument("--retry-after", type=int)
    ap.add_argument("--retry-after-date", action="store_true")
    args = ap.parse_args()
    Handler.retry_after, Handler.retry_after_date = args.retry_after, args.retry_after_date
    Handler.no_range, Handler.busy, Handler.busy_status = args.no_range, args.busy, args.busy_status
    Handler.root = Path(args.root)
    Handler.rate, Handler.range_early = args.rate, args.range_early
    if args.die_after:
        name, _, at = args.die_after.rpartition(":")
        Handler.die = (name, int(at))
    ThreadingHTTPServer.allow_reuse_address = True
    ThreadingHTTPServer.daemon_threads = True
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"serving {args.root} on 127.0.0.1:{args.port}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
