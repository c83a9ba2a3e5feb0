"""The writer lease of a local rank's shared-memory segments: one writer at a time.

The engine's writer (``memory.writer.SharedMemoryHandler``) takes it at its first save and holds it until it
closes (the kernel releases it when the process dies); a second writer of the same local rank (another
engine, another job with this job key) is refused with a message naming the holder. A holder that was just
killed is waited for a moment (its files close when its threads are gone). Imports ``format.segment`` and
``util.lease`` only; any thread may call ``take_writer_lease``.
"""

from __future__ import annotations

import os
from typing import Any

from flashckpt import errors as E
from flashckpt.format.segment import writer_lease_path
from flashckpt.util.lease import Lease, describe_holder, pid_running, read_holder

__all__ = ["take_writer_lease"]

_DEAD_HOLDER_WAIT_S = 10.0
_PROBE_S = 0.05


def take_writer_lease(job_dir: str, local_rank: int, info: dict[str, Any]) -> Lease:
    """The writer lease of ``local_rank``'s segments, or SharedMemoryError naming its holder."""
    path = writer_lease_path(job_dir, local_rank)
    lease = Lease(path)
    try:
        # A moment's retry: a reader probing whether a live writer holds it (``_lease.live_holder``)
        # locks it for an instant.
        ok = lease.try_acquire({"local_rank": local_rank, **info}, timeout=_PROBE_S)
    except OSError as e:
        raise E.SharedMemoryError(f"could not take the writer lease {path}: {e}") from e
    holder = read_holder(path) if not ok else {}
    pid = holder.get("pid")
    if not ok and isinstance(pid, int) and pid != os.getpid() and not pid_running(pid):
        # A holder that was just killed: its threads may still be exiting (its pid already a zombie) and
        # its files still open for a moment. Its lease frees when they are gone.
        ok = lease.try_acquire({"local_rank": local_rank, **info}, timeout=_DEAD_HOLDER_WAIT_S)
    if ok:
        return lease
    raise E.SharedMemoryError(
        f"local rank {local_rank}'s shared-memory snapshots in {job_dir} are already written by "
        f"{describe_holder(holder)}; two writers would tear each other's checkpoints. Close "
        "the other CheckpointEngine first, or give each job its own FLASHCKPT_JOB_ID or checkpoint dir.")
