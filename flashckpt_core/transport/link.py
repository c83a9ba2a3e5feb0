"""A trainer's link to its node's saver: attach (starting the saver when none runs), typed round trips that
survive the saver's death (a new saver adopts the snapshots; the link re-attaches and says which persists
were lost), and news after memory snapshots without ever waiting for the saver."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from flashckpt import errors as E
from flashckpt.config import Knobs, dir_identity, knob
from flashckpt.transport import messages as M
from flashckpt.transport.messages import RP
from flashckpt.transport.spawn import ensure_saver
from flashckpt.transport.wire import Client, ConnectionLost

__all__ = ["SaverLink", "agent_pid", "restart_expected"]

log = logging.getLogger(__name__)

# Memory snapshots ask the saver for news (failed persists, commits) at most this often, without waiting
# for the answer (it is collected by a later snapshot); wait() and every persist ask at once.
_STATUS_EVERY_S = 0.5


class SaverLink:
    """One engine's connection to the saver of its job on this node.

    Args:
        job_dir: the job's runtime dir (the saver's socket is there).
        checkpoint_dir: the checkpoint dir, for a saver this link starts.
        knobs: timeouts.
        storage: the backend's ``storage_spec``, for a saver this link starts.
        storage_options: the backend's options, for a saver this link starts.
        hello: the ``Hello`` this rank says on every attach.

    Not thread-safe: the engine's thread only.
    """

    def __init__(self, job_dir: str, checkpoint_dir: str, knobs: Knobs, *, storage: str,
                 storage_options: dict[str, Any] | None = None, hello: Callable[[], M.Hello]) -> None:
        self.job_dir, self.checkpoint_dir, self.knobs, self._storage, self._hello = (
            job_dir, checkpoint_dir, knobs, storage, hello)
        self._storage_options = storage_options
        self.client: Client | None = None
        self.saver_pid = 0
        self.cursor = 0  # errors the saver reported up to here are known
        self.event_seq = -1  # the saver's events up to here are known (its journal's sequence number)
        self.requested: set[int] = set()  # steps whose persist was asked for and not known to be done
        self.lost_persists: str | None = None  # persists lost with a dead saver: reported once
        self._status_req: int | None = None  # id of the status request sent and not answered yet
        self._status_seg: str | None = None  # the segment the saver last heard of from this engine
        self.status_at = 0.0  # monotonic time of the last round trip
        self.runtime: tuple[int, int] | None = None  # the job dir the saver attached last serves (dir_identity)
        self.attaches = 0  # attaches so far (a new saver, or the same one again)
        # One round trip at a time: a deferred snapshot asks for its segment from the snapshot thread
        # (``SharedMemoryHandler.start_save(defer=True)``) while the training thread may call too.
        self._lock = threading.RLock()

    def attach(self) -> M.HelloReply:
        """Connects to the job's saver (starting one when none runs) and says hello; returns its reply."""
        # The job's saver may be exiting at this very moment (an engine of this job just said its final
        # goodbye): it then refuses the hello or drops the connection (SaverError), while it persists its
        # last words (bounded by term_timeout_s) and cleans up. Retry, bounded, until a live saver accepts
        # us, or the new one ensure_saver starts once the old one is gone.
        deadline = time.monotonic() + self.knobs.spawn_timeout_s + self.knobs.term_timeout_s
        delay = 0.01
        while True:
            client = ensure_saver(self.job_dir, self.checkpoint_dir, self.knobs, storage=self._storage,
                                  storage_options=self._storage_options)
            try:
                hello = client.request(self._hello())
                break
            except E.SaverError:
                client.close()
                if time.monotonic() >= deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
        self.client = client
        self.cursor = hello.cursor or 0  # errors before we attached belong to an earlier run
        self.event_seq = hello.event_seq if hello.event_seq is not None else -1  # and so do its events
        self.saver_pid = hello.pid
        self.runtime = dir_identity(self.job_dir)
        self.attaches += 1
        return hello

    def reattach(self, op: str, cause: BaseException | None, *, runtime_lost: bool = False) -> Client:
        """Attaches to a new saver after the connection to ours broke (the saver died, e.g. SIGKILL), or
        (``runtime_lost``) after the job's runtime dir was removed under it.

        A saver that died leaves its runtime dir: the new saver adopts the job's shared-memory segments, so
        every snapshot in memory stays, and this rank says hello again. A runtime dir that was removed (or
        is found replaced once attached) took the snapshots with it: the old saver, if alive, is told this
        rank is done with it, the new saver starts with new shared memory, and one warning says so.
        Persists that were in flight in the old saver are lost: the next reply raises one PersistError
        saying so (``lost_persists``)."""
        old_pid, old_runtime = self.saver_pid, self.runtime
        if self.client is not None:
            if runtime_lost and not self.client.lost:
                try:  # the old saver serves a dir that is gone: it exits once its ranks said goodbye
                    self.client.request(M.Bye(final=True, intent="release"))
                except E.FlashCheckpointError as e:
                    log.debug("goodbye to the saver of the removed runtime dir: %s", e)
            self.client.close()
            self.client = None
        self._status_req = None
        hello = self.attach()
        try:  # what the new saver found committed (a persist the old one committed was not lost)
            committed = set(hello.committed if hello.records_ready else self.records(self.knobs.records_timeout_s))
        except E.FlashCheckpointError as e:
            log.warning("%s(): the new saver could not tell which steps are committed: %s", op, e)
            committed = set()
        lost = sorted(s for s in self.requested if s not in committed)
        self.requested.clear()
        lost_note = f"; the persists of steps {lost} were lost" if lost else ""
        if runtime_lost or (old_runtime is not None and self.runtime != old_runtime):
            log.warning(
                "%s(): the runtime dir %s was removed (by something outside flashckpt: systemd-logind's RemoveIPC "
                "when the user's last session ends, a tmp cleaner, a user; or its saver, pid %d, exited on a "
                "signal): the snapshots of this job in shared memory are lost; committed steps on storage are "
                "intact%s. Started a new saver (pid %d) with new shared memory; training goes on. To keep "
                "snapshots, set RemoveIPC=no in /etc/systemd/logind.conf (or run as a system user), keep tmp "
                "cleaners away from it, or set FLASHCKPT_RUNTIME_DIR to a RAM-backed dir nothing cleans",
                op, self.job_dir, old_pid, lost_note, self.saver_pid)
            why = (f"the runtime dir {self.job_dir} was removed before they were committed, and the snapshots "
                   "in memory with it")
        else:
            log.warning("%s(): lost the saver (pid %d: %s); attached to a new saver (pid %d), which adopted the "
                        "snapshots in shared memory%s", op, old_pid, cause or "connection closed", self.saver_pid,
                        lost_note)
            why = f"the saver (pid {old_pid}) died before committing them. The snapshots in memory are intact"
        if lost:
            self.lost_persists = (f"the persist(s) of step(s) {lost} were lost: {why}; save with "
                                  "StorageType.DISK again to persist")
        assert self.client is not None  # set by attach
        return self.client

    def records(self, timeout: float) -> list[int]:
        """Waits up to ``timeout`` seconds for the saver to ready the commit records; returns the steps
        committed then (in commit order). Raises why they are not ready (``saver/housekeeping``)."""
        return self.call(M.AwaitRecords(timeout_s=timeout), timeout=timeout + self.knobs.rpc_timeout_s).committed

    def call(self, req: M.Request[RP], *, on_reattach: Callable[[], None] | None = None,
             timeout: float | None = None) -> RP:
        """One round trip; a saver that died is replaced (``reattach``) and the request sent to the new
        one, after ``on_reattach``."""
        with self._lock:
            return self._call(req, on_reattach=on_reattach, timeout=timeout)

    def _call(self, req: M.Request[RP], *, on_reattach: Callable[[], None] | None,
              timeout: float | None) -> RP:
        client = self.client
        if client is not None and self._status_req is not None:  # its reply is in what this one says
            client.cancel(self._status_req)
        self._status_req = None
        for attempt in range(2):
            if client is None or client.lost:
                client = self.reattach(req.OP, None)
                if on_reattach is not None:
                    on_reattach()
            try:
                return client.request(req, timeout=timeout)
            except ConnectionLost:
                if attempt:
                    raise
                client = None
        raise AssertionError("unreachable")

    def news(self, seg: str | None, local_rank: int) -> M.StatusReply | None:
        """The saver's news after a memory snapshot, which needs no round trip (the saver reads slot
        headers itself) and never waits for the saver: the reply to the status request sent earlier if it
        has arrived (else None), and the next request sent when due (at most every _STATUS_EVERY_S, and at
        once when this snapshot went to a new segment, so that the saver frees the one it outgrew:
        ``local_rank`` says whose). A saver that does not answer (stopped) delays news, never a snapshot;
        a lost connection is re-attached by the next ``call`` (a persist, wait); nor for a round trip of the
        snapshot thread (news then waits for the next snapshot)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self._news(seg, local_rank)
        finally:
            self._lock.release()

    def _news(self, seg: str | None, local_rank: int) -> M.StatusReply | None:
        client = self.client
        if client is None or client.lost:
            return None
        got = None
        try:
            if self._status_req is not None:
                reply = client.poll(self._status_req)
                if reply is None:
                    return None
                self._status_req = None
                got = M.StatusReply.from_wire(reply)
            if seg != self._status_seg or time.monotonic() - self.status_at >= _STATUS_EVERY_S:
                self._status_req = client.submit(M.Status(cursor=self.cursor, local_rank=local_rank,
                                                          since=self.event_seq))
                self._status_seg = seg
                self.status_at = time.monotonic()
        except ConnectionLost as e:
            self._status_req = None
            log.warning("save(): %s Memory snapshots go on; the next persist or wait attaches a new saver.", e)
        return got

    def absorb(self, st: M.StatusReply) -> None:
        """Takes in a status reply: the error and event cursors and the persists known to be done."""
        if st.cursor is not None:
            self.cursor = st.cursor
        if st.event_seq is not None:
            self.event_seq = st.event_seq
        if st.inflight == 0:
            self.requested.clear()
        else:
            done = {int(e["step"]) for e in st.errors}
            self.requested = {s for s in self.requested if s not in st.committed and s not in done}

    def take_lost(self) -> str | None:
        """The persists lost with a dead saver, reported once."""
        lost, self.lost_persists = self.lost_persists, None
        return lost

    def bye(self, intent: str) -> None:
        """Says goodbye ("release", "keep" or "persist": see ``CheckpointEngine._close``) and disconnects."""
        if self.client is not None:
            try:
                self.client.request(M.Bye(final=intent != "keep", intent=intent))
            except E.FlashCheckpointError as e:
                log.warning("close(): %s", e)
            finally:
                self.client.close()
                self.client = None


def agent_pid() -> int:
    """The pid of the ``flashckpt-run`` launcher this process runs under (FLASHCKPT_AGENT_PID), else 0."""
    return int(knob("agent_pid"))


def restart_expected() -> bool:
    """Whether this process's failure is followed by a restart that can use its memory snapshots: a
    ``flashckpt-run`` launcher (FLASHCKPT_AGENT_PID) is alive, or torchrun's elastic agent has restarts
    left (TORCHELASTIC_RESTART_COUNT < TORCHELASTIC_MAX_RESTARTS)."""
    pid = agent_pid()
    if pid:
        try:
            os.kill(pid, 0)
            return True
        except PermissionError:
            return True
        except ProcessLookupError:
            pass
    try:
        return int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < int(os.environ["TORCHELASTIC_MAX_RESTARTS"])
    except (KeyError, ValueError):
        return False
