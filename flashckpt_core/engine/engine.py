"""CheckpointEngine: the trainer's entry point. Snapshots go to shared memory; the saver persists."""

from __future__ import annotations

import atexit
import errno
import functools
import logging
import math
import os
import sys
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from flashckpt import errors as E
from flashckpt.commit.adopt import unrecorded
from flashckpt.commit.layout import CommitLayout, commit_spec
from flashckpt.commit.retention import CheckpointDeletionStrategy, KeepLatestStepStrategy, uses_clean_up
from flashckpt.config import Knobs, RankInfo, StorageType, dir_identity, job_dir
from flashckpt.engine.agreement import agree, all_ranks, memory_across_nodes, multi_node, newer_in_memory, verified_step
from flashckpt.engine.guard import CallGuard
from flashckpt.engine.interval import AutoIntervals, default_failure_rates, storage_type_for
from flashckpt.engine.loader import StorageLoader
from flashckpt.format.files import FileSet, is_fileset_tree
from flashckpt.format.tree import gc_paused
from flashckpt.memory.reader import SnapshotReader
from flashckpt.memory.writer import SharedMemoryHandler
from flashckpt.storage import locations
from flashckpt.storage.locations import checkpoint_location, local_dir, resolve_in
from flashckpt.storage.registry import storage_for, storage_spec
from flashckpt.transport import messages as M
from flashckpt.transport.link import SaverLink, agent_pid, restart_expected
from flashckpt.transport.messages import RP
from flashckpt.transport.wire import process_cpu_seconds
from flashckpt.util.copy import Copier
from flashckpt.util.module_record import record_modules

__all__ = ["CheckpointEngine", "LoadResult", "Located", "local_dir", "resolve_in"]

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])
_EXIT_WAIT_S = 10.0  # at exit, how long a close waits for a call still running in another (daemon) thread


def _engine_call(op: str, *, renew: bool = True, forked_detaches: bool = False) -> Callable[[_F], _F]:
    """Runs a ``CheckpointEngine`` method as one call under the engine's ``CallGuard`` (``_guard``: the
    opening process only, one call at a time, no re-entry from a signal handler). A nested call made from
    this module (the engine calling itself) is the running call's own. The outermost call first makes sure
    the job's runtime dir still holds this engine's shared memory (``renew``: ``_ensure_runtime``).
    ``forked_detaches``: in a forked child the call only marks the child's copy closed (``close``)."""
    def wrap(fn: _F) -> _F:
        here = fn.__code__.co_filename

        @functools.wraps(fn)
        def call(self: CheckpointEngine, *args: Any, **kw: Any) -> Any:
            if forked_detaches and not self._guard.owner():
                self._closed = True  # a forked child's copy: only the opening process ends the engine
                return None
            with self._guard.call(op, internal=sys._getframe(1).f_code.co_filename == here) as outer:
                if outer and renew and not self._closed:
                    self._ensure_runtime(op)
                return fn(self, *args, **kw)

        return cast(_F, call)

    return wrap


# How long a new engine waits for its saver to ready the commit records before it goes on without them
# (the saver does that beside serving, so that a stalled store never holds up the start).
_START_RECORDS_WAIT_S = 2.0


@dataclass(frozen=True)
class LoadResult:
    """What the last ``load()`` found: the step, where it came from ("memory", "storage" or "none"),
    seconds it took and bytes of tensor data."""

    step: int | None
    source: str
    seconds: float
    nbytes: int
    note: str = ""  # with source "none": why files the checkpoint dir holds were not used (``adopt.unrecorded``)


