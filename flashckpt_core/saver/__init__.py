"""The node's saver: owns the shared memory, persists snapshots and commits them.

One saver runs per node and job. It is started by a launcher (``flashckpt-run``) or, under plain
``torchrun``/``python``, as a detached daemon by the first engine of the node (``transport.spawn.ensure_saver``,
which starts ``python -m flashckpt.saver.daemon`` by name). It serves trainers over a Unix socket in the job's
0700 runtime dir, persists on one thread per local rank, commits on one thread, and exits once it has no
clients and no work: when every client said a final goodbye, at once after persisting the newest complete
snapshot when it is newer than the last commit (last words); else after a grace period that lets a restarted
trainer re-attach. Trainers that vanish without a goodbye (a crash) or keep their snapshots for a restart
trigger the last words at once.

Its modules: ``daemon`` (``main``), ``server`` (``CheckpointSaver``: owns the parts, runs the saver's life),
``state`` (``SaverState``: what the parts share), and the parts: ``control`` (the trainers' socket and the
dispatch table), ``segments`` (the segment pool), ``persist`` (the persist queues), ``worker`` and
``persist_worker`` (the persist worker process), ``housekeeping`` (the commit records at start), ``uploader``
(a local tier's steps to the durable tier), ``committer`` (the commit thread), ``lastwords``, ``replica`` (the
peer service of a multi-node job) and ``recovery`` (after a node loss). This package imports its parts on
first use: the daemon (``python -m flashckpt.saver.daemon``) defers torch before any.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashckpt.util.lazy import lazy_attributes

if TYPE_CHECKING:
    from flashckpt.saver.server import CheckpointSaver

__all__ = ["CheckpointSaver"]

__getattr__, __dir__ = lazy_attributes(__name__, {"CheckpointSaver": ".server"})
