"""Which checkpoint every rank loads: all ranks agree on the newest step that each of them has, from memory
when memory holds it, else the most recently committed step whose files verify on every rank (falling
back to the previous one when damaged). One ``all_gather`` (and an ``all_reduce`` per verified step) when a
process group of several ranks exists; a lone process decides alone."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.engine.ranks import RankInfo
from flashckpt.transport.peers import NodePlan, across_nodes

__all__ = ["newer_in_memory", "agree", "verified_step", "all_ranks", "world", "across_nodes", "NodePlan",
           "multi_node", "memory_across_nodes"]

log = logging.getLogger(__name__)


def newer_in_memory(snaps: Sequence[tuple[int, float]], layout: CommitLayout, ranks: RankInfo,
                    committed: list[int]) -> list[int]:
    """The steps of this rank's live memory snapshots (``snaps``: (step, wall time), newest save first)
    that are not older than the most recently committed step: saved at or after the snapshot this rank's
    files of it were persisted from (where that time is not known, as in older manifests: a step not lower
    than it)."""
    if not committed:
        return [s for s, _t in snaps]
    try:
        m = layout.read_manifest(committed[-1])
    except E.CheckpointCorruptError:
        m = None
    # The time of the snapshot this rank's files came from (replicated: rank 0's, which this node's
    # reader holds only on rank 0's node): the same process's clock as the snapshots compared.
    saved_at = 0.0
    if m is not None and (not m.replicated or ranks.node_rank == 0):
        saved_at = float(m.extra.get("saved_at_ranks", {}).get("0" if m.replicated else str(ranks.rank), 0.0))
    if saved_at:
        return [s for s, t in snaps if t >= saved_at]
    return [s for s, _t in snaps if s >= committed[-1]]


def agree(mem: list[int], committed: list[int], group: Any = None) -> tuple[int | None, str]:
    """All ranks of ``group`` pick the newest step that every rank has: (step, "memory" | "storage" | "none").
    Memory wins when it holds that step.

    ``mem`` holds only snapshots not older than the most recently committed step (``committed[-1]``,
    commit order), so any step every rank holds in memory is the newest."""
    newest_committed = committed[-1] if committed else -1
    n = world(group)
    if n is None:
        best_mem = mem[0] if mem else -1
    else:
        import torch.distributed as dist

        mine = torch.full((3,), -1, dtype=torch.int64)
        for i, s in enumerate(mem[:2]):
            mine[i] = s
        mine[2] = newest_committed
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
        out = [torch.empty(3, dtype=torch.int64, device=dev) for _ in range(n)]
        dist.all_gather(out, mine.to(dev) if dev else mine, group=group)
        rows = [o.cpu().tolist() for o in out]
        common = set(rows[0][:2])
        for r in rows[1:]:
            common &= set(r[:2])
        common.discard(-1)
        best_mem = max(common, default=-1)
        newest_committed = min(r[2] for r in rows)
    if best_mem >= 0:
        return best_mem, "memory"
    if newest_committed >= 0:
        return newest_committed, "storage"
    return None, "none"


def world(group: Any = None) -> int | None:
    """The size of ``group`` when torch.distributed runs with more than one rank in it, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        n = dist.get_world_size(group)
        return n if n > 1 else None
    return None


