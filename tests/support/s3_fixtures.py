"""A real S3-compatible server on loopback for the tests of the S3 backend, directly or through a fault proxy.

Fixtures (a test module imports them: ``from s3_fixtures import moto_server_fixture, s3_fixture,
s3_proxied_fixture  # noqa: F401``):

- ``moto_server`` (session): moto 5's ``ThreadedMotoServer`` on 127.0.0.1, on a port the kernel picks
  (``port=0``: free, with no window for another process to take it), started on first use and stopped at
  the end of the session. A real HTTP server in this process: no client is mocked.
- ``s3`` (function): a fresh bucket with a unique name (``S3Env``): ``endpoint``, ``bucket``, ``url``
  (``s3://<bucket>/run``), ``client()`` (a boto3 client for it), ``env`` (the AWS variables that make a
  plain ``boto3.client("s3")`` in any process reach it: the saver daemon and the persist worker are
  processes of their own), ``keys(prefix)``, ``multipart_uploads(prefix)`` and ``read(key)``. The
  variables are set in ``os.environ`` with ``monkeypatch`` (so they are undone for the suite's env
  hygiene check); at teardown the clients it handed out are closed, open multipart uploads aborted, the
  objects deleted and the bucket removed.
- ``s3_proxied`` (function): the same with ``endpoint``/``env`` pointing at a ``FaultProxy``
  (tests/support/s3_proxy.py) in front of the server; ``s3_proxied.proxy`` sets faults and reads its records.
  ``keys``, ``multipart_uploads``, ``read`` and the teardown talk to the server directly: they are never
  faulted and never recorded.

Path-style addressing: botocore has no environment variable for it (``AWS_S3_ADDRESSING_STYLE`` is not
read; ``addressing_style`` is only read from ``Config(s3=...)`` or the shared config file). The fixtures
write a config file to the test's tmp dir and point ``AWS_CONFIG_FILE`` at it::

    [default]
    region = us-east-1
    s3 =
        addressing_style = path

botocore 1.44 already addresses a custom endpoint (``endpoint_url``, ``AWS_ENDPOINT_URL``) path-style
unless told ``virtual`` (checked: ``http://localhost:9/bucket/key``, ``https://s3.example.com/bucket/key``;
AWS's own endpoint goes virtual-hosted); the file pins it, so that no other config can turn it virtual,
and a client's ``meta.config.s3`` shows it. ``AWS_SHARED_CREDENTIALS_FILE`` points at a missing file,
IMDS is off, and ``AWS_PROFILE``, ``AWS_ENDPOINT_URL_S3``, ``AWS_RETRY_MODE``, ``AWS_MAX_ATTEMPTS`` and the
checksum knobs are removed, so that a developer's settings change nothing.

Thread hygiene: conftest's ``_thread_and_child_hygiene`` fails a test that leaves threads. The server's
accept thread is made by the session fixture, which pytest sets up before any function-scoped fixture, so
it precedes the per-test snapshot. The server (werkzeug) and the proxy serve each client connection on a
thread that ends when that connection closes: close every boto3 client a test makes (``client.close()``,
or get it from ``S3Env.client()``, which the teardown closes), or its pooled keep-alive connections keep
a ``process_request_thread`` (moto) or ``s3-proxy-*-conn-*`` thread alive and the test fails.

Findings for the S3 backend (moto 5.2.5, botocore/boto3 1.44.8, measured here)
=============================================================================

What moto 5.2.5 supports
  - ``If-None-Match: *`` on PutObject: yes, 412 ``PreconditionFailed`` when the key exists. On
    CompleteMultipartUpload: yes, 412, and the upload stays open (abort it). ``If-Match`` on PutObject
    and GetObject: yes. CopyObject ignores ``If-None-Match`` (it overwrites).
  - Checksums: stored, never verified. A wrong ``x-amz-checksum-crc32`` on PutObject, UploadPart or in
    CompleteMultipartUpload's part list is accepted, so is a wrong ``Content-MD5`` (no ``BadDigest``).
    UploadPart echoes the part's CRC32; HeadObject with ``ChecksumMode=ENABLED`` returns a CRC32 for a
    multipart object without S3's ``-<parts>`` composite suffix. Test checksum *handling* against moto,
    never checksum *verification*.
  - CompleteMultipartUpload is idempotent: completing an upload already completed into that key answers
    200 with the same ETag, so a retry after a lost reply succeeds. EntityTooSmall (parts
    under 5 MiB but the last) is enforced.
  - An unknown or aborted upload id: AbortMultipartUpload and ListParts answer 404 ``NoSuchUpload``, but
    UploadPart and CompleteMultipartUpload crash moto (500, a KeyError) where S3 answers 404
    ``NoSuchUpload``; botocore then retries them as transient errors.
  - ListMultipartUploads: Prefix works, ``MaxUploads`` is ignored (everything, never truncated).
    ListObjectsV2: MaxKeys/ContinuationToken pagination, Delimiter/CommonPrefixes work.
  - A 200 carrying an ``<Error>`` body: moto never sends one; the proxy's ``error_in_200`` makes it.

What botocore 1.44.8 sends over http://
  - ``retry_mode`` defaults to ``standard`` (3 attempts in all). ``Config(retries={"max_attempts": n})``
    counts *retries* (n + 1 requests); ``total_max_attempts`` counts requests.
  - Every PutObject/UploadPart carries ``Expect: 100-continue`` (bytes bodies too) and waits up to 1 s for
    the 100 before sending the body anyway; the proxy answers 100 at once, or the final status instead.
  - Request checksums default to CRC32 in a header (``x-amz-checksum-crc32`` with
    ``x-amz-sdk-checksum-algorithm``) plus a SigV4 payload hash. ``aws-chunked``/``Transfer-Encoding:
    chunked`` bodies with a trailing checksum are only used over https; a non-seekable body is refused
    (``io.UnsupportedOperation: seek``), so over http botocore always sends ``Content-Length``.
  - GetObject sends ``x-amz-checksum-mode: ENABLED`` (the response checksum is validated when the object
    has one); HeadObject does not unless asked (``ChecksumMode``).

How botocore handles each fault (standard / adaptive / legacy retry modes)
  - ``slowdown`` (503 SlowDown, ``Retry-After: 1``): retried in all three. ``Retry-After`` is ignored;
    standard and adaptive honour ``x-amz-retry-after`` (milliseconds; the delay is raised to it, capped
    at the backoff + 5 s), legacy ignores it. Throttling backoff: rand(0,1) * 2^i seconds (standard,
    adaptive); three SlowDowns in a row exhaust standard/adaptive (ClientError SlowDown, "reached max
    retries: 2"); legacy makes 5 attempts and got through. Adaptive additionally turns on its client-side
    token bucket after the first throttle: later requests of that client wait for tokens.
  - ``error500``: retried (non-throttling backoff rand(0,1) * 50 ms * 2^i in standard).
  - ``reset_request``, ``reset_response`` on a non-streaming operation, ``lost_reply`` (FIN or RST):
    ``botocore.exceptions.ConnectionClosedError`` ("Connection was closed before we received a valid
    response"), retried in all modes with the body rewound.
  - ``reset_response`` on GetObject: the call returns (headers were complete) and
    ``Body.read()`` raises ``botocore.exceptions.ResponseStreamingError``; botocore never retries a body
    being read. The backend must retry ranged reads itself (resume at the byte reached).
  - ``lost_reply`` on CompleteMultipartUpload: the upload was completed on the server; botocore retries and
    the retry succeeds against moto (idempotent, same ETag), not ``NoSuchUpload``. Do not build on either
    answer from a real store: on ``NoSuchUpload`` from a Complete that may have been retried, HEAD the
    key and compare its size and multipart ETag (``"<md5 of the parts' md5s>-<parts>"``) with the upload's.
    Without retries (``total_max_attempts=1``) the caller gets ``ConnectionClosedError`` while the object
    exists.
  - ``lost_reply`` on a conditional PutObject (``If-None-Match: *``): the retry gets 412
    ``PreconditionFailed`` although the object is the client's own write. A backend using conditional
    puts for commit records must resolve 412 by reading back what is there.
  - ``error_in_200`` on CompleteMultipartUpload: botocore turns the 200 into a 500 (``_handle_200_error``)
    and retries in all modes; the retry succeeds (idempotent). With retries exhausted it raises
    ``ClientError`` ``InternalError`` although the object exists.
  - ``slow_body``: no error unless a read stalls past ``read_timeout`` (default 60 s).

Throughput (this 2-core machine, one-off script, 3 rounds after a warm-up; one 256 MiB object of random
bytes; boto3 ``upload_fileobj``/``download_fileobj`` with its defaults: 8 MiB parts, 10 threads)
  ======================================  ============  ==============
  MiB/s                                   moto direct   through proxy
  ======================================  ============  ==============
  multipart upload (32 UploadParts)       128-158       134-146
  download (32 ranged GETs in parallel)   55            55-56
  one whole-object GetObject              850-920       640-740
  ======================================  ============  ==============
  A small request (HeadObject, a 1 KB PutObject) takes 3-4 ms either way: the proxy adds well under
  1 ms. The ranged download is bounded by moto, not by the client or the proxy: every GetObject, ranged
  or not, copies the whole object out of its buffer under the key's lock, so parallel range reads of a
  big object are O(size) each and serialized. Keep objects in the backend's tests small (a few MiB) and
  measure speed against real storage in ``benchmarks/``, never against moto.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from s3_proxy import FaultProxy

__all__ = ["REGION", "MotoServer", "ProxiedS3Env", "S3Env", "make_client", "moto_server_fixture", "s3_env",
           "s3_fixture", "s3_proxied_fixture"]

REGION = "us-east-1"
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
PREFIX = "run"

_CONFIG_FILE = f"""[default]
region = {REGION}
s3 =
    addressing_style = path
