"""Control messages between trainers and the saver: length-prefixed JSON over a Unix socket.

Nothing crosses a process boundary as pickle. A message is a 4-byte big-endian length and a UTF-8
JSON object; requests carry ``op`` and an ``id``, replies carry the request's ``id``, ``ok`` and either
the result or ``error``/``kind``. Both ends check the other's uid (SO_PEERCRED): the saver serves only
peers of its uid, and a client talks only to a saver of its own uid.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from typing import Any, NoReturn, cast

from flashckpt import errors as E
from flashckpt.transport.messages import RP, Request
from flashckpt.util.procfs import process_stopped

__all__ = ["MAX_MESSAGE", "send_msg", "recv_msg", "Client", "ConnectionLost", "peer_uid"]

MAX_MESSAGE = 64 << 20
_LEN = struct.Struct(">I")


def send_msg(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise E.ProtocolError(f"control message of {len(data)} bytes exceeds the {MAX_MESSAGE}-byte limit")
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise PeerClosed("peer closed the connection")
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket) -> dict[str, Any]:
    """Reads one message. Raises ProtocolError for malformed input, ConnectionError on EOF."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_MESSAGE:
        raise E.ProtocolError(f"announced message length {n} exceeds {MAX_MESSAGE}")
    return _decode(_recv_exact(sock, n))