@dataclass(frozen=True)
class Located:
    """Where the newest checkpoint every rank has lives: ``step``, ``source`` ("memory", "storage" or
    "none") and ``path``: this rank's file (or ``FileSet`` directory) as given to ``save``."""

    step: int | None
    source: str
    path: str | None


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
        process_mtbf_s / node_mtbf_s: with ``auto_save``, the mean seconds between failures that memory
            survives (process crashes) and that lose the node (``interval.mtbf_from_failures_per_day``
            converts a daily count); one given alone means no failures of the other kind. With neither,
            ``interval.default_failure_rates(world_size)`` (Llama 3's published per-GPU rate, 78% of
            failures losing the node), logged at INFO.
        weights_only: load persisted files with ``torch.load(weights_only=True)``, and decode the
            Python objects of memory snapshots under the same rules; set False only for trusted
            checkpoints holding arbitrary Python objects.
        overlap: ``save`` returns before its copy is done (see ``save`` and ``wait_snapshot``).
        storage_options: options of the storage backend (for ``s3://``: ``storage_s3.S3Options``' fields,
            such as ``endpoint_url`` or ``part_size_mb``); the node's saver is started with them.

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
                 storage_options: dict[str, Any] | None = None) -> None:
        for name, v in (("max_to_keep", max_to_keep), ("save_mem_interval", save_mem_interval),
                        ("save_storage_interval", save_storage_interval)):
            if not isinstance(v, int) or v < 0:
                raise E.InvalidArgumentError(f"CheckpointEngine({name}={v!r}): must be an integer >= 0")
        self._guard = CallGuard()
        self.ranks = RankInfo.current()
        self._auto = self._auto_intervals(process_mtbf_s, node_mtbf_s) if auto_save else None
        self._given_dir = checkpoint_location(checkpoint_dir)
        self.storage = storage_for(self._given_dir, storage_options)
        self.checkpoint_dir = self.storage.normpath(self._given_dir)
        self.storage.prepare_dir(self.checkpoint_dir, self._given_dir)
        self.save_mem_interval = save_mem_interval
        self.save_storage_interval = save_storage_interval
        self.replicated = replicated
        self.weights_only = weights_only
        self.process_group = process_group
        self.overlap = overlap
        self._bg: ThreadPoolExecutor | None = None
        self._pending: tuple[Any, int, StorageType, str] | None = None
        if deletion_strategy is None and max_to_keep > 0:
            deletion_strategy = KeepLatestStepStrategy(max_to_keep, self.checkpoint_dir)
        self.deletion_strategy = deletion_strategy
        self.knobs = Knobs.from_env()
        self.job_dir = job_dir(self.checkpoint_dir, self.knobs)
        self.last_load: LoadResult | None = None
        self._applied_retention: tuple[int, ...] = ()
        self._retention_baseline = -1  # the step committed last before this engine started
        self._cleaned_up: list[int] = []  # commit order last seen by a clean_up strategy
        self._copier = Copier(self.knobs.copy_threads)
        r = self.ranks
        self._link = SaverLink(self.job_dir, self.checkpoint_dir, self.knobs, storage=storage_spec(self.storage),
                               storage_options=storage_options,
                               hello=lambda: M.Hello(rank=r.rank, local_rank=r.local_rank, world_size=r.world_size,
                                                     local_world_size=r.local_world_size, pid=os.getpid(),
                                                     persists=self.persists, commit=self._commit_spec(),
                                                     agent_pid=agent_pid(), replicated=replicated))
        hello = self._link.attach()
        # The commit records are read once the saver has readied them (CommitLayout.claim, on its records
        # thread: a stalled store never holds up the start); until then ``layout`` waits for them.
        self._layout: CommitLayout | None = None
        self._storage_loader: StorageLoader | None = None
        # The rank that writes this local rank's snapshots takes its writer lease at its first save and
        # holds it until close: a second writer (another engine, another job with this job key) is refused.
        # It reads back only what this process may resume from: its rank's own snapshots (wherever they are on
        # this node), saved by a job of its number of ranks (replicated state: any copy), and none that another
        # live process writes (another training on this job key; the reader says so in the log).
        self._handler = SharedMemoryHandler(r.local_rank, self.job_dir,
                                            allocate=self._allocate if self.snapshots else None,
                                            copier=self._copier, weights_only=weights_only,
                                            writer_info={"rank": r.rank, "world_size": r.world_size,
                                                         "checkpoint_dir": self.checkpoint_dir},
                                            rank=None if replicated else r.rank,
                                            world_size=None if replicated else r.world_size, own_only=True)
        # Replicated, local ranks > 0 read local rank 0's segments, which a live sibling of this run writes:
        # the agreement with local rank 0 (which checks who writes them) decides whether memory serves.
        self._reader: SnapshotReader = (
            self._handler if not replicated or r.local_rank == 0 else
            SnapshotReader.for_job_dir(0, self.job_dir, copier=self._copier, weights_only=weights_only))
        self._downloads = False  # a load from an object store may have left a shared download
        self._closed = False
        self._memory_in = (self._link.runtime, self._link.attaches)  # the runtime dir of the shared memory used
        if hello.records_ready:
            self._records_readied(hello.committed)
        else:  # a store that answers has them ready within moments: take them now (bounded, never an error)
            try:
                self._records_readied(self._link.records(min(_START_RECORDS_WAIT_S, self.knobs.records_timeout_s)))
            except E.FlashCheckpointError as e:
                log.warning("CheckpointEngine(%r): the node's saver is still readying the commit records (%s); "
                            "memory snapshots go on, and the first load or storage save waits for them",
                            self._given_dir, e)
        _open_engines.add(self)

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
        self._retention_baseline = committed[-1] if committed else -1  # in commit order
        self._cleaned_up = list(committed)

    @property
    def _loader(self) -> StorageLoader:
        """This rank's reader of committed files (made at the first storage load)."""
        if self._storage_loader is None:
            self._storage_loader = StorageLoader(self.layout, self.ranks.rank, weights_only=self.weights_only,
                                                 resolve=self.resolve, cache_dir=self.job_dir,
                                                 world_size=self.ranks.world_size)
        return self._storage_loader

    def _auto_intervals(self, process_mtbf_s: float | None, node_mtbf_s: float | None) -> AutoIntervals:
        """``auto_save``'s interval chooser, with the default failure rates when none are given."""
        if process_mtbf_s is None and node_mtbf_s is None:
            rates = default_failure_rates(self.ranks.world_size)
            log.info("auto_save: no failure rates given; assuming %s. Pass process_mtbf_s / node_mtbf_s (seconds) "
                     "to use your cluster's own", rates.describe())
            return AutoIntervals(process_mtbf_s=rates.process_mtbf_s, node_mtbf_s=rates.node_mtbf_s)
        return AutoIntervals(process_mtbf_s=math.inf if process_mtbf_s is None else process_mtbf_s,
                             node_mtbf_s=math.inf if node_mtbf_s is None else node_mtbf_s)

    def resolve(self, path: str | os.PathLike[str]) -> str:
        """The absolute path a ``path`` argument (of ``save``, ``load``, ``delete_checkpoint``) names: see
        ``resolve_in`` (an absolute path is itself; a relative one that begins with the checkpoint dir as
        given, or as seen from the current directory, is that path; any other relative path is inside the
        checkpoint dir)."""
        return resolve_in(self.checkpoint_dir, self._given_dir, path)

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

    @_engine_call("save")
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
        if self._downloads:  # the node's shared download of a replicated step: mapped by now
            self._downloads = False
            self._loader.drop_downloads()
        if not isinstance(step, int) or step < 0:
            raise E.InvalidArgumentError(f"save(step={step!r}): step must be an integer >= 0")
        auto_kind = None
        if storage_type is None and self._auto is not None:
            auto_kind = self._auto.decide(step, time.monotonic())
            if auto_kind is None:
                return False
            storage_type = StorageType.DISK if auto_kind == "storage" else StorageType.MEMORY
        if storage_type is None:
            if not (self.save_mem_interval or self.save_storage_interval):
                raise E.InvalidArgumentError(f"save(step={step}, storage_type=None): no interval is set, so nothing would "
                                 "be saved; pass storage_type=StorageType.MEMORY or DISK, or construct the "
                                 "engine with save_mem_interval / save_storage_interval")
            storage_type = self._interval_type(step)
            if storage_type is None:
                return False
        if storage_type not in (StorageType.MEMORY, StorageType.DISK):
            raise E.InvalidArgumentError(f"save(storage_type={storage_type!r}): use StorageType.MEMORY or StorageType.DISK")
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
            self.layout.check_target(step, target, files=None if names is None else
                                     [locations.join(target, n) for n in names])
        elif storage_type == StorageType.DISK:
            self.layout.rel(target)  # refuses paths outside the checkpoint dir before anything is written
        self.wait_snapshot()
        overlap = self.overlap if overlap is None else overlap
        t0 = time.perf_counter()
        finish = self._handler.start_save(step, state_dict, ckpt_name=target) if self.snapshots else None
        nbytes = self._handler._plan.tensor_bytes if finish is not None and self._handler._plan else 0
        if overlap and finish is not None:
            if self._bg is None:
                self._bg = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-snapshot")
            self._pending = (self._bg.submit(finish), step, storage_type, target)
            finish = None
        ref = finish() if finish is not None else None
        blocked = time.perf_counter() - t0
        if auto_kind is not None and self._auto is not None:
            self._auto_observe(step, auto_kind, blocked)
        log.info("event=save step=%d storage=%s bytes=%d seconds=%.4f overlap=%d", step, storage_type.value,
                 nbytes, blocked, int(overlap))
        if self._pending is None:
            self._after_snapshot(step, storage_type, target, ref)
        record_modules()  # under flashckpt-run, once: what this rank's warm worker imports ahead
        return True

    @_engine_call("wait_snapshot")
    def wait_snapshot(self) -> None:
        """Waits for the overlapped snapshot of the last ``save(overlap=True)`` to be in shared memory;
        then its tensors may change. Call it before the optimizer step (the adapters do); every other
        engine call waits for it first. A no-op when no snapshot is in flight.

        Raises:
            whatever the snapshot's copy raised (the slot is then left empty; earlier snapshots stay).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        fut, step, storage_type, target = pending
        self._after_snapshot(step, storage_type, target, fut.result())

    def _after_snapshot(self, step: int, storage_type: StorageType, target: str, ref: Any) -> None:
        """Schedules the persist of a DISK snapshot and collects the saver's news."""
        reply = None
        if storage_type == StorageType.DISK and self.persists:
            self._handler.mark_pending(ref)
            try:
                # A new saver (after ours died) cleared every slot's flags when it adopted the segments.
                reply = self._client_call(
                    M.Persist(step=step, rank=self.ranks.rank, local_rank=self.ranks.local_rank, seg_path=ref.path,
                              slot=ref.slot, generation=ref.generation, path=target, commit=self._commit_spec(),
                              cursor=self._link.cursor),
                    on_reattach=lambda: self._handler.mark_pending(ref))
            except BaseException as e:
                self._handler.clear_pending(ref)
                if isinstance(e, E.CheckpointTimeoutError):  # unanswered: the saver may still persist it
                    self._link.requested.add(step)
                raise
            self._link.requested.add(step)
            self._link.status_at = time.monotonic()
        if reply is None:
            self._news(ref.path if ref is not None else None)
        else:
            self._after_reply(reply)

    def _news(self, seg: str | None) -> None:
        """The saver's news after a memory snapshot, never waiting for it (``SaverLink.news``)."""
        st = self._link.news(seg, self.ranks.local_rank)
        if st is not None:
            self._after_reply(st)

    def _commit_spec(self) -> dict[str, Any] | None:
        """What global rank 0's saver needs to commit a step; None on other ranks."""
        return commit_spec(self.ranks.world_size, self.replicated) if self.ranks.rank == 0 else None

    def _auto_observe(self, step: int, kind: str, blocked: float) -> None:
        auto = self._auto
        assert auto is not None  # internal invariant, not user input
        before = auto.choice
        auto.observe_snapshot(step, kind, blocked)
        if auto.choice is not None and (before is None or (before.memory_steps, before.storage_steps)
                                        != (auto.choice.memory_steps, auto.choice.storage_steps)):
            c = auto.choice
            log.info("event=auto_intervals memory_steps=%d storage_steps=%d step_s=%.4f snapshot_s=%.4f "
                     "persist_s=%.3f expected_goodput=%.4f", c.memory_steps, c.storage_steps, auto.step_time_s or 0,
                     auto.snapshot_cost_s or 0, auto.persist_cost_s, c.expected_goodput)

    def _interval_type(self, step: int) -> StorageType | None:
        return storage_type_for(step, self.save_mem_interval, self.save_storage_interval)

    def _allocate(self, local_rank: int, meta_cap: int, data_cap: int) -> str:
        return self._client_call(M.Alloc(local_rank=local_rank, meta_cap=meta_cap, data_cap=data_cap,
                                         nslots=self.knobs.slots)).path

    def _client_call(self, req: M.Request[RP], *, on_reattach: Callable[[], None] | None = None,
                     timeout: float | None = None) -> RP:
        """One round trip to the saver (``SaverLink.call``: a saver that died is replaced)."""
        if self._closed:
            raise E.FlashCheckpointError(_closed_message(req.OP))
        return self._link.call(req, on_reattach=on_reattach, timeout=timeout)

    def _after_reply(self, st: M.StatusReply) -> None:
        self._link.absorb(st)
        if self._auto is not None:
            self._auto.observe_persist(st.last_persist_s)
        self._retain(st.committed)
        failed = [e["error"] for e in st.errors if not e.get("committed")]
        notes = [e["error"] for e in st.errors if e.get("committed")]  # committed steps whose tracker update failed
        msgs = [f"{len(failed)} persist(s) failed: " + "; ".join(failed)] if failed else []
        lost = self._link.take_lost()
        if lost:
            msgs.append(lost)
        if msgs:
            error = E.PersistError(f"{'. '.join(msgs + notes)}. Earlier committed checkpoints are intact; memory "
                                   "snapshots continue.")
            if not lost and not notes:
                error.failed_steps = tuple(int(e["step"]) for e in st.errors if not e.get("committed"))
            raise error
        if notes:
            raise E.PersistError("; ".join(notes))

    def _retain(self, committed: list[int]) -> None:
        """Applies the deletion strategy after a commit newer than any that existed when this engine
        started: an engine that only loads never deletes checkpoints. ``committed`` is in commit order;
        the step committed last is never deleted, whatever its number."""
        if self.ranks.rank != 0 or self.deletion_strategy is None or not committed or self._layout is None:
            return  # (without the records, what existed when this engine started is not known yet)
        if uses_clean_up(self.deletion_strategy):
            self._clean_up(committed)
            return
        if committed[-1] == self._retention_baseline:
            return
        key = tuple(committed)
        if key == self._applied_retention:
            return
        doomed = [s for s in self.deletion_strategy.steps_to_delete(committed) if s != committed[-1]]
        self._applied_retention = key
        if doomed:
            self._client_call(M.DeleteSteps(steps=doomed, background=True))

    def _clean_up(self, committed: list[int]) -> None:
        """DLRover's contract: ``clean_up(step, delete_func)`` once per commit seen since the last call,
        with the step committed just before it (in commit order); a step committed again counts anew."""
        seen = self._cleaned_up
        if committed == seen:
            return
        self._cleaned_up = list(committed)
        self._applied_retention = tuple(committed)  # wait() waits for the deletions this schedules
        before = set(seen)
        moved = bool(seen) and committed[-1] in before and committed[-1] != seen[-1]  # saved again
        strategy = self.deletion_strategy
        assert strategy is not None  # checked by the caller
        for i, step in enumerate(committed):
            if i == 0 or (step in before and not (moved and i == len(committed) - 1)):
                continue
            prev = committed[i - 1]
            try:
                strategy.clean_up(prev, lambda path: self.delete_checkpoint(path))  # a call of this engine's own
            except Exception as e:  # retention never stops training; the strategy's fault is reported
                log.error("%s.clean_up(step=%d) after the commit of step %d failed: %s: %s", type(strategy).__name__,
                          prev, step, type(e).__name__, e)

    @_engine_call("delete_checkpoint")
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

    @_engine_call("delete_steps")
    def delete_steps(self, steps: list[int], *, newest: bool = False) -> list[int]:
        """Deletes committed ``steps`` now, through the node's saver (records first, then files that no
        other committed step lists), and returns those it deleted; steps that are not committed (being
        persisted, or unknown) are left alone. For adapters of frameworks that delete their own
        checkpoints: ``newest=True`` lets the newest committed step go too (the tracker then names the
        newest step left), as when a Trainer keeps only its best checkpoint."""
        self._check_open("delete_steps")
        reply = self._client_call(M.DeleteSteps(steps=[int(s) for s in steps], newest=newest))
        return reply.deleted

    def saver_cpu_seconds(self) -> float | None:
        """CPU time (user + system, all threads) the node's saver daemon and its persist workers have used
        since it started: what persisting costs the host's cores, for monitoring. None where ``/proc``
        cannot tell (not Linux, or the saver is gone)."""
        pid = self._link.saver_pid
        return process_cpu_seconds(pid, children=True) if pid > 0 else None

    # ------------------------------------------------------------------ wait / close
    @_engine_call("wait")
    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every scheduled persist is committed; raises the first persist error.

        Raises:
            PersistError: a persist or commit failed.
            CheckpointTimeoutError: ``timeout`` seconds passed first.
        """
        self._check_open("wait")
        self.wait_snapshot()
        for _ in range(2):  # a second round covers the retention the first commit triggered
            applied = self._applied_retention
            reply = self._client_call(M.Wait(timeout_s=timeout or 0, cursor=self._link.cursor),
                                      timeout=None if timeout is None else timeout + self.knobs.rpc_timeout_s)
            self._after_reply(reply)
            if self._applied_retention == applied:
                break

    @_engine_call("close", renew=False, forked_detaches=True)
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

    @_engine_call("close", renew=False, forked_detaches=True)
    def _close(self, intent: str) -> None:
        """``close`` with the goodbye's intent: "release" (``close()``) or "persist" (an exit or an
        exception without a restart coming): the saver exits once every rank left; "keep" (for a restart
        within the saver's grace). Each keeps the newest snapshot (see ``close``)."""
        if self._closed:
            return
        self._closed = True
        _open_engines.discard(self)
        try:
            try:
                self.wait_snapshot()
            except Exception as e:  # closing anyway; the error was the snapshot's, not the close's
                log.warning("close(): the last overlapped snapshot failed: %s", e)
            finally:
                if self._bg is not None:
                    self._bg.shutdown(wait=True)
            self._link.bye(intent)
        finally:
            if self._reader is not self._handler:
                self._reader.close()
            self._handler.close()
            self._copier.close()
            self.storage.close()

    def __enter__(self) -> CheckpointEngine:
        return self

    @_engine_call("close", renew=False, forked_detaches=True)
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
        runtime, attaches = self._memory_in
        if dir_identity(self.job_dir) == runtime and not self._handler.segment_gone():
            return
        pending, self._pending = self._pending, None
        if pending is not None:  # its copy went into the lost memory: wait for it to end, hand nothing over
            try:
                pending[0].result()
            except Exception as e:
                log.debug("%s(): the overlapped snapshot into the removed runtime dir failed: %s", op, e)
        self._handler.forget_segments()
        if self._reader is not self._handler:
            self._reader.forget_segments()
        link = self._link
        if link.attaches == attaches or link.runtime != dir_identity(self.job_dir):
            link.reattach(op, None, runtime_lost=True)
        self._memory_in = (link.runtime, link.attaches)

    # ------------------------------------------------------------------ load
    @_engine_call("memory_steps", renew=False)
    def memory_steps(self) -> list[int]:
        """Steps this rank could load from shared memory, newest first. (``SnapshotReader(engine)`` lists
        them with the path each is persisted to, and reads them without the engine.)"""
        return self._reader.memory_steps()

    @_engine_call("locate")
    def locate(self, *, memory: bool = True) -> Located:
        """Where the newest checkpoint that every rank has lives, without loading it.

        All ranks of the process group must call it (one ``all_gather``, and an ``all_reduce`` per
        storage step verified). Memory wins when it holds the agreed step; storage steps are
        checksum-verified on every rank, falling back to the previous committed step when damaged.
        ``memory=False`` considers storage only (for a caller that cannot use the memory snapshot)."""
        self._check_open("locate")
        self.wait_snapshot()
        return self._locate(memory=memory, deep=True)

    def _locate(self, *, memory: bool, deep: bool, exclude: frozenset[int] | set[int] = frozenset()) -> Located:
        """``locate``; ``deep=False`` verifies storage steps by size only (for a load that checks the
        checksums while it reads), ``exclude``: steps found damaged by such a load."""
        committed = self.layout.committed_steps()
        if memory and multi_node(self.ranks, self.process_group) and \
                not all_ranks(self._reader.written_by_another() is None, self.process_group):
            memory = False  # a rank's segments are another live training's (logged by its reader)
        if memory and multi_node(self.ranks, self.process_group):
            # Across nodes: a rank's snapshot may be on a peer (a backup of a lost node's, or ranks that moved).
            found = memory_across_nodes(
                lambda: self._client_call(M.Inventory()).to_wire(),
                lambda rank, step, sources: self._client_call(M.Fetch(local_rank=self.ranks.local_rank, rank=rank,
                                                                      step=step, sources=sources)),
                self.layout, self.ranks, committed, replicated=self.replicated, writes_snapshots=self.snapshots,
                group=self.process_group)
            if found is not None:
                return Located(found, "memory", self._reader.snapshot_name(found) or None)
            memory = False
        mem = newer_in_memory(self._reader.memory_snapshots(), self.layout, self.ranks, committed)[:2] if memory else []
        step, source = agree(mem, committed, self.process_group)
        if source == "memory" and step is not None:
            return Located(step, "memory", self._reader.snapshot_name(step) or None)
        if source == "storage":
            step = verified_step(self.layout, self.ranks.rank, committed, step, self.process_group, deep=deep,
                                 exclude=exclude, world_size=self.ranks.world_size)
            return Located(step, "storage", self._loader.path_of(step))
        return Located(None, "none", None)

    @_engine_call("load")
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
        deep = self.storage.local_path(self.checkpoint_dir) is not None
        damaged: set[int] = set()
        while True:
            loc = self._locate(memory=not damaged, deep=deep, exclude=damaged)
            if loc.source == "memory":
                return self.load_memory(loc.step, into=into, _t0=t0)
            if loc.source != "storage" or loc.step is None:
                self._loaded(None, "none", t0, 0, note=unrecorded(self.layout) or "")
                return {}
            failed: BaseException | None = None
            try:
                sd, nbytes = self._loader.load_step(loc.step, into=into), self._loader.last_bytes
                ok = True
            except E.CheckpointCorruptError as e:
                log.warning("load(): step %d is damaged on this rank (%s)", loc.step, e)
                ok = False
            except Exception as e:  # raised on every rank below, never a rank left waiting for the others
                failed, ok = e, False
            self._downloads = True
            if not all_ranks(failed is None, self.process_group):
                if failed is not None:
                    raise failed
                raise E.FlashCheckpointError(
                    f"load(): step {loc.step} could not be loaded on another rank (its error says why); nothing "
                    "was loaded")
            if all_ranks(ok, self.process_group):
                self._loaded(loc.step, "storage", t0, nbytes)
                return sd
            log.warning("load(): step %d is damaged on a rank; falling back to the previous committed step", loc.step)
            damaged.add(loc.step)

    @_engine_call("load_memory")
    def load_memory(self, step: int | None, *, into: Any = None, _t0: float | None = None) -> Any:
        """This rank's snapshot of ``step`` (the newest when None) from shared memory, without agreeing
        with other ranks (``locate`` does that). A ``FileSet`` for sets; see ``load`` for ``into``.

        Raises:
            FlashCheckpointError: memory holds no such snapshot (any more)."""
        self._check_open("load_memory")
        self.wait_snapshot()
        t0 = time.perf_counter() if _t0 is None else _t0
        snap = self._reader.load_snapshot(step, into=into)
        if snap is None:
            raise E.FlashCheckpointError(f"load(): the snapshot of step {step} is not (or no longer) in memory")
        self._loaded(snap.step, "memory", t0, snap.nbytes)
        sd = snap.state_dict
        return FileSet.decode(sd) if is_fileset_tree(sd) else sd

    @_engine_call("committed_steps", renew=False)
    def committed_steps(self) -> list[int]:
        """The committed steps on storage, ascending."""
        return self.layout.committed_steps()

    @_engine_call("step_path", renew=False)
    def step_path(self, step: int) -> str | None:
        """Rank 0's file (or ``FileSet`` directory) of committed ``step``; None when it has none."""
        return self._loader.path_of(step, rank=0)

    def _loaded(self, step: int | None, source: str, t0: float, nbytes: int, *, note: str = "") -> None:
        self.last_load = LoadResult(step, source, time.perf_counter() - t0, nbytes, note)
        if note:
            log.warning("load(): %s", note)
        log.info("event=load step=%s source=%s bytes=%d seconds=%.4f", step, source, nbytes, self.last_load.seconds)


_open_engines: weakref.WeakSet[CheckpointEngine] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """Engines still open when the interpreter exits say goodbye, so their saver does not wait out its
    grace period for a restart that will not come: after a normal exit, or an uncaught exception with
    no restart expected, it persists what is newer than the last commit and exits; after an uncaught
    exception with a restart coming, it keeps the snapshots."""
    crashed = getattr(sys, "last_value", None) is not None  # set by the uncaught-exception handler
    for eng in list(_open_engines):
        if not eng._guard.owner():  # a forked child's exit ends nothing of its parent's engines
            continue
        try:
            # A daemon thread still inside a call of it (a long wait()) holds it for at most this long; then
            # the saver sees this process gone, as after a crash.
            with eng._guard.call("close", internal=True, timeout=_EXIT_WAIT_S):
                eng._close("keep" if crashed and restart_expected() else "persist")
        except Exception as e:  # at exit: report, never raise
            log.warning("closing a CheckpointEngine at exit: %s", e)


def _closed_message(op: str) -> str:
    return (f"{op}(): this checkpointer is closed (close() was called, or its `with` block ended); create a new "
            "checkpointer to save or load again")
