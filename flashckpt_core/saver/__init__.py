"""The node's saver: owns the shared memory, persists snapshots and commits them.

One saver runs per node and job. It is started by a launcher (``flashckpt-run``) or, under plain
``torchrun``/``python``, as a detached daemon by the first engine of the node (``transport.spawn.ensure_saver``,
which starts ``python -m flashckpt.saver.daemon`` by name). It serves trainers over a Unix socket in the job's
0700 runtime dir, persists on one thread per local rank, commits on one thread, and exits once it has no
clients and no work: when every client said a final goodbye, at once after persisting the newest complete
snapshot when it is newer than the last commit (last words); else after a grace period that lets a restarted
trainer re-attach. Trainers that vanish without a goodbye (a crash) or keep their snapshots for a restart
trigger the last words at once.

Its parts: ``daemon`` (``main``), ``server`` (``CheckpointSaver``: life and dispatch), ``segments``,
``persist``, ``lastwords``, ``committer``; ``_base`` holds the state and names they share. This package
imports its parts on first use: the daemon (``python -m flashckpt.saver.daemon``) defers torch before any.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashckpt.util.lazy import lazy_attributes

if TYPE_CHECKING:
    from flashckpt.saver.server import CheckpointSaver

__all__ = ["CheckpointSaver"]

__getattr__, __dir__ = lazy_attributes(__name__, {"CheckpointSaver": ".server"})