"""
# Settings of the developer's environment that would change where or how a client talks to the server.
_CLEARED_ENV = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS",
                "AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION")


# ------------------------------------------------------------------------------------------ the server
@dataclass(frozen=True)
class MotoServer:
    """The session's moto server: ``endpoint`` is ``http://127.0.0.1:PORT``."""

    endpoint: str
    port: int


@dataclass
class _Shared:
    """The one server of the session, however many test modules import the fixture (pytest makes one
    session fixture per importing module: they share this one and the last to end stops it)."""

    server: Any = None
    info: MotoServer | None = None
    users: int = 0
    werkzeug_level: int = logging.NOTSET


_shared = _Shared()


@pytest.fixture(scope="session", name="moto_server")
def moto_server_fixture() -> Iterator[MotoServer]:
    """A moto S3 server on 127.0.0.1 for the whole session (see the module docstring)."""
    if _shared.server is None:
        from moto.server import ThreadedMotoServer

        # werkzeug logs every request at INFO; keep its warnings and errors (a moto crash is an ERROR).
        werkzeug = logging.getLogger("werkzeug")
        _shared.werkzeug_level = werkzeug.level
        werkzeug.setLevel(logging.WARNING)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        _shared.server, _shared.info = server, MotoServer(f"http://{host}:{port}", port)
    _shared.users += 1
    assert _shared.info is not None
    try:
        yield _shared.info
    finally:
        _shared.users -= 1
        if _shared.users == 0:
            _shared.server.stop()
            logging.getLogger("werkzeug").setLevel(_shared.werkzeug_level)
            _shared.server, _shared.info = None, None


