"""A fault-injecting HTTP/1.1 proxy between an S3 client and an S3-compatible server, for tests.

``FaultProxy(upstream)`` listens on 127.0.0.1 (a free port, ``endpoint``) and forwards every request to
``upstream`` (``http://host:port``) on one upstream connection per client connection, so that keep-alive
on one side is keep-alive on the other; each client connection has a thread of its own. It reads request
bodies framed by ``Content-Length`` or ``Transfer-Encoding: chunked`` (forwarded chunked; trailers are
dropped) and answers ``Expect: 100-continue`` itself: ``100 Continue`` at once when it will read the body,
or the final answer instead when a fault answers without it (then it closes the connection, lingering to
drop a body the client sends anyway, so that its answer is not lost to a reset). Responses framed by a
length, chunked or by the end of the connection go back with a length or chunked. Requests are classified
by S3 operation (``classify``: path-style URLs, ``/bucket/key?query``, the addressing the fixtures set).

Faults are rules (``Fault``) matched against each request's operation, key (substring) and range; the
first rule that matches fires, for its next ``times`` matching requests (None: every one), each with its
``probability`` drawn from the proxy's seeded RNG:

- ``slowdown``: 503 with the S3 ``SlowDown`` XML body and ``Retry-After: retry_after_s`` (and
  ``x-amz-retry-after`` in ms, which botocore honours, when ``amz_retry_after_ms`` is given); not forwarded;
- ``error500``: 500 ``InternalError`` XML; not forwarded;
- ``reset_request``: reads ``after_bytes`` of the request body (default: half; none when it has none),
  then resets the connection (SO_LINGER 0: RST); not forwarded;
- ``reset_response``: forwarded; sends the response head and ``after_bytes`` of its body (default: half),
  then resets; a response without a body is cut in the middle of its head;
- ``slow_body``: forwarded; the response body (``direction="response"``) or the request body sent upstream
  (``"request"``) trickles at ``rate`` bytes/s;
- ``lost_reply``: forwarded and answered upstream (it takes effect), then the client connection is closed
  without a reply (FIN, or RST with ``reset=True``);
- ``error_in_200``: forwarded (it takes effect), but the client gets ``200 OK`` with an S3
  ``<Error><Code>InternalError</Code>`` body instead, as S3 may answer CompleteMultipartUpload;
- ``stall``: no answer, for ``stall_s`` seconds (None: until ``release()``); then forwarded and answered,
  late (a client that gave up at its read timeout has retried on another connection meanwhile). A
  proxy that closes drops the stalled requests' connections without an answer.

``FaultProxy`` API: ``set_faults(faults, seed=None)`` (replaces the rules), ``pending()`` (rules that may
still fire), ``stalled()`` (requests held by ``stall`` now), ``release()`` (lets them go on),
``records(op=None)``, ``counts()`` (a Counter by operation), ``clear()`` (the records),
``connections()`` (client connections open now), ``close()`` (also a context manager). Every request is
recorded (``Record``: operation, method, path, query, bucket, key, ranged, fault, status sent, upstream
status, request body bytes read) before the client can see its answer or the lack of one, so a test may
assert on the records as soon as its client call returns. ``close()`` ends the listener and every
connection thread (they also end on their own when their client disconnects): a test's proxy leaves no
thread behind.
"""

from __future__ import annotations

import io
import logging
import random
import socket
import socketserver
import struct
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, replace
from http.client import HTTPConnection, HTTPException, HTTPResponse
from http.server import BaseHTTPRequestHandler
from typing import Literal, NoReturn, get_args

__all__ = ["FAULT_KINDS", "OPERATIONS", "Fault", "FaultKind", "FaultProxy", "Record", "classify"]

logger = logging.getLogger(__name__)

FaultKind = Literal["slowdown", "error500", "reset_request", "reset_response", "slow_body", "lost_reply",
                    "error_in_200", "stall"]
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)

