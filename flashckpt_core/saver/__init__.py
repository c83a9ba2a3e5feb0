"""The node's saver: owns the shared memory, persists snapshots and commits them.

One saver runs per node and job. It is started by a launcher (``flashckpt-run``) or, under plain
``torchrun``/``python``, as a detached daemon by the first engine of the node (``ensure_saver``). It
serves trainers over a Unix socket in the job's 0700 runtime dir, persists on one thread per local
rank, commits on one thread, and exits once it has no clients and no work: when every client said a final
goodbye, at once after persisting the newest complete snapshot when it is newer than the last commit (last
words); else after a grace period that lets a restarted trainer re-attach. Trainers that vanish without a
goodbye (a crash) or keep their snapshots for a restart trigger the last words at once.

Its parts: ``daemon`` (start, ``main``), ``server`` (``CheckpointSaver``: life and dispatch), ``segments``,
``persist``, ``lastwords``, ``committer``; ``_base`` holds the state and names they share. This package
imports its parts on first use: the daemon (``python -m flashckpt.saver.daemon``) defers torch before any.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashckpt.util.lazy import lazy_attributes

if TYPE_CHECKING:
    from flashckpt.saver._base import SOCKET_NAME, lock_job
    from flashckpt.saver.daemon import SAVER_MODULE, ensure_saver
    from flashckpt.saver.server import CheckpointSaver

__all__ = ["CheckpointSaver", "ensure_saver", "lock_job", "SOCKET_NAME", "SAVER_MODULE"]

__getattr__, __dir__ = lazy_attributes(__name__, {
    "CheckpointSaver": ".server", "ensure_saver": ".daemon", "SAVER_MODULE": ".daemon", "lock_job": "._base",
    "SOCKET_NAME": "._base"})
