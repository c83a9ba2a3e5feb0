"""flashckpt for megatron-core's distributed checkpointing (``megatron.core.dist_checkpointing``, the
``torch_dist`` format that Megatron-LM writes by default).

A save copies every rank's shards into node shared memory and returns; the node's saver persists them in
the background, in exactly the files megatron-core writes::

    iter_0000100/
      metadata.json          {"sharded_backend": "torch_dist", ...}   (rank 0)
      common.pt              torch.save of the common (non-sharded) state   (rank 0)
      __<rank>_<i>.distcp    each rank's tensor and object shards, split into ``thread_count`` files and
                             laid out as megatron-core's ``FileSystemWriterAsync`` lays them out
      .metadata              DCP's global metadata (rank 0): moved into place only after every rank's
                             files are durable, so a directory without it is never a checkpoint
    latest_checkpointed_iteration.txt   (with ``tracker=True``) written once the step is committed

so vanilla ``dist_checkpointing.load`` (and Megatron-LM) reads it without flashckpt. After a restart,
``load`` serves the newest checkpoint every rank holds straight from memory: each rank reads its own
shards in place and gets the shards other ranks wrote (replicas saved once) through one exchange.

The checkpoint dir may be a URL a storage backend serves (``s3://bucket/prefix``): the same files are
persisted there, and ``load`` reads a committed iteration from the store without a download (DCP's
reads through ``dcp.BackendStorageReader``, ``common.pt`` and ``metadata.json`` through the backend), with
megatron-core's own loading functions, as for memory (``MegatronCheckpointer.store_view``).

Three ways in:

- ``save`` / ``load``: drop-in versions of ``dist_checkpointing.save`` / ``load`` that route every file
  through flashckpt (nothing is written by the trainer; a MEMORY save touches no storage at all).
- ``FlashCkptSaveStrategy``: a ``sharded_strategy`` for vanilla ``dist_checkpointing.save``. The shards go
  through flashckpt; megatron-core itself still writes ``common.pt`` and ``metadata.json`` into the
  directory (which must exist, locally), so use it for storage saves to a local dir, or ``save`` for
  memory snapshots and for a checkpoint dir in a store.
- ``MegatronCheckpointer.memory_view`` / ``store_view``: a context in which megatron-core's own loading
  functions (``load``, ``load_common_state_dict``, ``get_default_load_sharded_strategy``, ...) read a
  checkpoint that lives only in memory, or in a store (through the storage backend).

Example::

    ckpt = MegatronCheckpointer("/ckpt")
    for it in range(start, iters):
        ...
        sd = model.sharded_state_dict()
        save(sd, iteration_dir("/ckpt", it), checkpointer=ckpt, step=it,
             storage_type=StorageType.DISK if it % 100 == 0 else StorageType.MEMORY)
    ...
    state = load(model.sharded_state_dict(), checkpointer=ckpt)   # None when there is nothing
    model.load_state_dict(state)
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from flashckpt import CheckpointEngine, FileSet, StorageType
from flashckpt import errors as E
from flashckpt.commit.retention import CheckpointDeletionStrategy
from flashckpt.engine.engine import LoadResult
from flashckpt.errors import FlashCheckpointError
from flashckpt.integrations._kit import Adapter, path_inside, rank, step_of, swapped
from flashckpt.integrations.dcp import METADATA_NAME, open_memory_reader, torch_save_frame
from flashckpt.storage import locations
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import serialization as _ser
from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingConfig
from megatron.core.dist_checkpointing.strategies import torch as _mtorch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from megatron.core.dist_checkpointing.strategies.filesystem_async import (
    _split_by_separation_hint,
    _split_by_size_and_type,
)
from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_plan
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    FileSystemReader,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

__all__ = ["MegatronCheckpointer", "FlashCkptSaveStrategy", "save", "load", "iteration_dir", "TRACKER_NAME",
           "StorageType"]

log = logging.getLogger(__name__)

TRACKER_NAME = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d+)$")
_CONTENT_METADATA_KEY = "content_metadata"


def iteration_dir(checkpoint_dir: str, iteration: int) -> str:
    """Megatron-LM's directory of an iteration: ``<checkpoint_dir>/iter_0000100`` (a path or a URL)."""
    return locations.join(checkpoint_dir, f"iter_{iteration:07d}")