def all_ranks(ok: bool, group: Any = None) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (one ``all_reduce``; every rank calls it)."""
    n = world(group)
    if n is None:
        return ok
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return int(flag.item()) == 1


def verified_step(layout: CommitLayout, rank: int, committed: list[int], newest: int | None, group: Any = None, *,
                  deep: bool = True, exclude: frozenset[int] | set[int] = frozenset(),
                  world_size: int | None = None) -> int:
    """The most recently committed step (not after ``newest`` in commit order, not in ``exclude``) whose
    files verify on every rank of ``group`` (``rank``'s files here, and with ``world_size`` those of the
    step's ranks beyond it that fall to this rank, see ``CommitLayout.verify``; ``deep``: their checksums,
    else their sizes, for a loader that checks checksums while it reads).

    Raises:
        CheckpointCorruptError: every committed step is damaged.
    """
    upto = committed.index(newest) + 1 if newest in committed else len(committed)
    for step in reversed(committed[:upto]):
        if step in exclude:
            continue
        problems = layout.verify(step, rank=rank, deep=deep, world_size=world_size)
        if all_ranks(not problems, group):
            return step
        log.warning("load(): step %d is damaged (%s); falling back to the previous committed step",
                    step, "; ".join(problems) or "on another rank")
    raise E.CheckpointCorruptError(f"load(): every committed step in {layout.root} is damaged; "
                                   "run `flashckpt verify` for details")


def multi_node(ranks: RankInfo, group: Any = None) -> bool:
    """Whether the ranks of ``group`` span more than one node (then memory is agreed across nodes)."""
    return ranks.world_size > ranks.local_world_size and world(group) is not None


def _saved_at_ranks(layout: CommitLayout, committed: list[int]) -> dict[str, float]:
    """The newest commit's ``saved_at_ranks`` (rank -> wall time of the snapshot its files came from); empty
    when nothing is committed or the manifest is damaged or does not record it."""
    if not committed:
        return {}
    try:
        return layout.read_manifest(committed[-1]).saved_at_ranks()
    except (E.CheckpointCorruptError, TypeError, ValueError):
        return {}


def _bring_here(fetch: Callable[[int, int, list[dict[str, Any]]], Any], me: dict[str, Any],
                holders: list[dict[str, Any]], step: int, ranks: RankInfo, *, replicated: bool) -> bool:
    """Has this rank's saver fetch its snapshot of ``step`` into its own local rank's segment unless it is
    there already (``me``: this node's inventory; ``holders``: where copies are). False when the fetch
    failed (logged)."""
    here = any(h["instance"] == me.get("instance") and h["kind"] == "own" and h["local_rank"] == ranks.local_rank
               for h in holders)
    if here:
        return True
    # This node first (a backup or another local rank's segment here), then own copies before backups.
    order = sorted(holders, key=lambda h: (h["instance"] != me.get("instance"), h["kind"] != "own"))
    sources = [{"host": h["host"], "port": h["port"]} for h in order if h["port"]]
    try:
        fetch(-1 if replicated else ranks.rank, step, sources)
    except E.FlashCheckpointError as e:
        log.warning("load(): could not bring rank %d's snapshot of step %d into this node's memory: %s",
                    ranks.rank, step, e)
        return False
    return True


def memory_across_nodes(inventory: Callable[[], dict[str, Any]], fetch: Callable[[int, int, list[dict[str, Any]]], Any],
                        layout: CommitLayout, ranks: RankInfo, committed: list[int], *, replicated: bool,
                        writes_snapshots: bool, group: Any = None) -> int | None:
    """The step every rank of a multi-node job loads from memory, with each rank's copy brought into its own
    node's memory first; None when memory cannot serve every rank (then storage, with a warning saying why).

    Every rank sends its node's inventory (``inventory()``: own snapshots and backups of other nodes') in one
    ``all_gather_object``; all pick the same step (``across_nodes``). A rank whose copy is not in its own local
    rank's segment has its saver fetch it (``fetch(rank, step, sources)``: from a backup or another node's
    memory, into a new segment of this local rank); one ``all_reduce`` then agrees that every fetch worked."""
    import torch.distributed as dist

    n = world(group)
    assert n is not None
    rows: list[Any] = [None] * n
    dist.all_gather_object(rows, inventory(), group=group)
    members = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    saved_at = _saved_at_ranks(layout, committed)
    plan = across_nodes(rows, members, replicated=replicated, saved_at=saved_at,
                        newest_committed=committed[-1] if committed else -1, world_size=ranks.world_size)
    if plan.step is None:
        if plan.partial is not None and ranks.rank == members[0]:
            log.warning("load(): memory holds step %d on some nodes, but ranks %s have no copy left (their node "
                        "and every node of its backup group were lost); loading from storage", plan.partial,
                        list(plan.missing))
        return None
    me = rows[members.index(ranks.rank)]
    ok = True
    if writes_snapshots:
        ok = _bring_here(fetch, me, plan.sources.get(ranks.rank, []), plan.step, ranks, replicated=replicated)
    if not all_ranks(ok, group):
        if ranks.rank == members[0]:
            log.warning("load(): a rank could not fetch its snapshot of step %d from a peer; loading from storage",
                        plan.step)
        return None
    return plan.step
