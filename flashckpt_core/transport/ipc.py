"""Node-local primitives shared by trainers and the saver: a file lock, a queue and a dict.

``SharedLock`` is an ``flock`` on a 0600 file in the job's runtime dir. ``SharedQueue`` and
``SharedDict`` are proxies to named objects kept by the node's saver, reached over its control socket;
their values must be JSON-serializable (nothing crosses a process boundary as pickle).
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import Any

from flashckpt import errors as E
from flashckpt.transport import messages as M
from flashckpt.transport.wire import Client

__all__ = ["SharedLock", "SharedQueue", "SharedDict"]


class SharedLock:
    """An inter-process lock on ``path`` (created 0600; a symbolic link there is refused, never followed).
    Re-entrant use from one thread is not allowed.

    Args:
        path: the lock file.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Takes the lock; returns False when ``blocking`` is False or ``timeout`` passes without it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if (not blocking or deadline) else 0))
                self._fd = fd
                return True
            except BlockingIOError:
                if not blocking or (deadline is not None and time.monotonic() >= deadline):
                    os.close(fd)
                    return False
                time.sleep(delay)
                delay = min(delay * 2, 0.02)

    def release(self) -> None:
        if self._fd is None:
            raise E.FlashCheckpointError(f"SharedLock.release(): {self.path} is not held")
        fd, self._fd = self._fd, None
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def fileno(self) -> int:
        if self._fd is None:
            raise E.FlashCheckpointError(f"SharedLock.fileno(): {self.path} is not held")
        return self._fd

    def locked(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> SharedLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SharedQueue:
    """A FIFO queue named ``name`` held by the saver; any process of the job on this node may use it."""

    def __init__(self, name: str, client: Client) -> None:
        self.name = name
        self._client = client

    def put(self, item: Any) -> None:
        self._client.request(M.QueuePut(name=self.name, item=item))

    def get(self, timeout: float | None = None) -> Any:
        """Removes and returns the oldest item; raises CheckpointTimeoutError after ``timeout`` s."""
        wait = self._client.timeout if timeout is None else timeout
        reply = self._client.request(M.QueueGet(name=self.name, timeout_s=wait), timeout=wait + 10)
        if not reply.found:
            raise E.CheckpointTimeoutError(f"SharedQueue({self.name!r}).get(): empty after {wait} s")
        return reply.item

    def qsize(self) -> int:
        return self._client.request(M.QueueSize(name=self.name)).size

    def empty(self) -> bool:
        return self.qsize() == 0


class SharedDict:
    """A dict named ``name`` held by the saver, with string keys and JSON values."""

    def __init__(self, name: str, client: Client) -> None:
        self.name = name
        self._client = client

    def set(self, key: str, value: Any) -> None:
        self._client.request(M.DictUpdate(name=self.name, items={key: value}))

    def update(self, items: dict[str, Any]) -> None:
        self._client.request(M.DictUpdate(name=self.name, items=items))

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_dict().get(key, default)

    def to_dict(self) -> dict[str, Any]:
        return dict(self._client.request(M.DictGet(name=self.name)).items)

    def __getitem__(self, key: str) -> Any:
        d = self.to_dict()
        if key not in d:
            raise KeyError(key)
        return d[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.set(key, value)
