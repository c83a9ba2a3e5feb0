"""The saver's start-up work on the commit records, on a thread of its own: a store that is slow, stalled or
down never holds up the saver's start, and so never the engine's.

What it does, in order, once (``Records._housekeeping``): take this job's hold on the records (``CommitLayout.claim``:
stale records removed, a lock or a lease object), read the committed steps, remove the half-written steps an
earlier run left (unless a saver of this job is alive on another node), abort the unfinished uploads of a
killed saver (object stores, when no other job is alive), and repair the tracker. A failed attempt is logged
and retried, 1 s after the first failure and up to every 30 s, until it succeeds or the saver stops.

Until it succeeds the records are *pending*: the saver serves (hello, allocations, memory snapshots, status,
waits), and what needs the records waits for them, bounded by ``Knobs.records_timeout_s``
(FLASHCKPT_RECORDS_TIMEOUT_S), or says why not at once when two attempts in a row failed (one failure may
be a passing race, such as another node's saver making the same records): a persist or a deletion request
(``NEEDS_RECORDS``), last words, and an engine's first use of its records (``AwaitRecords``: a load, a
storage save). Commits and deletions on the commit thread follow persists, which waited. No persist of this
job can therefore run while half-written steps are removed.

Imports the layers below the saver and ``saver.state``. The records thread writes the records' state
(``ready``, ``error``, ``failures``, ``start_committed``, the job's hold) under ``SaverState.cv``; request
threads wait on it there (``await_ready``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from flashckpt import errors as E
from flashckpt.commit.protocol import repair
from flashckpt.commit.records_home import Held
from flashckpt.commit.removal import clean_uncommitted
from flashckpt.saver.state import SaverState, log
from flashckpt.transport import messages as M

__all__ = ["Records", "NEEDS_RECORDS"]

_RETRY_FIRST_S = 1.0
_RETRY_MAX_S = 30.0

#: Requests that touch the commit records: each waits for them first (see the module docstring).
NEEDS_RECORDS: frozenset[type[M.Request[Any]]] = frozenset({M.Persist, M.LastWords, M.DeleteSteps, M.DeletePath})


class Records:
    """The commit records as this saver readies them (see the module docstring)."""

    def __init__(self, state: SaverState) -> None:
        self.state = state
        self.layout = state.layout
        self.ready = False  # the start-up work on the commit records is done
        self.error: str | None = None  # why its last attempt failed
        self.failures = 0
        self.since = time.monotonic()
        self.start_committed: list[int] = []  # the committed steps once the records were ready
        self._job_lock: Held | None = None  # this job's hold on the records (CommitLayout.claim)
        self._local_lock: Held | None = None  # and on the local tier's records

    def loop(self) -> None:
        """The records thread: ``_housekeeping`` until it succeeds or the saver stops (see the module
        docstring)."""
        st = self.state
        self.since = time.monotonic()
        delay = _RETRY_FIRST_S
        while not st.stop.is_set():
            try:
                self._housekeeping()
            except Exception as e:  # the store refused (after its own retries) or the records are unusable
                with st.cv:
                    self.error = f"{type(e).__name__}: {e}"
                    self.failures += 1
                    st.cv.notify_all()
                log.error("could not ready the commit records in %s (attempt %d): %s; retrying in %.0f s",
                          self.layout.meta, self.failures, self.error, delay)
                if st.stop.wait(delay):
                    return
                delay = min(2 * delay, _RETRY_MAX_S)
                continue
            with st.cv:
                self.ready = True
                self.error = None
                self.start_committed = list(st.committed)
                st.cv.notify_all()
            if self.failures:
                log.info("the commit records in %s are ready after %d failed attempt(s)", self.layout.meta,
                         self.failures)
            return

    def _housekeeping(self) -> None:
        """One attempt at the start-up work (see the module docstring); raises what the store raised."""
        st = self.state
        # A saver of this job alive on another node may be persisting a step right now (a node that joins a
        # running job): its half-written steps are then not left over from a crash.
        peers_alive = self.layout.job_alive(self.layout.job)
        if self._job_lock is None:
            held = self.layout.claim()
            with st.cv:  # under the lock release_hold takes: a hold taken as the saver stops is let go
                if st.stop.is_set():
                    if held is not None:
                        held.release()
                    return
                self._job_lock = held
        self._local_housekeeping()
        committed = self.layout.committed_steps()
        with st.cv:
            st.committed = committed
        cleaned = [] if peers_alive else clean_uncommitted(self.layout)
        if cleaned:
            log.warning("removed half-written, uncommitted steps %s left by an earlier run", cleaned)
        if not self.layout.live_jobs():  # unfinished uploads of a killed saver (object stores); no one else's
            try:
                for line in st.storage.tidy(self.layout.root):
                    log.warning("%s", line)
            except (OSError, E.FlashCheckpointError) as e:
                log.error("could not look for unfinished uploads in %s: %s", self.layout.root, e)
        self._repair()

    def _local_housekeeping(self) -> None:
        """The same start-up work on the local tier's records (a local dir: no store to wait for): the hold,
        half-written local steps removed, the tracker repaired. Its committed steps stay for the upload."""
        st = self.state
        local = st.local
        if local is None or self._local_lock is not None:
            return
        os.makedirs(local.root, exist_ok=True)  # a replaced node's local dir is made anew
        held = local.claim()
        with st.cv:
            if st.stop.is_set():
                if held is not None:
                    held.release()
                return
            self._local_lock = held
        cleaned = clean_uncommitted(local)
        if cleaned:
            log.warning("removed half-written, uncommitted steps %s from the local tier %s", cleaned, local.root)
        for line in repair(local):
            log.warning("repaired %s: %s", local.meta, line)

    def _repair(self) -> None:
        """Completes what a crash or a failed write left after the last commits: the tracker is derived
        from the manifests (``CommitLayout.repair``). A storage that refuses is reported, not fatal."""
        try:
            for line in repair(self.layout):
                log.warning("repaired %s: %s", self.layout.meta, line)
        except OSError as e:
            log.error("could not repair the commit records in %s: %s; the next saver tries again", self.layout.meta, e)
        committed = self.layout.committed_steps()
        with self.state.cv:
            self.state.committed = committed

    def release_hold(self) -> None:
        """Lets this job's hold on the records go (the saver exits; the records thread, stopped, takes none
        after this)."""
        with self.state.cv:
            held, self._job_lock = self._job_lock, None
            local, self._local_lock = self._local_lock, None
        for h in (held, local):
            if h is not None:
                h.release()

    def await_ready(self, what: str, timeout: float) -> None:
        """Returns once the commit records are ready; else, after ``timeout`` seconds, or at once when two
        attempts at readying them failed, raises why ``what`` cannot go on.

        Raises:
            CheckpointDirError: an attempt failed (the store's error, or records that cannot be used).
            CheckpointTimeoutError: no attempt finished within ``timeout`` (a stalled store).
            SaverError: the saver is stopping.
        """
        st = self.state
        deadline = time.monotonic() + timeout
        with st.cv:
            while not self.ready:
                where = (f"{what}: the commit records in {self.layout.meta} are not ready: the saver (pid "
                         f"{os.getpid()}) has been readying them for {time.monotonic() - self.since:.0f} s "
                         "(its job's hold, the committed steps, clean-up of half-written steps, the tracker)")
                # One failed attempt may be a passing race (another node's saver making the same records);
                # a caller is told once the retry, a second later, failed too.
                if self.error is not None and self.failures >= 2:
                    raise E.CheckpointDirError(
                        f"{where}, and its attempt {self.failures} failed: {self.error}. It "
                        "retries (up to every 30 s); nothing was written. Check the store (credentials, "
                        "endpoint, permissions) and try again")
                if st.stop.is_set():
                    raise E.SaverError(f"{where}; the saver is stopping")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise E.CheckpointTimeoutError(
                        f"{where}; the store has not answered within {timeout:.0f} s "
                        "(FLASHCKPT_RECORDS_TIMEOUT_S). Nothing was written; the saver keeps trying: try again "
                        "once the store answers")
                st.cv.wait(timeout=min(left, 0.5))
