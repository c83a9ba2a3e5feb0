"""Last words: after a crash, a SIGTERM, final goodbyes or a launcher's request, persist and commit the newest
snapshot that every persisting local rank holds (in a multi-node job, the newest every rank can get from some
node's memory; a survivor commits when global rank 0 was lost, see ``saver.recovery``).

Imports the layers below the saver and ``saver.state``, ``saver.segments``, ``saver.persist``,
``saver.housekeeping``, ``saver.recovery``. Last words may be asked several times at once (a crash seen here
and the launcher's request): the step is chosen and queued under ``SaverState.last_words_lock``."""

from __future__ import annotations

import logging

from flashckpt import errors as E
from flashckpt.format.segment import (
    Segment,
    live_snapshots,
    segment_paths,
)
from flashckpt.saver.housekeeping import Records
from flashckpt.saver.persist import PersistQueues
from flashckpt.saver.recovery import Recovery
from flashckpt.saver.segments import SegmentPool
from flashckpt.saver.state import ClientInfo, SaverState, log, saved_at
from flashckpt.transport import messages as M

__all__ = ["LastWords"]


class LastWords:
    """The last words of one saver (see the module docstring)."""

    def __init__(self, state: SaverState, pool: SegmentPool, persist: PersistQueues, records: Records,
                 recovery: Recovery) -> None:
        self.state = state
        self.pool = pool
        self.persist = persist
        self.records = records
        self.recovery = recovery
        self.layout = state.layout

    def thread(self) -> None:
        """A last-words thread (a client left without a final goodbye); the spawner counted it in flight."""
        try:
            self.save_shm_to_storage(timeout=self.state.knobs.commit_timeout_s)
        except Exception:
            log.exception("last-words persist failed")
        finally:
            with self.state.cv:
                self.state.work_done()

    def save_shm_to_storage(self, timeout: float | None = None) -> int | None:
        """Persists and commits the newest snapshot that every persisting local rank holds in memory,
        when it is newer than the last commit and not already being persisted. Waits for it.

        Safe to call concurrently and repeatedly (idempotent). Used after a trainer crash, on SIGTERM,
        and by ``flashckpt-run`` before it restarts failed workers.

        In a multi-node job whose global rank 0 was lost with its node, a survivor holding rank 0's newest
        snapshot also persists it and commits (``Recovery.take_over_commit``).

        Returns:
            The step persisted (or already in flight), or None when there was nothing newer to persist.
        """
        # The committed steps (what is newer) and a persist need the records (saver/housekeeping).
        self.records.await_ready("last words", self.state.knobs.records_timeout_s if timeout is None else timeout)
        with self.state.cv:  # whether this saver commits: as of the crash (a restarted rank 0 may say hello meanwhile)
            commits = any(i.commit is not None for i in self.state.persisters.values())
        limit, peers = self.recovery.newest_across_nodes()
        step = self._persist_newest(timeout, limit)
        taken = None if commits else self.recovery.take_over_commit(timeout, limit, peers)
        return step if taken is None else taken if step is None else max(step, taken)

    def _persist_newest(self, timeout: float | None, limit: int | None) -> int | None:
        """``save_shm_to_storage`` of the local ranks; ``limit``: in a multi-node job the newest step every
        rank can get from memory, on any node, and only that one is persisted (a newer step of these ranks
        could never be committed: a lost rank's copy of it is nowhere)."""
        with self.state.last_words_lock:
            with self.state.cv:
                persisters = dict(self.state.persisters)
                local = self.state.local
                # Steps persisted or being persisted here. With a local tier, one whose persist failed there (a full
                # local disk) is persisted again, straight to the checkpoint dir, when it is the newest; without
                # one, last words would write where it just failed.
                known = {s for s, st in self.state.steps.items() if st.status != "failed" or local is None}
                newest_committed = self.state.committed[-1] if self.state.committed else -1
            saved = saved_at(self.layout, newest_committed)
            if not persisters:
                return None
            if local is not None:  # committed on the local tier: the uploader brings it to the store, not this
                try:
                    known |= set(local.committed_steps())
                except (OSError, E.FlashCheckpointError) as e:
                    log.warning("last words: could not list the local tier's steps: %s", e)
            held = self._held_snapshots(persisters)
            chosen = self._newest_persistable(persisters, held, limit, saved, newest_committed)
            if chosen is None:
                return None
            step, jobs = chosen
            if step not in known and not self._queue_last_words(step, persisters, jobs):
                return None
        self.state.wait_step(step, timeout)
        return step

    def _held_snapshots(self, persisters: dict[int, ClientInfo]) -> dict[int, dict[int, tuple[Segment, int]]]:
        """Local rank -> step -> (segment, slot) of the live snapshots each persisting rank holds."""
        held: dict[int, dict[int, tuple[Segment, int]]] = {}
        for lr, info in persisters.items():
            segs = [self.pool.segment(path) for _epoch, path in segment_paths(self.state.job_dir, lr)]
            # Only the persisting rank's own snapshots: after a restart that numbered the ranks otherwise
            # (or changed their number), a local rank's segments still hold the previous rank's.
            held[lr] = {h.step: (seg, slot) for seg, slot, h in live_snapshots(segs) if info.owns(h)}
        return held

    def _newest_persistable(self, persisters: dict[int, ClientInfo], held: dict[int, dict[int, tuple[Segment, int]]],
                            limit: int | None, saved: dict[str, float],
                            newest_committed: int) -> tuple[int, list[M.Persist]] | None:
        """The newest step every persisting rank holds, newer than the newest commit (and ``limit`` when
        given), whose slots' metadata all read, with its persist requests; None when there is none."""
        common = set.intersection(*(set(steps) for steps in held.values()))

        def newer(s: int) -> bool:  # saved after the newest commit's snapshot (unknown time: by step)
            lr = min(held)
            seg, slot = held[lr][s]
            ref = saved.get(str(persisters[lr].rank), 0.0)  # that rank's own snapshot: one clock
            return seg.header(slot).wall_time > ref if ref else s > newest_committed

        for step in sorted((s for s in common if newer(s) and (limit is None or s == limit)), reverse=True):
            jobs = self._last_words_jobs(step, persisters, held)
            if jobs is not None:
                return step, jobs
        return None

    def _queue_last_words(self, step: int, persisters: dict[int, ClientInfo], jobs: list[M.Persist]) -> bool:
        """Holds the slots of ``step`` and queues its persists; False (logged) when a job has no persist
        path or a snapshot was overwritten meanwhile (then nothing is held or queued)."""
        self.state.note("last_words", level=logging.WARNING, step=step,
                        ranks=sorted(i.rank for i in persisters.values()))
        for job in jobs:
            if not job.path:
                log.error("step %d of local rank %d has no persist path; not persisted", step,
                          job.local_rank)
                return False
        if not self._hold_slots(step, jobs):
            return False
        for i, job in enumerate(jobs):
            try:
                self.persist.enqueue(job)
            except BaseException:
                for j in jobs[i:]:
                    self.pool.unhold_slot(j)
                raise
        return True

    def _hold_slots(self, step: int, jobs: list[M.Persist]) -> bool:
        """Holds every job's slot; False (logged, none left held) when one was overwritten meanwhile."""
        held_jobs: list[M.Persist] = []
        for job in jobs:
            if not self.pool.hold_slot(job):
                for j in held_jobs:
                    self.pool.unhold_slot(j)
                log.warning("last words: the snapshot of step %d was overwritten meanwhile", step)
                return False
            held_jobs.append(job)
        return True

    def _last_words_jobs(self, step: int, persisters: dict[int, ClientInfo],
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
