"""Control messages between trainers and the saver: length-prefixed JSON over a Unix socket.

Nothing crosses a process boundary as pickle. A message is a 4-byte big-endian length and a UTF-8
JSON object; requests carry ``op``, replies carry ``ok`` and either the result or ``error``/``kind``.
Both ends check the other's uid (SO_PEERCRED): the saver serves only peers of its uid, and a client
talks only to a saver of its own uid.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from typing import Any

from . import errors as E

__all__ = ["MAX_MESSAGE", "send_msg", "recv_msg", "Client", "peer_uid"]

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
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket) -> dict[str, Any]:
    """Reads one message. Raises ProtocolError for malformed input, ConnectionError on EOF."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_MESSAGE:
        raise E.ProtocolError(f"announced message length {n} exceeds {MAX_MESSAGE}")
    raw = _recv_exact(sock, n)
    try:
        msg = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise E.ProtocolError(f"control message is not JSON: {e}") from e
    except RecursionError as e:  # e.g. b"[" * 200000: json nests too deep; reject it like other bad JSON
        raise E.ProtocolError("control message is nested too deeply") from e
    if not isinstance(msg, dict):
        raise E.ProtocolError("control message is not a JSON object")
    return msg


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


_ERRORS: dict[str, type[E.FlashCheckpointError]] = {
    cls.__name__: cls for cls in (E.FlashCheckpointError, E.InvalidStateDictError, E.CheckpointDirError,
                                  E.SharedMemoryError, E.SaverError, E.PersistError,
                                  E.CheckpointCorruptError, E.CheckpointTimeoutError, E.ProtocolError)
}


class Client:
    """One connection to a saver. Thread-safe: one request in flight at a time.

    Raises:
        SaverError: (at construction) the process serving ``path`` runs as another uid; nothing was
            sent to it.
    """

    def __init__(self, path: str, *, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
            uid = peer_uid(self._sock)
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
        """Sends one request and returns the reply's fields; raises the saver's error as ours."""
        with self._lock:
            if self._sock is None:
                raise E.SaverError(f"{op}: the connection to the saver at {self.path} is closed")
            self._sock.settimeout(timeout if timeout is not None else self.timeout)
            try:
                send_msg(self._sock, {"op": op, **args})
                reply = recv_msg(self._sock)
            except TimeoutError as e:
                raise E.CheckpointTimeoutError(f"{op}: the saver did not answer within "
                                               f"{timeout or self.timeout:.0f} s") from e
            except (ConnectionError, OSError) as e:
                raise E.SaverError(f"{op}: lost the connection to the saver at {self.path} ({e}); "
                                   "it may have been killed. The next engine started on this node "
                                   "starts a new saver.") from e
        if not reply.get("ok", False):
            cls = _ERRORS.get(str(reply.get("kind")), E.SaverError)
            raise cls(str(reply.get("error", "saver error")))
        return reply

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.close()
                finally:
                    self._sock = None


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` (all its threads) has used so far, from
    ``/proc/<pid>/stat``; None where that cannot be read (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: stat(5) 14, 15
    except (OSError, ValueError, IndexError):
        return None


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
