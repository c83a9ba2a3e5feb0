"""The persist queues: one queue and thread per local rank; each job pins its slot and hands it to the persist
worker process, which writes the files; a job that commits goes on to the commit queue. Also the persists
the saver makes itself from a copy it holds (``persist_held``: a lost node's ranks, last words for a lost
rank 0).

Imports the layers below the saver and ``saver.state``, ``saver.segments``, ``saver.worker``. ``enqueue`` runs
on request threads, peer threads and the last-words thread at once; each queue's jobs run in order on its
thread."""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import time
from typing import Any

from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.removal import remove_rank_files
from flashckpt.commit.tiers import local_target
from flashckpt.format.segment import (
    COMPLETE,
    FLAG_PENDING,
    FLAG_PINNED,
    lock_path,
)
from flashckpt.saver.segments import SegmentPool
from flashckpt.saver.state import CommitJob, LocalCommitJob, SaverState, StepState, log
from flashckpt.saver.worker import PersistWorker
from flashckpt.storage.posix import PosixDiskStorage
from flashckpt.transport.ipc import SharedLock
from flashckpt.transport.messages import Persist

__all__ = ["PersistQueues"]


class PersistQueues:
    """The persist threads of one saver and their worker process (see the module docstring)."""

    def __init__(self, state: SaverState, pool: SegmentPool) -> None:
        self.state = state
        self.pool = pool
        self.layout = state.layout
        self._queues: dict[int, queue.Queue[Persist | None]] = {}  # persist jobs per local rank
        # Writes the files (torch's work) in a process of its own, started on demand: see persist_worker.
        self.worker = PersistWorker(state.layout.root, state.layout.job, state.storage, nice=state.knobs.persist_nice,
                                    idle_s=state.knobs.persist_worker_idle_s)
        # With a local tier, a second worker writes into the local dir (the persists the engine asks for);
        # the saver's own persists (last words, a lost node's ranks) go straight to the checkpoint dir.
        self.local_worker = None if state.local is None else PersistWorker(
            state.local.root, state.layout.job, PosixDiskStorage(), nice=state.knobs.persist_nice,
            idle_s=state.knobs.persist_worker_idle_s, options=False)

    def close_workers(self) -> None:
        """Stops the persist worker processes (the saver exits)."""
        self.worker.close()
        if self.local_worker is not None:
            self.local_worker.close()

    def _tier(self, job: Persist) -> tuple[CommitLayout, PersistWorker, str]:
        """Where ``job`` writes: (commit records, worker, path), on the local tier when it goes there."""
        local, worker = self.state.local, self.local_worker
        if job.local is None or local is None or worker is None:
            return self.layout, self.worker, job.path
        return local, worker, local_target(self.layout, local, job.path)

    def enqueue(self, req: Persist) -> None:
        st = self.state
        job = dataclasses.replace(req, path=st.storage.normpath(req.path))  # the request is the job
        if os.path.dirname(job.seg_path) != st.job_dir:  # the runtime dir is local
            raise E.ProtocolError(f"persist: segment {job.seg_path} is not in this job's runtime dir")
        # Refuses paths outside the checkpoint dir, in its commit records, or in another committed step's
        # directory (the engine checks this too, before its snapshot; this holds for any client). With a local
        # tier, the files are written there, so its committed steps are the ones asked; on the checkpoint dir
        # the upload stages a file that another step committed (a store that is down is never asked).
        layout, _worker, path = self._tier(job)
        if layout is self.layout:
            self.layout.check_target(job.step, job.path, files=[])
        else:
            self.layout.check_place(job.step, job.path)
            layout.check_target(job.step, path, files=[])
        with st.cv:
            step = st.steps.setdefault(job.step, StepState())
            if step.status == "failed":  # persisted again (last words after a failed persist): a new attempt
                step.status, step.error = "persisting", None
            step.paths.add(job.path)
            step.ranks.add(job.rank)
            st.failures.pop((job.step, job.rank), None)  # an earlier save's of the same step
            if job.commit is not None:
                step.commits_here = True
                step.spec = job.commit
            st.inflight += 1
            q = self._queues.get(job.local_rank)
            if q is None:
                q = self._queues[job.local_rank] = queue.Queue()
                st.spawn(self._persist_loop, f"persist{job.local_rank}", q)
        q.put(job)
        self.pool.want_spares()  # its slot is held from now on: the next snapshots need a spare each

    def stop(self) -> None:
        """Ends the persist threads once their queued jobs ran (the saver exits)."""
        for q in self._queues.values():
            q.put(None)

    def _persist_loop(self, q: queue.Queue[Persist | None]) -> None:
        # The files are written by the persist worker, whose threads run knobs.persist_nice lower.
        while True:
            job = q.get()
            if job is None:
                return
            layout, _worker, target = self._tier(job)
            try:
                self._persist(job)
                if layout is not self.layout:
                    self._local_done(job)
                elif job.commit is not None:
                    self.state.commit_q.put(CommitJob(job.step, job.commit))
                else:
                    self.state.finish(job.step, None, committed=False)
            except Exception as e:  # reported to the trainer; the saver keeps serving
                log.exception("persist of step %d rank %d failed", job.step, job.rank)
                try:  # give the space back now (a full disk), not at the next start
                    remove_rank_files(layout, job.step, job.rank)
                except Exception:
                    log.exception("removing the files of the failed persist of step %d rank %d", job.step, job.rank)
                # What failed, for every rank: the committer reads it from the failed marker (or, on this node,
                # from ``failures`` when the store refuses the marker too) and reports it to its trainers.
                # The path written: on the local tier, its copy there (a full local disk is not the store's).
                where = target if layout is self.layout else f"the node's local tier ({target})"
                why = f"{where}: {type(e).__name__}: {e}"
                with self.state.cv:
                    self.state.failures[(job.step, job.rank)] = why
                self.state.note("persist_failed", level=None, step=job.step, rank=job.rank, error=why)
                layout.write_failed(job.step, job.rank, why)
                self.state.finish(job.step, f"persisting step {job.step} of rank {job.rank} to {where} failed: "
                                  f"{type(e).__name__}: {e}", committed=False)

    def _local_done(self, job: Persist) -> None:
        """Rank ``job.rank``'s files of ``job.step`` are on the local tier: once every persisting rank of this
        node has them, the step's local commit is queued (carrying this unit of work on), else this rank's
        unit of work ends here."""
        st = self.state
        tier = dict(job.local or {})
        with st.cv:
            step = st.steps.setdefault(job.step, StepState())
            step.local_done.add(job.rank)
            if len(step.local_done) < int(tier.get("node_ranks", 1)):
                st.work_done()
                return
            ranks, spec = tuple(sorted(step.local_done)), step.spec
        st.commit_q.put(LocalCommitJob(job.step, ranks, tier, spec))

    def _persist(self, job: Persist) -> None:
        t0 = time.perf_counter()
        layout, worker, path = self._tier(job)
        seg = self.pool.segment(job.seg_path)
        lock = SharedLock(lock_path(self.state.job_dir, seg.local_rank))
        with lock:
            h = seg.header(job.slot)
            if h.state != COMPLETE or h.generation != job.generation or h.step != job.step:
                seg.release_pending(job.slot, job.generation)
                raise E.PersistError(f"the snapshot of step {job.step} was overwritten before it was persisted")
            seg.set_flags(job.slot, h.flags | FLAG_PINNED)
        self.pool.persist_activity()
        self.pool.prepare_spares(seg)
        tier = "local" if layout is not self.layout else "durable"
        started: dict[str, Any] = {"step": job.step, "rank": job.rank, "bytes": h.tensor_bytes + h.blob_len,
                                   "path": path, "tier": tier}
        self.state.note("persist_start", level=logging.DEBUG, **started)
        with self.state.cv:  # what ``flashckpt status`` shows of it while it runs (saver/report)
            self.state.running[(job.step, job.rank)] = {**started, "since": time.monotonic(), "storage": layout.storage}
        try:
            layout.clear_markers(job.step, job.rank)  # an earlier save's of the same step
            # The worker writes the intent and the files (it maps the segment read-only); then the done marker.
            recs, is_set = worker.persist(seg_path=seg.path, slot=job.slot, generation=job.generation,
                                          step=job.step, rank=job.rank, path=path)
            layout.write_done(job.step, job.rank, recs, base=path if is_set else "", saved_at=h.wall_time)
        finally:
            with self.state.cv:
                self.state.running.pop((job.step, job.rank), None)
            with lock:
                h2 = seg.header(job.slot)
                if h2.generation == job.generation:
                    seg.set_flags(job.slot, h2.flags & ~(FLAG_PINNED | FLAG_PENDING))
            self.pool.persist_activity()
            try:
                self.pool.release_spares(seg)
            except (OSError, E.FlashCheckpointError) as e:
                log.warning("giving back the spare slots of %s: %s", seg.path, e)
        dt = time.perf_counter() - t0
        size = sum(r.size for r in recs)
        with self.state.cv:
            self.state.stats.persisted_bytes += size
            self.state.stats.persist_seconds += dt
            self.state.stats.last_persist_s = dt
        self.state.note("persist", step=job.step, rank=job.rank, bytes=size, seconds=dt, path=path, tier=tier)

    # ------------------------------------------------------------------ persisting a copy held here
    def persist_held(self, step: int, ranks: list[int]) -> list[int]:
        """Persists what this node holds of ``step`` for ``ranks`` (own snapshots first, then backups), unless
        this saver already writes it; returns the ranks it writes (now or already)."""
        out = []
        with self.state.last_words_lock:
            for rank in ranks:
                with self.state.cv:
                    st = self.state.steps.get(step)
                    if st is not None and rank in st.ranks and st.status != "failed":
                        out.append(rank)
                        continue
                kind = self.persist_held_copy(rank, step, rank)
                if kind is None:
                    continue
                log.warning("event=persist_held step=%d rank=%d from=%s", step, rank, kind)
                out.append(rank)
        return out

    def persist_held_copy(self, rank: int, step: int, find: int, commit: dict[str, Any] | None = None) -> str | None:
        """Queues the persist of ``step`` for ``rank`` from the copy held here of ``find``'s snapshot (-1: any
        rank's), with ``commit`` when given; its kind ("own", "backup"), or None when there is no such copy
        (or it was overwritten, or names no path). The caller holds ``last_words_lock``."""
        found = self.pool.find_held(find, step)
        if found is None:
            return None
        kind, seg, slot, h = found
        try:
            name = str(seg.read_meta(slot, h).get("name", ""))
        except (E.FlashCheckpointError, ValueError):
            return None
        if not name:
            return None
        job = Persist(step=step, rank=rank, local_rank=seg.local_rank, seg_path=seg.path, slot=slot,
                      generation=h.generation, path=name, commit=commit)
        if not self.pool.hold_slot(job):
            return None
        try:
            self.enqueue(job)
        except BaseException:
            self.pool.unhold_slot(job)
            raise
        return kind
