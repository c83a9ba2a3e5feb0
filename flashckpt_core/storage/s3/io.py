"""S3 transfers, apart from the backend's bookkeeping: the clients (``make_client``: one per kind of
request, each with its bound on a request that makes no progress), the retry policy (which errors are
throttling, transient or fatal; backoff with full jitter honouring ``Retry-After``; fewer parallel parts
under throttling and stalls; a deadline per file), the store's reachability (``Reachability``: one warning
per outage) and zero-copy request bodies cut from a file's parts. boto3/botocore are imported only inside
functions that need them.

How a stall is cut short (botocore 1.44 / urllib3 2, read in their sources): botocore hands its client's
``connect_timeout`` and ``read_timeout`` to urllib3, which sets the socket's timeout to the connect timeout
while it connects and sends the request (each ``sendall`` of a piece of the body must finish within it:
Python's socket timeout bounds a whole ``sendall``), then to the read timeout before it reads the answer
(each ``recv`` of the status line, the headers and the body). A request that makes no progress for that
long raises ``ConnectTimeoutError``/``ReadTimeoutError``/``EndpointConnectionError``, which ``Retry``
retries on a new connection. botocore has no timeout per call that older releases honour, so each kind of
request has a client of its own: ``meta`` (HEAD, the commit records' small GETs and PUTs, LIST, DELETE,
creating and aborting uploads) bounded by ``meta_timeout_s``, ``data`` (upload parts, a file's PutObject,
ranged GETs, CompleteMultipartUpload and CopyObject, which S3 may answer slowly, DeleteObjects) by
``S3Options.timeout_s("data")``, scaled to the part size."""

from __future__ import annotations

import base64
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from flashckpt import errors as E
from flashckpt.format.rawio import ViewsReader, part_view
from flashckpt.storage.base import count_retry

if TYPE_CHECKING:
    from flashckpt.storage.s3.options import S3Options

try:  # ISA-L's CRC-32 (~20 GB/s), zlib's otherwise: the same values
    from isal.isal_zlib import crc32 as crc32
except ImportError:  # pragma: no cover - platforms without isal wheels
    from zlib import crc32 as crc32

__all__ = ["Retry", "Reachability", "Body", "make_client", "within", "chunks", "b64_crc", "error_code", "status",
           "crc32"]

log = logging.getLogger("flashckpt.storage.s3.backend")

_MIB = 1 << 20
_PIECE = _MIB  # hashing granularity (cache-sized)


# ------------------------------------------------------------------------------------------ clients
def make_client(o: S3Options, kind: str) -> Any:
    """A boto3 S3 client for requests of ``kind`` (``"meta"`` or ``"data"``): its connect and read
    timeouts are ``o.timeout_s(kind)``; botocore's retries are off (``Retry`` decides)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as e:
        raise E.CheckpointDirError("s3:// checkpoint dirs need boto3: pip install 'flashckpt[s3]'") from e
    session = boto3.session.Session(profile_name=o.profile) if o.profile else boto3.session.Session()
    bound = o.timeout_s(kind)
    cfg = Config(retries={"total_max_attempts": 1},
                 max_pool_connections=max(16, 2 * o.concurrency) if kind == "data" else 16,
                 # With a CRC-32 on every body (checksums) the store verifies what arrived, so SigV4's
                 # SHA-256 of each payload is not computed too (0.3 instead of 1.2 CPU s/GB uploaded,
                 # docs/storage.md "Choosing the client library")
                 s3={"addressing_style": o.addressing_style, "payload_signing_enabled": not o.checksums},
                 connect_timeout=bound, read_timeout=bound,
                 request_checksum_calculation="when_required", response_checksum_validation="when_required")
    region = o.region or session.region_name or "us-east-1"
    return session.client("s3", endpoint_url=o.endpoint_url, region_name=region, config=cfg)


# ------------------------------------------------------------------------------------------ retries
_THROTTLE = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
             "ProvisionedThroughputExceededException", "RequestThrottled"}
_TRANSIENT = {"InternalError", "ServiceUnavailable", "RequestTimeout", "RequestTimeTooSkewed", "BadDigest",
              "IncompleteBody", "XAmzContentSHA256Mismatch", "InternalServerError"}


def error_code(e: BaseException) -> str:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        return str(resp.get("Error", {}).get("Code", ""))
    return ""


def status(e: BaseException) -> int:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        return int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return 0


def _retry_after(e: BaseException) -> float:
    """The wait a throttling reply asks for: ``Retry-After`` (seconds) or ``x-amz-retry-after`` (ms)."""
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        headers = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}
        try:
            return max(0.0, float(headers.get("retry-after", 0) or 0),
                       float(headers.get("x-amz-retry-after", 0) or 0) / 1000)
        except ValueError:
            return 0.0
    return 0.0


def _kind(e: BaseException) -> str:
    """"throttle", "transient" or "fatal" for an error a request raised."""
    from botocore import exceptions as bx

    code, http = error_code(e), status(e)
    if code in _THROTTLE or http in (429, 503):
        return "throttle"
    if code in _TRANSIENT or http >= 500:
        return "transient"
    if isinstance(e, (bx.EndpointConnectionError, bx.ConnectionClosedError, bx.ReadTimeoutError,
                      bx.ConnectTimeoutError, bx.ResponseStreamingError, bx.HTTPClientError,
                      ConnectionError, TimeoutError, E.CheckpointCorruptError)):
        return "transient"
    try:
        from urllib3 import exceptions as ux

        if isinstance(e, (ux.ProtocolError, ux.ReadTimeoutError, ux.IncompleteRead)):
            return "transient"
    except ImportError:  # pragma: no cover
        pass
    return "fatal"


def _unreachable(e: BaseException) -> str | None:
    """Why the store did not answer ``e``'s request at all (refused, no connection, a stall), else None."""
    from botocore import exceptions as bx

    if isinstance(e, bx.ConnectTimeoutError):
        return f"no connection within its bound (storage options meta_timeout_s, min_mbps): {e}"
    if isinstance(e, bx.EndpointConnectionError):
        return f"cannot connect: {e}"
    cause: BaseException | None = e
    for _ in range(5):  # a body's send that timed out surfaces as a closed connection, caused by the timeout
        if cause is None:
            break
        if isinstance(cause, (bx.ReadTimeoutError, TimeoutError)):
            return f"a request made no progress within its bound (storage options meta_timeout_s, min_mbps): {e}"
        cause = cause.__cause__ or cause.__context__
    return None