# What a request is, from its method, whether it names a key, and the query parameter that marks it: the
# first row that matches wins (UploadPart before PutObject). Copies are told apart by their header.
_OPERATION_TABLE: tuple[tuple[str, bool, str | None, str], ...] = (
    ("PUT", True, "uploadId", "UploadPart"),
    ("PUT", True, None, "PutObject"),
    ("POST", True, "uploads", "CreateMultipartUpload"),
    ("POST", True, "uploadId", "CompleteMultipartUpload"),
    ("DELETE", True, "uploadId", "AbortMultipartUpload"),
    ("DELETE", True, None, "DeleteObject"),
    ("GET", True, "uploadId", "ListParts"),
    ("GET", True, None, "GetObject"),
    ("HEAD", True, None, "HeadObject"),
    ("POST", False, "delete", "DeleteObjects"),
    ("GET", False, "uploads", "ListMultipartUploads"),
    ("GET", False, "list-type", "ListObjectsV2"),
    ("GET", False, None, "ListObjects"),
    ("HEAD", False, None, "HeadBucket"),
    ("PUT", False, None, "CreateBucket"),
    ("DELETE", False, None, "DeleteBucket"),
)
# Sub-resources that are neither an object's data nor a bucket's listing (a PUT ?tagging is no PutObject,
# a GET ?versioning no ListObjects).
_SUBRESOURCES = frozenset({"acl", "tagging", "retention", "legal-hold", "attributes", "restore", "torrent",
                           "select", "location", "versioning", "versions", "policy", "cors", "lifecycle",
                           "website", "logging", "notification", "replication", "encryption", "object-lock",
                           "ownershipControls", "publicAccessBlock", "accelerate", "requestPayment"})
OPERATIONS: tuple[str, ...] = tuple(dict.fromkeys(
    [row[3] for row in _OPERATION_TABLE] + ["CopyObject", "UploadPartCopy", "Other"]))

# Headers that belong to one connection, not to the message (RFC 9110 7.6.1), plus Expect, which the
# proxy answers itself.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                         "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade", "expect"})
_PIECE = 1 << 20  # bytes read and sent at a time
_PACE_TICK_S = 0.05  # a trickled body goes out in pieces of rate * tick bytes
_UPSTREAM_TIMEOUT_S = 120.0
_LINGER_S = 5.0  # how long a lingering close waits for the client to stop sending
_JOIN_TIMEOUT_S = 30.0


def classify(method: str, path: str, query: str, headers: dict[str, str] | None = None) -> tuple[str, str, str]:
    """The S3 operation of a path-style request, with its bucket and (URL-decoded) key.

    Args:
        method: the HTTP method.
        path: the request path, ``/bucket/key`` (percent-encoded).
        query: the query string, without ``?``.
        headers: the request headers (lower-case names), to tell copies apart.

    Returns:
        ``(operation, bucket, key)``; the operation is one of ``OPERATIONS`` (``Other`` when unknown).
    """
    bucket, _, key = urllib.parse.unquote(path.lstrip("/")).partition("/")
    params = urllib.parse.parse_qs(query, keep_blank_values=True)
    headers = headers or {}
    if not bucket or _SUBRESOURCES & set(params):
        return "Other", bucket, key
    for method_, on_key, marker, op in _OPERATION_TABLE:
        if method_ == method and on_key == bool(key) and (marker is None or marker in params):
            if "x-amz-copy-source" in headers and op in ("PutObject", "UploadPart"):
                op = "CopyObject" if op == "PutObject" else "UploadPartCopy"
            return op, bucket, key
    return "Other", bucket, key


