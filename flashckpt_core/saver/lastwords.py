"""Last words: after a crash, a SIGTERM or a launcher's request, persist and commit the newest snapshot
that every persisting local rank holds."""

from __future__ import annotations

import time

from flashckpt import errors as E
from flashckpt.format.segment import (
    Segment,
    live_snapshots,
    lock_path,
    segment_paths,
)
from flashckpt.saver._base import SaverBase, _ClientInfo, log
from flashckpt.transport import messages as M
from flashckpt.transport.ipc import SharedLock


class LastWordsPart(SaverBase):
    def _last_words_thread(self) -> None:
        try:
            self.save_shm_to_storage(timeout=self.knobs.commit_timeout_s)
        except Exception:
            log.exception("last-words persist failed")
        finally:
            with self._cv:
                self._work_done()

    def _work_done(self) -> None:
        """One unit of in-flight work (persist, commit, deletion, last words) ended. Holds ``_cv``."""
        self._inflight -= 1
        if self._inflight == 0 and not self._clients:
            self._idle_since = time.monotonic()
        self._cv.notify_all()

    def save_shm_to_storage(self, timeout: float | None = None) -> int | None:
        """Persists and commits the newest snapshot that every persisting local rank holds in memory,
        when it is newer than the last commit and not already being persisted. Waits for it.

        Safe to call concurrently and repeatedly (idempotent). Used after a trainer crash, on SIGTERM,
        and by ``flashckpt-run`` before it restarts failed workers.

        In a multi-node job whose global rank 0 was lost with its node, a survivor holding rank 0's newest
        snapshot also persists it and commits (``_take_over_commit``).

        Returns:
            The step persisted (or already in flight), or None when there was nothing newer to persist.
        """
        # The committed steps (what is newer) and a persist need the records (saver/housekeeping).
        self._await_records("last words", self.knobs.records_timeout_s if timeout is None else timeout)
        with self._cv:  # whether this saver commits: as of the crash (a restarted rank 0 may say hello meanwhile)
            commits = any(i.commit is not None for i in self._persisters.values())
        limit, peers = self._newest_across_nodes()
        step = self._persist_newest(timeout, limit)
        taken = None if commits else self._take_over_commit(timeout, limit, peers)
        return step if taken is None else taken if step is None else max(step, taken)

    def _persist_newest(self, timeout: float | None, limit: int | None) -> int | None:
        """``save_shm_to_storage`` of the local ranks; ``limit``: in a multi-node job the newest step every
        rank can get from memory, on any node, and only that one is persisted (a newer step of these ranks
        could never be committed: a lost rank's copy of it is nowhere)."""
        with self._last_words_lock:
            with self._cv:
                persisters = dict(self._persisters)
                known = set(self._steps)
                newest_committed = self._committed[-1] if self._committed else -1
            saved_at = self._saved_at(newest_committed)
            if not persisters:
                return None
            held: dict[int, dict[int, tuple[Segment, int]]] = {}  # local rank -> step -> (segment, slot)
            for lr, info in persisters.items():
                segs = [self._segment(path) for _epoch, path in segment_paths(self.job_dir, lr)]
                # Only the persisting rank's own snapshots: after a restart that numbered the ranks otherwise
                # (or changed their number), a local rank's segments still hold the previous rank's.
                held[lr] = {h.step: (seg, slot) for seg, slot, h in live_snapshots(segs) if info.owns(h)}
            common = set.intersection(*(set(steps) for steps in held.values()))

            def newer(s: int) -> bool:  # saved after the newest commit's snapshot (unknown time: by step)
                lr = min(held)
                seg, slot = held[lr][s]
                ref = saved_at.get(str(persisters[lr].rank), 0.0)  # that rank's own snapshot: one clock
                return seg.header(slot).wall_time > ref if ref else s > newest_committed

            for step in sorted((s for s in common if newer(s) and (limit is None or s == limit)), reverse=True):
                jobs = self._last_words_jobs(step, persisters, held)
                if jobs is not None:
                    break
            else:
                return None
            if step not in known:
                log.warning("event=last_words step=%d ranks=%s", step, sorted(i.rank for i in persisters.values()))
                for job in jobs:
                    if not job.path:
                        log.error("step %d of local rank %d has no persist path; not persisted", step,
                                  job.local_rank)
                        return None
                held_jobs: list[M.Persist] = []
                for job in jobs:
                    if not self._hold_slot(job):
                        for j in held_jobs:
                            self._unhold_slot(j)
                        log.warning("last words: the snapshot of step %d was overwritten meanwhile", step)
                        return None
                    held_jobs.append(job)
                for i, job in enumerate(jobs):
                    try:
                        self._enqueue(job)
                    except BaseException:
                        for j in jobs[i:]:
                            self._unhold_slot(j)
                        raise
        self._wait_step(step, timeout)
        return step

    def _hold_slot(self, job: M.Persist) -> bool:
        """Flags a last-words persist's slot PENDING (as a trainer does for its persists), so that no
        snapshot overwrites it before the persist pins it; False when it was overwritten already."""
        seg = self._segment(job.seg_path)
        with SharedLock(lock_path(self.job_dir, seg.local_rank)):
            return seg.hold_pending(job.slot, job.generation, job.step)

    def _unhold_slot(self, job: M.Persist) -> None:
        seg = self._segment(job.seg_path)
        with SharedLock(lock_path(self.job_dir, seg.local_rank)):
            seg.release_pending(job.slot, job.generation)

    def _saved_at(self, step: int) -> dict[str, float]:
        """Rank -> the wall time of the snapshot committed ``step`` was persisted from ({} when unknown)."""
        if step < 0:
            return {}
        try:
            return {str(r): float(t) for r, t in self.layout.read_manifest(step).extra.get("saved_at_ranks", {}).items()}
        except (E.FlashCheckpointError, TypeError, ValueError):
            return {}

    def _last_words_jobs(self, step: int, persisters: dict[int, _ClientInfo],
                         held: dict[int, dict[int, tuple[Segment, int]]]) -> list[M.Persist] | None:
        """The persist requests of ``step`` for every persisting local rank; None when a slot's
        metadata is unreadable (then an older step is tried)."""
        jobs = []
        for lr, info in persisters.items():
            seg, slot = held[lr][step]
            h = seg.header(slot)
            try:
                name = str(seg.read_meta(slot, h).get("name", ""))
            except (E.FlashCheckpointError, ValueError):
                return None
            jobs.append(M.Persist(step=step, rank=info.rank, local_rank=lr, seg_path=seg.path, slot=slot,
                                  generation=h.generation, path=name, commit=info.commit))
        return jobs

    def _wait_step(self, step: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while not self._step_done(step):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise E.CheckpointTimeoutError(f"last words: step {step} not committed within {timeout:.0f} s")
                self._cv.wait(timeout=0.2 if left is None else min(left, 0.2))

    def _step_done(self, step: int) -> bool:
        st = self._steps.get(step)
        if st is None:
            return True
        if st.commits_here:
            return st.status in ("committed", "failed")
        return st.status != "persisting"

