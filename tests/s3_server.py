"""A real S3 API server for tests and benchmarks: ``moto_server`` as its own process on 127.0.0.1
(stopped by PID), with IAM authentication on (wrong keys are refused as by AWS), multipart parts
from ``PART_MIN_BYTES`` and unfinished multipart uploads listed ``UPLOADS_PAGE`` a page, and ``Proxy``, a
TCP proxy in front of it that can cut every connection, refuse new ones for a while, or answer
``503 SlowDown`` as an overloaded S3 does.

    with MotoS3() as s3:                         # s3.env: the AWS_* variables of a client
        proxy = Proxy(s3.port).start()           # point AWS_ENDPOINT_URL at proxy.url instead
        proxy.plan([(50_000, 1.0, 0), (80_000, 0.0, 3)])  # cut after 50 kB and refuse for 1 s; after 80 kB more
                                                          # cut and answer the next 3 connections 503 SlowDown
"""
from __future__ import annotations

import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

_SETUP_CALLS = 3  # IAM requests made before authentication starts (INITIAL_NO_AUTH_ACTION_COUNT)
PART_MIN_BYTES = 16 << 10  # smallest multipart part but the last (AWS: 5 MiB): tests upload small shards in parts
UPLOADS_PAGE = 2  # unfinished multipart uploads per ListMultipartUploads page (AWS: 1,000): tests page with a few
SLOWDOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
            b"<Message>Please reduce your request rate.</Message></Error>")


def free_port() -> int:
    """A free port below the kernel's ephemeral range: a client retrying a port that is refusing
    would otherwise, sooner or later, get that very port as its own source port and connect to
    itself (TCP self-connect), and the port could not be listened on again."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below the ephemeral range")


class MotoS3:
    """``moto_server`` on a free port; ``env`` holds a user's working AWS_* variables."""

    def __init__(self, log: Path | None = None):
        self.port, self.log, self.proc, self.env = free_port(), log, None, {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "MotoS3":
        import boto3

        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, __file__, "-H", "127.0.0.1", "-p", str(self.port)],
                                     env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(_SETUP_CALLS),
                                          "S3_UPLOAD_PART_MIN_SIZE": str(PART_MIN_BYTES)},
                                     stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        end = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.time() > end:
                    raise AssertionError("moto_server did not start") from None
                time.sleep(0.05)
        iam = boto3.client("iam", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id="setup",
                           aws_secret_access_key="setup")
        iam.create_user(UserName="vitscale")
        key = iam.create_access_key(UserName="vitscale")["AccessKey"]
        iam.put_user_policy(UserName="vitscale", PolicyName="all", PolicyDocument='{"Version": "2012-10-17", '
                            '"Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}')
        self.env = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.url}
        return self

    def client(self, endpoint: str | None = None):
        import boto3

        return boto3.client("s3", endpoint_url=endpoint or self.url, region_name="us-east-1",
                            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # by PID: the process this object started
            self.proc.wait(10)

    def __enter__(self) -> "MotoS3":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Proxy:
    """A TCP proxy on a free port of 127.0.0.1 in front of ``target_port``, in threads of this
    process. ``plan`` arms faults by bytes sent to clients: an event's cut comes after exactly its
    count of bytes, so it lands mid-response; ``cut`` resets every connection now."""

    def __init__(self, target_port: int):
        self.target, self.port = target_port, free_port()
        self.lock = threading.Lock()
        self.conns: set[socket.socket] = set()
        self.events: list[tuple[int, float, int]] = []  # (bytes to clients before it, refuse seconds, SlowDowns)
        self.sent = 0  # bytes to clients since the last event
        self.slowdowns = 0  # new connections still to answer 503 SlowDown
        self.log: list[str] = []  # what happened: "cut", "slowdown", "refusing", "listening"
        self.listener = None
        self.timer = None  # reopens the port after a refusing cut
        self.closed = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "Proxy":
        self._listen()
        return self

    def stop(self) -> None:
        self.closed = True
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
            if self.listener is not None:
                self._close_listener()
        self.cut()

    def _close_listener(self) -> None:
        """Stop listening: the port refuses connections. shutdown() first: a bare close() would
        leave the socket listening until the thread blocked in accept() returns."""
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        self.listener = None

    def plan(self, events) -> None:
        with self.lock:
            self.events, self.sent = list(events), 0

    def reset(self) -> None:
        """No fault armed or pending, the port open, the log empty."""
        with self.lock:
            self.events, self.sent, self.slowdowns, self.log = [], 0, 0, []
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
        self._listen()

    def cut(self, refuse_s: float = 0.0, slowdowns: int = 0) -> None:
        """Reset every open connection; refuse new ones for ``refuse_s`` s (the port closed), then
        answer the next ``slowdowns`` connections with 503 SlowDown."""
        with self.lock:
            self.slowdowns += slowdowns
            conns, self.conns = self.conns, set()
            self.log.append("cut")
            if refuse_s and self.listener is not None:
                self._close_listener()
                self.log.append("refusing")
                self.timer = threading.Timer(refuse_s, self._listen)
                self.timer.start()
        for c in conns:  # the pump threads close them (a close() here would not wake their recv())
            try:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # closed: RST, not FIN
                c.shutdown(socket.SHUT_RD)  # wakes the recv() blocked on it
            except OSError:
                pass

    def _listen(self) -> None:
        with self.lock:
            self.timer = None
            if self.closed or self.listener is not None:
                return
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", self.port))
            s.listen(64)
            self.listener = s
            self.log.append("listening")
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, s: socket.socket) -> None:
        while True:
            try:
                client, _ = s.accept()
            except OSError:  # closed: refusing, or stopped
                return
            with self.lock:
                slow = self.slowdowns > 0
                self.slowdowns -= slow
            if slow:
                threading.Thread(target=self._slowdown, args=(client,), daemon=True).start()
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns |= {client, server}
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _slowdown(self, client: socket.socket) -> None:
        try:
            client.settimeout(5)
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = client.recv(65536)
                if not chunk:
                    break
                head += chunk
            client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(SLOWDOWN), SLOWDOWN))
            with self.lock:
                self.log.append("slowdown")
        except OSError:
            pass
        finally:
            client.close()

    def _pump(self, src: socket.socket, dst: socket.socket, to_client: bool) -> None:
        try:
            while True:
                data = src.recv(8192)  # small steps: a cut lands mid-response
                if not data:
                    break
                fire = None
                if to_client:
                    with self.lock:
                        if self.events and self.sent + len(data) >= self.events[0][0]:
                            data = data[:self.events[0][0] - self.sent]  # the client gets exactly this many
                            fire, self.events, self.sent = self.events[0], self.events[1:], 0
                        else:
                            self.sent += len(data)
                dst.sendall(data)
                if fire:
                    self.cut(fire[1], fire[2])
                    break
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass
            with self.lock:
                self.conns -= {src, dst}


