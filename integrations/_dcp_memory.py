"""Reading a DCP checkpoint from the ranks' memory snapshots: ``open_memory_reader`` (whether the current
ranks' snapshots hold the whole checkpoint; collective) and ``FileSetStorageReader`` (serves each rank's
own items in place and exchanges the items other ranks hold inside ``read_data``). See
``flashckpt.integrations.dcp`` for the format and the call order.

Imports torch.distributed.checkpoint and flashckpt's core. ``dcp.load`` drives the reader from the
training thread; its ``read_data`` is collective when the plan says some rank needs another's items.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import logging
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch
from flashckpt import FileSet
from flashckpt.engine.collective import all_gather, exchange_files
from flashckpt.engine.collective import rank as group_rank
from flashckpt.engine.reshard import Resharded
from flashckpt.errors import CheckpointCorruptError, FlashCheckpointError
from flashckpt.format.files import tensor_view
from flashckpt.integrations._dcp_format import DATA_FILE, METADATA_NAME, torch_save_frame
from flashckpt.integrations._dcp_store import fill_target
from torch.distributed.checkpoint.filesystem import (
    FileSystemReader,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
)
from torch.futures import Future

__all__ = ["FileSetStorageReader", "ReshardedStorageReader", "open_memory_reader"]

log = logging.getLogger(__name__)


class _Parts:
    """A data file held as parts (bytes and tensors) with their file offsets."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts
        self.starts: list[int] = []
        pos = 0
        for p in parts:
            self.starts.append(pos)
            pos += len(p) if isinstance(p, bytes) else p.numel() * p.element_size()
        self.size = pos

    def _span(self, i: int) -> tuple[int, int]:
        end = self.starts[i + 1] if i + 1 < len(self.parts) else self.size
        return self.starts[i], end

    def _overlapping(self, offset: int, length: int) -> range:
        """Indices of the parts that overlap bytes [offset, offset + length) (and empty parts inside it)."""
        first = max(bisect.bisect_right(self.starts, offset) - 1, 0)
        last = bisect.bisect_left(self.starts, offset + length, lo=first)
        return range(first, last)

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or offset + length > self.size:
            raise CheckpointCorruptError(f"bytes {offset}..{offset + length} lie outside the data file "
                                         f"({self.size} bytes)")
        out = bytearray()
        for i in self._overlapping(offset, length):
            p = self.parts[i]
            s, e = self._span(i)
            lo, hi = max(s, offset), min(e, offset + length)
            if lo >= hi:
                continue
            view = memoryview(p) if isinstance(p, bytes) else tensor_view(p)
            out += view[lo - s: hi - s]
        return bytes(out)

    def tensor_in(self, offset: int, length: int) -> torch.Tensor | None:
        """The one non-empty tensor part inside bytes [offset, offset + length), if there is exactly one."""
        found = None
        for i in self._overlapping(offset, length):
            p = self.parts[i]
            if isinstance(p, bytes) or p.numel() == 0:
                continue
            s, e = self._span(i)
            if s < offset or e > offset + length or found is not None:
                return None
            found = p
        return found


@dataclass(frozen=True)
class _Routing:
    """``LoadPlan.storage_data`` set by the coordinator: whether any rank reads items another rank holds
    (then every rank joins the exchange) and which of this rank's items others read."""

    exchange: bool
    serve: tuple[MetadataIndex, ...]