def _config_bytes(backend: str, version: int) -> bytes:
    """``metadata.json`` as megatron-core's ``save_config`` writes it."""
    return json.dumps(dataclasses.asdict(CheckpointingConfig(backend, version))).encode()


# ------------------------------------------------------------------------------------------ collecting
@dataclasses.dataclass
class _Collecting:
    """The files of one save being gathered (by ``save``, a strategy, or the Megatron-LM patch)."""

    step: int
    path: str
    storage_type: StorageType
    fileset: FileSet


class MegatronCheckpointer(Adapter):
    """One per checkpoint directory (Megatron-LM's ``--save``): owns the rank's ``CheckpointEngine``.

    Every rank constructs one (it starts or joins the node's saver). Steps are iterations; a step
    commits once every rank's files are durable, and only then is Megatron-LM's tracker written.

    Args:
        checkpoint_dir: the root of all iterations (``iter_XXXXXXX`` directories live in it): a local or
            mounted directory, a ``file://`` URL, or the URL of a storage backend (``s3://bucket/prefix``).
        max_to_keep: committed iterations to keep when no ``deletion_strategy`` is given (0 keeps all,
            like Megatron-LM).
        deletion_strategy: which committed iterations to delete after each commit.
        weights_only: load ``common.pt`` and legacy files with ``torch.load(weights_only=True)``.
        engine: use this engine instead of constructing one (its ``checkpoint_dir`` wins).

    Thread safety: one training thread per checkpointer. A save returns once the shards are in shared
    memory; the model may then change.
    """

    def __init__(self, checkpoint_dir: str, *, max_to_keep: int = 0,
                 deletion_strategy: CheckpointDeletionStrategy | None = None, weights_only: bool = True,
                 engine: CheckpointEngine | None = None) -> None:
        self.engine = engine or CheckpointEngine(checkpoint_dir, max_to_keep=max_to_keep,
                                                 deletion_strategy=deletion_strategy, replicated=False,
                                                 weights_only=weights_only)
        self.checkpoint_dir = self.engine.checkpoint_dir
        self.weights_only = weights_only
        self.last_load: LoadResult | None = None
        self._active: _Collecting | None = None

    # ------------------------------------------------------------------ save
    def check_path(self, path: str | os.PathLike[str], what: str = "save") -> str:
        """The absolute form of ``path``, which must lie inside the checkpoint dir.

        Raises:
            FlashCheckpointError: it does not (nothing was written)."""
        p = self.engine.resolve(path)
        if not path_inside(p, self.checkpoint_dir, strict=True):
            raise FlashCheckpointError(f"{what}({str(path)!r}): the checkpoint must be a directory inside the "
                                       f"checkpointer's dir {self.checkpoint_dir} (for example "
                                       f"{iteration_dir(self.checkpoint_dir, 100)})")
        return p

    @contextlib.contextmanager
    def collecting(self, step: int, path: str, storage_type: StorageType, *,
                   tracker: bool = False) -> Iterator[_Collecting]:
        """Gathers the files every save function inside adds, then snapshots them as one step.

        Nested calls for the same step and path join the outer one (which saves). Nothing is saved
        when the body raises. With ``tracker`` (honoured on rank 0), Megatron-LM's
        ``latest_checkpointed_iteration.txt`` is written once the step is committed.
        """
        if not isinstance(step, int) or step < 0:
            raise E.InvalidArgumentError(f"save(step={step!r}): the iteration must be an integer >= 0")
        if storage_type not in (StorageType.MEMORY, StorageType.DISK):
            raise E.InvalidArgumentError(f"save(storage_type={storage_type!r}): use StorageType.MEMORY or StorageType.DISK")
        path = self.check_path(path)
        outer = self._active
        if outer is not None:
            if (outer.step, outer.path) != (step, path):
                raise FlashCheckpointError(f"save(): a save of iteration {outer.step} to {outer.path} is still being "
                                           f"gathered; cannot start iteration {step} to {path} inside it")
            yield outer
            return
        col = _Collecting(step, path, storage_type, FileSet())
        self._active = col
        try:
            yield col
        finally:
            self._active = None
        if tracker and rank() == 0:
            col.fileset.add_raw(TRACKER_NAME, str(step).encode(), kind="tracker")
        self.engine.save(step, col.fileset, path=col.path, storage_type=storage_type)

    def save_strategy(self, *, step: int | None = None, storage_type: StorageType = StorageType.DISK,
                      thread_count: int = 2) -> FlashCkptSaveStrategy:
        """A ``sharded_strategy`` for vanilla ``dist_checkpointing.save``; see ``FlashCkptSaveStrategy``."""
        return FlashCkptSaveStrategy(self, step=step, storage_type=storage_type, thread_count=thread_count)

    def flash_strategy(self, strategy: Any) -> Any:
        """``strategy`` with flashckpt doing the writing: megatron-core's ``torch_dist`` strategy (or None, or
        a ``('torch_dist', 1)`` tuple) becomes a ``FlashCkptSaveStrategy`` with the same options; a
        ``FullyParallelSaveStrategyWrapper`` gets one as its base (in place, so a strategy Megatron-LM
        caches in ``checkpointing_context`` keeps it).

        Raises:
            FlashCheckpointError: another format (flashckpt writes ``torch_dist`` only)."""
        if strategy is None or strategy == ("torch_dist", 1):
            return FlashCkptSaveStrategy(self)
        if isinstance(strategy, FlashCkptSaveStrategy):
            return strategy
        if isinstance(strategy, _mtorch.TorchDistSaveShardedStrategy):
            return FlashCkptSaveStrategy(self, thread_count=strategy.thread_count,
                                         keep_only_main_replica=strategy.keep_only_main_replica,
                                         separation_hint=strategy.separation_hint)
        base = getattr(strategy, "base_strategy", None)
        if base is not None and isinstance(strategy, SaveShardedStrategy):
            strategy.base_strategy = self.flash_strategy(base)
            return strategy
        raise FlashCheckpointError(f"save(sharded_strategy={strategy}): flashckpt writes the torch_dist format only; "
                                   "use megatron-core's default strategy (ckpt_format='torch_dist')")

    # ------------------------------------------------------------------ load
    def locate(self) -> Any:
        """Where the newest checkpoint every rank has lives (``Located``: step, source, path). Collective."""
        return self.engine.locate()

    def memory_view(self, checkpoint_dir: str | None = None, *, _located: tuple[int, str] | None = None,
                    _fileset: Any = None) -> _View | None:
        """A context that lets megatron-core's loading functions read a checkpoint from memory.

        Collective: every rank calls it. ``checkpoint_dir`` None means the newest checkpoint every rank
        holds; a directory is served from memory only when it is that checkpoint. Returns None (on every
        rank) when memory cannot serve it; then read it from storage.
        """
        t0 = time.perf_counter()
        if _located is not None:  # the caller located and loaded the snapshot already
            step, path = _located
            fs = _fileset
        else:
            loc = self.engine.locate()
            if loc.source != "memory" or loc.step is None or loc.path is None:
                return None
            if checkpoint_dir is not None and locations.normpath(str(checkpoint_dir)) != locations.normpath(loc.path):
                return None
            step, path = loc.step, loc.path
            fs = self.engine.load_memory(step)
        reader = open_memory_reader(fs if isinstance(fs, FileSet) else None, path)
        names = sorted(fs) if isinstance(fs, FileSet) else []
        head = _from_rank0(_raw(fs, COMMON_STATE_FNAME), _raw(fs, CONFIG_FNAME))
        if reader is None or head is None:
            log.info("memory_view(): the snapshot of iteration %d cannot be served from memory; read storage", step)
            return None
        common, config = head
        self.last_load = LoadResult(step, "memory", time.perf_counter() - t0,
                                    self.engine.last_load.nbytes if self.engine.last_load else 0)
        log.info("event=megatron_memory_view step=%d files=%d", step, len(names))
        return _View(path, step, reader, common, config, self.weights_only)

    def store_view(self, path: str, step: int | None = None) -> _View:
        """A context that lets megatron-core's loading functions read the ``torch_dist`` checkpoint at
        ``path`` (an iteration directory in a store, or a local one) through the checkpointer's storage
        backend, without a download: DCP's reads through ``dcp.BackendStorageReader`` (ranged reads of the
        records the rank needs), ``common.pt`` and ``metadata.json`` read whole. Not collective.

        Raises:
            FlashCheckpointError: ``path`` holds no ``metadata.json`` / ``common.pt`` (not a distributed
                checkpoint, or not committed).
        """
        from flashckpt.integrations.dcp import BackendStorageReader

        storage = self.engine.storage
        path = storage.normpath(path)
        try:
            config = CheckpointingConfig(**json.loads(storage.read_bytes(locations.join(path, CONFIG_FNAME))))
            common = storage.read_bytes(locations.join(path, COMMON_STATE_FNAME))
        except FileNotFoundError as e:
            raise FlashCheckpointError(f"load({path!r}): {e.filename or e} does not exist; {path} is not a committed "
                                       "distributed (torch_dist) checkpoint") from e
        return _View(path, step, BackendStorageReader(storage, path), common, config, self.weights_only)


