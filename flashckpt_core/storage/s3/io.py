"""S3 transfers, apart from the backend's bookkeeping: the retry policy (which errors are throttling,
transient or fatal; backoff with full jitter honouring ``Retry-After``; fewer parallel parts under
throttling; a deadline per file) and zero-copy request bodies cut from a file's parts. boto3/botocore are
imported only inside functions that need them."""

from __future__ import annotations

import base64
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from flashckpt import errors as E
from flashckpt.format.rawio import ViewsReader, part_view

if TYPE_CHECKING:
    from flashckpt.storage.s3.options import S3Options

try:  # ISA-L's CRC-32 (~20 GB/s), zlib's otherwise: the same values
    from isal.isal_zlib import crc32 as crc32
except ImportError:  # pragma: no cover - platforms without isal wheels
    from zlib import crc32 as crc32

__all__ = ["Retry", "Body", "chunks", "b64_crc", "error_code", "status", "crc32"]

log = logging.getLogger("flashckpt.storage.s3.backend")

_MIB = 1 << 20
_PIECE = _MIB  # hashing granularity (cache-sized)


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


class Retry:
    """One file's retry budget: attempts per request, a deadline for all of them, and the number of parts
    that may be in flight (halved on throttling, grown by one per success)."""

    def __init__(self, opts: S3Options, what: str) -> None:
        self.opts, self.what = opts, what
        self.deadline = time.monotonic() + opts.deadline_s
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
                with self._lock:
                    if kind == "throttle":
                        self.throttled += 1
                        self.allowed = max(1, self.allowed // 2)
                wait_s = max(_retry_after(e), self._rng.uniform(0, delay))  # full jitter; Retry-After first
                delay = min(delay * 2, 20.0)
                if time.monotonic() + wait_s > self.deadline:
                    raise self._failed(op, e, failures, deadline=True) from e
                log.info("%s: %s failed (%s: %s); retrying in %.2f s", self.what, op, type(e).__name__,
                         error_code(e) or e, wait_s)
                time.sleep(wait_s)

    def _failed(self, op: str, e: BaseException, attempts: int, *, deadline: bool = False) -> E.PersistError:
        why = (f"gave up after {self.opts.deadline_s:.0f} s (the deadline per file, storage option deadline_s)"
               if deadline else f"failed {attempts} time(s) (storage option max_attempts)")
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
