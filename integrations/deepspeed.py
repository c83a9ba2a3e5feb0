"""DeepSpeedCheckpointer: flash checkpoints for DeepSpeed engines (ZeRO stages 0-3, fp32/bf16/fp16),
through DeepSpeed's own checkpoint-engine interface.

The checkpointer installs ``FlashDeepSpeedCheckpointEngine`` as ``engine.checkpoint_engine``. Inside
``DeepSpeedCheckpointer.save_checkpoint`` DeepSpeed builds its state dicts exactly as it always does and
hands them to that engine (``create`` / ``save`` / ``commit``); instead of ``torch.save`` the engine
collects them into one ``FileSet`` per rank, under DeepSpeed's own file names, and at ``commit`` copies
the set into shared memory (the only pause) and, for DISK, has the saver persist it in the background.
DeepSpeed's ``latest`` file is a tracker entry: written only once the tag is committed on every rank, so
it never names a tag that is missing a file. The tag directory holds exactly the files vanilla DeepSpeed
writes, so ``engine.load_checkpoint`` and ``zero_to_fp32`` read it without flashckpt.

``load_checkpoint`` serves DeepSpeed's ``checkpoint_engine.load`` calls from the snapshot in shared
memory when memory holds the newest checkpoint (after a crash and restart, in the same job), and
otherwise lets DeepSpeed load from storage. Outside the checkpointer's own calls the installed engine
behaves like the one it replaced, so ``engine.save_checkpoint`` / ``engine.load_checkpoint`` called
directly stay vanilla (synchronous ``torch.save`` / ``torch.load``).

The checkpoint dir may be a URL a storage backend serves (``s3://bucket/prefix``; ``save_dir`` and
``load_dir`` are then URLs inside it). Saves persist the same files there (DeepSpeed's recovery scripts
too, once the tag is committed). A load from the store runs DeepSpeed's own ``load_checkpoint`` on a
private scratch directory, and only for a committed tag: every file of the tag is there as an empty
placeholder (for DeepSpeed's ``glob`` / ``os.path.exists``) and its reads, which go through the checkpoint
engine, are read through the backend (only the files this rank's DeepSpeed asks for cross the network);
where DeepSpeed reads files itself (ZeRO-3 without optimizer states, MoE, pipeline, universal,
model-parallel or elastic checkpoints) the tag's files are downloaded there instead.

Tags and steps: flashckpt identifies a checkpoint by an integer step, DeepSpeed by a tag (a directory
name, ``global_step<N>`` by default). A checkpoint's step is ``engine.global_steps`` when it is saved;
each step is saved under one tag, and a tag directory that holds one committed step is never rewritten
with another (a crash mid-persist would damage it).

Example::

    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(...), config=cfg)
    ckpt = DeepSpeedCheckpointer(engine, "/ckpt")
    load_path, client_state = ckpt.load_checkpoint("/ckpt")        # (None, None) on a fresh start
    for step in ...:
        ...
        ckpt.save_checkpoint("/ckpt", storage_type=StorageType.MEMORY)      # every few steps
        if engine.global_steps % 100 == 0:
            ckpt.save_checkpoint("/ckpt", client_state={"epoch": e})        # also persisted
    ckpt.close()
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
from collections.abc import Callable
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from flashckpt import CheckpointEngine as FlashEngine
from flashckpt import FlashCheckpointError, LoadResult, StorageType
from flashckpt import errors as E
from flashckpt.commit.retention import CheckpointDeletionStrategy
from flashckpt.engine.adapter import LOCAL, MEMORY, NONE, STORAGE, AdapterBase, LoadAttempt, Opened
from flashckpt.engine.collective import exchange_files, rank, world
from flashckpt.engine.engine import Located
from flashckpt.engine.routing import path_inside, swapped
from flashckpt.format.files import FileSet
from flashckpt.format.names import META
from flashckpt.integrations._deepspeed_engine import DsCapture, DsServe, FlashDeepSpeedCheckpointEngine
from flashckpt.integrations._kit_files import SnapshotDir, scratch_root
from flashckpt.integrations.telemetry import report_line
from flashckpt.storage import locations
from flashckpt.storage.base import CheckpointStorage

__all__ = ["DeepSpeedCheckpointer", "FlashDeepSpeedCheckpointEngine", "StorageType"]

log = logging.getLogger(__name__)

LATEST = "latest"  # DeepSpeed's tracker file, in the save dir


class DeepSpeedCheckpointer(AdapterBase):
    """Flash checkpoints for a ``DeepSpeedEngine`` with DeepSpeed's ``save_checkpoint`` /
    ``load_checkpoint`` arguments, meaning and return values (deepspeed 0.19.8), plus ``storage_type``.

    Construct it on every rank after ``deepspeed.initialize``; it replaces ``engine.checkpoint_engine``
    until ``close``.

    Args:
        engine: the ``DeepSpeedEngine`` (ZeRO stage 0-3, fp32, bf16 or fp16), with DeepSpeed's default
            checkpoint engine.
        checkpoint_dir: where checkpoints are persisted: a local or mounted directory, a ``file://`` URL, or
            the URL of a storage backend (``s3://bucket/prefix``); every ``save_dir`` must lie inside it
            (usually it is the same directory).
        deletion_strategy: which committed checkpoints to delete after each commit; None keeps the newest
            ``max_to_keep``.
        max_to_keep: committed checkpoints kept without a ``deletion_strategy`` (0 keeps all, as
            DeepSpeed does).
        process_group: the ranks that agree on what to load (the default group when None).
        local_dir: a node-local directory (NVMe, a local disk) as the fast tier: a DISK save commits there
            first (the tag directory and ``latest`` under the same relative path) and the node's saver
            uploads it to ``checkpoint_dir`` in the background; a load reads the tag there when this node's
            copy holds every rank's files of the newest step (DeepSpeed reads rank 0's model states on
            every rank), else from ``load_dir``. None: FLASHCKPT_LOCAL_DIR (unset: no local tier).
        local_max_to_keep: steps the local tier keeps (0 keeps all; a step not yet uploaded is never
            deleted).

    Raises:
        TypeError: ``engine`` is not a DeepSpeed engine.
        ValueError: the engine uses a checkpoint writer, datastates or NVMe optimizer offload (their
            files are written outside DeepSpeed's checkpoint-engine interface), or already has a
            checkpointer.
        CheckpointDirError: ``checkpoint_dir`` cannot be created or written.
    """

    def __init__(self, engine: Any, checkpoint_dir: str, *,
                 deletion_strategy: CheckpointDeletionStrategy | None = None, max_to_keep: int = 0,
                 process_group: Any = None, local_dir: str | os.PathLike[str] | None = None,
                 local_max_to_keep: int = 2) -> None:
        inner = getattr(engine, "checkpoint_engine", None)
        if inner is None or not hasattr(engine, "save_checkpoint") or not hasattr(engine, "global_steps"):
            raise E.InvalidArgumentTypeError(f"DeepSpeedCheckpointer(engine={type(engine).__name__}): pass the engine returned by "
                            "deepspeed.initialize")
        if isinstance(inner, FlashDeepSpeedCheckpointEngine):
            raise E.InvalidArgumentError("DeepSpeedCheckpointer: this engine already has a DeepSpeedCheckpointer; close it first")
        if not isinstance(inner, TorchCheckpointEngine):
            raise E.InvalidArgumentError(f"DeepSpeedCheckpointer: the engine's checkpoint engine is {type(inner).__name__}; "
                             "flashckpt replaces DeepSpeed's default TorchCheckpointEngine. Remove the "
                             "'checkpoint.writer' / 'datastates' settings from the DeepSpeed config")
        if engine.zero_nvme_offload_optimizer():
            raise E.InvalidArgumentError("DeepSpeedCheckpointer: NVMe optimizer offload keeps optimizer state in swap files that "
                             "DeepSpeed copies outside its checkpoint engine; use engine.save_checkpoint, or offload "
                             "the optimizer to 'cpu' instead")
        if getattr(inner, "zipfile_serialization", True) is False:
            log.warning("DeepSpeedCheckpointer: checkpoint_serialization=false is not honoured: persisted files "
                        "use torch's zipfile format, which torch.load reads either way")
        self.engine = engine
        self.process_group = process_group
        # DeepSpeed's files hold Python objects (configs, enums, shapes) and DeepSpeed loads them with
        # weights_only=False; memory snapshots are decoded the same way (they are this job's own, mode 0600).
        self._core = FlashEngine(checkpoint_dir, max_to_keep=max_to_keep, deletion_strategy=deletion_strategy,
                                 replicated=False, process_group=process_group, weights_only=False,
                                 local_dir=local_dir, local_max_to_keep=local_max_to_keep)
        self.checkpoint_dir = self._core.checkpoint_dir  # absolute, or the store's URL; a file:// URL mapped
        self._ds_engine = FlashDeepSpeedCheckpointEngine(inner)
        engine.checkpoint_engine = self._ds_engine
        self._step_dirs: dict[int, str] = {}  # step -> tag dir, of this run's saves
        self._disk_dirs: dict[str, int] = {}  # tag dir -> step, of this run's DISK saves
        self._dirs_of_committed: dict[int, str | None] = {}
        self.last_load: LoadResult | None = None
        self._closed = False

    # ------------------------------------------------------------------ save
    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, storage_type: StorageType = StorageType.DISK, *,
                        exclude_frozen_parameters: bool = False) -> bool:
        """``DeepSpeedEngine.save_checkpoint``, with the files snapshotted to shared memory and, for DISK,
        persisted in the background. Call it on every rank.

        Returns once this rank's files are in shared memory; training may then go on. ``latest`` (with
        ``save_latest``) is written when the tag is committed on every rank; a MEMORY checkpoint is
        persisted and committed only if the trainer dies while it is the newest (last words).

        Args:
            save_dir: the directory of DeepSpeed's tag directories and ``latest``; inside ``checkpoint_dir``.
            tag: the checkpoint's name (default ``global_step<engine.global_steps>``); the same on all ranks.
            client_state: extra entries for the model-states file, returned by ``load_checkpoint``.
            save_latest: point ``<save_dir>/latest`` at this tag once it is committed.
            storage_type: MEMORY (shared memory only) or DISK (memory, then storage).
            exclude_frozen_parameters: as in DeepSpeed.

        Returns:
            True, as DeepSpeed does.

        Raises:
            ValueError: ``save_dir`` outside ``checkpoint_dir``; a bad tag; this step already saved under
                another tag; a tag directory that holds another committed step (nothing is written).
            PersistError: an earlier persist failed (raised after this snapshot was taken).
        """
        self._check_open("save_checkpoint")
        if storage_type not in (StorageType.MEMORY, StorageType.DISK):
            raise E.InvalidArgumentError(f"save_checkpoint(storage_type={storage_type!r}): use StorageType.MEMORY or "
                             "StorageType.DISK")
        if not save_dir:
            raise E.InvalidArgumentError(f"save_checkpoint(save_dir={save_dir!r}): save_dir must be a non-empty string")
        root = locations.normpath(save_dir)
        if not path_inside(root, self.checkpoint_dir):
            raise E.InvalidArgumentError(f"save_checkpoint(save_dir={save_dir!r}): must lie inside the checkpoint dir "
                             f"{self.checkpoint_dir} given to DeepSpeedCheckpointer")
        step = int(self.engine.global_steps)
        tag = f"global_step{step}" if tag is None else str(tag)
        set_dir = locations.join(root, _check_tag(tag))
        self._check_step_and_dir(step, tag, set_dir)
        files = FileSet()
        if save_latest and rank() == 0:
            tracker = str(locations.relpath(locations.join(root, LATEST), self.checkpoint_dir)).replace(os.sep, "/")
            files.add_raw(tracker, tag.encode(), kind="tracker")

        def snapshot(cap: DsCapture) -> None:
            t0 = time.perf_counter()
            self._core.save(step, cap.files, path=cap.root, storage_type=storage_type)
            cap.pause_s = time.perf_counter() - t0

        cap = DsCapture(tag, set_dir, files, snapshot)
        t0 = time.perf_counter()
        self._ds_engine.capture = cap
        # DeepSpeed copies its recovery scripts into save_dir with shutil, outside its checkpoint engine
        swaps = [(self.engine, "_copy_recovery_script", self._scripts_copier(files))] if locations.is_url(root) else []
        try:
            with swapped(swaps):
                self.engine.save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=False,
                                            exclude_frozen_parameters=exclude_frozen_parameters)
        finally:
            self._ds_engine.capture = None
        seconds = time.perf_counter() - t0
        if cap.error is not None:
            raise cap.error
        if not cap.committed:
            raise FlashCheckpointError(f"save_checkpoint(tag={tag!r}): DeepSpeed returned without committing the "
                                       "checkpoint; nothing was saved")
        self._step_dirs[step] = set_dir
        if storage_type == StorageType.DISK:
            self._disk_dirs[set_dir] = step
        log.info("event=ds_save tag=%s step=%d storage=%s files=%d snapshot_s=%.4f seconds=%.4f", tag, step,
                 storage_type.value, len(files), cap.pause_s, seconds)
        from deepspeed.utils import logger as ds_logger

        report_line(ds_logger, step, self._core)  # the figures in DeepSpeed's own log
        return True

    def _scripts_copier(self, files: FileSet) -> Callable[[str], None]:
        """DeepSpeed's ``_copy_recovery_script(save_path)`` for a ``save_dir`` in a store (rank 0 calls it): the
        scripts it copies (``zero_to_fp32.py``, ...) are staged as tracker entries of this save, so they appear
        beside the tags, as on a local dir, once the tag is committed."""
        copy = self.engine._copy_recovery_script

        def stage(save_path: str) -> None:
            with SnapshotDir(None, "scripts", prefix="flashckpt-ds-") as view:
                copy(view.dir)  # DeepSpeed's own copy, into a local directory
                for name in sorted(os.listdir(view.dir)):
                    rel = locations.relpath(locations.join(locations.normpath(save_path), name), self.checkpoint_dir)
                    with open(view.path(name), "rb") as f:
                        files.add_raw(str(rel), f.read(), kind="tracker")

        return stage

    def _check_step_and_dir(self, step: int, tag: str, set_dir: str) -> None:
        """A step has one tag; a tag directory that holds another committed step (or another step this run
        is persisting) is not rewritten, which a crash mid-persist would leave damaged."""
        prev = self._step_dirs.get(step)
        if prev is not None and prev != set_dir:
            raise E.InvalidArgumentError(f"save_checkpoint(tag={tag!r}): global step {step} was already saved as "
                             f"{prev}; flashckpt identifies checkpoints by engine.global_steps, so save each step "
                             "under one tag")
        # In a store, listing the committed steps reads every manifest (requests, in the pause): skip it when
        # nothing lies under the tag directory and no step of this run went there, so no step can own it.
        clash = any(d == set_dir and s != step for d, s in self._disk_dirs.items())
        committed = (self._core.committed_steps()
                     if clash or not locations.is_url(set_dir) or self._core.storage.isdir(set_dir) else [])
        owners = [s for s in committed if self._committed_dir(s) == set_dir]
        newest = committed[-1] if committed else -1
        owners += [s for d, s in self._disk_dirs.items() if d == set_dir and s > newest]  # being persisted
        other = [s for s in owners if s != step]
        if other:
            raise E.InvalidArgumentError(f"save_checkpoint(tag={tag!r}): {set_dir} holds the checkpoint of step {other[-1]}; "
                             f"writing step {step} over it would damage that checkpoint if the persist were "
                             "interrupted. Use a new tag (the default is global_step<N>), or delete that "
                             "checkpoint first")

    def _committed_dir(self, step: int) -> str | None:
        if step not in self._dirs_of_committed:  # a manifest never changes: read each once
            try:
                p = self._core.step_path(step)
            except E.CheckpointCorruptError:  # damaged: owns nothing (a manifest that cannot be read raises)
                p = None
            self._dirs_of_committed[step] = locations.normpath(p) if p else None
        return self._dirs_of_committed[step]

    # ------------------------------------------------------------------ load
    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, *, custom_load_fn: Any = None) -> tuple[Any, Any]:
        """``DeepSpeedEngine.load_checkpoint``: from shared memory when memory holds the newest checkpoint
        every rank has, else from storage with DeepSpeed's own loader. Call it on every rank.

        With ``tag=None`` the newest checkpoint is loaded: the newest snapshot in memory, else the newest
        committed tag on storage that verifies against its checksums (normally the one ``latest`` names),
        else what ``<load_dir>/latest`` names. A given ``tag`` loads from memory when it is that newest
        snapshot, else from storage.

        Returns:
            ``(load_path, client_state)`` as DeepSpeed returns them: the path of the model-states file
            (under ``load_dir``) and the remaining entries of it; ``(None, None)`` when there is nothing
            to load.

        Raises:
            FileNotFoundError: ``tag`` names no checkpoint in memory or in ``load_dir``.
        """
        self._check_open("load_checkpoint")
        root = locations.normpath(load_dir)
        kw = dict(load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
                  load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                  custom_load_fn=custom_load_fn)
        newest: list[str | None] = [None]  # the newest checkpoint's tag, when it is a checkpoint of load_dir

        def refuse(loc: Located) -> str:
            newest[0] = self._tag_in(root, loc)
            if newest[0] is None or (tag is not None and str(tag) != newest[0]):
                return f"tag {tag!r} of {load_dir} is asked for" if tag is not None else f"it is not in {load_dir}"
            return self._memory_unsupported(load_optimizer_states)

        def from_memory(loc: Located, fs: Any) -> Opened | str:
            out = self._load_from_memory(load_dir, newest[0] or "", fs, kw)
            return Opened(out, loc.step) if not isinstance(out, str) else out

        def from_storage(attempt: LoadAttempt) -> Opened | None:
            self._say_other_layout()  # before DeepSpeed's own load, which refuses partitions of another layout
            loc = attempt.located
            if loc.source == MEMORY and tag is None and self._core.local_dir is not None:
                loc = attempt.stored()  # memory did not serve it: the newest committed step, maybe local
            if loc.source != MEMORY:
                newest[0] = self._tag_in(root, loc)
            if loc.source == LOCAL and newest[0] is not None and (tag is None or str(tag) == newest[0]):
                return self._load_local(root, newest[0], loc, kw)
            # memory held the newest but did not serve it: DeepSpeed's `latest` (the newest committed tag)
            want = None if tag is None and loc.source == "memory" else newest[0] if tag is None else str(tag)
            if locations.is_url(root):
                return self._load_from_store(root, want, newest[0], attempt, kw)
            if want is not None and not os.path.isdir(os.path.join(root, want)):
                raise self._no_tag(want, os.path.join(root, want), newest[0], loc.source)
            load_path, client_state = self.engine.load_checkpoint(load_dir, want, **kw)
            step = loc.step if load_path is not None and want == newest[0] and loc.source == "storage" else None
            return Opened((load_path, client_state), step, source="storage" if load_path is not None else "none")

        r = self.resolve_load(op="load_checkpoint", event="ds_load", logger=log, refuse=refuse,
                              from_memory=from_memory, from_storage=from_storage)
        self.last_load = r.result()
        return r.value if r.value is not None else (None, None)

    def _say_other_layout(self) -> None:
        """One warning when this rank's node holds snapshots of the job saved by another number of ranks (an
        elastic job that lost or gained a node): DeepSpeed cannot reshard ZeRO partitions from them."""
        from flashckpt.memory.reader import SnapshotReader

        world = self._core.ranks.world_size
        with SnapshotReader(self._core, self._core.ranks.local_rank) as held:
            other = [s for s in held.snapshots() if s.world_size is not None and s.world_size != world]
        if other and self._core.ranks.rank == 0:
            log.warning("load_checkpoint: memory holds step %d saved by %d ranks; this job has %d, and DeepSpeed "
                        "cannot reshard ZeRO partitions to another number of ranks without a universal checkpoint "
                        "(DeepSpeed's ds_to_universal, then load_universal): loaded from storage", other[0].step,
                        other[0].world_size, world)

    def _tag_in(self, root: str, loc: Located) -> str | None:
        """The tag of the checkpoint ``loc`` names, when its directory lies directly in ``root`` (a step on
        the local tier: in ``root``'s place there)."""
        newest = loc.path if loc.source in (MEMORY, LOCAL) else (
            self._core.step_path(loc.step) if loc.source == STORAGE and loc.step is not None else None)
        if loc.source == LOCAL:
            root = self._core.local_path(root) or ""
        if newest and root and locations.parent(newest) == root:
            return locations.basename(newest)
        return None

    def _load_local(self, root: str, tag: str, loc: Located, kw: dict[str, Any]) -> Opened:
        """DeepSpeed's own load of ``tag`` from this node's local tier (a whole copy of the step, in
        ``root``'s place there: ``locate(local=True)``); ``load_path`` is the file it read there."""
        local_root = self._core.local_path(root)
        assert local_root is not None  # _tag_in found the tag there
        load_path, client_state = self.engine.load_checkpoint(local_root, tag, **kw)
        return Opened((load_path, client_state), loc.step if load_path is not None else None, loc.path,
                      source=LOCAL if load_path is not None else NONE)

    @staticmethod
    def _no_tag(tag: str, where: str, newest_tag: str | None, source: str) -> FlashCheckpointError:
        return E.CheckpointNotFoundError(f"load_checkpoint(tag={tag!r}): {where} does not exist; the newest "
                                         f"checkpoint is {newest_tag!r} (from {source}). Pass tag=None to load "
                                         "the newest")

    def _load_from_store(self, root: str, want: str | None, newest_tag: str | None, attempt: LoadAttempt,
                         kw: dict[str, Any]) -> Opened | None:
        """DeepSpeed's load of tag ``want`` (None: the newest committed one that verifies, else what
        ``<root>/latest`` names) from a checkpoint dir in a store: only a committed tag is read."""
        storage = self._core.storage
        loc = attempt.located
        if want is None:
            loc = attempt.stored()  # memory could not serve it: the newest committed step that verifies
            want = self._tag_in(root, loc) or _read_text(storage, locations.join(root, LATEST))
            if want is None:
                log.warning("load_checkpoint: no checkpoint in %s (no committed tag, no %s)", root, LATEST)
                return None
        set_dir = locations.join(root, _check_tag(want))
        step = next((s for s in reversed(self._core.committed_steps()) if self._committed_dir(s) == set_dir), None)
        if step is None:
            raise self._no_tag(want, set_dir, newest_tag, loc.source)
        m = self._core.layout.read_manifest(step)
        files = {str(locations.relpath(p, set_dir)): p for p in (self._core.layout.abs(f.path) for f in m.all_files())
                 if locations.inside(p, set_dir, strict=True)}
        why = self._memory_unsupported(bool(kw["load_optimizer_states"]))
        with SnapshotDir(scratch_root() if why else None, want, prefix="flashckpt-ds-") as view:
            if why:  # DeepSpeed reads files itself: every file of the tag, and `latest` (zero_to_fp32 reads it)
                log.info("load_checkpoint: downloading %d files of %s (%s)", len(files), set_dir, why)
                for name, where in files.items():
                    view.fetch(name, storage, where)
                with open(os.path.join(view.base, LATEST), "w") as f:
                    f.write(want)
                load_path, client_state = self.engine.load_checkpoint(view.base, want, **kw)
            else:  # placeholders answer DeepSpeed's glob/exists; its reads go through the backend
                for name in files:
                    view.touch(name)
                self._ds_engine.serve = DsServe(view.dir, frozenset(files),
                                               lambda name, at: _torch_load(storage, files[name], at))
                try:
                    load_path, client_state = self.engine.load_checkpoint(view.base, want, **kw)
                finally:
                    self._ds_engine.serve = None
            if isinstance(load_path, str) and path_inside(load_path, view.base):
                load_path = locations.join(root, os.path.relpath(load_path, view.base).replace(os.sep, "/"))
        return Opened((load_path, client_state), step, source="storage" if load_path is not None else "none")

    def _memory_unsupported(self, load_optimizer_states: bool) -> str:
        """Why DeepSpeed's load of this engine reads files itself, past its checkpoint engine, so that it
        cannot be served from memory, nor from a store without downloading the tag ("" when it can)."""
        e = self.engine
        if e.zero_optimization_partition_weights() and not load_optimizer_states and not e.has_moe_layers:
            return "ZeRO-3 without optimizer states reads every rank's files itself (zero_to_fp32)"
        if e.has_moe_layers:
            return "memory loads do not cover MoE expert files"
        if getattr(e, "pipeline_parallelism", False):
            return "memory loads do not cover pipeline-parallel layer files"
        if e.load_universal_checkpoint():
            return "universal checkpoints are read by DeepSpeed itself"
        if e.mp_world_size != 1:
            return "memory loads do not cover model parallelism"
        if e.zero_optimization() and e.zero_elastic_checkpoint():
            return "ZeRO elastic checkpoints read every rank's optimizer file"
        return ""

    def _load_from_memory(self, load_dir: str, tag: str, fs: Any, kw: dict[str, Any]) -> tuple[Any, Any] | str:
        """Runs DeepSpeed's load with its reads served from this rank's snapshot ``fs``; why not (on every
        rank) when the model-states file is in no rank's snapshot."""
        files = {n: e.data for n, e in fs.items() if e.kind == "file" and e.format == "torch"}
        if world(self.process_group) > 1:
            why = self._share_model_states(files, tag)
            if why:
                return why
        with SnapshotDir(None, tag, prefix="flashckpt-ds-") as view:
            vroot = view.base
            # DeepSpeed finds its files with glob and os.path.exists before it reads them through the
            # checkpoint engine: empty placeholders answer those, the reads come from memory.
            for name in files:
                view.touch(name)
            self._ds_engine.serve = DsServe(view.dir, frozenset(files), lambda name, _map_location: _fresh(files[name]))
            try:
                load_path, client_state = self.engine.load_checkpoint(vroot, tag, **kw)
            finally:
                self._ds_engine.serve = None
        if isinstance(load_path, str) and path_inside(load_path, vroot):
            rel = os.path.relpath(load_path, vroot)
            load_path = (locations.join(locations.normpath(load_dir), rel.replace(os.sep, "/"))
                         if locations.is_url(load_dir) else os.path.join(load_dir, rel))
        return load_path, client_state

    def _share_model_states(self, files: dict[str, Any], tag: str) -> str:
        """DeepSpeed writes the model-states file of ZeRO 0-2 on data-parallel rank 0 only and every rank
        reads it: ranks whose snapshot lacks the file they read get it from a rank that has it. Why not (on
        every rank) when no rank has it, else ""."""
        need = os.path.relpath(self.engine._get_ckpt_name("/", tag), posixpath.join("/", tag)).replace(os.sep, "/")
        try:
            files.update(exchange_files(files, sorted(files), [] if need in files else [need],
                                        group=self.process_group, what=f"load_checkpoint(tag={tag!r})"))
        except FlashCheckpointError as e:
            return str(e)
        return ""

    # ------------------------------------------------------------------ wait / close
    def _flash_engine(self) -> FlashEngine:
        return self._core

    wait_latest_checkpoint = AdapterBase.wait

    def close(self, release: bool = True) -> None:
        """Gives the engine its checkpoint engine back and detaches from the saver (persists in flight
        still complete). ``release=False`` keeps the snapshots for a restarted process; see
        ``CheckpointEngine.close``."""
        if self._closed:
            return
        self._closed = True
        if self.engine.checkpoint_engine is self._ds_engine:
            self.engine.checkpoint_engine = self._ds_engine.inner
        self._core.close(release)

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise FlashCheckpointError(f"{op}(): this DeepSpeedCheckpointer is closed (close() was called, or its "
                                       "`with` block ended); create a new DeepSpeedCheckpointer(engine, checkpoint_dir) "
                                       "to save or load again")


def _fresh(tree: Any) -> Any:
    """A snapshot's tree for DeepSpeed, which may add or pop top-level keys: a new top-level dict."""
    return dict(tree) if type(tree) is dict else tree


def _torch_load(storage: CheckpointStorage, where: str, map_location: Any) -> Any:
    """``torch.load`` of a stored file as DeepSpeed's checkpoint engine loads it (``weights_only=False``:
    DeepSpeed's files hold Python objects), read through the backend (a local file is opened directly)."""
    local = storage.local_path(where)
    if local is not None:
        return torch.load(local, map_location=map_location, weights_only=False)
    with storage.open_read(where) as f:
        return torch.load(f, map_location=map_location, weights_only=False)


def _read_text(storage: CheckpointStorage, where: str) -> str | None:
    """The stripped text of a small stored file (DeepSpeed's ``latest``), None when it does not exist."""
    try:
        return storage.read_bytes(where).decode().strip() or None
    except FileNotFoundError:
        return None


def _check_tag(tag: str) -> str:
    norm = posixpath.normpath(tag)
    if not tag or "\0" in tag or "\\" in tag or tag.startswith("/") or norm.startswith("..") or norm == "." \
            or norm.split("/")[0] == META:
        raise E.InvalidArgumentError(f"save_checkpoint(tag={tag!r}): a tag names a directory inside save_dir; use a "
                         f"non-empty relative name without '..', other than {META} (flashckpt reserves it)")
    return norm