def _raw(fs: Any, name: str) -> bytes | None:
    return fs.raw_bytes(name) if isinstance(fs, FileSet) and name in fs and fs[name].format == "raw" else None


def _from_rank0(common: bytes | None, config: bytes | None) -> tuple[bytes, CheckpointingConfig] | None:
    """Rank 0's ``common.pt`` and ``metadata.json`` for every rank (one broadcast), or None."""
    obj: list[Any] = [(common, config) if rank() == 0 else None]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(obj, src=0)
    common, config = obj[0]
    if common is None or config is None:
        return None
    return common, CheckpointingConfig(**json.loads(config))


# ------------------------------------------------------------------------------------------ serving
class _HeldCommonLoadStrategy(TorchCommonLoadStrategy):
    """megatron-core's common load strategy over ``common.pt`` held in memory (from a snapshot, or read
    from a store)."""

    def __init__(self, common: bytes, weights_only: bool) -> None:
        super().__init__()
        self.common = common
        self.weights_only = weights_only

    def load_common(self, checkpoint_dir: str | Path) -> Any:
        return torch.load(io.BytesIO(self.common), map_location="cpu", weights_only=self.weights_only)

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> Any:
        # The legacy per-object files (``<key>/shard_*.pt``) this scans a local directory for do not exist in
        # a torch_dist checkpoint of ours: its sharded objects live in the DCP files (the sharded strategy's).
        return {}