@dataclass(frozen=True)
class Fault:
    """One fault rule (see the module docstring for what each kind does).

    Args:
        kind: the fault.
        op: the operation(s) it applies to (``OPERATIONS``); None: any.
        key: applies only to requests whose object key contains this substring.
        ranged: GetObject with a Range header (True) or without (False) only; None: either.
        times: fires for the next ``times`` matching requests; None: for every one.
        probability: the chance that a matching request gets it (the proxy's seeded RNG decides).
        retry_after_s: ``slowdown``: the ``Retry-After`` header, in seconds.
        amz_retry_after_ms: ``slowdown``: an ``x-amz-retry-after`` header (ms) as well, when given.
        after_bytes: ``reset_request``/``reset_response``: body bytes passed before the reset (default half).
        rate: ``slow_body``: bytes per second.
        direction: ``slow_body``: trickle the ``response`` body to the client or the ``request`` body upstream.
        reset: ``lost_reply``: reset the connection (RST) instead of closing it (FIN).
        stall_s: ``stall``: how long a request goes unanswered (None: until ``FaultProxy.release``).
    """

    kind: FaultKind
    op: str | tuple[str, ...] | None = None
    key: str | None = None
    ranged: bool | None = None
    times: int | None = 1
    probability: float = 1.0
    retry_after_s: int = 1
    amz_retry_after_ms: int | None = None
    after_bytes: int | None = None
    rate: float = 256 * 1024
    direction: Literal["response", "request"] = "response"
    reset: bool = False
    stall_s: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"Fault(kind={self.kind!r}): not one of {', '.join(FAULT_KINDS)}")
        unknown = [op for op in self.ops if op not in OPERATIONS]
        if unknown:
            raise ValueError(f"Fault(op={self.op!r}): unknown operation(s) {unknown}; use {', '.join(OPERATIONS)}")
        if self.times is not None and self.times < 1:
            raise ValueError(f"Fault(times={self.times}): give 1 or more, or None for every matching request")
        if not 0.0 < self.probability <= 1.0:
            raise ValueError(f"Fault(probability={self.probability}): must be in (0, 1]")
        if self.rate <= 0 or (self.after_bytes is not None and self.after_bytes < 0):
            raise ValueError(f"Fault(rate={self.rate}, after_bytes={self.after_bytes}): must be positive")
        if self.direction not in ("response", "request"):
            raise ValueError(f"Fault(direction={self.direction!r}): 'response' or 'request'")

    @property
    def ops(self) -> tuple[str, ...]:
        """The operations this rule names (empty: any)."""
        if self.op is None:
            return ()
        return (self.op,) if isinstance(self.op, str) else tuple(self.op)

    def matches(self, op: str, key: str, ranged: bool) -> bool:
        """Whether a request of ``op`` on ``key`` (``ranged``: a Range header) is one this rule targets."""
        return ((not self.ops or op in self.ops) and (self.key is None or self.key in key)
                and (self.ranged is None or self.ranged == ranged))


@dataclass(frozen=True)
class Record:
    """One request as the proxy saw and answered it.

    ``status`` is the status the proxy answered the client with (None: none; a ``reset_response`` record
    has the one whose answer it cut); ``upstream_status`` what the server answered (None: not forwarded);
    ``fault`` the fault applied (None: a plain forward); ``ranged`` whether it had a Range header;
    ``request_bytes`` the body bytes read from the client.
    """

    op: str
    method: str
    path: str
    query: str
    bucket: str
    key: str
    ranged: bool
    fault: str | None
    status: int | None
    upstream_status: int | None
    request_bytes: int


@dataclass
class _Rule:
    """A fault rule and how many more times it fires (None: unlimited)."""

    fault: Fault
    left: int | None


class _Abort(Exception):
    """Ends the client connection without an answer: RST (``reset``) or FIN."""

    def __init__(self, reset: bool) -> None:
        super().__init__("reset" if reset else "close")
        self.reset = reset


class _Pacer:
    """Sends data through ``send`` at ``rate`` bytes/s (None: at once), in pieces of ``rate * tick``."""

    def __init__(self, send: Callable[[bytes], object], rate: float | None) -> None:
        self._send = send
        self._rate = rate
        self._start = time.monotonic()
        self._sent = 0

    def __call__(self, data: bytes) -> None:
        if self._rate is None:
            self._send(data)
            return
        step = max(1, int(self._rate * _PACE_TICK_S))
        for i in range(0, len(data), step):
            due = self._start + self._sent / self._rate
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)  # the trickle itself, not a synchronization
            piece = data[i:i + step]
            self._send(piece)
            self._sent += len(piece)


