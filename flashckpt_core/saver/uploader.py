"""The uploader: a saver part that brings each step committed on the node-local tier to the durable tier, in
commit order, on a thread of its own.

For each locally committed step (``enqueue``, from the commit thread after the local commit; at start, the
catch-up: every locally committed step newer than the durable tier's newest commit, which a saver killed
mid-upload left) it uploads this node's files from the local dir and writes their done markers on the
durable tier (``commit.tiers.upload_step``); global rank 0's node then queues the durable commit on the
commit thread (``CommitJob``: markers of every rank, manifest, tracker; ``commit.protocol.commit_step``), so
a multi-node job commits once every node uploaded. A failed upload is reported to the trainers as a status
error entry with ``"tier": "durable"`` and retried in place with backoff (1 s doubling up to 30 s; later steps
wait, so the durable tier commits in order) until it succeeds or the saver stops. After an outage, a step with at
least as many newer local steps queued behind it as the checkpoint dir keeps (``max_to_keep``) is not uploaded:
retention would delete it at once: a store that is down for a while loses no step; the next saver's catch-up finishes what
a stopping one left. A local file that does not match its manifest is not retried (reported once).

Imports the layers below the saver and ``saver.state``, ``saver.housekeeping``. Each locally committed step
holds one unit of the saver's in-flight work until its durable commit is queued (or, on a node that does
not commit, until its markers are written): the saver does not exit idle while uploads are pending.
"""

from __future__ import annotations

import queue
import time

from flashckpt import errors as E
from flashckpt.commit.tiers import durable_spec_of, pending_uploads, upload_step
from flashckpt.saver.housekeeping import Records
from flashckpt.saver.state import CommitJob, SaverState, StepState, log

__all__ = ["Uploader"]

_RETRY_FIRST_S = 1.0
_RETRY_MAX_S = 30.0