class FileSetStorageReader(FileSystemReader):
    """A DCP ``StorageReader`` over the data files this rank holds in memory (see ``open_memory_reader``).

    Items of this rank's file are served straight from memory (tensor records without re-parsing:
    the snapshot's tensor is narrowed and copied into the target); items in other ranks' files are
    exchanged between ranks inside ``read_data`` (one ``all_gather_object``, on every rank, only when
    the coordinator's plan says some rank needs one). Reusable for several ``dcp.load`` calls.

    Args:
        path: the checkpoint's directory (its ``checkpoint_id``).
        metadata: the checkpoint's ``Metadata``.
        files: this rank's data files, name -> parts (bytes and tensors) as staged by the writer.
        owners: every data file of the checkpoint -> the rank (in ``process_group``) holding it.
        process_group: the group DCP loads with (the default group when None).
    """

    def __init__(self, path: str | os.PathLike[str], *, metadata: Metadata, files: dict[str, list[Any]],
                 owners: dict[str, int], process_group: Any = None) -> None:
        super().__init__(path)
        self.metadata = metadata
        self.files = {name: _Parts(parts) for name, parts in files.items()}
        self.owners = dict(owners)
        self.process_group = process_group
        self.source = "memory"

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise FlashCheckpointError("FileSetStorageReader: the checkpoint has global metadata, not per-rank")
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        serve: list[set[MetadataIndex]] = [set() for _ in plans]
        for rank, plan in enumerate(plans):
            for req in plan.items:
                owner = self._owner(req.storage_index)
                if owner != rank:
                    if owner is None or owner >= len(plans):
                        raise CheckpointCorruptError(f"FileSetStorageReader: {req.storage_index.fqn} lies in "
                                                     f"{self._info(req.storage_index).relative_path}, which no rank "
                                                     "holds in memory")
                    serve[owner].add(req.storage_index)
        exchange = any(serve)
        return [dataclasses.replace(p, storage_data=_Routing(exchange, tuple(sorted(serve[i], key=_index_key))))
                for i, p in enumerate(plans)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        routing = plan.storage_data if isinstance(plan.storage_data, _Routing) else _Routing(False, ())
        received: dict[MetadataIndex, Any] = {}
        if routing.exchange:
            received = self._exchange(plan, routing.serve)
        for req in plan.items:
            info = self._info(req.storage_index)
            mine = self.files.get(info.relative_path)
            if req.type == LoadItemType.BYTE_IO:
                raw = mine.read(info.offset, info.length) if mine is not None else received[req.storage_index]
                planner.load_bytes(req, io.BytesIO(raw))
                continue
            tensor = self._local_tensor(req.storage_index, mine, info) if mine is not None else None
            if tensor is None:
                raw = mine.read(info.offset, info.length) if mine is not None else received[req.storage_index]
                tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            fill_target(planner, req, tensor, "FileSetStorageReader")
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # ------------------------------------------------------------------ helpers
    def _info(self, index: MetadataIndex) -> _StorageInfo:
        try:
            return self.metadata.storage_data[index]
        except KeyError:
            raise CheckpointCorruptError(f"FileSetStorageReader: the metadata has no storage entry for {index}") from None

    def _owner(self, index: MetadataIndex) -> int | None:
        return self.owners.get(self._info(index).relative_path)

    def _local_tensor(self, index: MetadataIndex, parts: _Parts, info: _StorageInfo) -> torch.Tensor | None:
        """The snapshot's tensor of a record in this rank's file, checked against the metadata; None when
        the record must be parsed instead (the generic path)."""
        t = parts.tensor_in(info.offset, info.length)
        md = self.metadata.state_dict_metadata.get(index.fqn)
        if t is None or not isinstance(md, TensorStorageMetadata) or t.dtype != md.properties.dtype:
            return None
        chunk = next((c for c in md.chunks if tuple(c.offsets) == tuple(index.offset or ())), None)
        if chunk is None or tuple(t.shape) != tuple(chunk.sizes):
            return None
        head, tail = torch_save_frame(t.dtype, tuple(t.shape))
        if len(head) + t.numel() * t.element_size() + len(tail) != info.length:
            return None
        return t

    def _exchange(self, plan: LoadPlan, serve: tuple[MetadataIndex, ...]) -> dict[MetadataIndex, Any]:
        """Every rank gets the records of ``plan`` that other ranks hold, and serves those others read from
        it (``serve``, as the coordinator planned): data-parallel replicas restarting from memory get the
        whole model from the rank that holds it. Errors on any rank are raised on every rank."""
        wanted = list(dict.fromkeys(req.storage_index for req in plan.items
                                    if self._info(req.storage_index).relative_path not in self.files))
        return exchange_files(self._record, serve, wanted, group=self.process_group, what="FileSetStorageReader")

    def _record(self, index: MetadataIndex) -> bytes:
        info = self._info(index)
        parts = self.files.get(info.relative_path)
        if parts is None or info.offset + info.length > parts.size:
            raise CheckpointCorruptError(f"{info.relative_path} bytes {info.offset}+{info.length} are not held by "
                                         "this rank")
        return parts.read(info.offset, info.length)


@dataclass(frozen=True)
class _ReshardRouting(_Routing):
    """``_Routing`` of a resharded load, and the old data files this rank reads itself (``load``: held on its
    node, or fetched into it first)."""

    load: tuple[str, ...] = ()


class ReshardedStorageReader(FileSetStorageReader):
    """A DCP ``StorageReader`` over a step that another number of ranks saved, held in the nodes' memory
    (``Resharded``). DCP's planner does the resharding, as from storage; the coordinator then routes every item:
    an item of an old data file that this rank's node holds is read in place (the old rank's snapshot, no copy
    but the item's own); one of a file held on another node is fetched with its whole file into this node
    (the replica's fetch, saver to saver) when the rank needs more than ``SMALL`` bytes of it, else served by
    a rank whose node holds it inside ``read_data`` (the same exchange as ``FileSetStorageReader``'s: the
    small replicated items DCP stores in one rank's file, a step counter, never a whole shard). The file
    ``__{r}_0.distcp`` is old rank ``r``'s.

    Args:
        path: the checkpoint's directory (its ``checkpoint_id``).
        metadata: the checkpoint's ``Metadata`` (old rank 0's ``.metadata``).
        held: the old ranks' states.
        process_group: the group DCP loads with.
    """

    SMALL = 4 << 20

    def __init__(self, path: str | os.PathLike[str], *, metadata: Metadata, held: Resharded,
                 process_group: Any = None) -> None:
        super().__init__(path, metadata=metadata, files={}, owners={}, process_group=process_group)
        self.held = held

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        here = [set(h) for h in self.held.here_by_rank] or [set(range(self.held.world))]
        here += [set() for _ in range(len(plans) - len(here))]
        need: dict[tuple[int, str], int] = {}  # (rank, file it does not hold) -> its bytes of items in it
        load: list[set[str]] = [set() for _ in plans]
        for p, plan in enumerate(plans):
            for req in plan.items:
                info = self._info(req.storage_index)
                old = self._writer(info.relative_path)
                if old is not None and old in here[p]:
                    load[p].add(info.relative_path)
                else:
                    need[(p, info.relative_path)] = need.get((p, info.relative_path), 0) + info.length
        serve: list[set[MetadataIndex]] = [set() for _ in plans]
        for (p, name), nbytes in sorted(need.items()):
            old = self._writer(name)
            servers = [q for q in range(len(plans)) if old is not None and old in here[q]]
            if nbytes > self.SMALL or not servers:
                load[p].add(name)  # fetched whole into p's node
                continue
            for req in plans[p].items:
                if self._info(req.storage_index).relative_path == name:
                    serve[servers[0]].add(req.storage_index)
            load[servers[0]].add(name)
        exchange = any(serve)
        return [dataclasses.replace(p, storage_data=_ReshardRouting(exchange, tuple(sorted(serve[i], key=_index_key)),
                                                                    tuple(sorted(load[i]))))
                for i, p in enumerate(plans)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        routing = plan.storage_data
        names = routing.load if isinstance(routing, _ReshardRouting) else tuple(dict.fromkeys(
            self._info(req.storage_index).relative_path for req in plan.items))
        for name in names:
            if name not in self.files:
                self.files[name] = _Parts(self._data_file(name))
        log.info("event=reshard_read step=%d from_ranks=%d files=%d read_from=%s bytes=%d seconds=%.3f",
                 self.held.step, self.held.world, len(names), self.held.read_from, self.held.nbytes,
                 self.held.seconds)
        done = super().read_data(plan, planner)  # items of files not loaded here come through the exchange
        torn = self.held.torn()
        if torn:  # the items were copied from snapshots that changed meanwhile
            raise CheckpointCorruptError(f"ReshardedStorageReader: the snapshots of step {self.held.step} of old ranks "
                                         f"{torn} were overwritten while they were read")
        return done

    def _writer(self, name: str) -> int | None:
        """The old rank that wrote data file ``name`` (None: not a name of the ``__{r}_0.distcp`` form)."""
        m = DATA_FILE.match(name)
        return int(m.group(1)) if m and int(m.group(1)) < self.held.world else None

    def _data_file(self, name: str) -> list[Any]:
        """The parts of data file ``name``, from the old rank that wrote it."""
        writer = self._writer(name)
        order = [writer] if writer is not None else []
        order += [r for r in range(self.held.world) if r not in order]
        for r in order:  # its writer first (a process group other than the default numbers them otherwise)
            st = self.held.state(r)
            files, _meta = _held(st if isinstance(st, FileSet) else None)
            if name in files:
                return files[name]
        raise CheckpointCorruptError(f"ReshardedStorageReader: no rank of the {self.held.world}-rank step "
                                     f"{self.held.step} in memory holds {name}")


def _resharded_reader(held: Resharded, path: str | os.PathLike[str], group: Any) -> ReshardedStorageReader | None:
    """A reader of a step another number of ranks saved, or None on every rank: rank 0 reads old rank 0's
    ``.metadata`` and every rank gets it (one ``all_gather_object``)."""
    answer: tuple[str, bytes | None] = ("", None)
    if group_rank(group) == 0:
        try:
            fs0 = held.state(0)
            meta = fs0.raw_bytes(METADATA_NAME) if isinstance(fs0, FileSet) and METADATA_NAME in fs0 else None
            answer = ("" if meta is not None else f"old rank 0's snapshot has no {METADATA_NAME}", meta)
        except FlashCheckpointError as e:
            answer = (str(e), None)
    error, meta = all_gather(answer, group)[0]
    if error or meta is None:
        log.info("open_memory_reader: the %d-rank step %d in memory cannot be read (%s); reading from storage",
                 held.world, held.step, error)
        return None
    metadata: Metadata = pickle.loads(meta)  # the coordinator's own pickle (as DCP reads .metadata)
    return ReshardedStorageReader(path, metadata=metadata, held=held, process_group=group)


def _index_key(idx: MetadataIndex) -> tuple[str, tuple[int, ...]]:
    return idx.fqn, tuple(idx.offset or ())


def _held(fileset: FileSet | None) -> tuple[dict[str, list[Any]], bytes | None]:
    """This rank's data files in ``fileset`` (name -> parts) and the ``.metadata`` it holds (the coordinator's)."""
    files: dict[str, list[Any]] = {}
    meta_bytes: bytes | None = None
    if fileset is None:
        return files, meta_bytes
    for name, e in fileset.items():
        if name == METADATA_NAME:
            meta_bytes = fileset.raw_bytes(name)
        elif DATA_FILE.match(name) and e.format == "raw":
            files[name] = e.data if isinstance(e.data, list) else [e.data]
    return files, meta_bytes


def open_memory_reader(fileset: FileSet | Resharded | None, path: str | os.PathLike[str], *,
                       process_group: Any = None) -> FileSetStorageReader | None:
    """A reader over the ranks' in-memory sets of one checkpoint, or None (on every rank) when they cannot
    serve it: a rank lacks its set, the coordinator's ``.metadata`` is missing, or the checkpoint has data
    files that no current rank holds (it was saved by a different number of ranks or another layout).
    Given a ``Resharded`` (every rank: ``load_memory`` of a step that ``locate(reshard=True)`` found saved by
    another number of ranks), a ``ReshardedStorageReader`` over the old ranks' snapshots.

    Collective: every rank of ``process_group`` calls it (one ``all_gather_object``), passing its own set
    (None when it has none). Single-process use needs no process group.

    Args:
        fileset: this rank's ``FileSet`` of the checkpoint (from ``CheckpointEngine.load_memory``).
        path: the checkpoint's directory (its ``checkpoint_id``).
        process_group: the group DCP loads with.
    """
    if isinstance(fileset, Resharded):
        return _resharded_reader(fileset, path, process_group)
    files, meta_bytes = _held(fileset)
    gathered = all_gather((None if fileset is None else list(files), meta_bytes), process_group)
    if any(g[0] is None for g in gathered):
        log.info("open_memory_reader: a rank holds no snapshot of the checkpoint; reading from storage")
        return None
    meta_raw = gathered[0][1]
    if meta_raw is None:
        log.info("open_memory_reader: rank 0's snapshot has no %s; reading from storage", METADATA_NAME)
        return None
    metadata: Metadata = pickle.loads(meta_raw)  # the coordinator's own pickle (as DCP reads .metadata)
    owners: dict[str, int] = {}
    for rank, (rank_names, _) in enumerate(gathered):
        for n in rank_names:
            if n in owners:
                log.info("open_memory_reader: ranks %d and %d both hold %s (snapshots of different runs); reading "
                         "from storage", owners[n], rank, n)
                return None
            owners[n] = rank
    needed = {info.relative_path for info in (metadata.storage_data or {}).values()}
    missing = sorted(needed - set(owners))
    if missing:
        log.info("open_memory_reader: the checkpoint's files %s are held by no current rank (saved with another "
                 "layout); reading from storage", missing[:4])
        return None
    return FileSetStorageReader(path, metadata=metadata, files=files, owners=owners, process_group=process_group)