class Reachability:
    """Whether a backend's store answers, shared by all of its requests: the first request that cannot
    reach it (connection refused, no connection or no progress within its bound) logs one warning that
    names the endpoint and what is retried; the other failures of the same outage log at INFO only; the
    first answer after it logs one line saying that the store answers again."""

    def __init__(self, endpoint: str | None) -> None:
        self.endpoint = endpoint or "(the AWS configuration's)"
        self._lock = threading.Lock()
        self._since: float | None = None
        self._retried = 0

    def failed(self, what: str, op: str, why: str, wait_s: float) -> None:
        with self._lock:
            first = self._since is None
            if first:
                self._since, self._retried = time.monotonic(), 0
            self._retried += 1
        if first:
            log.warning("S3 endpoint %s: %s; retrying %s of %s in %.2f s, and every request until the store "
                        "answers or a file's deadline passes (storage option deadline_s); logged once per outage",
                        self.endpoint, why, op, what, wait_s)
        else:
            log.info("S3 endpoint %s still unreachable: %s of %s retried in %.2f s (%s)", self.endpoint, op, what,
                     wait_s, why)

    def answered(self) -> None:
        if self._since is None:  # the common case, without the lock
            return
        with self._lock:
            since, n = self._since, self._retried
            self._since = None
        if since is not None:
            log.warning("S3 endpoint %s answers again after %.1f s (%d request(s) retried meanwhile)", self.endpoint,
                        time.monotonic() - since, n)


_bound = threading.local()  # .until: (monotonic deadline, why) of the requests this thread makes now


@contextlib.contextmanager
def within(seconds: float, why: str) -> Iterator[None]:
    """The ``Retry``s made inside (on this thread) give up after ``seconds`` at the latest (``why``: what
    bounds them, for the error)."""
    before = getattr(_bound, "until", None)
    _bound.until = (time.monotonic() + seconds, f"gave up after {seconds:.0f} s ({why})")
    try:
        yield
    finally:
        _bound.until = before