def _page_multipart_uploads(per_page: int) -> None:
    """moto (5.2) lists every unfinished multipart upload in one answer; S3 answers at most
    ``max-uploads`` (1,000) a page, ``IsTruncated`` with ``NextKeyMarker`` / ``NextUploadIdMarker``
    to go on from. Make moto's answers such pages of at most ``per_page``, by key then upload id."""
    from moto.core.responses import ActionResult
    from moto.s3.responses import S3Response

    def list_multipart_uploads(self):
        q = {k: v[0] for k, v in self.querystring.items()}
        key_marker, id_marker = q.get("key-marker", ""), q.get("upload-id-marker", "")
        size = min(int(q.get("max-uploads", 1000)), per_page)
        ups = sorted((u for u in self.backend.list_multipart_uploads(self.bucket_name).values()
                      if u.key_name.startswith(q.get("prefix", ""))), key=lambda u: (u.key_name, u.id))
        if key_marker:  # after the marker's key, or its key's uploads after the upload id marker
            ups = [u for u in ups if ((u.key_name, u.id) > (key_marker, id_marker) if id_marker
                                      else u.key_name > key_marker)]
        page = ups[:size]
        result = {"Bucket": self.bucket_name, "KeyMarker": key_marker, "UploadIdMarker": id_marker,
                  "MaxUploads": size, "IsTruncated": len(ups) > size,
                  "Uploads": [{"Key": u.key_name, "UploadId": u.id, "StorageClass": "STANDARD"} for u in page]}
        if len(ups) > size:
            result.update(NextKeyMarker=page[-1].key_name, NextUploadIdMarker=page[-1].id)
        self.data["Action"] = "ListMultipartUploads"
        return self.serialized(ActionResult(result))

    S3Response.list_multipart_uploads = list_multipart_uploads


if __name__ == "__main__":  # moto_server, with the listing above: ``MotoS3.start`` runs it
    from moto.server import main

    _page_multipart_uploads(UPLOADS_PAGE)
    main(sys.argv[1:])
