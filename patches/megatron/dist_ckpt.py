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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from flashckpt import CheckpointEngine, FileSet, StorageType
from flashckpt import errors as E
from flashckpt.commit.retention import CheckpointDeletionStrategy
from flashckpt.engine.adapter import LOCAL, STORAGE, AdapterBase, LoadAttempt, Opened
from flashckpt.engine.collective import rank
from flashckpt.engine.engine import LoadResult, Located
from flashckpt.engine.reshard import Resharded
from flashckpt.engine.routing import path_inside, step_of
from flashckpt.errors import FlashCheckpointError
from flashckpt.integrations.dcp import METADATA_NAME, open_memory_reader
from flashckpt.integrations.telemetry import report_line
from flashckpt.patches.megatron._stager import DistcpStager
from flashckpt.patches.megatron._view import View, from_rank0, raw_entry
from flashckpt.storage import locations
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import serialization as _ser
from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingConfig
from megatron.core.dist_checkpointing.strategies import torch as _mtorch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    SaveShardedStrategy,
)
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_plan
from megatron.core.dist_checkpointing.validation import StrictHandling

__all__ = ["MegatronCheckpointer", "FlashCkptSaveStrategy", "save", "load", "iteration_dir", "TRACKER_NAME",
           "StorageType"]

log = logging.getLogger(__name__)
_MEGATRON_LOG = logging.getLogger("megatron.core.dist_checkpointing")  # where megatron-core logs its saves

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