class Retry:
    """One file's retry budget: attempts per request, a deadline for all of them, and the number of parts
    that may be in flight (halved on throttling and on stalls, grown by one per success). ``reach``: the
    backend's ``Reachability``, told of each failure to reach the store and of each answer."""

    def __init__(self, opts: S3Options, what: str, reach: Reachability | None = None) -> None:
        self.opts, self.what, self.reach = opts, what, reach
        self.deadline = time.monotonic() + opts.deadline_s
        self.why = (f"gave up after {opts.deadline_s:.0f} s (the deadline per file, storage option deadline_s)")
        bound = getattr(_bound, "until", None)
        if bound is not None and bound[0] < self.deadline:
            self.deadline, self.why = bound
        self.allowed = opts.concurrency
        self.throttled = 0
        self._lock = threading.Lock()
        self._rng = random.Random()

    def call(self, op: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` until it succeeds, a fatal error, ``max_attempts`` failures or the deadline (then a
        PersistError). Throttling counts against the deadline only: a throttled store slows the upload
        down (fewer parts at once, waits), it never makes it fail before the deadline."""
        delay = 0.1
        failures = 0
        while True:
            try:
                out = fn()
                if self.reach is not None:
                    self.reach.answered()
                with self._lock:
                    self.allowed = min(self.opts.concurrency, self.allowed + 1)
                return out
            except (FileNotFoundError, FileExistsError):  # answers, not failures
                raise
            except Exception as e:
                kind = _kind(e)
                if kind != "throttle":
                    failures += 1
                if kind == "fatal":
                    raise E.PersistError(f"{self.what}: S3 {op} failed: {type(e).__name__}: {e}") from e
                if failures >= self.opts.max_attempts:
                    raise self._failed(op, e, failures) from e
                why = _unreachable(e)
                with self._lock:
                    if kind == "throttle" or why is not None:  # a stalled link too: fewer parts at once
                        self.throttled += kind == "throttle"
                        self.allowed = max(1, self.allowed // 2)
                count_retry("throttled" if kind == "throttle" else "unreachable" if why is not None else "error")
                wait_s = max(_retry_after(e), self._rng.uniform(0, delay))  # full jitter; Retry-After first
                delay = min(delay * 2, 20.0)
                if time.monotonic() + wait_s > self.deadline:
                    raise self._failed(op, e, failures, deadline=True) from e
                if why is not None and self.reach is not None:
                    self.reach.failed(self.what, op, why, wait_s)
                else:
                    log.info("%s: %s failed (%s: %s); retrying in %.2f s", self.what, op, type(e).__name__,
                             error_code(e) or e, wait_s)
                time.sleep(wait_s)

    def _failed(self, op: str, e: BaseException, attempts: int, *, deadline: bool = False) -> E.PersistError:
        why = self.why if deadline else f"failed {attempts} time(s) (storage option max_attempts)"
        return E.PersistError(f"{self.what}: S3 {op} {why}: {type(e).__name__}: {e}")


# ------------------------------------------------------------------------------------------ bodies
class Body(ViewsReader):
    """A seekable, read-only request body over memoryview pieces (views of the snapshot, no copy): botocore
    reads it to send (``read`` hands out views, which go to the socket as they are) and seeks it back to
    retry."""

    def __init__(self, pieces: Sequence[memoryview]) -> None:
        super().__init__(list(pieces))

    def read(self, n: int | None = -1) -> Any:  # a memoryview: http.client sends it as it is
        if self._pos >= self._size:
            return b""
        want = self._size - self._pos if n is None or n < 0 else n
        view = self._view(max(want, 4 * _MIB) if n and n > 0 else want)  # large sends: fewer system calls
        self._pos += len(view)
        return view


def chunks(parts: Sequence[Any], size: int, crc_slots: dict[int, list[tuple[int, int]]] | None,
            h: Any) -> Iterator[tuple[list[memoryview], int]]:
    """The file ``parts`` make, cut into upload parts of ``size`` bytes (the last shorter): each a list of
    views and its CRC-32. Hashes the whole file into ``h`` and fills the zip CRC-32s of ``crc_slots`` on
    the way: a part ``j`` that holds a slot is read only after the tensor part whose CRC goes there."""
    cur: list[memoryview] = []
    cur_n = 0
    cur_crc = 0
    yielded = False
    for i, p in enumerate(parts):
        v = part_view(p)
        want = crc_slots is not None and i in crc_slots
        zcrc = 0
        off = 0
        while off < len(v):
            k = min(len(v) - off, size - cur_n)
            piece = v[off:off + k]
            for q in range(0, k, _PIECE):  # hashed while in cache
                sub = piece[q:q + _PIECE]
                h.update(sub)
                cur_crc = crc32(sub, cur_crc)
                if want:
                    zcrc = crc32(sub, zcrc)
            cur.append(piece)
            cur_n += k
            off += k
            if cur_n == size:
                yield cur, cur_crc
                yielded = True
                cur, cur_n, cur_crc = [], 0, 0
        if want:
            assert crc_slots is not None
            for j, at in crc_slots[i]:
                parts[j][at:at + 4] = zcrc.to_bytes(4, "little")
    if cur_n or not yielded:  # the rest; an empty file is one empty part
        yield cur, cur_crc


def b64_crc(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()