class _View:
    """While entered, megatron-core reads the checkpoint at ``path`` from memory (a ``FileSetStorageReader``)
    or from a store (a ``BackendStorageReader``): its strategy lookup (``verify_checkpoint_and_load_strategy``)
    and its DCP reader factory (``_get_filesystem_reader``) answer for that one directory, with
    ``common.pt`` and ``metadata.json`` held here. Other directories are read as usual. Not thread-safe:
    megatron-core's module functions are swapped while inside (one training thread)."""

    def __init__(self, path: str, step: int | None, reader: FileSystemReader, common: bytes,
                 config: CheckpointingConfig, weights_only: bool) -> None:
        self.path = locations.normpath(path)
        self.step = step
        self.reader = reader
        self.config = config
        self.common_strategy = _HeldCommonLoadStrategy(common, weights_only)
        self._swaps: Any = None

    def _mine(self, checkpoint_dir: Any) -> bool:
        if checkpoint_dir is None:
            return False
        # megatron-core passes the directory as given, or as a pathlib.Path (which folds a URL's "//")
        return locations.normpath(str(checkpoint_dir)) == self.path or str(checkpoint_dir) == str(Path(self.path))

    def __enter__(self) -> _View:
        orig_verify = _ser.verify_checkpoint_and_load_strategy
        orig_reader = _mtorch._get_filesystem_reader

        def verify(checkpoint_dir: Any, sharded_strategy: Any = None, common_strategy: Any = None) -> Any:
            if not self._mine(checkpoint_dir):
                return orig_verify(checkpoint_dir, sharded_strategy, common_strategy)
            if sharded_strategy is None:
                sharded_strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, self.config.sharded_backend,
                                                        self.config.sharded_backend_version)
            elif isinstance(sharded_strategy, tuple):
                sharded_strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, *sharded_strategy)
            if not isinstance(common_strategy, LoadCommonStrategy):
                common_strategy = self.common_strategy
            return sharded_strategy, common_strategy

        def reader(checkpoint_dir: Any, cache_metadata: bool = False) -> Any:
            return self.reader if self._mine(checkpoint_dir) else orig_reader(checkpoint_dir, cache_metadata)

        swaps = swapped([(_ser, "verify_checkpoint_and_load_strategy", verify),
                         (_mtorch, "_get_filesystem_reader", reader)])
        swaps.__enter__()
        self._swaps = swaps
        return self

    def __exit__(self, *exc: Any) -> None:
        swaps, self._swaps = self._swaps, None
        if swaps is not None:
            swaps.__exit__(None, None, None)


