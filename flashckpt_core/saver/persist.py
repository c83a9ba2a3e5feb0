"""Persisting: one queue and thread per local rank; each job pins its slot and hands it to the persist
worker process, which writes the files."""

from __future__ import annotations

import dataclasses
import os
import queue
import time

from flashckpt import errors as E
from flashckpt.commit.removal import remove_rank_files
from flashckpt.format.segment import (
    COMPLETE,
    FLAG_PENDING,
    FLAG_PINNED,
    lock_path,
)
from flashckpt.saver._base import SaverBase, _CommitJob, _StepState, log
from flashckpt.transport.ipc import SharedLock
from flashckpt.transport.messages import Persist


class PersistPart(SaverBase):
    def _enqueue(self, req: Persist) -> None:
        job = dataclasses.replace(req, path=self.storage.normpath(req.path))  # the request is the job
        if os.path.dirname(job.seg_path) != self.job_dir:  # the runtime dir is local
            raise E.ProtocolError(f"persist: segment {job.seg_path} is not in this job's runtime dir")
        # Refuses paths outside the checkpoint dir, in its commit records, or in another committed step's
        # directory (the engine checks this too, before its snapshot; this holds for any client).
        self.layout.check_target(job.step, job.path, files=[])
        with self._cv:
            st = self._steps.setdefault(job.step, _StepState())
            st.paths.add(job.path)
            st.ranks.add(job.rank)
            if job.commit is not None:
                st.commits_here = True
            self._inflight += 1
            q = self._persist_q.get(job.local_rank)
            if q is None:
                q = self._persist_q[job.local_rank] = queue.Queue()
                self._spawn(self._persist_loop, f"persist{job.local_rank}", q)
        q.put(job)
        self._spares_wanted.set()  # its slot is held from now on: the next snapshots need a spare each

    def _persist_loop(self, q: queue.Queue[Persist | None]) -> None:
        # The files are written by the persist worker, whose threads run knobs.persist_nice lower.
        while True:
            job = q.get()
            if job is None:
                return
            try:
                self._persist(job)
                if job.commit is not None:
                    self._commit_q.put(_CommitJob(job.step, job.commit))
                else:
                    self._finish(job.step, None, committed=False)
            except Exception as e:  # reported to the trainer; the saver keeps serving
                log.exception("persist of step %d rank %d failed", job.step, job.rank)
                try:  # give the space back now (a full disk), not at the next start
                    remove_rank_files(self.layout, job.step, job.rank)
                except Exception:
                    log.exception("removing the files of the failed persist of step %d rank %d", job.step, job.rank)
                self.layout.write_failed(job.step, job.rank, f"{type(e).__name__}: {e}")
                self._finish(job.step, f"persisting step {job.step} of rank {job.rank} to {job.path} failed: "
                             f"{type(e).__name__}: {e}", committed=False)

    def _persist(self, job: Persist) -> None:
        t0 = time.perf_counter()
        seg = self._segment(job.seg_path)
        lock = SharedLock(lock_path(self.job_dir, seg.local_rank))
        with lock:
            h = seg.header(job.slot)
            if h.state != COMPLETE or h.generation != job.generation or h.step != job.step:
                seg.release_pending(job.slot, job.generation)
                raise E.PersistError(f"the snapshot of step {job.step} was overwritten before it was persisted")
            seg.set_flags(job.slot, h.flags | FLAG_PINNED)
        self._persist_seen = time.monotonic()
        self._prepare_spares(seg)
        try:
            self.layout.clear_markers(job.step, job.rank)  # an earlier save's of the same step
            # The worker writes the intent and the files (it maps the segment read-only); then the done marker.
            recs, is_set = self._worker.persist(seg_path=seg.path, slot=job.slot, generation=job.generation,
                                                step=job.step, rank=job.rank, path=job.path)
            self.layout.write_done(job.step, job.rank, recs, base=job.path if is_set else "", saved_at=h.wall_time)
        finally:
            with lock:
                h2 = seg.header(job.slot)
                if h2.generation == job.generation:
                    seg.set_flags(job.slot, h2.flags & ~(FLAG_PINNED | FLAG_PENDING))
            self._persist_seen = time.monotonic()
            try:
                self._release_spares(seg)
            except (OSError, E.FlashCheckpointError) as e:
                log.warning("giving back the spare slots of %s: %s", seg.path, e)
        dt = time.perf_counter() - t0
        size = sum(r.size for r in recs)
        with self._cv:
            self.stats.persisted_bytes += size
            self.stats.persist_seconds += dt
            self.stats.last_persist_s = dt
        log.info("event=persist step=%d rank=%d bytes=%d seconds=%.3f path=%s", job.step, job.rank,
                 size, dt, job.path)

