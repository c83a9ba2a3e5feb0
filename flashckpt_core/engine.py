"""CheckpointEngine: the trainer's entry point. Snapshots go to shared memory; the saver persists."""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from . import errors as E
from ._copy import Copier
from ._protocol import Client, process_cpu_seconds
from .commit import CommitLayout
from .config import Knobs, RankInfo, StorageType, job_dir
from .files import FileEntry, FileSet, is_fileset_tree
from .interval import AutoIntervals, storage_type_for
from .retention import CheckpointDeletionStrategy, KeepLatestStepStrategy
from .saver import ensure_saver
from .shm import SharedMemoryHandler
from .storage import PosixDiskStorage

__all__ = ["CheckpointEngine", "LoadResult", "Located"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadResult:
    """What the last ``load()`` found: the step, where it came from ("memory", "storage" or "none"),
    seconds it took and bytes of tensor data."""

    step: int | None
    source: str
    seconds: float
    nbytes: int


@dataclass(frozen=True)
class Located:
    """Where the newest checkpoint every rank has lives: ``step``, ``source`` ("memory", "storage" or
    "none") and ``path``: this rank's file (or ``FileSet`` directory) as given to ``save``."""

    step: int | None
    source: str
    path: str | None


# Memory snapshots ask the saver for news (failed persists, commits) at most this often; wait(), load()
# and every persist ask at once.
_STATUS_EVERY_S = 0.5

class CheckpointEngine:
    """Checkpoints one rank's state dict: into node shared memory at once, to storage in the background.

    Args:
        checkpoint_dir: where persisted checkpoints go; created if missing, must be writable.
        max_to_keep: committed checkpoints to keep when no ``deletion_strategy`` is given (0 keeps all).
        save_mem_interval: with ``save(storage_type=None)``, snapshot to memory every this many steps.
        save_storage_interval: with ``save(storage_type=None)``, persist every this many steps.
        auto_save: with ``save(storage_type=None)``, choose memory and storage intervals from the measured
            step time, snapshot pause and persist time and the given failure rates (Young/Daly).
        deletion_strategy: which committed checkpoints to delete after each commit.
        replicated: every rank holds the same state (DDP): local rank 0 of each node snapshots, global
            rank 0 persists, and every rank loads that one copy.
        process_group: the group whose ranks agree on the step to load (the default group when None).
        process_mtbf_s / node_mtbf_s: with ``auto_save``, the mean seconds between failures that memory
            survives (process crashes) and that lose the node (``interval.mtbf_from_failures_per_day``
            converts a daily count); at least one is needed.
        weights_only: load persisted files with ``torch.load(weights_only=True)``, and decode the
            Python objects of memory snapshots under the same rules; set False only for trusted
            checkpoints holding arbitrary Python objects.
        overlap: ``save`` returns before its copy is done (see ``save`` and ``wait_snapshot``).

    Raises:
        CheckpointDirError: ``checkpoint_dir`` cannot be created or written.
        SaverError: the node's saver could not be started or reached.

    Thread safety: one thread per engine. ``save`` must not run concurrently with a mutation of the
    tensors it was given; once it returns they may be changed freely.
    """

    def __init__(self, checkpoint_dir: str, max_to_keep: int = 1, save_mem_interval: int = 0,
                 save_storage_interval: int = 0, auto_save: bool = False,
                 deletion_strategy: CheckpointDeletionStrategy | None = None, *, replicated: bool = False,
                 process_group: Any = None, weights_only: bool = True, process_mtbf_s: float | None = None,
                 node_mtbf_s: float | None = None, overlap: bool = False) -> None:
        self._auto = (AutoIntervals(process_mtbf_s=process_mtbf_s or math.inf, node_mtbf_s=node_mtbf_s or math.inf)
                      if auto_save else None)
        for name, v in (("max_to_keep", max_to_keep), ("save_mem_interval", save_mem_interval),
                        ("save_storage_interval", save_storage_interval)):
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"CheckpointEngine({name}={v!r}): must be an integer >= 0")
        self.checkpoint_dir = os.path.abspath(checkpoint_dir)
        _check_writable(self.checkpoint_dir)
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
        self.ranks = RankInfo.current()
        self.job_dir = job_dir(self.checkpoint_dir, self.knobs)
        self.layout = CommitLayout(self.checkpoint_dir, PosixDiskStorage())
        self.last_load: LoadResult | None = None
        self._cursor = 0
        self._status_at = 0.0  # monotonic time of the last round trip to the saver
        self._status_seg: str | None = None  # the segment the saver last heard of from this engine
        self._applied_retention: tuple[int, ...] = ()
        self._retention_baseline = -1  # the step committed last before this engine started
        self._copier = Copier(self.knobs.copy_threads)
        r = self.ranks
        # The job's saver may be exiting at this very moment (an engine of this job just said its final
        # goodbye): it then refuses the hello or drops the connection (SaverError). Retry, bounded, until
        # a live saver accepts us, or the new one ensure_saver starts once the old one has cleaned up.
        deadline = time.monotonic() + self.knobs.spawn_timeout_s
        while True:
            client = ensure_saver(self.job_dir, self.checkpoint_dir, self.knobs)
            try:
                hello = client.call("hello", rank=r.rank, local_rank=r.local_rank, world_size=r.world_size,
                                    local_world_size=r.local_world_size, pid=os.getpid(), persists=self.persists,
                                    commit=self._commit_spec())
                break
            except E.SaverError:
                client.close()
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)
        self._client: Client | None = client
        self._cursor = int(hello["cursor"])  # errors before we attached belong to an earlier run
        self._saver_pid = int(hello.get("pid", 0))
        self._handler = SharedMemoryHandler(r.local_rank, self.job_dir, allocate=self._allocate,
                                            copier=self._copier, weights_only=weights_only)
        self._reader = (self._handler if not replicated or r.local_rank == 0 else
                        SharedMemoryHandler(0, self.job_dir, copier=self._copier, weights_only=weights_only))
        self._closed = False
        self._retention_baseline = hello["committed"][-1] if hello["committed"] else -1  # in commit order

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
        return os.path.join(self.checkpoint_dir, f"step_{step}", name)

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
                (several files in their own formats; see ``flashckpt_core.files``).
            path: the file to persist to, inside the checkpoint dir (default ``step_<N>/rank_<R>.pt``);
                for a ``FileSet``, the directory its files go to (default ``step_<N>``).
            storage_type: MEMORY or DISK; None lets the intervals decide (and may skip the step).
            overlap: return before the copy is done; it runs in the background (a thread for CPU
                tensors, a CUDA stream for GPU ones) while training goes on, and the tensors must not
                change until ``wait_snapshot()``. Default: the engine's ``overlap``.

        Returns:
            True when a snapshot was taken, False when the intervals skipped this step.

        Raises:
            InvalidStateDictError: ``state_dict`` holds something that cannot be stored (nothing written).
            SharedMemoryError: shared memory cannot hold the snapshot.
            PersistError: an earlier persist failed (raised once, after this snapshot was taken).
        """
        self._check_open("save")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"save(step={step!r}): step must be an integer >= 0")
        auto_kind = None
        if storage_type is None and self._auto is not None:
            auto_kind = self._auto.decide(step, time.monotonic())
            if auto_kind is None:
                return False
            storage_type = StorageType.DISK if auto_kind == "storage" else StorageType.MEMORY
        if storage_type is None:
            if not (self.save_mem_interval or self.save_storage_interval):
                raise ValueError(f"save(step={step}, storage_type=None): no interval is set, so nothing would "
                                 "be saved; pass storage_type=StorageType.MEMORY or DISK, or construct the "
                                 "engine with save_mem_interval / save_storage_interval")
            storage_type = self._interval_type(step)
            if storage_type is None:
                return False
        if storage_type not in (StorageType.MEMORY, StorageType.DISK):
            raise ValueError(f"save(storage_type={storage_type!r}): use StorageType.MEMORY or StorageType.DISK")
        if isinstance(state_dict, FileSet):
            state_dict = state_dict.encode()
            default = os.path.join(self.checkpoint_dir, f"step_{step}")
        else:
            default = self.default_path(step)
        target = os.path.abspath(os.path.join(self.checkpoint_dir, path) if path else default)
        if storage_type == StorageType.DISK:
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
        return True

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
                reply = self._client_call("persist", step=step, rank=self.ranks.rank,
                                          local_rank=self.ranks.local_rank, seg_path=ref.path, slot=ref.slot,
                                          generation=ref.generation, path=target, commit=self._commit_spec(),
                                          cursor=self._cursor)
            except BaseException:
                self._handler.clear_pending(ref)
                raise
        if reply is None:
            # A memory snapshot needs no round trip: the saver reads slot headers itself. Its news (failed
            # persists, commits for retention) is collected at most every _STATUS_EVERY_S, and at once
            # when this snapshot went to a new segment, so that the saver frees the one it outgrew
            # (local_rank says whose).
            seg = ref.path if ref is not None else None
            if seg == self._status_seg and time.monotonic() - self._status_at < _STATUS_EVERY_S:
                return
            reply = self._client_call("status", cursor=self._cursor, local_rank=self.ranks.local_rank)
            self._status_seg = seg
        self._status_at = time.monotonic()
        self._after_reply(reply)

    def _commit_spec(self) -> dict[str, Any] | None:
        """What global rank 0's saver needs to commit a step; None on other ranks."""
        if self.ranks.rank != 0:
            return None
        ranks = [0] if self.replicated else list(range(self.ranks.world_size))
        return {"ranks": ranks, "world_size": self.ranks.world_size, "replicated": self.replicated, "extra": {}}

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
        return str(self._client_call("alloc", local_rank=local_rank, meta_cap=meta_cap, data_cap=data_cap,
                                     nslots=self.knobs.slots)["path"])

    def _client_call(self, op: str, **kw: Any) -> dict[str, Any]:
        if self._client is None:
            raise E.SaverError(f"{op}: the engine is closed")
        return self._client.call(op, **kw)

    def _after_reply(self, reply: dict[str, Any]) -> None:
        self._cursor = int(reply.get("cursor", self._cursor))
        if self._auto is not None:
            self._auto.observe_persist(float(reply.get("last_persist_s", 0.0)))
        self._retain(reply.get("committed", []))
        errs = reply.get("errors") or []
        if errs:
            msgs = "; ".join(e["error"] for e in errs)
            raise E.PersistError(f"{len(errs)} persist(s) failed: {msgs}. Earlier committed checkpoints are intact; "
                                 "memory snapshots continue.")

    def _retain(self, committed: list[int]) -> None:
        """Applies the deletion strategy after a commit newer than any that existed when this engine
        started: an engine that only loads never deletes checkpoints. ``committed`` is in commit order;
        the step committed last is never deleted, whatever its number."""
        if self.ranks.rank != 0 or self.deletion_strategy is None or not committed:
            return
        if committed[-1] == self._retention_baseline:
            return
        key = tuple(committed)
        if key == self._applied_retention:
            return
        doomed = [s for s in self.deletion_strategy.steps_to_delete(committed) if s != committed[-1]]
        self._applied_retention = key
        if doomed:
            self._client_call("delete_steps", steps=doomed, background=True)

    def saver_cpu_seconds(self) -> float | None:
        """CPU time (user + system, all threads) the node's saver daemon has used since it started: what
        persisting costs the host's cores, for monitoring. None where ``/proc`` cannot tell (not Linux,
        or the saver is gone)."""
        return process_cpu_seconds(self._saver_pid) if self._saver_pid > 0 else None

    # ------------------------------------------------------------------ wait / close
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
            reply = self._client_call("wait", timeout_s=timeout or 0, cursor=self._cursor,
                                      timeout=None if timeout is None else timeout + self.knobs.rpc_timeout_s)
            self._after_reply(reply)
            if self._applied_retention == applied:
                break

    def close(self, release: bool = True) -> None:
        """Detaches from the saver. Scheduled persists still complete in the saver.

        Args:
            release: this rank is done with its snapshots: once every rank released, the saver exits
                (after its persists) and frees the shared memory. With False (a crash or a planned
                restart) the saver keeps the snapshots for its grace period so a new process can load
                them from memory.
        """
        if self._closed:
            return
        self._closed = True
        try:
            try:
                self.wait_snapshot()
            except Exception as e:  # closing anyway; the error was the snapshot's, not the close's
                log.warning("close(): the last overlapped snapshot failed: %s", e)
            finally:
                if self._bg is not None:
                    self._bg.shutdown(wait=True)
            if self._client is not None:
                try:
                    self._client.call("bye", final=release)
                except E.FlashCheckpointError as e:
                    log.warning("close(): %s", e)
                self._client.close()
        finally:
            self._client = None
            if self._reader is not self._handler:
                self._reader.close()
            self._handler.close()
            self._copier.close()

    def __enter__(self) -> CheckpointEngine:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(release=exc_type is None)

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise E.FlashCheckpointError(f"{op}(): the CheckpointEngine is closed")

    # ------------------------------------------------------------------ load
    def memory_steps(self) -> list[int]:
        """Steps this rank could load from shared memory, newest first."""
        return self._reader.memory_steps()

    def locate(self, *, memory: bool = True) -> Located:
        """Where the newest checkpoint that every rank has lives, without loading it.

        All ranks of the process group must call it (one ``all_gather``, and an ``all_reduce`` per
        storage step verified). Memory wins when it holds the agreed step; storage steps are
        checksum-verified on every rank, falling back to the previous committed step when damaged.
        ``memory=False`` considers storage only (for a caller that cannot use the memory snapshot)."""
        self._check_open("locate")
        self.wait_snapshot()
        committed = self.layout.committed_steps()
        mem = self._newer_in_memory(committed)[:2] if memory else []
        step, source = self._agree(mem, committed)
        if source == "memory" and step is not None:
            return Located(step, "memory", self._reader.snapshot_name(step) or None)
        if source == "storage":
            step = self._verified_step(committed, step)
            return Located(step, "storage", self._storage_path(step))
        return Located(None, "none", None)

    def load(self, resume_path: str = "", *, into: Any = None) -> Any:
        """The newest state dict that every rank has: from memory when memory holds it, else storage.

        Args:
            resume_path: load this persisted file (or ``FileSet`` directory) instead (verified against
                its manifest when listed).
            into: a state-dict tree of existing tensors (for example ``{"model": model.state_dict()}``;
                for a ``FileSet``, ``{file name: tree}``). On a load from memory, every snapshot tensor
                whose key path, dtype and shape match a contiguous CPU tensor of ``into`` is copied
                straight into it (no new memory; the model's parameters are then already loaded) and that
                tensor is returned in its place. Loads from storage ignore it.

        Returns:
            The state dict (a ``FileSet`` for sets), or ``{}`` when there is no checkpoint. ``last_load``
            tells where it came from.

        Raises:
            CheckpointCorruptError: ``resume_path`` does not match its manifest.
        """
        self._check_open("load")
        self.wait_snapshot()
        t0 = time.perf_counter()
        if resume_path:
            sd = self._load_file(os.path.abspath(os.path.join(self.checkpoint_dir, resume_path)))
            self._loaded(None, "storage", t0, 0)
            return sd
        loc = self.locate()
        if loc.source == "memory":
            return self.load_memory(loc.step, into=into, _t0=t0)
        if loc.source == "storage" and loc.step is not None:
            sd = self._load_step(loc.step)
            self._loaded(loc.step, "storage", t0, 0)
            return sd
        self._loaded(None, "none", t0, 0)
        return {}

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

    def committed_steps(self) -> list[int]:
        """The committed steps on storage, ascending."""
        return self.layout.committed_steps()

    def step_path(self, step: int) -> str | None:
        """Rank 0's file (or ``FileSet`` directory) of committed ``step``; None when it has none."""
        return self._storage_path(step, rank=0)

    def _storage_path(self, step: int, rank: int | None = None) -> str | None:
        r = self.ranks.rank if rank is None else rank
        base = self.layout.base(step, r)
        if base is not None:
            return base
        files = self.layout.read_manifest(step).files_for(r)
        return self.layout.abs(files[0].path) if len(files) == 1 else None

    def _loaded(self, step: int | None, source: str, t0: float, nbytes: int) -> None:
        self.last_load = LoadResult(step, source, time.perf_counter() - t0, nbytes)
        log.info("event=load step=%s source=%s bytes=%d seconds=%.4f", step, source, nbytes, self.last_load.seconds)

    def _newer_in_memory(self, committed: list[int]) -> list[int]:
        """This rank's live memory snapshots (newest save first) that are not older than the most recently
        committed step: saved at or after the snapshot it was persisted from (legacy manifests without
        that time: a step not lower than it)."""
        snaps = self._reader.memory_snapshots()
        if not committed:
            return [s for s, _t in snaps]
        try:
            saved_at = float(self.layout.read_manifest(committed[-1]).extra.get("saved_at", 0.0))
        except (E.CheckpointCorruptError, TypeError, ValueError):
            saved_at = 0.0
        if saved_at:
            return [s for s, t in snaps if t >= saved_at]
        return [s for s, _t in snaps if s >= committed[-1]]

    def _agree(self, mem: list[int], committed: list[int]) -> tuple[int | None, str]:
        """All ranks pick the newest step that every rank has; memory wins when it holds that step.

        ``mem`` holds only snapshots not older than the most recently committed step (``committed[-1]``,
        commit order), so any step every rank holds in memory is the newest."""
        newest_committed = committed[-1] if committed else -1
        world = self._world()
        if world is None:
            best_mem = mem[0] if mem else -1
        else:
            import torch.distributed as dist

            mine = torch.full((3,), -1, dtype=torch.int64)
            for i, s in enumerate(mem[:2]):
                mine[i] = s
            mine[2] = newest_committed
            dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.process_group) == "nccl" else None
            out = [torch.empty(3, dtype=torch.int64, device=dev) for _ in range(world)]
            dist.all_gather(out, mine.to(dev) if dev else mine, group=self.process_group)
            rows = [o.cpu().tolist() for o in out]
            common = set(rows[0][:2])
            for r in rows[1:]:
                common &= set(r[:2])
            common.discard(-1)
            best_mem = max(common, default=-1)
            newest_committed = min(r[2] for r in rows)
        if best_mem >= 0:
            return best_mem, "memory"
        if newest_committed >= 0:
            return newest_committed, "storage"
        return None, "none"

    def _world(self) -> int | None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            n = dist.get_world_size(self.process_group)
            return n if n > 1 else None
        return None

    def _verified_step(self, committed: list[int], newest: int | None) -> int:
        """The most recently committed step (not after ``newest`` in commit order) whose files verify on
        every rank."""
        import torch.distributed as dist

        upto = committed.index(newest) + 1 if newest in committed else len(committed)
        for step in reversed(committed[:upto]):
            problems = self.layout.verify(step, rank=self.ranks.rank)
            ok = torch.tensor([0 if problems else 1], dtype=torch.int64)
            if self._world() is not None:
                if dist.get_backend(self.process_group) == "nccl":
                    ok = ok.cuda()
                dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.process_group)
            if int(ok.item()) == 1:
                return step
            log.warning("load(): step %d is damaged (%s); falling back to the previous committed step",
                        step, "; ".join(problems) or "on another rank")
        raise E.CheckpointCorruptError(f"load(): every committed step in {self.checkpoint_dir} is damaged; "
                                       "run `flashckpt verify` for details")

    def _load_step(self, step: int) -> Any:
        files = self.layout.read_manifest(step).files_for(self.ranks.rank)
        if any(f.name for f in files):
            return self._load_fileset(files)
        if len(files) != 1:
            raise E.CheckpointCorruptError(f"load(): step {step} lists {len(files)} files for rank "
                                           f"{self.ranks.rank}; expected one")
        return self._torch_load(self.layout.abs(files[0].path))

    def _load_fileset(self, files: list[Any]) -> FileSet:
        fs = FileSet()
        for f in files:
            path = self.layout.abs(f.path)
            if f.fmt == "torch":
                fs[f.name] = FileEntry("torch", self._torch_load(path), f.kind)
            else:
                fs[f.name] = FileEntry("raw", [self.layout.storage.read_bytes(path)], f.kind)
        return fs

    def _load_file(self, path: str) -> Any:
        rel = self.layout.rel(path)
        for step in reversed(self.layout.committed_steps()):
            m = self.layout.read_manifest(step)
            if rel in m.extra.get("bases", {}).values():
                for r, b in m.extra["bases"].items():
                    if b == rel:
                        listed = m.files[int(r)]
                        bad = [p for f in listed for p in self._mismatch(f, step)]
                        if bad:
                            raise E.CheckpointCorruptError("load(): " + "; ".join(bad))
                        return self._load_fileset(listed)
            for f in m.all_files():
                if f.path == rel:
                    bad = self._mismatch(f, step)
                    if bad:
                        raise E.CheckpointCorruptError("load(): " + bad[0])
                    return self._torch_load(path)
        return self._torch_load(path)

    def _mismatch(self, f: Any, step: int) -> list[str]:
        path = self.layout.abs(f.path)
        if self.layout.storage.checksum(path) != (f.size, f.xxh3):
            return [f"{path} does not match the manifest of step {step}"]
        return []

    def _torch_load(self, path: str) -> Any:
        try:
            return torch.load(path, map_location="cpu", weights_only=self.weights_only)
        except Exception as e:
            if self.weights_only and "weights_only" in str(e):
                raise E.FlashCheckpointError(
                    f"load(): {path} holds Python objects that torch.load(weights_only=True) refuses. If the "
                    "checkpoint is trusted, construct the engine with weights_only=False.") from e
            raise


def _check_writable(d: str) -> None:
    try:
        os.makedirs(d, exist_ok=True)
        probe = os.path.join(d, f".flashckpt-probe-{uuid.uuid4().hex}")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.unlink(probe)
    except OSError as e:
        raise E.CheckpointDirError(f"CheckpointEngine({d!r}): the checkpoint dir is not writable ({e}); "
                                   "choose a writable directory or fix its permissions") from e
