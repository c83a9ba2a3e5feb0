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
  engine's own module (``engine_call`` decorates its methods).
- At exit, engines still open say goodbye (``close_at_exit``), bounded, from the process that opened them.

Imports only ``errors`` and ``transport.link`` (whether a restart is coming); the engine is seen through
the ``Guarded`` protocol.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar, cast

from flashckpt import errors as E
from flashckpt.transport.link import restart_expected

__all__ = ["CallGuard", "Guarded", "engine_call", "open_engines"]

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])
_EXIT_WAIT_S = 10.0  # at exit, how long a close waits for a call still running in another (daemon) thread
_HERE = (lambda: None).__code__.co_filename  # this module's file, as its frames name it (close_at_exit's calls)


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


class Guarded(Protocol):
    """What ``engine_call`` and ``close_at_exit`` use of an engine."""

    _guard: CallGuard
    _closed: bool

    def _ensure_runtime(self, op: str) -> None: ...

    def _close(self, intent: str) -> None: ...


def engine_call(op: str, *, renew: bool = True, forked_detaches: bool = False) -> Callable[[_F], _F]:
    """Runs an engine method as one call under the engine's ``CallGuard`` (``_guard``: the opening process
    only, one call at a time, no re-entry from a signal handler). A nested call made from the decorated
    method's own module (the engine calling itself), or from this one (``close_at_exit``), is the running
    call's own. The outermost call first
    makes sure the job's runtime dir still holds the engine's shared memory (``renew``: ``_ensure_runtime``).
    ``forked_detaches``: in a forked child the call only marks the child's copy closed (``close``)."""
    def wrap(fn: _F) -> _F:
        here = fn.__code__.co_filename

        @functools.wraps(fn)
        def call(self: Guarded, *args: Any, **kw: Any) -> Any:
            if forked_detaches and not self._guard.owner():
                self._closed = True  # a forked child's copy: only the opening process ends the engine
                return None
            caller = sys._getframe(1).f_code.co_filename
            with self._guard.call(op, internal=caller == here or caller == _HERE) as outer:
                if outer and renew and not self._closed:
                    self._ensure_runtime(op)
                return fn(self, *args, **kw)

        return cast(_F, call)

    return wrap


#: The engines not closed yet (``close_at_exit`` ends them).
open_engines: weakref.WeakSet[Any] = weakref.WeakSet()


@atexit.register
def close_at_exit() -> None:
    """Engines still open when the interpreter exits say goodbye, so their saver does not wait out its
    grace period for a restart that will not come: after a normal exit, or an uncaught exception with
    no restart expected, it persists what is newer than the last commit and exits; after an uncaught
    exception with a restart coming, it keeps the snapshots."""
    crashed = getattr(sys, "last_value", None) is not None  # set by the uncaught-exception handler
    for eng in list(open_engines):
        if not eng._guard.owner():  # a forked child's exit ends nothing of its parent's engines
            continue
        try:
            # A daemon thread still inside a call of it (a long wait()) holds it for at most this long; then
            # the saver sees this process gone, as after a crash.
            with eng._guard.call("close", internal=True, timeout=_EXIT_WAIT_S):
                eng._close("keep" if crashed and restart_expected() else "persist")
        except Exception as e:  # at exit: report, never raise
            log.warning("closing a CheckpointEngine at exit: %s", e)
