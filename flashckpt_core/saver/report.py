"""What a saver is doing now, for ``flashckpt status``: ``inspect`` answers the ``Inspect`` request (no hello
needed, so the command never counts as a trainer): its trainers, the persists running with the bytes written
so far, the newest commits per tier, what its node's memory holds, its replica partners and its newest events.

Imports the saver's parts it reads (``state``, ``replica``) and the layers below."""

from __future__ import annotations

import os
import time
from typing import Any

from flashckpt.saver.replica import ReplicaService
from flashckpt.saver.state import SaverState
from flashckpt.transport import messages as M
from flashckpt.transport.peers import partners

__all__ = ["inspect"]


def inspect(state: SaverState, replica: ReplicaService, req: M.Inspect) -> M.InspectReply:
    """The ``InspectReply`` of this saver now."""
    now = time.monotonic()
    with state.cv:
        clients = [{"rank": c.rank, "local_rank": c.local_rank, "pid": c.pid, "world_size": c.world_size}
                   for c in state.clients.values()]
        running = [dict(r) for r in state.running.values()]
        committed = state.committed[-1] if state.committed else None
        commits = list(state.commits)
        queued = state.inflight
        events = list(state.journal)[-max(0, req.events):] if req.events > 0 else []
    persisting = []
    for r in sorted(running, key=lambda r: (r["step"], r["rank"])):
        persisting.append({"step": r["step"], "rank": r["rank"], "bytes": r["bytes"], "path": r["path"],
                           "tier": r["tier"], "seconds": now - r["since"], "done": _written(r["storage"], r["path"])})
    local = [c["step"] for c in commits if c.get("tier") == "local"]
    held = replica.inventory().held
    rep = replica.rep
    rep_state: dict[str, Any] = {}
    if rep is not None:
        rep_state = {"node": rep.node, "nnodes": rep.nnodes, "host": rep.host, "port": rep.port,
                     "partners": partners(rep.node, rep.nnodes, rep.knobs.group_size, rep.knobs.stride)
                     if rep.knobs.mode != "off" else [],
                     "sent_bytes": rep.sent_bytes, "send_seconds": rep.send_seconds}
    return M.InspectReply(pid=os.getpid(), checkpoint_dir=state.layout.root, started_at=state.started_at,
                          clients=clients, persisting=persisting, queued=queued, committed=committed,
                          local_committed=local[-1] if local else None,
                          local_dir=state.local.root if state.local is not None else "", commits=commits,
                          held=held, memory_bytes=_memory_bytes(state.job_dir), replica=rep_state, events=events)


def _written(storage: Any, path: str) -> int | None:
    """The bytes of ``path`` written so far (a file being written has the backend's temporary suffix; a
    ``FileSet`` is a directory of such files); None where the backend cannot tell (an object store: parts
    in flight are not visible)."""
    local = storage.local_path(path)
    suffix = getattr(storage, "temp_suffix", None)
    if local is None or suffix is None:
        return None
    if os.path.isdir(local):
        total = 0
        for root, _dirs, files in os.walk(local):
            for f in files:
                total += _size(os.path.join(root, f))
        return total
    return _size(local + suffix) or _size(local)


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _memory_bytes(job_dir: str) -> int:
    """The shared memory this job's files take on the node (allocated blocks)."""
    total = 0
    try:
        with os.scandir(job_dir) as it:
            for e in it:
                try:
                    if e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_blocks * 512
                except OSError:
                    continue
    except OSError:
        return 0
    return total