class MegatronCheckpointer(AdapterBase):
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
        engine: use this engine instead of constructing one (its ``checkpoint_dir`` and local tier win).
        local_dir: a node-local directory (NVMe, a local disk) as the fast tier: a DISK save commits there
            first (``iter_XXXXXXX`` and the tracker file under the same relative paths) and the node's saver
            uploads it to ``checkpoint_dir`` in the background; a load reads it when this node's copy holds
            every rank's files of the newest iteration (megatron-core reads across ranks), else
            ``checkpoint_dir``. None: FLASHCKPT_LOCAL_DIR (unset: no local tier).
        local_max_to_keep: iterations the local tier keeps (0 keeps all; one not yet uploaded is never
            deleted).

    Thread safety: one training thread per checkpointer. A save returns once the shards are in shared
    memory; the model may then change.
    """

    def __init__(self, checkpoint_dir: str, *, max_to_keep: int = 0,
                 deletion_strategy: CheckpointDeletionStrategy | None = None, weights_only: bool = True,
                 engine: CheckpointEngine | None = None, local_dir: str | os.PathLike[str] | None = None,
                 local_max_to_keep: int = 2) -> None:
        self.engine = engine or CheckpointEngine(checkpoint_dir, max_to_keep=max_to_keep,
                                                 deletion_strategy=deletion_strategy, replicated=False,
                                                 weights_only=weights_only, local_dir=local_dir,
                                                 local_max_to_keep=local_max_to_keep)
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
        report_line(_MEGATRON_LOG, step, self.engine)  # the figures in Megatron's own log

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
        """Where the newest checkpoint every rank has lives (``Located``: step, source, path; ``world``: the
        number of ranks that saved a step in memory when this job has another, which ``load`` reads resharded).
        Collective."""
        return self.engine.locate(reshard=True)

    def memory_view(self, checkpoint_dir: str | None = None) -> View | None:
        """A context that lets megatron-core's loading functions read a checkpoint from memory.

        Collective: every rank calls it. ``checkpoint_dir`` None means the newest checkpoint every rank
        holds; a directory is served from memory only when it is that checkpoint. Returns None (on every
        rank) when memory cannot serve it; then read it from storage.
        """
        r = self.resolve_load(op="memory_view()", event="megatron_memory_view", logger=log, reshard=True,
                              refuse=_asked_for(checkpoint_dir), from_storage=lambda _attempt: None,
                              from_memory=lambda loc, fs: self.view_of(loc, fs))
        if r.source != "memory":
            return None
        self.last_load = r.result()
        view: View = r.value
        return view

    def view_of(self, loc: Located, fs: Any) -> View | str:
        """The view of the located step from this rank's snapshot ``fs`` (collective: rank 0's ``common.pt``
        and ``metadata.json`` go to every rank, and the ranks' data files are gathered), or why memory
        cannot serve it (on every rank)."""
        assert loc.step is not None and loc.path is not None  # a memory location has both
        reader = open_memory_reader(fs if isinstance(fs, (FileSet, Resharded)) else None, loc.path)
        fs0 = fs.state(0) if isinstance(fs, Resharded) and rank() == 0 else fs  # another layout: old rank 0's
        head = from_rank0(raw_entry(fs0, COMMON_STATE_FNAME), raw_entry(fs0, CONFIG_FNAME))
        if reader is None or head is None:
            return f"the snapshot of iteration {loc.step} cannot be served from memory"
        common, config = head
        return View(loc.path, loc.step, reader, common, config, self.weights_only)

    def store_view(self, path: str, step: int | None = None) -> View:
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
        return View(path, step, BackendStorageReader(storage, path), common, config, self.weights_only)


def _asked_for(checkpoint_dir: str | Path | None) -> Callable[[Located], str]:
    """``refuse`` of a load of ``checkpoint_dir`` (None: the newest): memory serves only that one."""
    def refuse(loc: Located) -> str:
        if loc.path is None:
            return "its directory is not known"
        if checkpoint_dir is not None and locations.normpath(str(checkpoint_dir)) != locations.normpath(loc.path):
            return f"{checkpoint_dir} is asked for"
        return ""

    return refuse


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
        thread_count: files per rank, as for megatron-core's ``TorchDistSaveShardedStrategy``.
        keep_only_main_replica: as for megatron-core's ``TorchDistSaveShardedStrategy``.
        separation_hint: as for megatron-core's ``TorchDistSaveShardedStrategy``.
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
        stager = DistcpStager(checkpoint_dir, self.thread_count, self.separation_hint)
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
    damaged); with a directory, that checkpoint (from memory when it is the one memory holds). With a local
    tier, the newest committed checkpoint is read from this node's local dir when it holds every rank's
    files of it (``last_load.source`` "local"), also when ``checkpoint_dir`` names it. A checkpoint in a
    store (``s3://...``) is read through the storage backend (``store_view``). Collective: call it on every
    rank.

    Returns:
        What ``dist_checkpointing.load`` returns, or None when there is no checkpoint at all.
        ``checkpointer.last_load`` tells the step and where it came from.
    """
    def from_memory(loc: Located, fs: Any) -> Opened | str:
        view = checkpointer.view_of(loc, fs)
        if isinstance(view, str):
            return view
        with view:
            out = dist_checkpointing.load(sharded_state_dict, view.path, sharded_strategy, common_strategy,
                                          validate_access_integrity, strict)
        return Opened(out, view.step)

    def from_storage(attempt: LoadAttempt) -> Opened | None:
        step: int | None = None
        where = str(checkpoint_dir) if checkpoint_dir is not None else None
        loc = attempt.located
        if where is None or (loc.source == LOCAL and checkpointer.engine.local_path(where) == loc.path):
            loc = attempt.stored()  # the newest; "local": this node's whole copy (a directory of the local dir)
            if loc.path is None:
                return None
            step, where = loc.step, loc.path
        if locations.is_url(where):  # a store: megatron-core's own load, its reads through the backend
            with checkpointer.store_view(where, step) as store:
                return Opened(dist_checkpointing.load(sharded_state_dict, store.path, sharded_strategy,
                                                      common_strategy, validate_access_integrity, strict), step)
        return Opened(dist_checkpointing.load(sharded_state_dict, where, sharded_strategy, common_strategy,
                                              validate_access_integrity, strict), step, where,
                      source=LOCAL if loc.source == LOCAL and where == loc.path else STORAGE)

    r = checkpointer.resolve_load(op="load()", event="megatron_load", logger=log, reshard=True,
                                  refuse=_asked_for(checkpoint_dir),
                                  from_memory=from_memory, from_storage=from_storage)
    checkpointer.last_load = r.result()
    return r.value