# ------------------------------------------------------------------------------------------ staging
class _DistcpStager:
    """The storage writer megatron-core's planning (``save_state_dict_async_plan``) drives: instead of
    writing, it lays each rank's items out as ``FileSystemWriterAsync`` would (``thread_count`` buckets by
    size, BYTE_IO items first in each, files ``__<rank>_<i>.distcp``) and stages them in a ``FileSet``.
    Errors while staging are kept and reported to every rank by the finalize step."""

    can_run_decentralized_global_plan = True

    def __init__(self, checkpoint_dir: str, thread_count: int, separation_hint: str | None) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.thread_count = thread_count
        self.separation_hint = separation_hint
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = False
        self.fileset = FileSet()
        self.results: list[WriteResult] = []
        self.error: str | None = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(plans)]

    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        return dataclasses.replace(local_plan, storage_data=_StoragePrefix(f"__{rank()}_"))

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        try:
            self._stage(plan, planner)
        except Exception as e:  # reported on every rank by _finalize
            log.exception("staging the rank's shards failed")
            self.error = f"{type(e).__name__}: {e}"

    def _stage(self, plan: SavePlan, planner: SavePlanner) -> None:
        prefix = plan.storage_data.prefix
        bins = self.thread_count // 2 if self.separation_hint is not None else self.thread_count
        if bins < 1:
            raise E.InvalidArgumentError(f"thread_count={self.thread_count}: at least 1 (2 with a separation_hint)")
        buckets = _split_by_size_and_type(bins, plan.items)
        count = 0
        for group, group_buckets in _split_by_separation_hint(buckets, self.separation_hint).items():
            for bucket in group_buckets:
                if not bucket:
                    continue
                name = f"{group}{prefix}{count}{DEFAULT_SUFFIX}"
                count += 1
                self.fileset.add_raw(name, self._file(name, bucket, planner))

    def _file(self, name: str, bucket: list[Any], planner: SavePlanner) -> list[Any]:
        parts: list[Any] = []
        pending = bytearray()
        offset = 0

        def add(index: Any, length: int) -> None:
            nonlocal offset
            self.results.append(WriteResult(index=index, size_in_bytes=length,
                                            storage_data=_StorageInfo(name, offset, length)))
            offset += length

        for item in bucket:
            if item.type == WriteItemType.BYTE_IO:
                data: Any = planner.resolve_data(item)
                buf = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
                pending += buf
                add(item.index, len(buf))
        for item in bucket:
            if item.type == WriteItemType.BYTE_IO:
                continue
            resolved: Any = planner.resolve_data(item)
            t = _saveable(resolved)
            head, tail = torch_save_frame(t.dtype, tuple(t.shape))
            pending += head
            parts.append(bytes(pending))
            parts.append(t)
            pending = bytearray(tail)
            add(item.index, len(head) + t.numel() * t.element_size() + len(tail))
        if pending:
            parts.append(bytes(pending))
        return parts

    def metadata_bytes(self, metadata: Metadata, results: list[list[WriteResult]]) -> bytes:
        """``.metadata`` as ``FileSystemWriter.finish`` writes it."""
        import pickle

        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rl in results for wr in rl}
        metadata.storage_meta = StorageMeta(checkpoint_id=str(self.checkpoint_dir), save_id=self.save_id)
        return pickle.dumps(metadata)


