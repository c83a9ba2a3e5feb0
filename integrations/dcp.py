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

import dataclasses
import io
import logging
import os
import pickle
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from flashckpt import FileSet
from flashckpt import errors as E
from flashckpt.errors import FlashCheckpointError
from flashckpt.integrations._dcp_format import METADATA_NAME, data_file_name, torch_save_frame
from flashckpt.integrations._dcp_memory import FileSetStorageReader, open_memory_reader
from flashckpt.integrations._dcp_store import BackendStorageReader
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystem,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
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