class Uploader:
    """The upload thread of a saver with a local tier (see the module docstring)."""

    def __init__(self, state: SaverState, records: Records) -> None:
        self.state = state
        self.records = records
        self._q: queue.Queue[int | None] = queue.Queue()
        self._failures: dict[int, int] = {}  # step -> failed attempts in a row

    def enqueue(self, step: int) -> None:
        """Queues the upload of locally committed ``step``; the caller hands it its unit of in-flight work."""
        with self.state.cv:
            self.state.uploading.add(step)
            st = self.state.steps.setdefault(step, StepState())
            if st.status == "persisting":
                st.status = "uploading"
        self._q.put(step)

    def retry(self, step: int, error: str) -> bool:
        """Has ``step`` uploaded and committed again after its durable commit failed with ``error`` (a store
        that went down meanwhile); False (not retried) when the saver stops (the next saver's catch-up takes
        it) or a newer step is on its way to the durable tier (committing this one after it would make it
        the newest there)."""
        st = self.state
        with st.cv:
            newer = st.uploading - {step}
        if st.stop.is_set() or newer:
            with st.cv:
                st.uploading.discard(step)
            return False
        self._failed(step, error)
        self._q.put(step)
        return True

    def stop(self) -> None:
        """Ends the upload thread (the saver exits)."""
        self._q.put(None)

    def loop(self) -> None:
        """The upload thread: the catch-up once the records are ready, then the queued steps in order."""
        st = self.state
        if st.local is None:
            return
        while not st.stop.is_set():
            try:
                self.records.await_ready("uploading to the durable tier", 5.0)
                break
            except E.FlashCheckpointError:  # the records thread retries; so does this one, paced
                st.stop.wait(1.0)
        else:
            return
        self._catch_up()
        while True:
            step = self._q.get()
            if step is None:
                return
            self._upload(step)

    def _catch_up(self) -> None:
        """Queues the locally committed steps the durable tier lacks (left by a saver that died mid-upload)."""
        st = self.state
        assert st.local is not None
        try:
            steps = pending_uploads(st.local, st.layout)
        except (OSError, E.FlashCheckpointError) as e:
            log.error("could not list the steps the local tier %s holds for upload: %s", st.local.root, e)
            return
        with st.cv:
            steps = [s for s in steps if s not in st.uploading]
            st.inflight += len(steps)
        queued = []  # steps committed locally since the start: uploaded after the older ones, in order
        while True:
            try:
                queued.append(self._q.get_nowait())
            except queue.Empty:
                break
        for s in steps:
            log.warning("event=catch_up tier=durable step=%d: committed on the local tier %s, not on %s; uploading",
                        s, st.local.root, st.layout.root)
            self.enqueue(s)
        for q in queued:
            self._q.put(q)

    def _upload(self, step: int) -> None:
        """Uploads ``step``, retrying in place (later steps wait: the durable tier commits in order), until
        it succeeds or the saver stops (then its unit of work ends here)."""
        st = self.state
        assert st.local is not None
        newer = self._backlog(step)
        if newer:  # retention would delete it as soon as the newer ones are committed there
            log.info("event=upload tier=durable step=%d skipped: %d newer local steps follow and the checkpoint "
                     "dir keeps %d", step, newer, st.durable_keep)
            self._give_up(step, "superseded")
            return
        delay = _RETRY_FIRST_S
        while True:
            t0 = time.monotonic()
            try:
                m = upload_step(st.local, st.layout, step)
                break
            except E.CheckpointCorruptError as e:
                why = str(e)
                if not st.local.storage.exists(st.local.manifest_path(step)):
                    if self._superseded(step):  # a newer local step reused its files
                        log.info("event=upload tier=durable step=%d skipped: superseded on the local tier", step)
                        self._give_up(step, "superseded")
                        return
                    # The local tier lost it (the dir removed or emptied): said, never skipped quietly.
                    why = (f"step {step} was committed on the local tier {st.local.root}, but its copy there is "
                           f"gone before it reached {st.layout.root}: it is not on the checkpoint dir")
                log.error("event=upload tier=durable step=%d failed: %s", step, why)
                self._give_up(step, why, report=True)
                return
            except Exception as e:  # the store refused or stalled: retried
                if not st.stop.is_set():
                    self._failed(step, f"uploading step {step} to {st.layout.root} failed: {type(e).__name__}: {e}")
                if st.stop.wait(delay):
                    self._give_up(step, "the saver stopped; the next saver on this node uploads it")
                    return
                delay = min(2 * delay, _RETRY_MAX_S)
        nbytes = m.nbytes()
        st.note("upload", tier="durable", step=step, bytes=nbytes, seconds=time.monotonic() - t0,
                attempts=self._failures.pop(step, 0) + 1)
        spec = durable_spec_of(m)
        if spec is not None:
            st.commit_q.put(CommitJob(step, spec))  # the unit of work goes on with it
            return
        with st.cv:
            st.uploading.discard(step)
        st.finish(step, None, committed=False)

    def _backlog(self, step: int) -> int:
        """How many locally committed steps wait behind ``step`` when they are at least as many as the
        checkpoint dir keeps (a backlog after the store was down), else 0: ``step`` is then not uploaded (its
        newer steps are, in order). 0 when the checkpoint dir keeps every step or its retention is not known."""
        keep = self.state.durable_keep
        if keep <= 0:
            return 0
        newer = sum(1 for s in list(self._q.queue) if s is not None and s != step)
        return newer if newer >= keep else 0

    def _superseded(self, step: int) -> bool:
        """Whether a step committed on the local tier after ``step`` is there now (its commit may have taken
        ``step``'s files over); False when the local tier holds no newer step (it was removed or emptied)."""
        st = self.state
        assert st.local is not None
        try:
            order = st.local.committed_steps()
        except (OSError, E.FlashCheckpointError):
            return False
        return bool(order) and order[-1] != step

    def _failed(self, step: int, error: str) -> None:
        """Reports a failed attempt at ``step`` (each one: a status error entry with ``"tier": "durable"``)."""
        n = self._failures[step] = self._failures.get(step, 0) + 1
        log.error("event=upload tier=durable step=%d attempt=%d failed: %s; retrying", step, n, error)
        with self.state.cv:
            self.state.errors.append({"step": step, "error": error, "tier": "durable", "retrying": True})
            self.state.cv.notify_all()

    def _give_up(self, step: int, why: str, *, report: bool = False) -> None:
        """Ends this saver's work on ``step`` without its durable commit (it stays committed locally)."""
        st = self.state
        self._failures.pop(step, None)
        with st.cv:
            st.uploading.discard(step)
            if report:
                st.errors.append({"step": step, "error": why, "tier": "durable"})
            s = st.steps.get(step)
            if s is not None and s.status == "uploading":
                s.status = "persisted" if not s.commits_here else "failed"
            st.work_done()
