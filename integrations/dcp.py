"""PyTorch Distributed Checkpoint (DCP) over flashckpt ``FileSet``s: a ``StorageWriter`` that stages a
rank's items for a memory snapshot instead of writing them, a ``StorageReader`` that serves them back
from memory, and ``BackendStorageReader`` (``_dcp_store``), which reads a persisted checkpoint through a
flashckpt storage backend (an ``s3://`` checkpoint dir without a download). Framework-neutral (plain DCP: FSDP, FSDP2/``fully_shard``, DTensor, ShardedTensor and
megatron-core's ``torch_dist`` format all go through it); ``flashckpt.integrations.fsdp`` is its first user.

The persisted layout is the one ``FileSystemWriter`` writes (torch 2.13, ``filesystem.py``), so
``torch.distributed.checkpoint.load`` with a ``FileSystemReader`` loads it without flashckpt:

- one data file per rank, ``__{rank}_0.distcp``: the rank's BYTE_IO items first (the bytes the
  planner's ``resolve_data`` gives), then its tensor items, each a complete ``torch.save`` of the
  tensor, in plan order (what ``FileSystemWriter(thread_count=1)`` writes on a CPU-only machine);
- ``.metadata``: the pickled ``Metadata`` of DCP's coordinator, with ``storage_data`` mapping every
  ``MetadataIndex`` to ``_StorageInfo(relative_path, offset, length)``. It is the commit marker: the
  coordinator stages it as a ``kind="commit"`` entry, which flashckpt moves into place only after every
  rank's data file is durable.

A tensor record is the ``torch.save`` output split around its data: the bytes before the data and the
bytes after it depend only on dtype and shape, so they are computed once per (dtype, shape) with
``torch.serialization.skip_data`` (no data touched), and the record is ``[head, tensor, tail]`` with the
tensor as a ``FileSet`` part (copied once, into shared memory). Offsets and lengths of every item are
therefore known in ``write_data`` before anything is written, and ``WriteResult``s are returned at once.
The one difference from ``FileSystemWriter``'s bytes: tensor records carry no CRC-32 of their data (as
with ``torch.serialization.set_crc32_options(False)``; ``torch.load`` does not check it), and their
``.data/serialization_id`` differs accordingly. flashckpt's manifest holds an xxh3 checksum of every
file instead.

Call order (DCP's, see ``StorageWriter``/``StorageReader``)::

    writer = FileSetStorageWriter()                 # one per checkpointer, reused: keeps plan caches
    dcp.save(sd, checkpoint_id=dir, storage_writer=writer, planner=CachingSavePlanner())   # all ranks
    fs = writer.take_fileset()                      # this rank's FileSet; the coordinator's has .metadata
    engine.save(step, fs, path=dir, storage_type=...)

    reader = open_memory_reader(engine.load_memory(step), dir)   # all ranks; None: layout differs
    dcp.load(sd, storage_reader=reader or FileSystemReader(dir))
    # a checkpoint dir in a store (s3://...): read it through the engine's backend, without a download
    dcp.load(sd, storage_reader=BackendStorageReader(engine.storage, dir))

Memory reads: each rank holds only its own data file; items another rank wrote (DCP deduplicates
replicated items such as optimizer step counters and non-tensor values to one rank) are exchanged with
one ``all_gather_object`` inside ``read_data``, which DCP calls on every rank.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import logging
import os
import pickle
import re
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from flashckpt import FileSet
from flashckpt import errors as E
from flashckpt.errors import CheckpointCorruptError, FlashCheckpointError
from flashckpt.format.files import tensor_view
from flashckpt.format.torchfile import torch_save_parts
from flashckpt.integrations._dcp_store import BackendStorageReader, fill_target
from flashckpt.integrations._kit import exchange_files
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    FileSystem,
    FileSystemReader,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

__all__ = ["FileSetStorageWriter", "FileSetStorageReader", "BackendStorageReader", "CachingSavePlanner",
           "open_memory_reader", "torch_save_frame", "data_file_name", "METADATA_NAME"]

log = logging.getLogger(__name__)

METADATA_NAME = ".metadata"
_DATA_FILE = re.compile(r"^__(\d+)_(\d+)" + re.escape(DEFAULT_SUFFIX) + "$")


def data_file_name(rank: int) -> str:
    """The data file of ``rank`` (its rank in the checkpoint's process group): ``__{rank}_0.distcp``."""
    return f"__{rank}_0{DEFAULT_SUFFIX}"


# ------------------------------------------------------------------------------------- tensor records
_FRAMES: dict[tuple[torch.dtype, tuple[int, ...]], tuple[bytes, bytes]] = {}


def torch_save_frame(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """The bytes ``torch.save`` writes before and after the data of a contiguous CPU tensor of this dtype
    and shape: ``head + data (C order) + tail`` is a ``torch.save`` file of that tensor.

    Computed once per (dtype, shape) and cached; no tensor data is allocated or touched.

    Raises:
        FlashCheckpointError: this torch writes ``torch.save`` files in a way the split does not expect.
    """
    key = (dtype, tuple(shape))
    frame = _FRAMES.get(key)
    if frame is not None:
        return frame
    # The tensor is never touched (skip_data only records its size): no pages are used.
    parts = torch_save_parts(torch.empty(shape, dtype=dtype))
    if len(parts) == 1 and isinstance(parts[0], bytes):  # no data (a zero-size tensor)
        frame = (parts[0], b"")
    elif len(parts) == 3 and isinstance(parts[0], bytes) and isinstance(parts[2], bytes):
        frame = (parts[0], parts[2])
    else:
        raise FlashCheckpointError(f"torch_save_frame({dtype}, {tuple(shape)}): torch {torch.__version__} wrote the "
                                   "tensor's data in an unexpected way; flashckpt's DCP writer does not support this "
                                   "torch version")
    _FRAMES[key] = frame
    return frame


# ------------------------------------------------------------------------------------------- planning
class CachingSavePlanner(DefaultSavePlanner):
    """DCP's ``DefaultSavePlanner`` with plan caching (``enable_plan_caching=True``) under a key of its own.

    DCP caches plans in class-level dicts keyed by the planner's class name, so two checkpointers in one
    process would evict each other; each instance here has its own key, and ``forget()`` drops its cache.
    DCP compares plans by keys, offsets and sizes only: a tensor that changes dtype at the same shape would
    reuse a stale plan, so the dtypes are compared here as well (the rank resends its plan, and the
    coordinator sends the rank its new global plan instead of "use the cached one").

    While the state dict's structure is unchanged, ``dcp.save`` exchanges only empty plans: the global
    plan and the metadata are reused.
    """

    def __init__(self, key: str | None = None) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = key or f"flashckpt-{uuid.uuid4().hex}"
        self._dtypes: tuple[Any, ...] | None = None

    def set_up_planner(self, state_dict: Any, storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        dtypes = tuple((k, v.dtype) for k, v in self.state_dict.items() if isinstance(v, torch.Tensor))
        if dtypes != self._dtypes:
            SavePlanner._cached_save_plan.pop(self._cached_plans_key, None)  # resend this rank's plan
            self._dtypes = dtypes

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # Coordinator only. DCP sends a rank an empty "use your cached plan" delta when its new global plan
        # compares equal to the cached one, and that comparison ignores dtypes: send the plan itself then.
        old = SavePlanner._cached_global_plan.get(self._cached_plans_key)
        delta, metadata = super().create_global_plan(all_plans)
        if old is not None and len(old) == len(delta):
            delta = [new if not d.usable and _plan_dtypes(prev) != _plan_dtypes(new) else d
                     for d, prev, new in zip(delta, old, self.global_plan, strict=True)]
        return delta, metadata

    def forget(self) -> None:
        """Drops this planner's cached plans and metadata (the next save plans afresh)."""
        for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_final_save_plan,
                      SavePlanner._cached_all_plans, SavePlanner._cached_global_plan, SavePlanner._cached_metadata):
            cache.pop(self._cached_plans_key, None)
        self._dtypes = None


def _plan_dtypes(plan: SavePlan) -> tuple[Any, ...]:
    return tuple((i.index.fqn, i.index.offset, i.tensor_data.properties.dtype if i.tensor_data else None)
                 for i in plan.items)


@dataclass(frozen=True)
class _RankFile:
    """``SavePlan.storage_data``: the data file the rank writes."""

    name: str


# ------------------------------------------------------------------------------------------- writer
class FileSetStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` that writes nothing: it lays the rank's items out exactly as
    ``FileSystemWriter`` would in ``__{rank}_0.distcp`` and stages them in a ``FileSet``.

    Call order (DCP's): ``reset`` (all ranks), ``set_up_storage_writer`` (all), ``prepare_local_plan``
    (all), ``prepare_global_plan`` (coordinator), ``write_data`` (all: stages the rank's data file and
    returns its ``WriteResult``s at once), ``finish`` (coordinator: adds ``.metadata`` as a
    ``kind="commit"`` entry). After ``dcp.save`` returns, ``take_fileset()`` hands the set over.

    The set references the state dict's tensors (no copy): pass it to ``CheckpointEngine.save`` before
    the tensors change. Reuse one writer (and one ``CachingSavePlanner``) across saves.

    Args:
        path: the checkpoint directory (DCP's ``checkpoint_id``); ``dcp.save(checkpoint_id=...)`` sets it.
    """

    def __init__(self, path: str | os.PathLike[str] = "") -> None:
        super().__init__()
        self.path = path
        self.save_id = uuid.uuid4().hex
        self.rank: int | None = None
        self.is_coordinator = False
        self._fileset: FileSet | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = checkpoint_id
        self.save_id = uuid.uuid4().hex
        self._fileset = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise E.InvalidArgumentError("FileSetStorageWriter: dcp.save(use_collectives=False) writes per-rank metadata, which "
                             "this writer does not support; save with collectives (the default)")
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=_RankFile(data_file_name(i))) if p.storage_data is None else p
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rf = plan.storage_data
        name = rf.name if isinstance(rf, _RankFile) else data_file_name(self.rank or 0)
        parts: list[Any] = []
        pending = bytearray()
        results: list[WriteResult] = []
        offset = 0

        def add(item: WriteItem, length: int) -> None:
            nonlocal offset
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(name, offset, length)))
            offset += length

        for item in plan.items:  # FileSystemWriter writes BYTE_IO items first
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                if not isinstance(data, io.BytesIO):
                    raise E.InvalidArgumentTypeError(f"FileSetStorageWriter: {item.index.fqn}: the planner resolved a BYTE_IO item "
                                    f"to a {type(data).__name__}, not io.BytesIO")
                buf = data.getbuffer()
                pending += buf
                add(item, len(buf))
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            t = planner.resolve_data(item)
            if not isinstance(t, torch.Tensor):
                raise E.InvalidArgumentTypeError(f"FileSetStorageWriter: {item.index.fqn}: the planner resolved a tensor item to a "
                                f"{type(t).__name__}")
            t = t.detach()
            td = item.tensor_data
            want = tuple(td.chunk.sizes) if td is not None else tuple(t.shape)
            if td is not None and (tuple(t.shape) != want or t.dtype != td.properties.dtype):
                raise FlashCheckpointError(
                    f"FileSetStorageWriter: {item.index.fqn} is a {t.dtype} tensor of shape {tuple(t.shape)}, but "
                    f"the save plan says {td.properties.dtype} {want}; the plan is stale (call forget() on the "
                    "planner)")
            head, tail = torch_save_frame(t.dtype, tuple(t.shape))
            pending += head
            parts.append(bytes(pending))
            parts.append(t)
            pending = bytearray(tail)
            add(item, len(head) + t.numel() * t.element_size() + len(tail))
        if pending:
            parts.append(bytes(pending))
        fs = FileSet()
        fs.add_raw(name, parts)
        self._fileset = fs
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rl in results for wr in rl}
        metadata.storage_meta = self.storage_meta()
        if self._fileset is None:
            raise FlashCheckpointError("FileSetStorageWriter.finish(): write_data() did not run on the coordinator")
        self._fileset.add_raw(METADATA_NAME, pickle.dumps(metadata), kind="commit")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str | os.PathLike[str]:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return FileSystem.validate_checkpoint_id(checkpoint_id)

    def take_fileset(self) -> FileSet:
        """This rank's staged set of the last ``dcp.save`` (the coordinator's holds ``.metadata``); once.

        Raises:
            FlashCheckpointError: no ``dcp.save`` staged anything since the last call.
        """
        fs, self._fileset = self._fileset, None
        if fs is None:
            raise FlashCheckpointError("FileSetStorageWriter.take_fileset(): nothing staged; run dcp.save with this "
                                       "writer first")
        return fs


# ------------------------------------------------------------------------------------------- reader
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


def _index_key(idx: MetadataIndex) -> tuple[str, tuple[int, ...]]:
    return idx.fqn, tuple(idx.offset or ())


def open_memory_reader(fileset: FileSet | None, path: str | os.PathLike[str], *,
                       process_group: Any = None) -> FileSetStorageReader | None:
    """A reader over the ranks' in-memory sets of one checkpoint, or None (on every rank) when they cannot
    serve it: a rank lacks its set, the coordinator's ``.metadata`` is missing, or the checkpoint has data
    files that no current rank holds (it was saved by a different number of ranks or another layout).

    Collective: every rank of ``process_group`` calls it (one ``all_gather_object``), passing its own set
    (None when it has none). Single-process use needs no process group.

    Args:
        fileset: this rank's ``FileSet`` of the checkpoint (from ``CheckpointEngine.load_memory``).
        path: the checkpoint's directory (its ``checkpoint_id``).
        process_group: the group DCP loads with.
    """
    names: list[str] | None = None
    meta_bytes: bytes | None = None
    files: dict[str, list[Any]] = {}
    if fileset is not None:
        names = []
        for name, e in fileset.items():
            if name == METADATA_NAME:
                meta_bytes = fileset.raw_bytes(name)
            elif _DATA_FILE.match(name) and e.format == "raw":
                names.append(name)
                files[name] = e.data if isinstance(e.data, list) else [e.data]
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        gathered: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, (names, meta_bytes), group=process_group)
    else:
        gathered = [(names, meta_bytes)]
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
