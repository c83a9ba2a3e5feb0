"""CheckpointEngine: the trainer's entry point. Snapshots go to shared memory; the saver persists.

The engine is a facade: each public method states its contract here (those docstrings are over a third
of this module) and hands the work to the parts of the engine package, one job each:
``interval.SavePolicy`` (what ``save(storage_type=None)`` takes), ``snapshot.Snapshots`` (the copy into
shared memory, overlapped or not), ``session.SaverSession`` (persist requests, the saver's replies and
errors, a lost runtime dir), ``deletions.Deletions`` (when the deletion strategy runs), ``restore.Restorer``
(locate and the storage load) and ``guard`` (who may call, and when; the goodbye at exit). The engine owns
the wiring between them and the ``SaverLink`` (``transport.link``).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from flashckpt import errors as E
from flashckpt.commit.adopt import unrecorded
from flashckpt.commit.checkpoint_dir import prepare_dir
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.retention import CheckpointDeletionStrategy, KeepLatestStepStrategy
from flashckpt.commit.tiers import local_layout, local_target
from flashckpt.config import Knobs, StorageType, job_dir
from flashckpt.engine.deletions import Deletions
from flashckpt.engine.durability import Durability, DurabilityPolicy
from flashckpt.engine.events import Event, EventStream, Loaded, SnapshotTaken, Stats, metrics_file
from flashckpt.engine.guard import CallGuard, engine_call, open_engines
from flashckpt.engine.interval import SavePolicy
from flashckpt.engine.loader import StorageLoader
from flashckpt.engine.ranks import RankInfo
from flashckpt.engine.reshard import Resharded
from flashckpt.engine.restore import LoadResult, Located, Restorer
from flashckpt.engine.session import SaverSession, commit_spec_for
from flashckpt.engine.snapshot import Snapshots, open_memory
from flashckpt.engine.tiers import local_file, local_tier
from flashckpt.format.files import FileSet, is_fileset_tree
from flashckpt.format.tree import gc_paused
from flashckpt.storage import locations
from flashckpt.storage.locations import local_dir, resolve_in
from flashckpt.storage.registry import checkpoint_location, storage_for, storage_spec
from flashckpt.transport import messages as M
from flashckpt.transport.link import SaverLink, agent_pid, restart_expected
from flashckpt.transport.messages import RP
from flashckpt.util.copy import Copier
from flashckpt.util.module_record import record_modules
from flashckpt.util.procfs import process_cpu_seconds

__all__ = ["CheckpointEngine", "LoadResult", "Located", "local_dir", "resolve_in"]

log = logging.getLogger(__name__)

# How long a new engine waits for its saver to ready the commit records before it goes on without them
# (the saver does that beside serving, so that a stalled store never holds up the start).
_START_RECORDS_WAIT_S = 2.0


class CheckpointEngine:
    """Checkpoints one rank's state dict: into node shared memory at once, to storage in the background.

    Args:
        checkpoint_dir: where persisted checkpoints go: a local (or mounted) directory or a ``file://``
            URL (created if missing, must be writable), or the URL of a storage backend
            (``storage.storage_for``; see docs/storage.md).
        max_to_keep: committed checkpoints to keep when no ``deletion_strategy`` is given (0 keeps all).
        save_mem_interval: with ``save(storage_type=None)``, snapshot to memory every this many steps.
        save_storage_interval: with ``save(storage_type=None)``, persist every this many steps.
        auto_save: with ``save(storage_type=None)``, choose memory and storage intervals from the measured
            step time, snapshot pause and persist time and the failure rates (Young/Daly).
        deletion_strategy: which committed checkpoints to delete after each commit (see
            ``retention.CheckpointDeletionStrategy``: ``steps_to_delete`` or DLRover's ``clean_up``).
        replicated: every rank holds the same state (DDP): local rank 0 of each node snapshots, global
            rank 0 persists, and every rank loads that one copy.
        process_group: the group whose ranks agree on the step to load (the default group when None).
        process_mtbf_s: with ``auto_save``, the mean seconds between failures that memory survives
            (process crashes; ``interval.mtbf_from_failures_per_day`` converts a daily count). Given
            without ``node_mtbf_s``, it means no node is ever lost. With neither,
            ``interval.default_failure_rates(world_size)`` (Llama 3's published per-GPU rate, 78% of
            failures losing the node), logged at INFO.
        node_mtbf_s: with ``auto_save``, the mean seconds between failures that lose the node; given
            without ``process_mtbf_s``, it means no process crash that memory survives.
        weights_only: load persisted files with ``torch.load(weights_only=True)``, and decode the
            Python objects of memory snapshots under the same rules; set False only for trusted
            checkpoints holding arbitrary Python objects.
        overlap: ``save`` returns before its copy is done (see ``save`` and ``wait_snapshot``).
        storage_options: options of the storage backend (for ``s3://``: ``storage_s3.S3Options``' fields,
            such as ``endpoint_url`` or ``part_size_mb``); the node's saver is started with them.
        on_persist_error: what a failed persist or commit does to training: ``"raise"`` (``PersistError``
            at the next save or wait) or ``"warn"`` (logged once with what is still safe; training and
            memory snapshots go on, and storage catches up when it answers again). None:
            FLASHCKPT_ON_PERSIST_ERROR (default "raise"). See ``durability()``.
        max_lag_s: a bound on how far storage may fall behind: a save finding the oldest step asked of
            storage and not yet committed older than this many seconds raises ``DurabilityLagError``
            (``"raise"``; its snapshot is in memory) or logs a warning (``"warn"``). None:
            FLASHCKPT_MAX_LAG_S (default 0: no bound).

    Raises:
        CheckpointDirError: ``checkpoint_dir`` is a URL no backend serves, a file, or cannot be
            created or written.
        SaverError: the node's saver could not be started or reached.

    Thread safety: calls from several threads run one at a time (a call waits while another thread's
    runs), so two threads saving take their snapshots one after the other. A call made on a thread that is
    inside a call of the same engine (a signal handler interrupting it) is refused (``EngineUseError``),
    as is any call from a process forked from the one that opened the engine (a DataLoader worker); a
    forked child's ``close`` or exit ends nothing of the parent's. ``save`` must not run concurrently
    with a mutation of the tensors it was given; once it returns they may be changed freely.

    A runtime dir removed under a live engine (systemd-logind's RemoveIPC, a tmp cleaner) takes the memory
    snapshots with it: the next call sees it, logs one warning, starts a new saver with new shared memory
    and goes on (committed steps stay).
    """

    def __init__(self, checkpoint_dir: str, max_to_keep: int = 1, save_mem_interval: int = 0,
                 save_storage_interval: int = 0, auto_save: bool = False,
                 deletion_strategy: CheckpointDeletionStrategy | None = None, *, replicated: bool = False,
                 process_group: Any = None, weights_only: bool = True, process_mtbf_s: float | None = None,
                 node_mtbf_s: float | None = None, overlap: bool = False,
                 storage_options: dict[str, Any] | None = None, on_persist_error: str | None = None,
                 max_lag_s: float | None = None, local_dir: str | os.PathLike[str] | None = None,
                 local_max_to_keep: int = 2) -> None:
        for name, v in (("max_to_keep", max_to_keep), ("save_mem_interval", save_mem_interval),
                        ("save_storage_interval", save_storage_interval), ("local_max_to_keep", local_max_to_keep)):
            if not isinstance(v, int) or v < 0:
                raise E.InvalidArgumentError(f"CheckpointEngine({name}={v!r}): must be an integer >= 0")
        self._guard = CallGuard()
        self.ranks = RankInfo.current()
        auto = SavePolicy.for_auto_save(process_mtbf_s, node_mtbf_s, self.ranks.world_size) if auto_save else None
        self._policy = SavePolicy(save_mem_interval, save_storage_interval, auto)
        self._given_dir = checkpoint_location(checkpoint_dir)
        self.storage = storage_for(self._given_dir, storage_options)
        self.checkpoint_dir = self.storage.normpath(self._given_dir)
        prepare_dir(self.storage, self.checkpoint_dir, self._given_dir)
        self.replicated = replicated
        self.weights_only = weights_only
        self.process_group = process_group
        self.overlap = overlap
        if deletion_strategy is None and max_to_keep > 0:
            deletion_strategy = KeepLatestStepStrategy(max_to_keep, self.checkpoint_dir)
        self._deletions = Deletions(deletion_strategy, applies=self.ranks.rank == 0,
                                    call=lambda req: self._client_call(req),
                                    delete=lambda path: self.delete_checkpoint(path))  # a call of this engine's own
        self.knobs, self.local_dir = local_tier(Knobs.from_env(), self.checkpoint_dir, self.storage, local_dir,
                                                local_max_to_keep)
        self._durability = DurabilityPolicy(self.knobs.on_persist_error if on_persist_error is None else on_persist_error,
                                            self.knobs.max_lag_s if max_lag_s is None else max_lag_s, self._given_dir,
                                            backoff_s=self.knobs.unreadable_backoff_s)
        self.job_dir = job_dir(self.checkpoint_dir, self.knobs)
        self.last_load: LoadResult | None = None
        self._copier = Copier(self.knobs.copy_threads)
        r = self.ranks
        self._link = SaverLink(self.job_dir, self.checkpoint_dir, self.knobs, storage=storage_spec(self.storage),
                               storage_options=storage_options,
                               hello=lambda: M.Hello(rank=r.rank, local_rank=r.local_rank, world_size=r.world_size,
                                                     local_world_size=r.local_world_size, pid=os.getpid(),
                                                     persists=self.persists, commit=commit_spec_for(r, replicated),
                                                     agent_pid=agent_pid(), replicated=replicated,
                                                     local_dir=self.local_dir or ""))
        hello = self._link.attach()
        # The commit records are read once the saver has readied them (CommitLayout.claim, on its records
        # thread: a stalled store never holds up the start); until then ``layout`` waits for them.
        self._layout: CommitLayout | None = None
        self._storage_loader: StorageLoader | None = None
        self._tier_loader: StorageLoader | None = None
        self._handler, self._reader = open_memory(r, self.job_dir, self.checkpoint_dir, replicated=replicated,
                                                  allocate=self._allocate if self.snapshots else None,
                                                  copier=self._copier, weights_only=weights_only)
        if self.knobs.cuda_prestage:  # a restart's newest snapshot page-locked while the process builds its model
            try:
                self._reader.prestage()
            except (OSError, RuntimeError, ValueError, E.FlashCheckpointError) as e:
                log.debug("pre-staging the newest snapshot for the GPU: %s", e)
        self._restore = Restorer(ranks=r, group=process_group, replicated=replicated, snapshots=self.snapshots,
                                 reader=self._reader, layout=lambda: self.layout, loader=lambda: self._loader,
                                 call=lambda req: self._client_call(req), local_loader=lambda: self._local_loader)
        self._restore.make_resharded = lambda plan, instance: Resharded(
            plan, job_dir=self.job_dir, local_rank=r.local_rank, instance=instance,
            fetch=lambda req: self._client_call(req), weights_only=weights_only)
        self._closed = False
        self._events = EventStream(r.rank, r.local_rank)
        self._metrics = metrics_file(self.knobs.metrics_file, r.rank, r.local_rank, os.path.basename(self.job_dir),
                                     self._stats_now)
        if self._metrics is not None:
            self._events.add_listener(self._metrics)
        self._session = SaverSession(self._link, ranks=r, replicated=replicated, persists=self.persists,
                                     handler=self._handler, reader=self._reader, job_dir=self.job_dir,
                                     call=lambda req, **kw: self._client_call(req, **kw), on_status=self._on_status,
                                     durability=self._durability,
                                     tier=None if self.local_dir is None else self._tier_spec, events=self._events)
        self._snapshots = Snapshots(self._handler, writes=self.snapshots, done=self._session.after_snapshot)
        if hello.records_ready:
            self._records_readied(hello.committed)
        else:  # a store that answers has them ready within moments: take them now (bounded, never an error)
            try:
                self._records_readied(self._link.records(min(_START_RECORDS_WAIT_S, self.knobs.records_timeout_s)))
            except E.FlashCheckpointError as e:
                log.warning("CheckpointEngine(%r): the node's saver is still readying the commit records (%s); "
                            "memory snapshots go on, and the first load or storage save waits for them",
                            self._given_dir, e)
        open_engines.add(self)

    @property
    def layout(self) -> CommitLayout:
        """The checkpoint dir's commit records. The node's saver readies them when it starts, on a thread of
        its own; the first use waits for that (a load, a storage save), bounded by FLASHCKPT_RECORDS_TIMEOUT_S.

        Raises:
            CheckpointTimeoutError: the store has not answered the saver's start-up work within the bound.
            CheckpointDirError: the saver's attempt failed (the message has the store's error).
        """
        if self._layout is None:
            if self._closed:  # no saver is started again to ask
                return CommitLayout(self.checkpoint_dir, self.storage)
            self._records_readied(self._link.records(self.knobs.records_timeout_s))
            assert self._layout is not None  # set by _records_readied
        return self._layout

    def _records_readied(self, committed: list[int]) -> None:
        """The saver readied the commit records, with ``committed`` (in commit order) committed then: the
        steps this engine's retention leaves alone until a newer commit (an engine that only loads never
        deletes checkpoints)."""
        self._layout = CommitLayout(self.checkpoint_dir, self.storage)
        self._deletions.readied(committed)

    @property
    def _loader(self) -> StorageLoader:
        """This rank's reader of committed files (made at the first storage load)."""
        if self._storage_loader is None:
            self._storage_loader = StorageLoader(self.layout, self.ranks.rank, weights_only=self.weights_only,
                                                 resolve=self.resolve, cache_dir=self.job_dir,
                                                 world_size=self.ranks.world_size)
        return self._storage_loader

    def _tier_spec(self) -> dict[str, Any]:
        """What a persist tells the saver of a job with a local tier (``Persist.local``): this node's persisting
        ranks, the job's layout, and how many steps the checkpoint dir keeps under the deletion strategy set
        now (0: all, or not known), for the uploader's backlog rule."""
        r, strategy = self.ranks, self.deletion_strategy
        return {"node_ranks": 1 if self.replicated else r.local_world_size, "world_size": r.world_size,
                "replicated": self.replicated,
                "durable_keep": strategy.max_to_keep if isinstance(strategy, KeepLatestStepStrategy) else 0}

    @property
    def _local_loader(self) -> StorageLoader | None:
        """This rank's reader of the node-local tier's committed files (None: no local tier)."""
        if self.local_dir is None:
            return None
        if self._tier_loader is None:
            self._tier_loader = StorageLoader(local_layout(self.local_dir), self.ranks.rank,
                                              weights_only=self.weights_only, resolve=self.resolve,
                                              cache_dir=self.job_dir, world_size=self.ranks.world_size)
        return self._tier_loader

    def local_path(self, path: str | os.PathLike[str]) -> str | None:
        """Where ``path`` (of the checkpoint dir; absolute, or relative as ``resolve`` says) lies on this
        node's local tier: the same path relative to the local dir. None without a local tier, or for a
        path outside the checkpoint dir. For adapters whose framework derives its paths from a directory
        (a load dir, an output dir) rather than from ``Located.path``."""
        tier, target = self._local_loader, self.resolve(path)
        if tier is None or locations.relpath(target, self.checkpoint_dir) is None:
            return None
        return local_target(self.layout, tier.layout, target)

    def local_file(self, path: str | os.PathLike[str]) -> tuple[int, str] | None:
        """(step, its file there): the newest step committed on this node's local tier whose manifest lists
        ``path`` (a file of the checkpoint dir, as ``resolve`` says), when the local tier holds that whole step
        intact for this rank (``tiers.whole_copy``); None otherwise (no local tier, not there, incomplete).
        Not collective: for an adapter whose ranks each load the one file on their own (replicated state)."""
        tier = self._local_loader
        if tier is None:
            return None
        return local_file(tier.layout, self.checkpoint_dir, self.resolve(path), self.ranks.rank, self.ranks.world_size)

    def resolve(self, path: str | os.PathLike[str]) -> str:
        """The absolute path a ``path`` argument (of ``save``, ``load``, ``delete_checkpoint``) names: see
        ``resolve_in`` (an absolute path is itself; a relative one that begins with the checkpoint dir as
        given, or as seen from the current directory, is that path; any other relative path is inside the
        checkpoint dir)."""
        return resolve_in(self.checkpoint_dir, self._given_dir, path)

    @property
    def save_mem_interval(self) -> int:
        """With ``save(storage_type=None)``, snapshot to memory every this many steps (0: never)."""
        return self._policy.memory_interval

    @save_mem_interval.setter
    def save_mem_interval(self, steps: int) -> None:
        self._policy.memory_interval = steps

    @property
    def save_storage_interval(self) -> int:
        """With ``save(storage_type=None)``, persist every this many steps (0: never)."""
        return self._policy.storage_interval

    @save_storage_interval.setter
    def save_storage_interval(self, steps: int) -> None:
        self._policy.storage_interval = steps

    @property
    def deletion_strategy(self) -> CheckpointDeletionStrategy | None:
        """Which committed checkpoints global rank 0 deletes after each commit (None: none)."""
        return self._deletions.strategy

    @deletion_strategy.setter
    def deletion_strategy(self, strategy: CheckpointDeletionStrategy | None) -> None:
        self._deletions.strategy = strategy

    # ------------------------------------------------------------------ save
    @property
    def snapshots(self) -> bool:
        """Whether this rank writes snapshots (in replicated mode only local rank 0 does)."""
        return not self.replicated or self.ranks.local_rank == 0

    @property
    def persists(self) -> bool:
        """Whether this rank persists its snapshots (in replicated mode only global rank 0 does)."""
        return not self.replicated or self.ranks.rank == 0

    def default_path(self, step: int) -> str:
        name = "checkpoint.pt" if self.replicated else f"rank_{self.ranks.rank:05d}.pt"
        return locations.join(self.checkpoint_dir, f"step_{step}", name)

    @engine_call("save")
    def save(self, step: int, state_dict: Any, path: str | None = None,
             storage_type: StorageType | None = None, *, overlap: bool | None = None) -> bool:
        """Snapshots ``state_dict`` into shared memory and, for DISK, schedules its persist to ``path``.

        Returns once the copy is in shared memory (with ``overlap``, once it started); the caller may
        then mutate its tensors (with ``overlap``, after ``wait_snapshot()``).

        Args:
            step: the training step. The newest save wins: saving a step again replaces its earlier
                snapshot (in memory once the new copy is complete) and its earlier commit (on storage,
                once the new one is committed); saving a lower step than before starts a new timeline
                (a rollback), which abandons the higher steps: ``load`` returns the newest save, in
                memory by save order and on storage by commit order, and retention keeps the steps
                committed last, never the one just committed.
            state_dict: a tree of dicts/lists/tuples with tensors and plain leaves, or a ``FileSet``
                (several files in their own formats; see ``flashckpt.format.files``).
            path: the file to persist to, inside the checkpoint dir (default ``step_<N>/rank_<R>.pt``);
                for a ``FileSet``, the directory its files go to (default ``step_<N>``). Absolute, or
                relative as ``resolve`` says: ``os.path.join(checkpoint_dir, "x.pt")`` means that path
                whether ``checkpoint_dir`` is absolute or relative; a bare ``"x.pt"`` is inside the
                checkpoint dir.
            storage_type: MEMORY or DISK; None lets the intervals decide (and may skip the step).
            overlap: return before the copy is done; it runs in the background (a thread for CPU
                tensors, a CUDA stream for GPU ones) while training goes on, and the tensors must not
                change until ``wait_snapshot()``. Default: the engine's ``overlap``.

        Returns:
            True when a snapshot was taken, False when the intervals skipped this step.

        Raises:
            InvalidStateDictError: ``state_dict`` holds something that cannot be stored (nothing written).
            CheckpointDirError: ``path`` is outside the checkpoint dir, in its commit records, or
                over another committed step's files (nothing written). A file that replaces exactly a file
                of an older step (a fixed name reused) is allowed: that step is superseded at the commit.
            SharedMemoryError: shared memory cannot hold the snapshot.
            PersistError: an earlier persist failed (raised once, after this snapshot was taken).
        """
        self._check_open("save")
        t_enter = time.perf_counter()
        if self._restore.downloads:  # the node's shared download of a replicated step: mapped by now
            self._restore.downloads = False
            self._loader.drop_downloads()
        if not isinstance(step, int) or step < 0:
            raise E.InvalidArgumentError(f"save(step={step!r}): step must be an integer >= 0")
        storage_type, auto_kind = self._policy.choose(step, storage_type, time.monotonic())
        if storage_type is None:
            return False
        names: list[str] | None = None
        if isinstance(state_dict, FileSet):
            names = [n for n, e in state_dict.items() if e.kind != "tracker"]
            state_dict = state_dict.encode()
            default = locations.join(self.checkpoint_dir, f"step_{step}")
        else:
            default = self.default_path(step)
        target = self.resolve(path) if path else default
        if storage_type == StorageType.DISK and self.persists:
            # Before anything is written: refuses paths outside the checkpoint dir, in its commit records,
            # or over another committed step's files.
            storage_type = self._check_target(step, target, None if names is None else
                                              [locations.join(target, n) for n in names])
        elif storage_type == StorageType.DISK:
            self.layout.rel(target)  # refuses paths outside the checkpoint dir before anything is written
        self.wait_snapshot()
        overlap = self.overlap if overlap is None else overlap
        nbytes, blocked, ref = self._snapshots.take(step, state_dict, storage_type, target, overlap=overlap)
        self._policy.observe_snapshot(step, auto_kind, blocked)
        log.info("event=save step=%d storage=%s bytes=%d seconds=%.4f overlap=%d", step, storage_type.value,
                 nbytes, blocked, int(overlap))
        with self._events.after(lambda: SnapshotTaken(  # the pause: the whole call, the persist request included
                time.time(), step, self.ranks.rank, bytes=nbytes, pause_s=time.perf_counter() - t_enter,
                storage=storage_type.value, overlap=overlap)):
            if not self._snapshots.pending:
                self._session.after_snapshot(step, storage_type, target, ref)
        record_modules()  # under flashckpt-run, once: what this rank's warm worker imports ahead
        return True

    def _check_target(self, step: int, target: str, files: list[str] | None) -> StorageType:
        """``CommitLayout.check_target`` for a storage save, against the tier its files are written to (with a
        local tier: its committed steps; the checkpoint dir's place only, whose upload stages what collides).
        A checkpoint dir that cannot be read (a store that is down) under ``on_persist_error="warn"`` makes
        the save a memory snapshot, the step owed to storage and the failure logged, and the saves of the next
        ``unreadable_backoff_s`` (FLASHCKPT_UNREADABLE_BACKOFF_S) memory snapshots at once (the store's deadline is not waited out on the
        training path at every save of an outage); returns the storage type.

        Raises:
            CheckpointDirError: the target is refused, or (``"raise"``) the checkpoint dir cannot be read.
        """
        if self._durability.unreadable():  # "warn", the store down a moment ago: not waited for again
            self._durability.not_readable(step, f"{self.checkpoint_dir} could not be read a moment ago")
            return StorageType.MEMORY
        try:
            tier = self._local_loader
            if tier is None:
                self.layout.check_target(step, target, files=files)
                self._durability.readable()
                return StorageType.DISK
            self.layout.check_place(step, target, files)
            local = tier.layout
            local.check_target(step, local_target(self.layout, local, target),
                               files=None if files is None else [local_target(self.layout, local, f) for f in files])
        except E.CheckpointDirError as e:
            if not (self._durability.warns and isinstance(e.__cause__, OSError)):
                raise
            self._durability.not_readable(step, str(e))
            return StorageType.MEMORY
        return StorageType.DISK

    @engine_call("wait_snapshot")
    def wait_snapshot(self) -> None:
        """Waits for the overlapped snapshot of the last ``save(overlap=True)`` to be in shared memory;
        then its tensors may change. Call it before the optimizer step (the adapters do); every other
        engine call waits for it first. A no-op when no snapshot is in flight.

        Raises:
            Exception: whatever the snapshot's copy raised (the slot is then left empty; earlier
                snapshots stay).
        """
        self._snapshots.wait()

    def _on_status(self, st: M.StatusReply) -> None:
        """A status reply of the saver: the persist time for ``auto_save``, the commits for retention."""
        self._policy.observe_persist(st.last_persist_s)
        self._deletions.after_commits(st.committed)

    def _allocate(self, local_rank: int, meta_cap: int, data_cap: int) -> str:
        return self._client_call(M.Alloc(local_rank=local_rank, meta_cap=meta_cap, data_cap=data_cap,
                                         nslots=self.knobs.slots)).path

    def _client_call(self, req: M.Request[RP], *, on_reattach: Callable[[], None] | None = None,
                     timeout: float | None = None) -> RP:
        """One round trip to the saver (``SaverLink.call``: a saver that died is replaced)."""
        if self._closed:
            raise E.FlashCheckpointError(_closed_message(req.OP))
        return self._link.call(req, on_reattach=on_reattach, timeout=timeout)

    @engine_call("delete_checkpoint")
    def delete_checkpoint(self, path: str | os.PathLike[str] | int) -> None:
        """Deletes a checkpoint's file or directory inside the checkpoint dir, safely: through the node's
        saver, in the background (after the commits queued before it; ``wait()`` waits for it), removing
        the commit records of the committed steps whose files it held. It is the ``delete_func`` that a
        ``clean_up`` deletion strategy receives.

        Args:
            path: a file or directory, absolute or relative (as for ``save``, see ``resolve``); or a
                committed step number (its files are deleted wherever they lie; the newest committed
                step and steps that are not committed are left alone).

        Raises:
            CheckpointDirError: nothing is deleted when ``path`` is outside the checkpoint dir, is the
                checkpoint dir itself or flashckpt's commit records, holds the newest committed step, holds
                only part of a committed step's files, or is being written by a persist in flight.
            FileNotFoundError: ``path`` does not exist.
        """
        self._check_open("delete_checkpoint")
        if isinstance(path, bool):
            raise E.InvalidArgumentTypeError(f"delete_checkpoint({path!r}): pass a path or a step number")
        if isinstance(path, int):
            self._client_call(M.DeleteSteps(steps=[path], background=True))
            return
        target = self.resolve(path)
        reply = self._client_call(M.DeletePath(path=target))
        if reply.missing:
            raise E.CheckpointNotFoundError(errno.ENOENT, f"delete_checkpoint({os.fspath(path)!r}): no such file or directory",
                                    target)

    @engine_call("delete_steps")
    def delete_steps(self, steps: list[int], *, newest: bool = False) -> list[int]:
        """Deletes committed ``steps`` now, through the node's saver (records first, then files that no
        other committed step lists), and returns those it deleted; steps that are not committed (being
        persisted, or unknown) are left alone. For adapters of frameworks that delete their own
        checkpoints: ``newest=True`` lets the newest committed step go too (the tracker then names the
        newest step left), as when a Trainer keeps only its best checkpoint."""
        self._check_open("delete_steps")
        reply = self._client_call(M.DeleteSteps(steps=[int(s) for s in steps], newest=newest))
        return reply.deleted

    def durability(self) -> Durability:
        """Where this rank's newest state is safe now: the newest step in memory, the newest committed step,
        how far storage is behind (``lag_s``) and which steps asked of storage it still owes, the recent
        commits' lags, the failures seen; as of the saver's last news (a save or ``wait()`` brings news).
        See ``flashckpt.engine.durability``."""
        return self._durability.report()

    def add_listener(self, fn: Callable[[Event], Any], kinds: Iterable[str] | None = None) -> Callable[[], None]:
        """Calls ``fn(event)`` for every checkpointing event this engine hears from now on: its snapshots
        (``SnapshotTaken``: bytes, the pause), the persists of its rank (``PersistStarted``, ``Persisted``:
        bytes, seconds, throughput; ``PersistFailed``), its loads (``Loaded``: source, step, seconds), failures
        (``Failed``: what is still safe); on local rank 0 also the node's commits (``Committed``: step, tier,
        lag), uploads, storage retries (``Retried``), last words and replica traffic. ``kinds``: only these
        (the events' ``kind`` names). Returns a function that removes the listener.

        ``fn`` runs in the training thread, inside the engine call that learnt of the event (a save,
        ``wait``, ``stats``, a load, ``close``): the saver's events arrive with its news, which every save
        asks for without waiting (so a commit is heard at a save or ``wait`` after it). Keep it short; an
        exception it raises is logged and ignored. Every event is also logged at INFO on the
        ``flashckpt.events`` logger. See ``flashckpt.engine.events``.

        Raises:
            InvalidArgumentError: ``fn`` is not callable, or ``kinds`` names an unknown kind.
        """
        return self._events.add_listener(fn, kinds)

    @engine_call("stats")
    def stats(self, refresh: bool = True) -> Stats:
        """A running summary of this engine's checkpointing: snapshots and the pause they cost, this rank's
        persists (bytes, seconds, throughput), commits per tier and the newest step on each tier, the lag,
        retries, failures, loads and replica traffic (``flashckpt.engine.events.Stats``). Asks the node's
        saver for its news first (one round trip), so the figures are current; ``refresh=False``: as of the
        news the last save or ``wait`` brought (no round trip: what the adapters report after each save).

        Raises:
            PersistError: a persist failed since the last call that reported one (as ``save`` and ``wait``
                raise it), with ``on_persist_error="raise"``.
        """
        self._check_open("stats")
        self.wait_snapshot()
        if refresh:
            self._session.absorb(self._client_call(M.Status(cursor=self._link.cursor, local_rank=self.ranks.local_rank,
                                                            since=self._link.event_seq)))
        return self._stats_now()

    def _stats_now(self) -> Stats:
        d = self._durability.report()
        return self._events.stats(durable_step=d.durable_step, local_step=d.local_step, memory_step=d.memory_step,
                                  lag_s=d.lag_s)

    def saver_cpu_seconds(self) -> float | None:
        """CPU time (user + system, all threads) the node's saver daemon and its persist workers have used
        since it started: what persisting costs the host's cores, for monitoring. None where ``/proc``
        cannot tell (not Linux, or the saver is gone)."""
        pid = self._link.saver_pid
        return process_cpu_seconds(pid, children=True) if pid > 0 else None

    # ------------------------------------------------------------------ wait / close
    @engine_call("wait")
    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every scheduled persist is committed; raises the first persist error.

        Raises:
            PersistError: a persist or commit failed.
            CheckpointTimeoutError: ``timeout`` seconds passed first.
        """
        self._check_open("wait")
        self.wait_snapshot()
        for _ in range(2):  # a second round covers the retention the first commit triggered
            applied = self._deletions.applied
            reply = self._client_call(M.Wait(timeout_s=timeout or 0, cursor=self._link.cursor,
                                             since=self._link.event_seq),
                                      timeout=None if timeout is None else timeout + self.knobs.rpc_timeout_s)
            self._session.absorb(reply)
            if self._deletions.applied == applied:
                break

    @engine_call("close", renew=False, forked_detaches=True)
    def close(self, release: bool = True) -> None:
        """Detaches from the saver. Scheduled persists still complete in the saver.

        Every end of an engine keeps the newest state, the same way: ``close()``, ``close(release=False)``,
        the end of a ``with`` block (with or without an exception) and an exit without ``close()`` all have
        the node's saver persist and commit the newest snapshot in memory when it is newer than the last
        commit (last words, in the background: ``close`` does not wait for it; ``FLASHCKPT_LAST_WORDS=0``
        turns it off), so the next run resumes from it. What differs is only how long the snapshots stay
        in memory. To know the state is committed before going on, save with ``StorageType.DISK`` and
        ``wait()`` first (then there is nothing newer to persist).

        Args:
            release: this rank is done with its snapshots: once every rank released, the saver writes
                its last words, finishes its persists, exits and frees the shared memory (an engine
                opened on the same dir meanwhile waits for that). With False (a planned restart; a crash
                or an exception with a restart coming does the same) the saver also keeps the snapshots
                for its grace period (``FLASHCKPT_SAVER_GRACE_S``), so a new process loads them from
                memory.
        """
        self._close("release" if release else "keep")

    @engine_call("close", renew=False, forked_detaches=True)
    def _close(self, intent: str) -> None:
        """``close`` with the goodbye's intent: "release" (``close()``) or "persist" (an exit or an
        exception without a restart coming): the saver exits once every rank left; "keep" (for a restart
        within the saver's grace). Each keeps the newest snapshot (see ``close``)."""
        if self._closed:
            return
        self._closed = True
        open_engines.discard(self)
        try:
            try:
                self.wait_snapshot()
            except Exception as e:  # closing anyway; the error was the snapshot's, not the close's
                log.warning("close(): the last overlapped snapshot failed: %s", e)
            finally:
                self._snapshots.close()
            self._link.bye(intent)
        finally:
            if self._metrics is not None:
                self._metrics.flush()
            if self._reader is not self._handler:
                self._reader.close()
            self._handler.close()
            self._copier.close()
            self.storage.close()

    def __enter__(self) -> CheckpointEngine:
        return self

    @engine_call("close", renew=False, forked_detaches=True)
    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        """Without an exception, ``close()``. With one, the snapshots are kept for a restart when one is
        coming (``restart_expected``); otherwise the saver persists what is newer than the last commit
        and exits at once, instead of holding the memory for its grace period."""
        if exc_type is None:
            self.close()
        else:
            self._close("keep" if restart_expected() else "persist")

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise E.FlashCheckpointError(_closed_message(op))

    def _ensure_runtime(self, op: str) -> None:
        """Before a call uses the saver or shared memory: when the job's runtime dir is no longer the one this
        engine's shared memory lives in (removed or replaced, ``dir_identity``; or the segment it writes was
        removed), the snapshots there are lost. The engine then drops everything bound to it (mappings, its
        writer lease, an overlapped snapshot not yet handed over) and attaches to a new saver, which starts
        with new shared memory (``SaverLink.reattach``, which logs one warning); unless the link already
        attached to a saver of the new dir (its connection broke meanwhile). Costs a ``stat`` or two."""
        if not self._session.runtime_lost():
            return
        self._snapshots.abandon(op)  # its copy went into the lost memory
        self._session.renew(op)

    # ------------------------------------------------------------------ load
    @engine_call("memory_steps", renew=False)
    def memory_steps(self) -> list[int]:
        """Steps this rank could load from shared memory, newest first. (``SnapshotReader(engine)`` lists
        them with the path each is persisted to, and reads them without the engine.)"""
        return self._reader.memory_steps()

    @engine_call("locate")
    def locate(self, *, memory: bool = True, local: bool = False, reshard: bool = False) -> Located:
        """Where the newest checkpoint that every rank has lives, without loading it.

        All ranks of the process group must call it (one ``all_gather``, and an ``all_reduce`` per
        storage step verified). Memory wins when it holds the agreed step; storage steps are
        checksum-verified on every rank, falling back to the previous committed step when damaged.
        ``memory=False`` considers storage only (for a caller that cannot use the memory snapshot).

        ``local=True`` (an adapter whose framework opens the files itself) also considers the node-local
        tier, as a whole: ``Located(step, "local", this rank's path under the local dir)`` when every rank's
        local tier holds every file of the step (its local manifest lists every rank of the job, each rank
        verified its part, all agree: one more ``all_reduce`` pair) and it is the step the checkpoint dir
        would serve or a newer one committed locally and not yet uploaded. A node holding only its own
        ranks' files (a multi-node job) or a wiped local dir gives the checkpoint dir's step, as without
        it. The local dir has the checkpoint dir's layout: the path opens as a durable one would.

        ``reshard=True`` (an adapter whose framework reshards a checkpoint saved by another number of ranks:
        FSDP/DCP, megatron-core ``torch_dist``): when memory holds no step of this job's number of ranks, a step
        saved by another number that the nodes' memory holds whole (every old rank's snapshot on some node: its
        own, a copy, or a partner's backup) and that is not older than the newest commit gives
        ``Located(step, "memory", its path, world=<the old number of ranks>)``; ``load_memory`` then returns a
        ``Resharded`` (the old ranks' states, read from this node's memory or fetched from a peer on first
        use) for the adapter's resharding reader."""
        self._check_open("locate")
        self.wait_snapshot()
        return self._restore.locate(memory=memory, deep=True, local="whole" if local else "", reshard=reshard)

    @engine_call("load")
    def load(self, resume_path: str = "", *, into: Any = None) -> Any:
        """The newest state dict that every rank has: from memory when memory holds it, else storage.

        Args:
            resume_path: load this persisted file (or ``FileSet`` directory) instead (verified against
                its manifest when listed).
            into: a state-dict tree of existing tensors (for example ``{"model": model.state_dict()}``;
                for a ``FileSet``, ``{file name: tree}``), filled by one rule whatever the source (memory,
                a file system, an object store, ``resume_path``): a tensor of ``into`` receives the saved
                tensor at the same key path when dtype and shape are the same and it is a plain contiguous
                CPU or CUDA tensor (whatever device the saved one was on); it is then returned in place of
                the saved one, so the model's parameters are loaded already. Memory copies straight from
                shared memory (host-to-device for CUDA tensors) and an object store reads straight into
                them where it can; other tensors go through a copy. A tensor of ``into`` that the rule
                leaves alone (another dtype or shape, or nothing at its key path) keeps its values, the
                returned state dict holds what the checkpoint has there, and one warning names it. Saved
                tensors that fill nothing come back as without ``into`` (from memory, tensors saved from
                a GPU come back on that GPU; from storage, on the CPU).

        Memory serves only this rank's own snapshots (wherever on this node: a restart may number the
        node's ranks otherwise), saved by a job of this number of ranks (replicated: any copy), and none
        that another live process writes (another training on this job key: logged, storage decides).

        Returns:
            The state dict (a ``FileSet`` for sets), or ``{}`` when there is no checkpoint. ``last_load``
            tells where it came from.

        Raises:
            RankStateNotFoundError: the newest committed step holds no state of some rank of this job (saved
                by fewer ranks), on every rank alike; a rank is never handed another rank's state.
            CheckpointCorruptError: ``resume_path`` does not match its manifest.
            CheckpointDirError: ``resume_path`` lies outside the checkpoint dir.
            FileNotFoundError: ``resume_path`` does not exist (the message lists the committed steps).
        """
        self._check_open("load")
        self.wait_snapshot()
        # A restore allocates a few containers per tensor: no full garbage collection in the middle of it
        # (60-80 ms with torch imported); it runs at the caller's next allocation instead.
        with gc_paused():
            return self._load(resume_path, into)

    def _load(self, resume_path: str, into: Any) -> Any:
        t0 = time.perf_counter()
        if resume_path:
            sd = self._loader.load_file(self._loader.resume_target(resume_path), into=into)
            self._loaded(None, "storage", t0, 0)
            return sd
        # A store without local files (an object store) is verified while it is read: a step whose file
        # turns out damaged on any rank is excluded and every rank goes back to the previous one.
        loc, sd, nbytes = self._restore.newest(deep=self.storage.local_path(self.checkpoint_dir) is not None,
                                               into=into)
        if loc.source == "memory":
            return self.load_memory(loc.step, into=into, _t0=t0)
        if loc.source in ("storage", "local") and loc.step is not None:
            self._loaded(loc.step, loc.source, t0, nbytes)
            return sd
        self._loaded(None, "none", t0, 0, note=unrecorded(self.layout) or "")
        return {}

    @engine_call("load_memory")
    def load_memory(self, step: int | None, *, into: Any = None, _t0: float | None = None) -> Any:
        """This rank's snapshot of ``step`` (the newest when None) from shared memory, without agreeing
        with other ranks (``locate`` does that). A ``FileSet`` for sets; see ``load`` for ``into``.

        After ``locate(reshard=True)`` found a step saved by another number of ranks, that step gives its
        ``Resharded`` (the old ranks' states, for a resharding reader) instead.

        Raises:
            FlashCheckpointError: memory holds no such snapshot (any more)."""
        self._check_open("load_memory")
        self.wait_snapshot()
        t0 = time.perf_counter() if _t0 is None else _t0
        resharded = self._restore.resharded
        if resharded is not None and step == resharded.step:  # located by ``locate(reshard=True)``
            self._restore.resharded = None  # the caller's now: its views of the segments go with its last use
            self._loaded(resharded.step, "memory", t0, resharded.nbytes)
            return resharded
        snap = self._reader.load_snapshot(step, into=into)
        if snap is None:
            raise E.FlashCheckpointError(f"load(): the snapshot of step {step} is not (or no longer) in memory")
        self._loaded(snap.step, "memory", t0, snap.nbytes)
        sd = snap.state_dict
        return FileSet.decode(sd) if is_fileset_tree(sd) else sd

    @engine_call("committed_steps", renew=False)
    def committed_steps(self) -> list[int]:
        """The committed steps on storage, ascending."""
        return self.layout.committed_steps()

    @engine_call("step_path", renew=False)
    def step_path(self, step: int) -> str | None:
        """Rank 0's file (or ``FileSet`` directory) of committed ``step``; None when it has none."""
        return self._loader.path_of(step, rank=0)

    def _loaded(self, step: int | None, source: str, t0: float, nbytes: int, *, note: str = "") -> None:
        self.last_load = LoadResult(step, source, time.perf_counter() - t0, nbytes, note)
        if note:
            log.warning("load(): %s", note)
        log.info("event=load step=%s source=%s bytes=%d seconds=%.4f", step, source, nbytes, self.last_load.seconds)
        self._events.emit(Loaded(time.time(), step, self.ranks.rank, source=source, seconds=self.last_load.seconds,
                                 bytes=nbytes, note=note))


def _closed_message(op: str) -> str:
    return (f"{op}(): this checkpointer is closed (close() was called, or its `with` block ended); create a new "
            "checkpointer to save or load again")