def _saveable(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose ``torch.save`` the data file holds: detached, and a contiguous copy of views (as
    megatron-core clones them), so the record's data is exactly the tensor's bytes in C order."""
    t = t.detach()
    if not (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


class FlashCkptSaveStrategy(AsyncSaveShardedStrategy):
    """A megatron-core save strategy for the ``torch_dist`` format that stages the rank's shards in shared
    memory (flashckpt) instead of writing them; the node's saver persists them in the background.

    Usable as ``sharded_strategy=`` of vanilla ``dist_checkpointing.save`` (which then also writes
    ``common.pt`` and ``metadata.json`` itself, into a directory that must exist; rank 0 stages copies of
    them too, so memory loads have them) or through ``save`` in this module (everything through flashckpt).
    ``save`` and ``async_save`` both return once the shards are in shared memory; the returned
    ``AsyncRequest`` has nothing left to run.

    Args:
        checkpointer: the ``MegatronCheckpointer`` of the checkpoint root.
        step: the iteration; None takes it from the directory's name (``iter_0000100`` -> 100).
        storage_type: MEMORY (a snapshot only) or DISK (also persisted).
        thread_count / keep_only_main_replica / separation_hint: as for megatron-core's
            ``TorchDistSaveShardedStrategy`` (``thread_count`` files per rank).
    """

    def __init__(self, checkpointer: MegatronCheckpointer, *, step: int | None = None,
                 storage_type: StorageType = StorageType.DISK, thread_count: int = 2,
                 keep_only_main_replica: bool = True, separation_hint: str | None = None) -> None:
        super().__init__("torch_dist", 1)
        self.checkpointer = checkpointer
        self.step = step
        self.storage_type = storage_type
        self.thread_count = thread_count
        self.keep_only_main_replica = keep_only_main_replica
        self.separation_hint = separation_hint

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> AsyncRequest:
        self.save(sharded_state_dict, checkpoint_dir)
        return AsyncRequest(None, (), [])

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        ck = self.checkpointer
        path = ck.check_path(checkpoint_dir)
        if ck._active is not None:
            self.stage(sharded_state_dict, path, ck._active.fileset)
            return
        step = self.step if self.step is not None else _iteration_of(path)
        with ck.collecting(step, path, self.storage_type) as col:
            self.stage(sharded_state_dict, path, col.fileset)
            if rank() == 0:
                common = os.path.join(path, COMMON_STATE_FNAME)  # vanilla save wrote it just before calling us
                if not locations.is_url(path) and os.path.exists(common):
                    with open(common, "rb") as f:
                        col.fileset.add_raw(COMMON_STATE_FNAME, f.read())
                col.fileset.add_raw(CONFIG_FNAME, _config_bytes(self.backend, self.version))

    def stage(self, sharded_state_dict: Any, checkpoint_dir: str, into: FileSet) -> None:
        """Plans the save with every rank (collective) and adds this rank's data files, and on rank 0
        ``.metadata`` (a commit-time entry), to ``into``.

        Raises:
            FlashCheckpointError: staging failed on some rank (raised on every rank; nothing is added).
        """
        sd, _, _ = _mtorch._replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        pyt_state_dict = _mtorch.mcore_to_pyt_state_dict(sd, False)
        stager = _DistcpStager(checkpoint_dir, self.thread_count, self.separation_hint)
        planner = _mtorch.MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                           flatten_state_dict=False)
        ret = save_state_dict_async_plan(pyt_state_dict, stager, None, 0, planner=planner)
        _, global_metadata, dist_wrapper = ret[0]
        gathered = dist_wrapper.gather_object(stager.error if stager.error else stager.results)
        problem: str | None = None
        meta: bytes | None = None
        if dist_wrapper.is_coordinator:
            errors = {r: g for r, g in enumerate(gathered) if isinstance(g, str)}
            if errors:
                problem = f"staging failed on ranks {errors}"
            elif global_metadata is None:
                problem = "the coordinator has no global metadata"
            else:
                meta = stager.metadata_bytes(global_metadata, gathered)
        problem = dist_wrapper.broadcast_object(problem)
        if problem:
            raise FlashCheckpointError(f"save({checkpoint_dir!r}): {problem}; nothing was saved")
        into.update(stager.fileset)
        if meta is not None:
            into.add_raw(METADATA_NAME, meta, kind="commit")


def _iteration_of(path: str) -> int:
    step = step_of(path, _ITER_DIR)
    if step is None:
        raise FlashCheckpointError(f"FlashCkptSaveStrategy: cannot tell the iteration of {path!r}; name the directory "
                                   "iter_XXXXXXX (Megatron-LM's layout) or pass step= to the strategy")
    return step


# ------------------------------------------------------------------------------------------ entry points
def save(sharded_state_dict: Any, checkpoint_dir: str | Path, sharded_strategy: Any = None,
         common_strategy: Any = None, validate_access_integrity: bool = True, async_sharded_save: bool = False,
         preprocess_common_before_consistancy_check: Any = None, content_metadata: dict[str, Any] | None = None,
         *, checkpointer: MegatronCheckpointer, step: int, storage_type: StorageType = StorageType.DISK,
         tracker: bool = False) -> AsyncRequest | None:
    """``dist_checkpointing.save`` through flashckpt: the same arguments and the same files, but the
    trainer writes nothing; every file is staged in shared memory and persisted by the saver (DISK).

    Call it on every rank. Returns once the state is in shared memory (an ``AsyncRequest`` with nothing
    left to run when ``async_sharded_save``). With ``tracker``, ``latest_checkpointed_iteration.txt`` is
    written (by the committing saver) once the step is committed.

    Args:
        sharded_state_dict ... content_metadata: as for ``dist_checkpointing.save``.
        checkpointer: the ``MegatronCheckpointer`` whose directory holds ``checkpoint_dir``.
        step: the iteration.
        storage_type: MEMORY (a snapshot only) or DISK (also persisted).
        tracker: update Megatron-LM's tracker file at commit.

    Raises:
        FlashCheckpointError: ``checkpoint_dir`` lies outside the checkpointer's directory, or staging
            failed on a rank (on every rank; nothing was saved).
    """
    if common_strategy is not None:
        raise NotImplementedError("save(common_strategy=...): the only supported common strategy is torch")
    strategy = checkpointer.flash_strategy(sharded_strategy)
    with checkpointer.collecting(step, str(checkpoint_dir), storage_type, tracker=tracker) as col:
        if content_metadata is not None:
            sharded_state_dict[_CONTENT_METADATA_KEY] = content_metadata
        sharded_part, common_state_dict = _ser.save_preprocess(sharded_state_dict, validate_access_integrity,
                                                               preprocess_common_before_consistancy_check)
        if rank() == 0:
            buf = io.BytesIO()
            torch.save(common_state_dict, buf)
            col.fileset.add_raw(COMMON_STATE_FNAME, buf.getvalue())
        strategy.save(sharded_part, col.path)
        if rank() == 0:
            col.fileset.add_raw(CONFIG_FNAME, _config_bytes(strategy.backend, strategy.version))
    return AsyncRequest(None, (), []) if async_sharded_save else None


def load(sharded_state_dict: Any, checkpoint_dir: str | Path | None = None, sharded_strategy: Any = None,
         common_strategy: Any = None, validate_access_integrity: bool = True,
         strict: str | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED, *,
         checkpointer: MegatronCheckpointer) -> Any:
    """``dist_checkpointing.load`` that reads from memory when it can.

    With ``checkpoint_dir`` None it loads the newest checkpoint every rank has (memory first, else the
    newest committed one on storage, checksum-verified, falling back to the previous committed one when
    damaged); with a directory, that checkpoint (from memory when it is the one memory holds). A checkpoint
    in a store (``s3://...``) is read through the storage backend (``store_view``). Collective: call it on
    every rank.

    Returns:
        What ``dist_checkpointing.load`` returns, or None when there is no checkpoint at all.
        ``checkpointer.last_load`` tells the step and where it came from.
    """
    t0 = time.perf_counter()
    view = checkpointer.memory_view(str(checkpoint_dir) if checkpoint_dir is not None else None)
    if view is not None:
        with view:
            out = dist_checkpointing.load(sharded_state_dict, view.path, sharded_strategy, common_strategy,
                                          validate_access_integrity, strict)
        checkpointer.last_load = LoadResult(view.step, "memory", time.perf_counter() - t0,
                                            checkpointer.last_load.nbytes if checkpointer.last_load else 0)
        log.info("event=megatron_load step=%d source=memory seconds=%.4f", view.step, checkpointer.last_load.seconds)
        return out
    step: int | None = None
    if checkpoint_dir is None:
        loc = checkpointer.engine.locate()
        if loc.source == "memory":  # memory could not serve it: the newest committed step that verifies
            loc = checkpointer.engine.locate(memory=False)
        step, path = loc.step, loc.path
        if path is None:
            checkpointer.last_load = LoadResult(None, "none", time.perf_counter() - t0, 0)
            return None
        checkpoint_dir = path
    where = str(checkpoint_dir)
    if locations.is_url(where):  # a store: megatron-core's own load, its reads through the backend
        with checkpointer.store_view(where, step) as store:
            out = dist_checkpointing.load(sharded_state_dict, store.path, sharded_strategy, common_strategy,
                                          validate_access_integrity, strict)
    else:
        out = dist_checkpointing.load(sharded_state_dict, where, sharded_strategy, common_strategy,
                                      validate_access_integrity, strict)
    checkpointer.last_load = LoadResult(step, "storage", time.perf_counter() - t0, 0)
    log.info("event=megatron_load step=%s source=storage seconds=%.4f", step, checkpointer.last_load.seconds)
    return out
