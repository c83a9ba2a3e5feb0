"""FsdpShardCheckpointer: flash checkpoints for sharded training (FSDP2 ``fully_shard``, FSDP, DTensor)
through PyTorch Distributed Checkpoint (DCP).

Every rank holds a unique shard, so every rank snapshots its own into the node's shared memory. The save
runs ``torch.distributed.checkpoint.save`` with a ``StorageWriter`` that stages the rank's items instead of
writing them (``flashckpt.integrations.dcp``; the save plan is computed once and reused while the state dict's
structure is unchanged); the saver then persists them in DCP's own layout (``__{rank}_0.distcp`` per rank,
``.metadata`` last, as the commit marker), so ``dcp.load`` with a ``FileSystemReader`` loads a persisted
checkpoint without flashckpt, on any number of ranks.

The checkpoint dir may be a URL a storage backend serves (``s3://bucket/prefix``): the saver persists the
same files there, and loads from the store go through ``dcp.BackendStorageReader`` (ranged reads through
the backend, no download); ``dcp.load`` with a ``FileSystemReader`` reads a downloaded copy.

Example::

    from torch.distributed.checkpoint.state_dict import get_state_dict

    checkpointer = FsdpShardCheckpointer("/ckpt")
    extra = checkpointer.load_checkpoint(model, optimizer)      # {} on a fresh start
    start = extra.get("step", 0) + 1
    for step in range(start, steps + 1):
        ...
        model_sd, optim_sd = get_state_dict(model, optimizer)
        sd = {"model": model_sd, "optim": optim_sd, "step": step}
        if step % 10 == 0:
            checkpointer.save_checkpoint(step, sd, f"step_{step}", storage_type=StorageType.MEMORY)
        if step % 100 == 0:
            checkpointer.save_checkpoint(step, sd, f"step_{step}", storage_type=StorageType.DISK)

Or with DCP's own API: ``reader = checkpointer.get_storage_reader()`` and ``dcp.load(sd, storage_reader=reader)``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from flashckpt import CheckpointEngine, FileSet, StorageType
from flashckpt import errors as E
from flashckpt.commit.retention import CheckpointDeletionStrategy
from flashckpt.engine.adapter import LOCAL, AdapterBase, LoadAttempt, Opened, Resolved, is_stored, log_load
from flashckpt.engine.engine import LoadResult, Located
from flashckpt.engine.reshard import Resharded
from flashckpt.engine.routing import path_inside
from flashckpt.errors import CheckpointCorruptError
from flashckpt.storage import locations

__all__ = ["FsdpShardCheckpointer", "StorageType", "SaveTiming"]

log = logging.getLogger(__name__)

MODEL_KEY = "model"
OPTIM_KEY = "optim"


@dataclass(frozen=True)
class SaveTiming:
    """Where the pause of the last ``save_checkpoint`` went: DCP's planning and its collectives
    (``plan_s``), and the copy into shared memory (``snapshot_s``)."""

    step: int
    plan_s: float
    snapshot_s: float

    @property
    def total_s(self) -> float:
        return self.plan_s + self.snapshot_s


class FsdpShardCheckpointer(AdapterBase):
    """Checkpointer for sharded state dicts (DTensor / ShardedTensor), in DCP's format.

    Args:
        checkpoint_dir: where checkpoints are persisted (shared by all nodes): a local or mounted
            directory, a ``file://`` URL, or the URL of a storage backend (``s3://bucket/prefix``); one DCP
            checkpoint directory per step lives inside it.
        deletion_strategy: which committed checkpoints to delete; None keeps the newest ``max_to_keep``.
        max_to_keep: committed checkpoints kept without a ``deletion_strategy`` (0 keeps all).
        process_group: the group that saves and loads (the default group when None); DCP's coordinator is
            its rank 0.
        local_dir: a node-local directory (NVMe, a local disk) as the fast tier: a DISK save commits there
            first and the node's saver uploads it to ``checkpoint_dir`` in the background; a load reads it
            when this node's copy holds every rank's files of the newest step (DCP reads across ranks), else
            ``checkpoint_dir``. None: FLASHCKPT_LOCAL_DIR (unset: no local tier).
        local_max_to_keep: steps the local tier keeps (0 keeps all; a step not yet uploaded is never
            deleted).

    Every rank of the group constructs one and makes the same calls (they are collective).
    """

    def __init__(self, checkpoint_dir: str, *, deletion_strategy: CheckpointDeletionStrategy | None = None,
                 max_to_keep: int = 0, process_group: Any = None, local_dir: str | os.PathLike[str] | None = None,
                 local_max_to_keep: int = 2) -> None:
        from flashckpt.integrations.dcp import CachingSavePlanner, FileSetStorageWriter

        self.engine = CheckpointEngine(checkpoint_dir, max_to_keep=max_to_keep, deletion_strategy=deletion_strategy,
                                       replicated=False, process_group=process_group, local_dir=local_dir,
                                       local_max_to_keep=local_max_to_keep)
        self.checkpoint_dir = self.engine.checkpoint_dir
        self.process_group = process_group
        self._writer = FileSetStorageWriter()
        self._planner = CachingSavePlanner()
        self.last_save: SaveTiming | None = None
        self.last_load: LoadResult | None = None

    # ------------------------------------------------------------------ save
    def save_checkpoint(self, step: int, state_dict: Any, path: str = "",
                        storage_type: StorageType = StorageType.DISK) -> bool:
        """Snapshots this rank's shard of ``state_dict`` to memory and, with DISK, persists the step in
        the background as a DCP checkpoint in directory ``path``.

        Call it on every rank with the same arguments. Returns once the shard is in shared memory; the
        state may then be changed. The step is committed (``.metadata`` written) only once every rank's
        data file is durable.

        Args:
            step: the training step (newer steps are larger).
            state_dict: what ``dcp.save`` accepts: a dict of DTensors / ShardedTensors / tensors / plain
                values or ``Stateful`` objects, e.g. ``{"model": m_sd, "optim": o_sd, "step": step}`` with
                ``m_sd, o_sd = get_state_dict(model, optimizer)`` (what ``load_checkpoint`` expects).
            path: the checkpoint's directory inside ``checkpoint_dir``, one per step: absolute, or relative
                as ``CheckpointEngine.resolve`` says (``os.path.join(checkpoint_dir, str(step))`` means that
                directory, also for a relative ``checkpoint_dir``; a bare ``"10"`` is inside it). Default
                ``step_<step>``.
            storage_type: MEMORY (snapshot only; still persisted if the trainer dies) or DISK.

        Returns:
            True (a snapshot was taken).

        Raises:
            ValueError: a bad ``step``, ``storage_type`` or ``path`` (nothing saved).
            CheckpointException: DCP's planning failed on some rank (raised on every rank).
            PersistError: an earlier persist failed (raised once, after this snapshot was taken).
        """
        import torch.distributed.checkpoint as dcp

        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise E.InvalidArgumentError(f"save_checkpoint(step={step!r}): step must be an integer >= 0")
        if storage_type not in (StorageType.MEMORY, StorageType.DISK):
            raise E.InvalidArgumentError(f"save_checkpoint(storage_type={storage_type!r}): use StorageType.MEMORY or "
                             "StorageType.DISK")
        if not isinstance(state_dict, dict):
            raise E.InvalidArgumentError(f"save_checkpoint(state_dict=...): a dict is needed (as for dcp.save), not "
                             f"{type(state_dict).__name__}")
        target = self._dir(path or f"step_{step}", "save_checkpoint")
        # (in a store, a key and a "directory" of that name coexist: only a local file is in the way)
        if not locations.is_url(target) and os.path.isfile(target):
            raise E.InvalidArgumentError(f"save_checkpoint(path={path!r}): {target} is a file; a DCP checkpoint is a directory")
        t0 = time.perf_counter()
        self._writer.reset(target)
        dcp.save(state_dict, checkpoint_id=target, storage_writer=self._writer, planner=self._planner,
                 process_group=self.process_group)
        fs = self._writer.take_fileset()
        t1 = time.perf_counter()
        self.engine.save(step, fs, path=target, storage_type=storage_type)
        t2 = time.perf_counter()
        self.last_save = SaveTiming(step, t1 - t0, t2 - t1)
        log.info("event=fsdp_save step=%d storage=%s plan_seconds=%.4f snapshot_seconds=%.4f path=%s", step,
                 storage_type.value, t1 - t0, t2 - t1, target)
        return True

    # ------------------------------------------------------------------ load
    def get_storage_reader(self, resume_path: str = "") -> Any:
        """A DCP ``StorageReader`` for the newest checkpoint every rank has, or None when there is none.

        From memory when every rank holds the agreed step in memory and the checkpoint's layout matches
        the current ranks (same number of ranks holding its data files); otherwise from storage (the
        newest committed step that verifies on every rank: a plain ``FileSystemReader`` on a local dir, a
        ``BackendStorageReader`` reading through the storage backend on a URL), which also reshards: a
        checkpoint saved by N ranks loads on M. Collective: call it on every rank.

        Args:
            resume_path: read this persisted DCP directory instead (absolute, or relative as for
                ``save_checkpoint``); it must hold a ``.metadata``.

        Raises:
            CheckpointCorruptError: ``resume_path`` is not a committed DCP checkpoint, or every
                committed step is damaged.
        """
        from flashckpt.integrations.dcp import METADATA_NAME

        t0 = time.perf_counter()
        if resume_path:
            d = self._dir(resume_path, "get_storage_reader")
            if not self._has_metadata(d):
                raise CheckpointCorruptError(f"get_storage_reader(resume_path={resume_path!r}): {d} has no "
                                             f"{METADATA_NAME}, so it is not a committed DCP checkpoint")
            self._loaded(None, "storage", t0)
            return self._storage_reader(d)
        return self._resolved(self.resolve_load(op="get_storage_reader()", event="fsdp_load", logger=log,
                                                from_memory=self._open_memory, from_storage=self._open_stored,
                                                reshard=True))

    def _open_memory(self, loc: Located, fs: Any) -> Opened | str:
        """A reader over the ranks' snapshots of the located step (collective), or why not."""
        from flashckpt.integrations.dcp import open_memory_reader

        if fs is not None and not isinstance(fs, (FileSet, Resharded)):
            log.warning("get_storage_reader(): the snapshot of step %s is not a DCP checkpoint of this "
                        "checkpointer; reading from storage", loc.step)
            fs = None
        reader = open_memory_reader(fs, loc.path or self.checkpoint_dir, process_group=self.process_group)
        return Opened(reader, loc.step, loc.path) if reader is not None else "the ranks' snapshots cannot serve it"

    def _open_stored(self, attempt: LoadAttempt) -> Opened | None:
        """A reader of the newest committed step that verifies (None when there is none)."""
        from flashckpt.integrations.dcp import METADATA_NAME

        loc = attempt.stored()
        if not is_stored(loc):
            return None
        local = loc.source == LOCAL  # this node's whole copy under the local dir: plain files
        if not loc.path or not (os.path.exists(os.path.join(loc.path, METADATA_NAME)) if local
                                else self._has_metadata(loc.path)):
            raise CheckpointCorruptError(f"get_storage_reader(): committed step {loc.step} at {loc.path} has no "
                                         f"{METADATA_NAME}; it was not written by this checkpointer")
        return Opened(self._storage_reader(loc.path), loc.step, loc.path, source=loc.source)

    def _resolved(self, r: Resolved) -> Any:
        self.last_load = r.result()
        return r.value

    def _has_metadata(self, d: str) -> bool:
        """Whether the DCP checkpoint directory ``d`` holds its ``.metadata`` (through the backend)."""
        from flashckpt.integrations.dcp import METADATA_NAME

        return self.engine.storage.exists(locations.join(d, METADATA_NAME))

    def _storage_reader(self, d: str) -> Any:
        """DCP's ``FileSystemReader`` on a local dir; a ``BackendStorageReader`` (reads through the
        engine's storage backend, no download) on a URL."""
        from flashckpt.integrations.dcp import BackendStorageReader
        from torch.distributed.checkpoint import FileSystemReader

        return BackendStorageReader(self.engine.storage, d) if locations.is_url(d) else FileSystemReader(d)

    def load_checkpoint(self, model: Any, optimizer: Any = None, resume_path: str = "") -> dict[str, Any]:
        """Loads the newest checkpoint (see ``get_storage_reader``) into ``model`` and ``optimizer``.

        The checkpoint must have been saved as ``{"model": model_sd, "optim": optim_sd, ...}`` with
        ``get_state_dict(model, optimizer)``; it is loaded with ``dcp.load`` and applied with
        ``set_state_dict``, resharding as needed. Collective: call it on every rank.

        Returns:
            The checkpoint's other top-level entries (e.g. ``{"step": 10}``); ``{}`` when there is no
            checkpoint (``model`` and ``optimizer`` are then untouched). ``last_load`` tells where it came
            from.

        Raises:
            CheckpointCorruptError: the checkpoint lacks ``"model"`` (or ``"optim"`` when an optimizer is
                given).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        t0 = time.perf_counter()
        reader = self.get_storage_reader(resume_path)
        if reader is None:
            return {}
        located = self.last_load
        metadata = reader.read_metadata()
        top = _top_level_keys(metadata)
        for key in (MODEL_KEY, OPTIM_KEY) if optimizer is not None else (MODEL_KEY,):
            if key not in top:
                raise CheckpointCorruptError(
                    f"load_checkpoint(): the checkpoint has no {key!r} entry (it has {sorted(top)}); it must be saved "
                    "as {'model': model_sd, 'optim': optim_sd, ...} from get_state_dict(model, optimizer), or "
                    "loaded with get_storage_reader() and dcp.load")
        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            sd: dict[str, Any] = {MODEL_KEY: model_sd, OPTIM_KEY: optim_sd}
        else:
            sd = {MODEL_KEY: get_model_state_dict(model)}
        extra = _extra_template(metadata, skip={MODEL_KEY, OPTIM_KEY})
        sd.update(extra)
        dcp.load(sd, storage_reader=reader, process_group=self.process_group)
        if optimizer is not None:
            set_state_dict(model, optimizer, model_state_dict=sd[MODEL_KEY], optim_state_dict=sd[OPTIM_KEY])
        else:
            set_model_state_dict(model, sd[MODEL_KEY])
        del reader
        step, source = (located.step, located.source) if located else (None, "storage")
        self._loaded(step, source, t0)
        return {k: sd[k] for k in extra}

    def _loaded(self, step: int | None, source: str, t0: float) -> None:
        self.last_load = LoadResult(step, source, time.perf_counter() - t0, 0)
        log_load(log, "fsdp_load", step, source, self.last_load.seconds)

    def _dir(self, path: str, op: str) -> str:
        d = self.engine.resolve(path)  # os.path.join(checkpoint_dir, str(step)) means that dir, as in DLRover's guide
        if not path_inside(d, self.checkpoint_dir):
            raise E.InvalidArgumentError(f"{op}(path={path!r}): {d} is outside the checkpoint dir {self.checkpoint_dir}")
        if d == self.checkpoint_dir:
            raise E.InvalidArgumentError(f"{op}(path={path!r}): use a directory inside the checkpoint dir, one per step")
        return d

    # ------------------------------------------------------------------ lifecycle
    def wait_latest_checkpoint(self, timeout: float | None = 1800) -> None:
        """Blocks until every scheduled persist is committed; raises the first persist error."""
        self.engine.wait(timeout)

    def close(self, release: bool = True) -> None:
        """See ``CheckpointEngine.close``; also drops the cached save plan."""
        self._planner.forget()
        super().close(release)


def _top_level_keys(metadata: Any) -> set[str]:
    mappings = getattr(metadata, "planner_data", None) or {}
    keys = {path[0] for path in mappings.values() if path}
    return keys | {fqn.split(".", 1)[0] for fqn in metadata.state_dict_metadata if fqn not in mappings}


def _extra_template(metadata: Any, *, skip: set[str]) -> dict[str, Any]:
    """Placeholders for the checkpoint's top-level entries outside ``skip``: None for plain values, an empty
    full-size CPU tensor for tensors (DCP loads into them)."""
    import torch
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    mappings = getattr(metadata, "planner_data", None) or {}
    out: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        path = mappings.get(fqn, (fqn,))
        if not path or path[0] in skip:
            continue
        value = (torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None)
        set_element(out, path, value)
    return out