class _Body:
    """The request body as it arrives from the client, framed by a length or chunked; read once."""

    def __init__(self, rfile: io.BufferedIOBase, length: int | None, chunked: bool) -> None:
        self._rfile = rfile
        self.length = length
        self.chunked = chunked
        self.consumed = 0
        self.done = not chunked and not length

    def pieces(self, limit: int | None = None) -> Iterator[bytes]:
        """Yields the body's bytes (up to ``limit`` in all), at most ``_PIECE`` at a time."""
        read, readline = self._rfile.read, self._rfile.readline
        while not self.done and (limit is None or self.consumed < limit):
            if self.chunked:
                size = int(readline(65537).split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:  # the last chunk; then trailers up to an empty line
                    while readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    self.done = True
                    return
                left = yield from self._exactly(read, size, limit)
                if left:  # stopped at the limit, inside the chunk
                    return
                readline(65537)  # the CRLF after the chunk's data
            else:
                assert self.length is not None
                yield from self._exactly(read, self.length - self.consumed, limit)
                self.done = self.consumed >= self.length

    def _exactly(self, read: Callable[[int], bytes], n: int, limit: int | None) -> Generator[bytes, None, int]:
        """Yields the next ``n`` bytes (fewer at ``limit``); returns how many of the ``n`` are left."""
        while n > 0:
            want = min(n, _PIECE) if limit is None else min(n, _PIECE, limit - self.consumed)
            if want <= 0:
                break
            data = read(want)
            if not data:
                raise ConnectionError("the client closed the connection in the middle of the request body")
            n -= len(data)
            self.consumed += len(data)
            yield data
        return n

    def drain(self, limit: int | None = None) -> None:
        """Reads and drops the body (up to ``limit`` bytes in all)."""
        for _ in self.pieces(limit):
            pass


def _s3_error(code: str, message: str, resource: str) -> bytes:
    request_id = uuid.uuid4().hex[:16].upper()
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            f"<Resource>{resource}</Resource><RequestId>{request_id}</RequestId>"
            f"<HostId>fault-proxy</HostId></Error>").encode()


_ERROR_ANSWERS: dict[str, tuple[int, str, str, str]] = {
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "error500": (500, "Internal Server Error", "InternalError",
                 "We encountered an internal error. Please try again."),
}


