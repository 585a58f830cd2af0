"""``s3://bucket/key``: shards, manifests and ``vit-shards`` output in S3 and S3-compatible stores.

Credentials, region and endpoint come from boto3's standard chain: ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``~/.aws/credentials`` and
``~/.aws/config``, instance roles; ``AWS_DEFAULT_REGION`` (botocore reads ``AWS_REGION`` only in
AWS's own execution environments); ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (or
``endpoint_url`` in the profile) for MinIO, Cloudflare R2, GCS's XML API, moto... When the endpoint
is not AWS's own, requests use path-style addressing
(``http://host/bucket/key``), which every S3-compatible store serves.

Reading (``S3Object``) follows ``storage.retry``: a refused connect, a reset or stalled read, a 5xx
answer and S3's ``SlowDown`` are retried under the ``RemotePolicy`` and the read resumes at its byte
with a ranged GET (``If-Match`` the object's ETag, so a replaced object is an error rather than a
mix of two). A missing bucket or key, a 403 and bad credentials are one-line ``RemoteShardError``s
naming the URL and what to check; settings boto3 cannot make a client with (an endpoint that is not
a URL, a bad region or profile) one naming the variable. botocore's own retries are off: every retry is ours, counted as
``remote_retries``.

Writing (``S3Upload``): bytes are buffered up to ``PART_BYTES`` and sent as the parts of a multipart
upload (each part retried under the policy), so memory stays bounded whatever the object's size;
``commit`` completes the upload (the object appears whole, at once), ``abort`` drops it. An object
smaller than one part is a single PUT. ``S3Prefix`` is a "folder" of such objects for the writer.
"""
from __future__ import annotations

import fnmatch
import io
import os
import re
import threading
from typing import Callable, Optional, TypeVar
from urllib.parse import urlparse

from data_pipeline.errors import DataError
from data_pipeline.storage.retry import RemotePolicy, RemoteShardError, ResumableRead, retrying
from data_pipeline.storage.urls import split_s3
from data_pipeline.tally import Tally

PART_BYTES = 8 << 20  # multipart upload part size (S3's minimum is 5 MiB, but for the last)
_RETRY_CODES = frozenset({"SlowDown", "RequestTimeout", "Throttling", "ThrottlingException", "InternalError",
                          "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests"})
_CREDENTIALS = ("check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
                "~/.aws/credentials) and that they may access this bucket")
_clients: dict = {}
_clients_lock = threading.Lock()
T = TypeVar("T")