# ------------------------------------------------------------------------------------------ a bucket
_loader: list[Any] = []  # botocore's data loader, shared: each new session would parse the S3 model again


def make_client(endpoint: str, *, retries: Mapping[str, Any] | None = None, **config: Any) -> Any:
    """A boto3 S3 client for ``endpoint`` with the fixtures' credentials, region and path-style
    addressing; ``retries`` and ``config`` go to ``botocore.config.Config``. The caller closes it.

    Each client has a session of its own (the environment is read afresh); only botocore's cache of
    parsed service models is shared between them (40 ms a client)."""
    import boto3
    import botocore.session
    from botocore.config import Config

    session = botocore.session.get_session()
    if _loader:
        session.register_component("data_loader", _loader[0])
    else:
        _loader.append(session.get_component("data_loader"))
    cfg = Config(s3={"addressing_style": "path"}, retries=dict(retries) if retries else None, **config)
    return boto3.session.Session(botocore_session=session).client(
        "s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY, config=cfg)


@dataclass
class S3Env:
    """One test's bucket (see the module docstring). ``endpoint``/``env`` are what the code under test
    uses; ``server_endpoint`` is the moto server itself (the same unless proxied)."""

    endpoint: str
    server_endpoint: str
    bucket: str
    env: dict[str, str]
    prefix: str = PREFIX
    _clients: list[Any] = field(default_factory=list, init=False, repr=False)
    _admin: Any = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        """The checkpoint location of the test: ``s3://<bucket>/run``."""
        return f"s3://{self.bucket}/{self.prefix}"

    def client(self, *, retries: Mapping[str, Any] | None = None, direct: bool = False, **config: Any) -> Any:
        """A boto3 client for ``endpoint`` (the server itself with ``direct=True``), closed at teardown.

        Args:
            retries: ``Config(retries=...)``, e.g. ``{"mode": "adaptive", "total_max_attempts": 2}``.
            direct: talk to the moto server, past the proxy.
            config: more ``botocore.config.Config`` arguments (``read_timeout``, ...).
        """
        c = make_client(self.server_endpoint if direct else self.endpoint, retries=retries, **config)
        self._clients.append(c)
        return c

    def _server(self) -> Any:
        if self._admin is None:
            self._admin = make_client(self.server_endpoint)
        return self._admin

    def keys(self, prefix: str = "") -> list[str]:
        """The bucket's keys under ``prefix``, sorted (read from the server directly)."""
        pages = self._server().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def multipart_uploads(self, prefix: str = "") -> list[tuple[str, str]]:
        """The open multipart uploads under ``prefix``: ``(key, upload id)``, sorted (from the server)."""
        got = self._server().list_multipart_uploads(Bucket=self.bucket, Prefix=prefix)
        return sorted((u["Key"], u["UploadId"]) for u in got.get("Uploads", []))

    def read(self, key: str) -> bytes:
        """The object ``key``'s bytes (from the server directly)."""
        return bytes(self._server().get_object(Bucket=self.bucket, Key=key)["Body"].read())

    def _create(self) -> None:
        self._server().create_bucket(Bucket=self.bucket)

    def _destroy(self) -> None:
        """Closes the clients handed out, aborts open uploads, deletes every object and the bucket."""
        for c in self._clients:
            c.close()
        self._clients.clear()
        server = self._server()
        try:
            for key, upload_id in self.multipart_uploads():
                server.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            keys = self.keys()
            for i in range(0, len(keys), 1000):
                server.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
            server.delete_bucket(Bucket=self.bucket)
        finally:
            server.close()
            self._admin = None


@dataclass
class ProxiedS3Env(S3Env):
    """An ``S3Env`` whose ``endpoint`` is ``proxy``, a ``FaultProxy`` in front of the server (no faults
    set at first; the fixture closes it after the bucket's teardown)."""

    proxy: FaultProxy = field(kw_only=True)


def s3_env(monkeypatch: pytest.MonkeyPatch, tmp_dir: str, endpoint: str) -> dict[str, str]:
    """Points the AWS SDK of this process and of its children at ``endpoint`` (``os.environ`` through
    ``monkeypatch``; a path-style config file in ``tmp_dir``); returns the variables set."""
    config_file = os.path.join(tmp_dir, "aws-config")
    with open(config_file, "w") as f:
        f.write(_CONFIG_FILE)
    env = {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_CONFIG_FILE": config_file,
        "AWS_SHARED_CREDENTIALS_FILE": os.path.join(tmp_dir, "aws-credentials-none"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    for name in _CLEARED_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def _bucket_name() -> str:
    return f"fct-{uuid.uuid4().hex[:16]}"


@pytest.fixture(name="s3")
def s3_fixture(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[S3Env]:
    """A fresh bucket on the moto server, with the AWS environment pointing at it (module docstring)."""
    aws_dir = tmp_path / "aws"
    aws_dir.mkdir()
    env = s3_env(monkeypatch, str(aws_dir), moto_server.endpoint)
    s3 = S3Env(moto_server.endpoint, moto_server.endpoint, _bucket_name(), env)
    s3._create()
    try:
        yield s3
    finally:
        s3._destroy()


@pytest.fixture(name="s3_proxied")
def s3_proxied_fixture(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch,
                       tmp_path: Path) -> Iterator[ProxiedS3Env]:
    """A fresh bucket behind a ``FaultProxy`` (no faults set), the AWS environment pointing at the proxy."""
    proxy = FaultProxy(moto_server.endpoint)
    try:
        aws_dir = tmp_path / "aws"
        aws_dir.mkdir()
        env = s3_env(monkeypatch, str(aws_dir), proxy.endpoint)
        s3 = ProxiedS3Env(proxy.endpoint, moto_server.endpoint, _bucket_name(), env, proxy=proxy)
        s3._create()
        try:
            yield s3
        finally:
            s3._destroy()
    finally:
        proxy.close()