class _Handler(BaseHTTPRequestHandler):
    """One client connection: its requests in turn (keep-alive), each forwarded or faulted.

    The record of a request is appended before the first byte of its answer is written (or before the
    connection is dropped), so that a client that got its answer finds the record there."""

    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._upstream: HTTPConnection | None = None
        self._linger = False

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            if self._upstream is not None:
                self._upstream.close()

    def handle(self) -> None:
        try:
            super().handle()
            if self._linger:
                self._lingering_close()
        except _Abort as abort:
            if abort.reset:  # RST at close: SO_LINGER on, zero timeout
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.rfile.close()  # the files hold references: the socket closes with the last one
            self.wfile.close()
            self.connection.close()
        except OSError as e:  # the client went away (or close() shut its socket)
            logger.debug("s3 proxy: connection ended: %r", e)

    def _lingering_close(self) -> None:
        """After an answer that left a request body unread: FIN first, then read and drop what the client
        may still send (a client that gave up waiting for 100 Continue), so that closing with unread data
        sends no RST that could destroy the answer on its way."""
        self.connection.shutdown(socket.SHUT_WR)
        self.connection.settimeout(_LINGER_S)
        try:
            while self.connection.recv(_PIECE):
                pass
        except TimeoutError:
            pass

    def handle_expect_100(self) -> bool:
        return True  # answered by _continue() when the body is wanted, or by the final answer instead

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("s3 proxy: " + format, *args)

    def _proxy(self) -> None:
        path, _, query = self.path.partition("?")
        headers = {k.lower(): v for k, v in self.headers.items()}
        op, bucket, key = classify(self.command, path, query, headers)
        ranged = "range" in headers
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self._body = _Body(self.rfile, None if chunked else int(headers.get("content-length") or "0"), chunked)
        self._expects_continue = headers.get("expect", "").lower() == "100-continue"
        fault = self.server.proxy._pick(op, key, ranged)
        self._pending: Record | None = Record(op, self.command, path, query, bucket, key, ranged,
                                              fault.kind if fault else None, None, None, 0)
        try:
            if fault is None:
                self._forward(None)
            else:
                self._FAULTS[fault.kind](self, fault)
        finally:
            self._record(None, None)  # when an error cut the request short

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _proxy

    # ------------------------------------------------------------------ pieces of an answer
    def _record(self, status: int | None, upstream_status: int | None) -> None:
        """Appends the request's record (once) with what the client and the server answered."""
        if self._pending is not None:
            self.server.proxy._append(replace(self._pending, status=status, upstream_status=upstream_status,
                                              request_bytes=self._body.consumed))
            self._pending = None

    def _continue(self) -> None:
        if self._expects_continue:
            self._expects_continue = False
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _head(self, status: int, reason: str, headers: Sequence[tuple[str, str]]) -> bytes:
        if self.close_connection:
            headers = [*headers, ("Connection", "close")]
        lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _reply(self, status: int, reason: str, body: bytes, *, upstream_status: int | None,
               extra: Sequence[tuple[str, str]] = ()) -> None:
        headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(body))), *extra]
        self._record(status, upstream_status)
        self.wfile.write(self._head(status, reason, headers) + body)

    # ------------------------------------------------------------------ faults answered here
    def _answer_error(self, fault: Fault) -> None:
        """``slowdown``/``error500``: answers at once, without forwarding."""
        if self._expects_continue:  # the final answer instead of 100 Continue: the client keeps its body
            self.close_connection = self._linger = True
        else:
            self._body.drain()
        status, reason, code, message = _ERROR_ANSWERS[fault.kind]
        extra = [("Retry-After", str(fault.retry_after_s))] if fault.kind == "slowdown" else []
        if fault.kind == "slowdown" and fault.amz_retry_after_ms is not None:
            extra.append(("x-amz-retry-after", str(fault.amz_retry_after_ms)))
        self._reply(status, reason, _s3_error(code, message, self.path), upstream_status=None, extra=extra)

    def _reset_request(self, fault: Fault) -> NoReturn:
        """Reads part of the request body, then resets the connection."""
        self._continue()
        total = self._body.length if self._body.length is not None else 2 * _PIECE
        self._body.drain(fault.after_bytes if fault.after_bytes is not None else total // 2)
        self._record(None, None)
        raise _Abort(reset=True)

    def _stall(self, fault: Fault) -> None:
        """``stall``: no answer until released (or ``stall_s``), then forwarded; dropped if the proxy closes."""
        if not self.server.proxy._hold(fault.stall_s):
            self._record(None, None)
            raise _Abort(reset=False)
        self._forward(None)

    # ------------------------------------------------------------------ forwarding
    def _send_upstream(self, fault: Fault | None) -> HTTPResponse:
        if self._upstream is None:
            self._upstream = HTTPConnection(*self.server.proxy.upstream, timeout=_UPSTREAM_TIMEOUT_S)
        conn = self._upstream
        conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for name, value in self.headers.items():  # Host too: the client signed it
            if name.lower() not in _HOP_BY_HOP:
                conn.putheader(name, value)
        if self._body.chunked:
            conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        self._continue()
        slow = fault is not None and fault.kind == "slow_body" and fault.direction == "request"
        send = _Pacer(conn.send, fault.rate if slow and fault is not None else None)
        for piece in self._body.pieces():
            send(b"%x\r\n%s\r\n" % (len(piece), piece) if self._body.chunked else piece)
        if self._body.chunked:
            conn.send(b"0\r\n\r\n")
        return conn.getresponse()

    def _forward(self, fault: Fault | None) -> None:
        """Forwards the request; the answer goes back as ``fault`` says (None: as it came)."""
        try:
            resp = self._send_upstream(fault)
        except (OSError, HTTPException) as e:
            if not self._body.done:
                raise  # the client's side failed
            logger.warning("s3 proxy: the upstream server failed: %r", e)
            if self._upstream is not None:
                self._upstream.close()
            self.close_connection = True
            self._reply(502, "Bad Gateway", _s3_error("BadGateway", f"upstream: {e!r}", self.path),
                        upstream_status=None)
            return
        if fault is not None and fault.kind == "lost_reply":
            resp.read()
            self._record(None, resp.status)
            raise _Abort(reset=fault.reset)
        if fault is not None and fault.kind == "error_in_200":
            resp.read()
            self._reply(200, "OK", _s3_error("InternalError", "We encountered an internal error. Please try again.",
                                             self.path), upstream_status=resp.status)
            return
        self._relay(resp, fault)

    def _relay(self, resp: HTTPResponse, fault: Fault | None) -> None:
        """Sends the upstream response to the client (cut by ``reset_response``, paced by ``slow_body``)."""
        no_body = self.command == "HEAD" or resp.status in (204, 304) or resp.status < 200
        headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
        whole: bytes | None = None
        if not no_body and not resp.chunked and resp.length is None:  # close-delimited: send it with a length
            whole = resp.read()
            headers.append(("Content-Length", str(len(whole))))
        chunked = not no_body and bool(resp.chunked)
        if chunked:
            headers.append(("Transfer-Encoding", "chunked"))
        head = self._head(resp.status, resp.reason, headers)
        self._record(resp.status, resp.status)
        if fault is not None and fault.kind == "reset_response":
            self._cut(resp, head, whole, fault, no_body)
        slow = fault is not None and fault.kind == "slow_body" and fault.direction == "response"
        send = _Pacer(self.wfile.write, fault.rate if slow and fault is not None else None)
        self.wfile.write(head)
        if no_body:
            return
        for piece in [whole] if whole is not None else iter(lambda: resp.read(_PIECE), b""):
            send(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _cut(self, resp: HTTPResponse, head: bytes, whole: bytes | None, fault: Fault, no_body: bool) -> NoReturn:
        """``reset_response``: the head and part of the body (half of the head when there is no body)."""
        length = len(whole) if whole is not None else resp.length
        if no_body or length == 0:
            self.wfile.write(head[:len(head) // 2])
        else:
            want = fault.after_bytes if fault.after_bytes is not None else (length or 2 * _PIECE) // 2
            body = whole[:want] if whole is not None else resp.read(want)
            self.wfile.write(head + (b"%x\r\n%s" % (len(body), body) if resp.chunked else body))
        if self._upstream is not None:  # the rest of the upstream response is left unread
            self._upstream.close()
        raise _Abort(reset=True)

    # The faults answered without forwarding; the others change how a forwarded request is answered.
    _FAULTS: dict[str, Callable[[_Handler, Fault], None]] = {
        "slowdown": _answer_error,
        "error500": _answer_error,
        "reset_request": _reset_request,
        **dict.fromkeys(("reset_response", "slow_body", "lost_reply", "error_in_200"), _forward),
        "stall": _stall,
    }


class _ProxyServer(socketserver.TCPServer):
    """The listener: a thread per client connection, named, kept for ``FaultProxy.close`` to join."""

    allow_reuse_address = True

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        super().__init__(("127.0.0.1", 0), _Handler)

    def process_request(self, request: socket.socket, client_address: tuple[str, int]) -> None:  # type: ignore[override]
        self.proxy._serve(request, client_address)

    def handle_error(self, request: object, client_address: object) -> None:
        logger.warning("s3 proxy: the connection from %s failed", client_address, exc_info=True)


class FaultProxy:
    """The proxy (see the module docstring). Thread-safe; use as a context manager or call ``close``.

    Args:
        upstream: the server to forward to, ``http://host:port``.
        seed: the seed of the RNG that decides probabilistic faults.
    """

    def __init__(self, upstream: str, *, seed: int = 0) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"FaultProxy(upstream={upstream!r}): give http://host:port")
        self.upstream: tuple[str, int] = (parsed.hostname, parsed.port)
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._rules: list[_Rule] = []
        self._records: list[Record] = []
        self._conns: dict[threading.Thread, socket.socket] = {}
        self._closed = False
        self._held = threading.Condition(self._lock)  # stalled requests wait on it
        self._stalled = 0
        self._releases = 0
        self._server = _ProxyServer(self)
        self.port: int = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._accept = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"s3-proxy-{self.port}", daemon=True)
        self._accept.start()

    # ------------------------------------------------------------------ faults
    def set_faults(self, faults: Sequence[Fault], *, seed: int | None = None) -> None:
        """Replaces the fault rules (first match wins); ``seed`` reseeds the RNG of probabilistic rules."""
        with self._lock:
            self._rules = [_Rule(f, f.times) for f in faults]
            if seed is not None:
                self._rng.seed(seed)

    def pending(self) -> list[tuple[Fault, int | None]]:
        """The rules that may still fire, with how many times (None: unlimited)."""
        with self._lock:
            return [(r.fault, r.left) for r in self._rules if r.left != 0]

    def stalled(self) -> int:
        """How many requests ``stall`` holds now."""
        with self._lock:
            return self._stalled

    def release(self) -> None:
        """Lets every request held by ``stall`` now go on (later ones are held again while the rule fires)."""
        with self._held:
            self._releases += 1
            self._held.notify_all()

    def _hold(self, stall_s: float | None) -> bool:
        """A stalled request's wait: True once released (or after ``stall_s``), False when the proxy closes."""
        with self._held:
            seen = self._releases
            self._stalled += 1
            try:
                self._held.wait_for(lambda: self._releases != seen or self._closed, timeout=stall_s)
                return not self._closed
            finally:
                self._stalled -= 1

    def _pick(self, op: str, key: str, ranged: bool) -> Fault | None:
        with self._lock:
            for rule in self._rules:
                if rule.left == 0 or not rule.fault.matches(op, key, ranged):
                    continue
                if rule.fault.probability < 1.0 and self._rng.random() >= rule.fault.probability:
                    continue
                if rule.left is not None:
                    rule.left -= 1
                return rule.fault
        return None

    # ------------------------------------------------------------------ records
    def _append(self, record: Record) -> None:
        with self._lock:
            self._records.append(record)

    def records(self, op: str | None = None) -> list[Record]:
        """Every request seen since the last ``clear`` (only those of ``op`` when given), in order."""
        with self._lock:
            return [r for r in self._records if op is None or r.op == op]

    def counts(self) -> Counter[str]:
        """How many requests of each operation the proxy saw since the last ``clear``."""
        with self._lock:
            return Counter(r.op for r in self._records)

    def clear(self) -> None:
        """Forgets the records (the fault rules stay: ``set_faults([])`` removes them)."""
        with self._lock:
            self._records.clear()

    # ------------------------------------------------------------------ connections
    def _serve(self, request: socket.socket, client_address: tuple[str, int]) -> None:
        thread = threading.Thread(target=self._serve_one, args=(request, client_address),
                                  name=f"s3-proxy-{self.port}-conn-{client_address[1]}", daemon=True)
        with self._lock:
            if self._closed:
                request.close()
                return
            self._conns[thread] = request
        thread.start()

    def _serve_one(self, request: socket.socket, client_address: tuple[str, int]) -> None:
        try:
            self._server.finish_request(request, client_address)
        except Exception:
            self._server.handle_error(request, client_address)
        finally:
            self._server.shutdown_request(request)
            with self._lock:
                self._conns.pop(threading.current_thread(), None)

    def connections(self) -> int:
        """Client connections open now."""
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        """Stops accepting, ends every open connection and waits for their threads (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._held.notify_all()
        self._server.shutdown()
        self._accept.join(_JOIN_TIMEOUT_S)
        self._server.server_close()
        with self._lock:
            conns = dict(self._conns)
        for sock in conns.values():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in conns:
            thread.join(_JOIN_TIMEOUT_S)
        stuck = [t.name for t in conns if t.is_alive()]
        if stuck:
            raise RuntimeError(f"FaultProxy.close: connection threads did not end: {stuck}")

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
