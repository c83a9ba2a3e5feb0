"""The engine's load path: where the newest checkpoint every rank has lives, and reading it from storage.

``Restorer.locate`` agrees with every rank of the process group on the step to load (memory, a peer's
memory across nodes, or a committed step verified on every rank); ``Restorer.newest`` locates and, from
storage, loads it, going back a committed step while a step turns out damaged on some rank. A memory
snapshot is read by the engine (``CheckpointEngine.load_memory``). ``LoadResult`` and ``Located`` are
what a load and a locate report.

Imports ``commit``, ``transport.messages``, ``memory.reader`` and the engine's ``agreement`` and
``loader``; the engine hands in its commit records, its storage loader and how to ask its saver (all made
lazily). Collective: every rank of the group calls ``locate`` and ``newest`` together; one engine call at
a time uses a ``Restorer``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.engine.agreement import agree, all_ranks, memory_across_nodes, multi_node, newer_in_memory, verified_step
from flashckpt.engine.loader import StorageLoader
from flashckpt.engine.ranks import RankInfo
from flashckpt.engine.reshard import Resharded, agree_resharded
from flashckpt.engine.tiers import agreed_local, local_copy, whole_copy
from flashckpt.format.segment import local_ranks
from flashckpt.memory.reader import SnapshotReader
from flashckpt.transport import messages as M
from flashckpt.transport.peers import ReshardPlan

__all__ = ["LoadResult", "Located", "Restorer"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadResult:
    """What the last ``load()`` found: the step, where it came from ("memory", "local": the node-local tier,
    "storage": the checkpoint dir, or "none"),
    seconds it took and bytes of tensor data."""

    step: int | None
    source: str
    seconds: float
    nbytes: int
    note: str = ""  # with source "none": why files the checkpoint dir holds were not used (``adopt.unrecorded``)


@dataclass(frozen=True)
class Located:
    """Where the newest checkpoint every rank has lives: ``step``, ``source`` ("memory", "local", "storage"
    or "none") and ``path``: this rank's file (or ``FileSet`` directory) as given to ``save`` ("local": its
    copy on the node-local tier, the same layout under the local dir; only ``load()`` reads that tier)."""

    step: int | None
    source: str
    path: str | None
    world: int = 0  # memory: the number of ranks that saved the step, when it differs from this job's (resharded)


class Restorer:
    """One engine's load path.

    Args:
        ranks / group: this rank and the process group whose ranks agree (None: the default group).
        replicated / snapshots: the engine's replicated mode, and whether this rank writes snapshots.
        reader: this rank's reader of memory snapshots.
        layout / loader: the engine's commit records and storage loader (asked for when needed).
        call: sends a request to the node's saver (the engine's ``_client_call``).
        local_loader: the reader of the node-local tier (None: no local tier).
    """

    def __init__(self, *, ranks: RankInfo, group: Any, replicated: bool, snapshots: bool, reader: SnapshotReader,
                 layout: Callable[[], CommitLayout], loader: Callable[[], StorageLoader],
                 call: Callable[[Any], Any], local_loader: Callable[[], StorageLoader | None] = lambda: None) -> None:
        self.ranks, self.group, self.replicated, self.snapshots = ranks, group, replicated, snapshots
        self.reader, self._layout, self._loader, self._call = reader, layout, loader, call
        self._local_loader = local_loader
        self.downloads = False  # a load from an object store may have left a shared download
        # the step of another number of ranks that the last ``locate(reshard=True)`` found in memory
        self.resharded: Resharded | None = None
        self.make_resharded: Callable[[ReshardPlan, str], Resharded] | None = None

    def locate(self, *, memory: bool, deep: bool, exclude: frozenset[int] | set[int] = frozenset(),
               local: Literal["", "mine", "whole"] = "", reshard: bool = False) -> Located:
        """``CheckpointEngine.locate``; ``deep=False`` verifies storage steps by size only (for a load that
        checks the checksums while it reads), ``exclude``: steps found damaged by such a load; ``local``:
        the node-local tier too. ``"mine"`` (``load()``, each rank reading its own files only): "local"
        when every rank holds the newest step there, or this rank's intact local copy of the step the
        checkpoint dir serves. ``"whole"`` (an adapter, whose framework may read another rank's files):
        "local" only when every rank's local tier holds the whole step (``whole_copy``), on every rank.
        ``reshard`` (an adapter whose framework reshards): when memory holds no step of this job's number of
        ranks, a step of another number that the nodes' memory holds whole (``reshard.agree_resharded``;
        ``Located.world`` says how many ranks saved it, and ``self.resharded`` serves the old ranks' states)."""
        layout = self._layout()
        committed = layout.committed_steps()
        self.resharded = None
        asked = memory
        if memory and multi_node(self.ranks, self.group):
            found = self._across_nodes(layout, committed)
            if found is not None:
                return Located(found, "memory", self.reader.snapshot_name(found) or None)
            memory = False
        mem = newer_in_memory(self.reader.memory_snapshots(), layout, self.ranks, committed)[:2] if memory else []
        step, source = agree(mem, committed, self.group)
        if source == "memory" and step is not None:
            return Located(step, "memory", self.reader.snapshot_name(step) or None)
        if asked and reshard and not self.replicated and self.make_resharded is not None:
            self.resharded = self._resharded(layout, committed)
            if self.resharded is not None:
                return Located(self.resharded.step, "memory", self.resharded.name or None, self.resharded.world)
        tier = self._local_loader() if local else None
        whole = self.ranks.world_size if local == "whole" else 0
        if tier is not None:
            newer = agreed_local(tier.layout, layout, committed, self.ranks.rank, exclude, self.group, whole=whole)
            if newer is not None:
                return Located(newer, "local", tier.path_of(newer))
        if source == "storage":
            step = verified_step(layout, self.ranks.rank, committed, step, self.group, deep=deep,
                                 exclude=exclude, world_size=self.ranks.world_size)
            if tier is not None and step is not None and self._local_serves(tier, step, layout.root, whole):
                return Located(step, "local", tier.path_of(step))
            return Located(step, "storage", self._loader().path_of(step))
        return Located(None, "none", None)

    def _local_serves(self, tier: StorageLoader, step: int, durable_root: str, whole: int) -> bool:
        """Whether this rank reads committed ``step`` from the local tier: its own intact copy there; with
        ``whole`` (the job's number of ranks), the whole step on every rank's node (collective, every rank
        alike)."""
        if not whole:
            return local_copy(tier.layout, step, self.ranks.rank, durable_root)
        return all_ranks(whole_copy(tier.layout, step, self.ranks.rank, whole, durable_root), self.group)

    def _across_nodes(self, layout: CommitLayout, committed: list[int]) -> int | None:
        """The step memory holds for every rank across nodes (a rank's snapshot may be on a peer: a backup
        of a lost node's, or ranks that moved), or None; None at once when a rank's segments are another
        live training's (logged by its reader)."""
        if not all_ranks(self.reader.written_by_another() is None, self.group):
            return None
        return memory_across_nodes(
            lambda: self._call(M.Inventory()).to_wire(),
            lambda rank, step, sources: self._call(M.Fetch(local_rank=self.ranks.local_rank, rank=rank,
                                                           step=step, sources=sources)),
            layout, self.ranks, committed, replicated=self.replicated, writes_snapshots=self.snapshots,
            group=self.group)

    def _resharded(self, layout: CommitLayout, committed: list[int]) -> Resharded | None:
        """A step of another number of ranks held whole in the nodes' memory (collective), or None; None at
        once when a local rank's segments here are another live training's (logged by the reader)."""
        assert self.make_resharded is not None
        others = [lr for lr in local_ranks(self.reader.job_dir) if self.reader.written_by_another(lr) is not None]
        if not all_ranks(not others, self.group):
            return None
        return agree_resharded(lambda: self._call(M.Inventory()).to_wire(), layout, committed, self.ranks,
                               self.group, self.make_resharded)

    def newest(self, *, deep: bool, into: Any) -> tuple[Located, Any, int]:
        """Locates the newest checkpoint every rank has and, from storage, loads it: (where, the state dict,
        bytes of tensor data); a memory snapshot is only located (the state dict None). A step damaged on a
        rank (``CheckpointCorruptError``) is excluded on every rank and the previous one tried; ``deep``:
        verify storage steps by checksum before reading (else the read verifies them).

        Raises:
            whatever a rank's load raised, on that rank; ``FlashCheckpointError`` on the others.
        """
        damaged: set[int] = set()
        while True:
            loc = self.locate(memory=not damaged, deep=deep, exclude=damaged, local="mine")
            if loc.source not in ("storage", "local") or loc.step is None:
                return loc, None, 0
            ok, sd, nbytes = self._load_step(loc.step, into, local=loc.source == "local")
            if ok:
                return loc, sd, nbytes
            log.warning("load(): step %d is damaged on a rank; falling back to the previous committed step", loc.step)
            damaged.add(loc.step)

    def _load_step(self, step: int, into: Any, *, local: bool = False) -> tuple[bool, Any, int]:
        """Committed ``step`` from storage (``local``: this rank's copy on the local tier) on every rank:
        (True, its state dict, bytes), or (False, None, 0) when it is damaged on some rank."""
        loader = (self._local_loader() if local else None) or self._loader()
        failed: BaseException | None = None
        try:
            sd, nbytes = loader.load_step(step, into=into), loader.last_bytes
            ok = True
        except E.CheckpointCorruptError as e:
            log.warning("load(): step %d is damaged on this rank (%s)", step, e)
            sd, nbytes, ok = None, 0, False
        except Exception as e:  # raised on every rank below, never a rank left waiting for the others
            sd, nbytes, failed, ok = None, 0, e, False
        self.downloads = True
        if not all_ranks(failed is None, self.group):
            if failed is not None:
                raise failed
            raise E.FlashCheckpointError(
                f"load(): step {step} could not be loaded on another rank (its error says why); nothing "
                "was loaded")
        if all_ranks(ok, self.group):
            return True, sd, nbytes
        return False, None, 0
