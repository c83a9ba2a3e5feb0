"""Children that do not outlive their parent: the ``preexec_fn`` that ``flashckpt-run`` starts its workers and
warm workers with, so that a launcher killed with SIGKILL (which can run no clean-up of its own) takes them
with it instead of leaving orphans that hold GPUs, ports and shared memory.

Linux's ``PR_SET_PDEATHSIG`` delivers a signal to a process when the *thread* that created it exits (not
the process): children must be started from a thread that lives as long as they may, the main thread.
``die_with_parent`` therefore offers the setting only when called on the main thread. The setting survives
``exec`` (except of a set-uid program) and is not passed on to the child's own children (a saver daemon a
worker starts is not affected: its life is the saver's own business).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

__all__ = ["die_with_parent"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` after which the child receives ``sig`` when this process
    (its main thread) exits; None off Linux, without ``prctl``, or when called on another thread (a child
    would then die with that thread: start it from the main thread instead).

    The function runs in the child between ``fork`` and ``exec``: it only calls ``prctl`` (resolved here, in
    the parent) and ``getppid``, and if the parent died before the setting took effect it sends ``sig`` to
    itself, since no signal would come."""
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        log.debug("die_with_parent() called on thread %s: not set (the child would die with that thread)",
                  threading.current_thread().name)
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent was gone before the setting: no signal will come
            os.kill(os.getpid(), sig)

    return preexec
