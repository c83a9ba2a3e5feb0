"""Who may call a ``CheckpointEngine``, and when: ``CallGuard``.

- Only the process that opened an engine uses it. A forked child (a DataLoader worker, a multiprocessing
  'fork' child) inherits a copy that shares the parent's saver connection and shared-memory writer; any
  call it makes is refused (``EngineUseError``), and its close or exit ends nothing of the parent's (the
  engine checks ``owner`` before its goodbye). Nothing is done at fork time: the pid, recorded when the
  engine was opened, decides, so a fork made by any means is covered.
- One call at a time. A call from a second thread waits for the running one to return (a lock), so two
  threads saving on one engine take their snapshots one after the other, never into one slot at once.
  A call that re-enters an engine on the thread already inside one of its calls (a signal handler that
  interrupted it, or a callback) is refused: it would run in the middle of the other call's work. The
  engine's own nested calls (``save`` waiting for an overlapped snapshot, ``load`` reading memory, the
  delete function a deletion strategy is given) are told apart by their caller's code, which lies in the
  engine's own module.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from flashckpt import errors as E

__all__ = ["CallGuard"]


class CallGuard:
    """The calls of one engine: owner process, one at a time, no re-entry from a signal handler.

    Thread safety: ``call`` is made for use by any thread; that is its point.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.RLock()
        self._depth = 0  # calls of this engine on the thread holding the lock (1: one call; more: nested)
        self._op = ""  # the outermost call running

    def owner(self) -> bool:
        """Whether this process opened the engine (False in a forked child)."""
        return os.getpid() == self.pid

    def check_owner(self, op: str) -> None:
        """Refuses a call in a process forked from the engine's (its connection and leases are the parent's)."""
        if not self.owner():
            raise E.EngineUseError(
                f"{op}(): this checkpointer was opened by pid {self.pid}; pid {os.getpid()} was forked from it "
                "(a DataLoader worker, a multiprocessing 'fork' child) and may not use it: its connection to the "
                "saver and its shared-memory snapshots belong to the parent. Checkpoint from the parent, or open "
                "a new checkpointer in the child (a 'spawn' child, or after the fork)")

    @contextmanager
    def call(self, op: str, *, internal: bool, timeout: float | None = None) -> Iterator[bool]:
        """Runs one call of the engine: waits while another thread's call runs (up to ``timeout`` seconds,
        else ``EngineUseError``); refuses a call nested in a running one on this thread unless ``internal``
        (the engine calling itself). Yields whether this is the outermost call."""
        self.check_owner(op)
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise E.EngineUseError(f"{op}(): {self._op or 'a call'}() of this checkpointer is still running in "
                                   f"another thread after {timeout:.0f} s")
        try:
            if self._depth and not internal:
                raise E.EngineUseError(
                    f"{op}() was called while {self._op}() of the same checkpointer is still running on this thread "
                    f"(from a signal handler, or a callback): nothing was done. Calls of one checkpointer cannot "
                    f"nest; in a signal handler, set a flag and call {op}() once {self._op}() has returned")
            outer = not self._depth
            if outer:
                self._op = op
            self._depth += 1
            try:
                yield outer
            finally:
                self._depth -= 1
                if outer:
                    self._op = ""
        finally:
            self._lock.release()