def client(timeout_s: float = 30.0):
    """A boto3 S3 client of this process (clients do not survive a fork) and of the AWS_* variables
    now set, without botocore's retries; path-style addressing when the endpoint is not AWS's."""
    key = (os.getpid(), timeout_s, tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    with _clients_lock:
        if key not in _clients:
            try:
                import boto3
                from botocore.config import Config
            except ImportError:
                raise DataError("s3:// URLs need boto3: pip install boto3") from None
            from botocore import exceptions as bx

            kw = dict(connect_timeout=timeout_s, read_timeout=timeout_s,
                      retries={"total_max_attempts": 1, "mode": "standard"})
            try:
                session = boto3.session.Session()
                c = session.client("s3", config=Config(**kw))
                host = urlparse(c.meta.endpoint_url).hostname or ""
                if not host.endswith((".amazonaws.com", ".amazonaws.com.cn")):  # MinIO, R2, GCS, moto...
                    c = session.client("s3", config=Config(s3={"addressing_style": "path"}, **kw))
            except (bx.BotoCoreError, ValueError) as e:  # nothing was asked of the store yet: the settings
                raise RemoteShardError(_settings_problem(e)) from None
            _clients[key] = c
        return _clients[key]


def _setting(variables: tuple[str, ...], profile_key: str) -> str:
    """Where a client setting came from: the first of ``variables`` set, else the profile's key."""
    for v in variables:
        if os.environ.get(v):
            return f"{v}={os.environ[v]!r}"
    profile = os.environ.get("AWS_PROFILE", "default")
    return f"{profile_key} of profile {profile!r} in {os.environ.get('AWS_CONFIG_FILE', '~/.aws/config')}"


def _settings_problem(e: Exception) -> str:
    """One line naming the setting a boto3 client cannot be made with, and what it should be."""
    from botocore import exceptions as bx

    if isinstance(e, bx.ProfileNotFound):
        return (f"S3: AWS_PROFILE={os.environ.get('AWS_PROFILE', '')!r} names no profile in "
                f"{os.environ.get('AWS_CONFIG_FILE', '~/.aws/config')} or "
                f"{os.environ.get('AWS_SHARED_CREDENTIALS_FILE', '~/.aws/credentials')}; set it to one of "
                "their profiles or unset it")
    if isinstance(e, bx.InvalidRegionError):
        return (f"S3: region {_setting(('AWS_DEFAULT_REGION',), 'region')} is not a region name; "
                "set AWS_DEFAULT_REGION to the bucket's region (us-east-1, auto, ...)")
    if str(e).startswith("Invalid endpoint"):
        return (f"S3: endpoint {_setting(('AWS_ENDPOINT_URL_S3', 'AWS_ENDPOINT_URL'), 'endpoint_url')} is not a "
                "URL; give it as http(s)://host[:port]")
    config = os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")
    return f"S3: cannot set up a client ({e}); check the AWS_* variables and {config}"


def call(op: Callable[[], T], url: str, name: str, kind: str = "shard") -> T:
    """``op()`` (one boto3 request) with its failures sorted: transient ones become a
    ``ConnectionError`` (which ``retrying`` retries), refusals a one-line ``RemoteShardError``."""
    from botocore import exceptions as bx

    try:
        return op()
    except bx.ClientError as e:
        err = e.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        said = f"S3 {status}" + (f" {code}" if code and code != str(status) else "")
        if code in _RETRY_CODES or status in (408, 429) or status >= 500:
            # the backoff, not a Retry-After: MinIO sends 120 s with every SlowDown, a whole default bound
            raise ConnectionError(said) from None
        error = S3NotFound if status == 404 and code != "NoSuchBucket" else RemoteShardError
        raise error(f"{url}: {said}: {_why(code, status, url, name, kind)}") from None
    except (bx.NoCredentialsError, bx.PartialCredentialsError) as e:
        raise RemoteShardError(f"{url}: {e}; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                               "AWS_PROFILE or ~/.aws/credentials") from None
    except (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError) as e:
        if isinstance(e, bx.SSLError) and "CERTIFICATE_VERIFY_FAILED" in str(e):  # waiting cannot fix it
            raise RemoteShardError(f"{url}: the endpoint's TLS certificate is not trusted; put the CA that "
                                   "signed it in AWS_CA_BUNDLE, or check AWS_ENDPOINT_URL") from None
        raise ConnectionError(str(e)) from None
    except bx.BotoCoreError as e:  # a setting met only when a request is made (a failing credential_process...)
        raise RemoteShardError(f"{url}: {e}; check the AWS_* variables and ~/.aws/config") from None


def _why(code: str, status: int, url: str, name: str, kind: str) -> str:
    bucket = split_s3(url)[0]
    if code == "NoSuchBucket":
        return (f"bucket {bucket!r} does not exist at this endpoint; check the URL and AWS_ENDPOINT_URL / "
                "AWS_ENDPOINT_URL_S3")
    if code in ("NoSuchKey", "404", "NotFound") or status == 404:
        return (f"shard {name} is listed in the manifest but not in the bucket" if kind == "shard"
                else "no such object in the bucket")
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "ExpiredToken",
                "InvalidToken") or status == 403:
        return _CREDENTIALS
    if code in ("PermanentRedirect", "AuthorizationHeaderMalformed", "301") or status == 301:
        return f"bucket {bucket!r} is in another region; set AWS_DEFAULT_REGION to it"
    if code == "PreconditionFailed" or status == 412:
        return f"the {kind} was replaced while it was being read; rerun"
    return f"refused by the store ({kind} {name})"


class S3NotFound(RemoteShardError):
    """No such object (404): for the writer, "not written yet"."""


class S3Object(ResumableRead):
    """One S3 object that survives connection cuts and ``SlowDown``, resumed with a ranged GET
    that must match the object's first ETag (an object replaced mid-read is an error, not a mix)."""

    def __init__(self, url: str, name: str, policy: RemotePolicy, tally: Optional[Tally] = None,
                 kind: str = "shard"):
        self.bucket, self.key = split_s3(url)
        self.etag = None
        super().__init__(url, name, policy, tally, kind)

    def _read(self, b) -> int:
        data = call(lambda: self.body.read(len(b)), self.url, self.name, self.kind)
        b[:len(data)] = data
        return len(data)

    def _connect(self) -> None:
        kw = dict(Bucket=self.bucket, Key=self.key)
        if self.pos:
            kw.update(Range=f"bytes={self.pos}-", **({"IfMatch": self.etag} if self.etag else {}))
        c = client(self.policy.timeout_s)
        resp = call(lambda: c.get_object(**kw), self.url, self.name, self.kind)
        if self.pos:
            self._check_resumed(resp.get("ContentRange"), resp["Body"], "the store")
        else:
            self.size, self.etag = resp.get("ContentLength"), resp.get("ETag")
        self.body = resp["Body"]



class S3Upload(io.RawIOBase):
    """A writable stream into one S3 object: parts of ``part_bytes`` go up as they fill
    (multipart upload, each part retried under ``policy``); ``commit()`` completes the object and
    returns ``{"bytes", "etag"}``, ``abort()`` (or ``close()`` without ``commit``) drops it."""

    def __init__(self, url: str, policy: RemotePolicy = RemotePolicy(), part_bytes: Optional[int] = None):
        super().__init__()
        self.url, self.policy, self.part_bytes = url, policy, part_bytes or PART_BYTES
        self.bucket, self.key = split_s3(url)
        self.name = self.key.rsplit("/", 1)[-1]
        self.buf, self.parts, self.upload_id, self.size = bytearray(), [], None, 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.buf += b
        self.size += len(b)
        while len(self.buf) >= self.part_bytes:
            self._send(bytes(self.buf[:self.part_bytes]))
            del self.buf[:self.part_bytes]
        return len(b)

    def commit(self) -> dict:
        c = client(self.policy.timeout_s)
        if self.upload_id is None:  # smaller than one part: one PUT
            data = bytes(self.buf)
            resp = self._call(lambda: c.put_object(Bucket=self.bucket, Key=self.key, Body=data))
        else:
            if self.buf or not self.parts:
                self._send(bytes(self.buf))
            parts = {"Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(self.parts)]}
            try:
                resp = self._call(lambda: c.complete_multipart_upload(Bucket=self.bucket, Key=self.key,
                                                                      UploadId=self.upload_id, MultipartUpload=parts))
            except S3NotFound:  # NoSuchUpload: an earlier try completed it and its answer was lost
                resp = self._call(lambda: c.head_object(Bucket=self.bucket, Key=self.key))
                if resp["ContentLength"] != self.size:
                    raise

        self.buf, self.upload_id = bytearray(), None
        super().close()
        return {"bytes": self.size, "etag": resp.get("ETag")}

    def abort(self) -> None:
        if self.upload_id is not None:
            upload_id, self.upload_id = self.upload_id, None
            try:
                client(self.policy.timeout_s).abort_multipart_upload(Bucket=self.bucket, Key=self.key,
                                                                     UploadId=upload_id)
            except Exception:  # left for the next run's clean-up (S3Prefix.clean_unfinished)
                pass
        self.buf = bytearray()
        super().close()

    def close(self) -> None:
        if not self.closed:
            self.abort()

    def _send(self, data: bytes) -> None:
        c = client(self.policy.timeout_s)
        if self.upload_id is None:
            self.upload_id = self._call(lambda: c.create_multipart_upload(Bucket=self.bucket, Key=self.key))["UploadId"]
        n = len(self.parts) + 1
        resp = self._call(lambda: c.upload_part(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                                                PartNumber=n, Body=data))
        self.parts.append(resp["ETag"])

    def _call(self, op):
        return retrying(lambda: call(op, self.url, self.name, "object"), policy=self.policy, url=self.url,
                        name=self.name)


class S3Prefix:
    """``s3://bucket/prefix`` as the writer's output folder: objects named ``prefix/<name>``."""

    def __init__(self, url: str, policy: RemotePolicy = RemotePolicy()):
        self.root = url.rstrip("/")
        self.bucket, key = split_s3(self.root)
        if not self.bucket:
            raise DataError(f"{url}: no bucket in the URL; expected s3://bucket/prefix")
        self.prefix = f"{key}/" if key else ""
        self.policy = policy

    def url(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _call(self, op, name: str):
        url = self.url(name) if name else self.root
        return retrying(lambda: call(op, url, name or self.root, "object"), policy=self.policy, url=url,
                        name=name or self.root)

    def prepare(self) -> None:
        """Check the bucket is there and ours to write, before any work."""
        c = client(self.policy.timeout_s)
        try:
            self._call(lambda: c.head_bucket(Bucket=self.bucket), "")
        except S3NotFound:  # a HEAD answer has no error code to tell a bucket from a key
            raise RemoteShardError(f"{self.root}: S3 404: {_why('NoSuchBucket', 404, self.root, '', '')}") from None

    def read_bytes(self, name: str) -> Optional[bytes]:
        """The object's bytes (read as shards are: retried, resumed), or None when there is no such object."""
        try:
            with S3Object(self.url(name), name, self.policy, kind="object") as f:
                return f.read()
        except S3NotFound:
            return None

    def read_text(self, name: str) -> Optional[str]:
        """The object's text, or None when there is no such object."""
        data = self.read_bytes(name)
        return None if data is None else data.decode("utf-8")

    def write_text(self, name: str, text: str) -> str:
        """One PUT: an object appears whole or not at all."""
        c = client(self.policy.timeout_s)
        data = text.encode("utf-8")
        self._call(lambda: c.put_object(Bucket=self.bucket, Key=self.prefix + name, Body=data), name)
        return self.url(name)

    def stat(self, name: str) -> Optional[dict]:
        """``{"bytes", "etag"}`` of the object, or None when there is none."""
        c = client(self.policy.timeout_s)
        try:
            h = self._call(lambda: c.head_object(Bucket=self.bucket, Key=self.prefix + name), name)
        except S3NotFound:
            return None
        return {"bytes": h["ContentLength"], "etag": h.get("ETag")}

    def create(self, name: str) -> S3Upload:
        return S3Upload(self.url(name), self.policy)

    def remove(self, name: str) -> None:
        c = client(self.policy.timeout_s)
        self._call(lambda: c.delete_object(Bucket=self.bucket, Key=self.prefix + name), name)

    def names(self, pattern: str = "*") -> list[str]:
        """Names of the objects directly under the prefix that match the shell ``pattern``."""
        return sorted(n for n in self.sizes() if fnmatch.fnmatchcase(n, pattern))

    def sizes(self) -> dict[str, int]:
        """Name -> byte size of every object directly under the prefix (LIST pages of 1,000: one
        request per 1,000 shards, where a HEAD per shard would be one each)."""
        c = client(self.policy.timeout_s)
        out, token = {}, None
        while True:
            kw = dict(Bucket=self.bucket, Prefix=self.prefix, Delimiter="/", **({"ContinuationToken": token}
                                                                                 if token else {}))
            page = self._call(lambda: c.list_objects_v2(**kw), "")
            out.update({o["Key"][len(self.prefix):]: int(o["Size"]) for o in page.get("Contents", [])})
            token = page.get("NextContinuationToken")
            if not token:
                break
        return out

    def head_bytes(self, name: str, n: int) -> bytes:
        """The object's first ``n`` bytes (one ranged GET, retried under the policy)."""
        c = client(self.policy.timeout_s)
        return self._call(lambda: c.get_object(Bucket=self.bucket, Key=self.prefix + name,
                                               Range=f"bytes=0-{n - 1}")["Body"].read(), name)

    def clean_unfinished(self, own: "re.Pattern") -> None:
        """Abort the multipart uploads of names ``own`` matches that interrupted runs left: every
        LIST page of them (1,000 uploads a page), then one request per upload."""
        c = client(self.policy.timeout_s)
        left, after = [], {}
        while True:
            kw = dict(Bucket=self.bucket, Prefix=self.prefix, **after)
            page = self._call(lambda: c.list_multipart_uploads(**kw), "")
            left += [u for u in page.get("Uploads", []) if own.fullmatch(u["Key"][len(self.prefix):])]
            if not (page.get("IsTruncated") and page.get("NextKeyMarker")):
                break
            after = {"KeyMarker": page["NextKeyMarker"], **({"UploadIdMarker": page["NextUploadIdMarker"]}
                                                            if page.get("NextUploadIdMarker") else {})}
        for u in left:
            self._call(lambda: c.abort_multipart_upload(Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"]),
                       u["Key"][len(self.prefix):])