# Over pipes (the saver and its persist worker): the same frames, on file descriptors.
def write_frame(fd: int, msg: dict[str, Any]) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_exact_fd(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame(fd: int) -> dict[str, Any] | None:
    """One message; None at the end of the pipe (the other end closed it or exited)."""
    head = _read_exact_fd(fd, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE:
        raise E.ProtocolError(f"message of {n} bytes exceeds {MAX_MESSAGE}")
    raw = _read_exact_fd(fd, n)
    if raw is None:
        return None
    msg = json.loads(raw)
    if not isinstance(msg, dict):
        raise E.ProtocolError("a framed message is not a JSON object")
    return msg


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        msg = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise E.ProtocolError(f"control message is not JSON: {e}") from e
    except RecursionError as e:  # e.g. b"[" * 200000: json nests too deep; reject it like other bad JSON
        raise E.ProtocolError("control message is nested too deeply") from e
    if not isinstance(msg, dict):
        raise E.ProtocolError("control message is not a JSON object")
    return msg


def peer_creds(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(pid), int(uid)


def peer_uid(sock: socket.socket) -> int:
    return peer_creds(sock)[1]


_ERRORS: dict[str, type[E.FlashCheckpointError]] = {
    cls.__name__: cls for cls in (E.FlashCheckpointError, E.InvalidStateDictError, E.CheckpointDirError,
                                  E.SharedMemoryError, E.SaverError, E.PersistError,
                                  E.CheckpointCorruptError, E.CheckpointTimeoutError, E.ProtocolError,
                                  E.InvalidArgumentError)
}


class ConnectionLost(E.SaverError):
    """The connection to the saver broke (the saver died or closed it): a new saver can be attached."""


class PeerClosed(E.SaverError, ConnectionError):
    """The other end closed the connection in the middle of a message (``recv_msg``)."""


# While a reply is awaited, the saver's process state is checked this often; a saver found stopped
# (SIGSTOP, a debugger) for _STOPPED_S is reported as not responding instead of being waited for.
_POLL_S = 0.25
_STOPPED_S = 1.0


class Client:
    """One connection to a saver. Thread-safe: one request in flight at a time.

    Every request carries an ``id`` (increasing per connection) that the saver echoes in its reply. A
    reply whose id is not the one awaited answers a request given up earlier (a call that timed out, a
    ``send`` cancelled) and is discarded, so a late reply is never taken for the answer to a later
    call. Bytes of a reply cut short by a timeout are kept, so the framing stays intact.

    Raises:
        SaverError: (at construction) the process serving ``path`` runs as another uid; nothing was
            sent to it.
    """

    def __init__(self, path: str, *, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self._lock = threading.Lock()
        self._next_id = 0
        self._buf = bytearray()
        self._sent: set[int] = set()  # ids of ``send`` requests whose replies ``poll`` may collect
        self._arrived: dict[int, dict[str, Any]] = {}
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
            self.peer_pid, uid = peer_creds(self._sock)
        except BaseException:
            self._sock.close()
            raise
        if uid != os.getuid():
            self._sock.close()
            self._sock = None
            raise E.SaverError(f"the socket {path} is served by uid {uid}, not by this user (uid {os.getuid()}): "
                               "another user owns that socket, so nothing was sent to it. Remove it (ask that "
                               "user or an administrator) or set FLASHCKPT_RUNTIME_DIR to a directory of your own.")

    def call(self, op: str, *, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        """Sends one request in its raw wire form (``op`` and fields) and returns the reply's fields; raises
        the saver's error as ours. The library sends typed requests (``request``); this is for tools and
        for tests of the protocol itself (malformed requests).

        Raises:
            CheckpointTimeoutError: no reply within ``timeout`` (default: the client's), or the saver
                process is stopped (the request is then given up; its late reply is discarded).
            ConnectionLost: the connection broke (the saver died).
        """
        limit = timeout if timeout is not None else self.timeout
        with self._lock:
            rid = self._send(op, args, limit)
            deadline = time.monotonic() + limit
            stopped_since: float | None = None
            while True:
                reply = self._take(rid)
                if reply is not None:
                    break
                now = time.monotonic()
                if now >= deadline:
                    raise E.CheckpointTimeoutError(f"{op}: the saver (pid {self.peer_pid}) did not answer "
                                                   f"within {limit:.0f} s")
                if process_stopped(self.peer_pid):
                    stopped_since = now if stopped_since is None else stopped_since
                    if now - stopped_since >= _STOPPED_S:
                        raise E.CheckpointTimeoutError(
                            f"{op}: the saver (pid {self.peer_pid}) is not responding: it is stopped (SIGSTOP or "
                            f"a debugger). Resume it (kill -CONT {self.peer_pid}), or kill it and the next "
                            "call starts a new saver; snapshots in shared memory are unaffected.")
                else:
                    stopped_since = None
                self._fill(op, min(deadline - now, _POLL_S))
        return _result(reply)

    def request(self, req: Request[RP], *, timeout: float | None = None) -> RP:
        """Sends the typed request ``req`` and returns its typed reply (``req.REPLY``; see ``call``)."""
        return cast(RP, type(req).REPLY.from_wire(self.call(req.OP, timeout=timeout, **_fields(req))))

    def submit(self, req: Request[Any]) -> int:
        """Sends the typed request ``req`` without waiting (see ``send``); returns its id for ``poll``,
        whose reply fields ``req.REPLY.from_wire`` reads."""
        return self.send(req.OP, **_fields(req))

    def send(self, op: str, **args: Any) -> int:
        """Sends a request without waiting for its reply; returns its id for ``poll`` or ``cancel``.

        Raises:
            ConnectionLost: the connection broke (the saver died).
        """
        with self._lock:
            rid = self._send(op, args, self.timeout)
            self._sent.add(rid)
            return rid

    def poll(self, rid: int) -> dict[str, Any] | None:
        """The reply to ``send`` request ``rid`` when it has arrived, else None; never blocks.

        Raises:
            ConnectionLost: the connection broke (the saver died).
            the saver's error, as ``call`` does.
        """
        if not self._lock.acquire(blocking=False):
            return None  # another thread is in a call; its reply loop stashes ours
        try:
            if rid not in self._arrived:
                self._fill("poll", 0.0)
                self._take(None)
            reply = self._arrived.pop(rid, None)
            if reply is not None:
                self._sent.discard(rid)
        finally:
            self._lock.release()
        return None if reply is None else _result(reply)

    def cancel(self, rid: int) -> None:
        """Gives up ``send`` request ``rid``: its reply is discarded, now or when it arrives."""
        with self._lock:
            self._sent.discard(rid)
            self._arrived.pop(rid, None)

    def _send(self, op: str, args: dict[str, Any], timeout: float) -> int:
        """Sends one request (holding ``_lock``); returns its id."""
        if self._sock is None:
            raise E.SaverError(f"{op}: the connection to the saver at {self.path} is closed")
        self._next_id += 1
        self._sock.settimeout(timeout)
        try:
            send_msg(self._sock, {"op": op, **args, "id": self._next_id})
        except (OSError, ConnectionError) as e:  # TimeoutError too: a half-sent request breaks the framing
            self._lost(op, e)
        return self._next_id

    def _take(self, rid: int | None) -> dict[str, Any] | None:
        """Takes complete messages from the buffer until one answers request ``rid`` (or carries no id:
        the saver could not read the request it answers) and returns it; None when the buffer holds
        none. On the way, replies ``poll`` awaits are stashed and late replies are dropped."""
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > MAX_MESSAGE:
                raise E.ProtocolError(f"announced message length {n} exceeds {MAX_MESSAGE}")
            if len(self._buf) < _LEN.size + n:
                return None
            msg = _decode(bytes(self._buf[_LEN.size:_LEN.size + n]))
            del self._buf[:_LEN.size + n]
            got = msg.get("id")
            if got == rid or (got is None and rid is not None):
                return msg
            if got in self._sent:
                self._arrived[got] = msg
        return None

    def _fill(self, op: str, timeout: float) -> None:
        """Reads what the saver sent within ``timeout`` s (0: only what has arrived) into the buffer."""
        assert self._sock is not None  # _send checked it; internal invariant
        try:
            self._sock.settimeout(max(timeout, 0.0))  # 0: non-blocking (MSG_DONTWAIT alone still waits)
            chunk = self._sock.recv(1 << 20)
        except (BlockingIOError, TimeoutError):
            return
        except OSError as e:
            self._lost(op, e)
        if not chunk:
            self._lost(op, ConnectionError("peer closed the connection"))
        self._buf += chunk

    def _lost(self, op: str, e: BaseException) -> NoReturn:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        raise ConnectionLost(f"{op}: lost the connection to the saver (pid {self.peer_pid}) at {self.path} ({e}); "
                             "it may have been killed.") from e

    @property
    def lost(self) -> bool:
        """Whether the connection broke (or was closed)."""
        return self._sock is None

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.close()
                finally:
                    self._sock = None


def _fields(req: Request[Any]) -> dict[str, Any]:
    wire = req.to_wire()
    del wire["op"]
    return wire


def _result(reply: dict[str, Any]) -> dict[str, Any]:
    if not reply.get("ok", False):
        cls = _ERRORS.get(str(reply.get("kind")), E.SaverError)
        raise cls(str(reply.get("error", "saver error")))
    return reply
