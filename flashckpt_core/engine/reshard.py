"""Resuming from memory across a change of the number of ranks (an elastic job that lost a node and goes on
with fewer, or grew): the step that the nodes' memory holds whole for the *old* layout, read by the ranks of
the new one, each reading the old ranks' states it needs from its own node's memory or, through its saver,
from the peer that holds them.

``agree_resharded`` is the agreement (collective): every rank sends its node's inventory (its saver's
``Inventory``: own snapshots, copies fetched from peers and backups of other nodes) in one
``all_gather_object``; all pick the same (step, number of ranks) with ``transport.peers.reshard_plan`` (the
newest step not older than the newest commit of which every old rank's snapshot is held on some node: one step
for every item, never a mix); rank 0 reads the old rank 0's snapshot (the name every rank saved it under, and
what a framework reads first: DCP's ``.metadata``, megatron-core's ``common.pt``) and tells every rank. The
decision is logged once, on rank 0.

``Resharded`` is what the engine's ``load_memory`` then hands an adapter in place of this rank's snapshot: the
old ranks' states by old rank (``state(r)``), read on first use in place from this node's memory (``view_held``) or
fetched into it first (``Fetch``: the replica transport, saver to saver; never the training process group),
and where each came from (``read_from``, logged). Only adapters whose framework reshards (DCP: FSDP,
megatron-core ``torch_dist``) ask for it (``locate(reshard=True)``); a rank's own state of another layout is
never handed to a plain ``load()``.

Imports the memory reader, the transport's messages and peers, and the engine's agreement helpers; one engine
call at a time uses it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.engine.agreement import world
from flashckpt.engine.collective import group_ranks
from flashckpt.engine.ranks import RankInfo
from flashckpt.format.files import FileSet, is_fileset_tree
from flashckpt.memory.reader import HeldView, view_held
from flashckpt.transport import messages as M
from flashckpt.transport.peers import ReshardPlan, node_key, reshard_plan

__all__ = ["Resharded", "agree_resharded"]

log = logging.getLogger(__name__)


class Resharded:
    """The states of a step saved by ``world`` ranks (another number than this job's), as this rank reads them:
    ``state(r)`` is old rank ``r``'s state dict (a ``FileSet`` for sets), from this node's memory or fetched from
    a peer first. ``name``: the path the step was saved under (old rank 0's; the same on every rank for the
    resharding formats). ``read_from``: old rank -> "here" or the peer it was fetched from.

    Args:
        plan: the agreed plan (every rank the same).
        job_dir / local_rank: this node's runtime dir of the job, and this rank's local rank (fetched copies go
            into a new segment of it).
        instance: this node's key (``node_key``: its holders are read in place, never fetched).
        fetch: sends a ``Fetch`` to this node's saver.
        weights_only: as the engine's reader (the snapshots' Python objects).

    The states' tensors are views of the segments that hold them (``view_held``: no copy; a reader copies the
    parts it needs); ``torn()`` names those whose slot changed since they were read (a reader checks it after
    copying). The mappings go with the last reference to them (a framework may keep a tensor it loaded as is).
    """

    def __init__(self, plan: ReshardPlan, *, job_dir: str, local_rank: int, instance: str,
                 fetch: Callable[[M.Fetch], Any], weights_only: bool) -> None:
        assert plan.step is not None
        self.step: int = plan.step
        self.world = plan.world
        self.plan = plan
        self.name = ""
        self.read_from: dict[int, str] = {}
        self.here_by_rank: list[list[int]] = []  # by group rank: the old ranks its node holds (set by the agreement)
        self.nbytes = 0
        self.seconds = 0.0
        self._job_dir, self._local_rank, self._instance = job_dir, local_rank, instance
        self._fetch, self._weights_only = fetch, weights_only
        self._states: dict[int, Any] = {}
        self._views: dict[int, HeldView] = {}

    def state(self, rank: int) -> Any:
        """Old rank ``rank``'s state of the step (a ``FileSet`` for sets), read once and kept.

        Raises:
            FlashCheckpointError: no holder could serve it (the message names each one's answer).
        """
        if not 0 <= rank < self.world:
            raise E.InvalidArgumentError(f"Resharded.state({rank}): the step was saved by ranks 0..{self.world - 1}")
        if rank not in self._states:
            t0 = time.perf_counter()
            view = self._views[rank] = self._read(rank)
            sd = view.snapshot.state_dict
            self._states[rank] = FileSet.decode(sd) if is_fileset_tree(sd) else sd
            self.nbytes += view.snapshot.nbytes
            self.seconds += time.perf_counter() - t0
            if rank == 0:
                self.name = view.snapshot.name
        return self._states[rank]

    def torn(self) -> list[int]:
        """The old ranks whose snapshot read here was overwritten since (a torn read): [] when none."""
        return [r for r, v in sorted(self._views.items()) if not v.intact()]

    def _read(self, rank: int) -> HeldView:
        def here() -> HeldView | None:
            return view_held(self._job_dir, rank, self.world, self.step, weights_only=self._weights_only)

        snap = here()
        if snap is not None:
            self.read_from.setdefault(rank, "here")
            return snap
        holders = [h for h in self.plan.sources.get(rank, []) if h.get("port") and h.get("instance") != self._instance]
        if not holders:
            raise E.FlashCheckpointError(f"the snapshot of step {self.step} of rank {rank} (of {self.world}) is no "
                                         "longer in this node's memory and no peer holds it")
        self._fetch(M.Fetch(local_rank=self._local_rank, rank=rank, step=self.step, world=self.world,
                            sources=[{"host": h["host"], "port": h["port"]} for h in holders]))
        snap = here()
        if snap is None:
            raise E.FlashCheckpointError(f"the snapshot of step {self.step} of rank {rank} (of {self.world}) was "
                                         "fetched into this node's memory but is gone (overwritten meanwhile)")
        first = holders[0]
        self.read_from[rank] = f"node {first.get('node')} ({first.get('kind')})"
        return snap


def agree_resharded(inventory: Callable[[], dict[str, Any]], layout: CommitLayout, committed: list[int],
                    ranks: RankInfo, group: Any, make: Callable[[ReshardPlan, str], Resharded]) -> Resharded | None:
    """The step every rank of a job whose number of ranks changed loads from memory, resharded (see the module
    docstring), or None on every rank (memory holds no such step whole; rank 0 says why when some node holds a
    part of one). Collective.

    ``inventory()``: this node's saver's ``Inventory`` reply; ``make(plan, instance)``: this rank's
    ``Resharded`` over the agreed plan."""
    import torch.distributed as dist

    n = world(group)
    mine = inventory()
    rows: list[Any] = [mine]
    if n is not None:
        rows = [None] * n
        dist.all_gather_object(rows, mine, group=group)
    committed_world, saved_at = 0, {}
    if committed:
        try:
            m = layout.read_manifest(committed[-1])
            committed_world = m.world_size
            saved_at = m.saved_at_ranks()
        except (E.CheckpointCorruptError, TypeError, ValueError):
            pass
    plan = reshard_plan(rows, world_size=ranks.world_size, newest_committed=committed[-1] if committed else -1,
                        committed_world=committed_world, saved_at=saved_at)
    src = group_ranks(group)[0]  # the group's first rank (global): it reads old rank 0's snapshot, and warns
    first = ranks.rank == src
    if plan.step is None:
        if plan.partial is not None and first:
            log.warning("load(): memory holds step %d saved by %d ranks, but no node holds the snapshots of ranks %s "
                        "(lost with their node and its backup partners); this job of %d ranks loads from storage",
                        plan.partial[1], plan.partial[0], list(plan.missing), ranks.world_size)
        return None
    resharded = make(plan, node_key(mine))
    # which old ranks each rank's node holds (its reader reads them in place; the others serve or fetch them)
    resharded.here_by_rank = [sorted(r for r, hs in plan.sources.items() if any(h["instance"] == node_key(row)
                                                                                for h in hs)) for row in rows]
    # Rank 0 reads the old rank 0's snapshot (what a framework reads first) and tells every rank its name,
    # or why it could not: then memory cannot serve the step, on every rank alike.
    answer: Any = None
    if first:
        try:
            resharded.state(0)
            answer = ("", resharded.name)
        except E.FlashCheckpointError as e:
            answer = (str(e), "")
    if n is not None:
        box = [answer]
        dist.broadcast_object_list(box, src=src, group=group)
        answer = box[0]
    error, name = answer
    if error:
        if first:
            log.warning("load(): step %d saved by %d ranks is in memory, but %s; loading from storage", plan.step,
                        plan.world, error)
        return None
    resharded.name = name
    if first:
        where = {r: [f"node {h['node']} {h['kind']}" for h in hs] for r, hs in plan.sources.items()}
        # a warning: the job's number of ranks changed (a node lost or added), which its operators want to see
        log.warning("load(): resuming from memory at step %d, saved by %d ranks, resharded to this job's %d "
                    "(event=reshard_plan step=%d from_ranks=%d to_ranks=%d holders=%s)", plan.step, plan.world,
                    ranks.world_size, plan.step, plan.world, ranks.world_size, where)
    return resharded
