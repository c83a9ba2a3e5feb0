"""The saver's control server: accepts the trainers' connections on the job's Unix socket, keeps their
sessions (who said hello, who persists, the launcher to watch, final goodbyes), and answers each request
through a dispatch table of handlers, request type -> the part that does the work (``saver/server`` lists
the parts). Also the small shared queues and dicts that trainers of a job may use (``QueuePut``...).

Imports the layers below the saver and the saver's parts. One thread accepts; one thread serves each
connection; handlers run concurrently and share ``SaverState`` under its ``cv``."""

from __future__ import annotations

import collections
import os
import select
import socket
import time
from collections.abc import Callable
from typing import Any, ClassVar

from flashckpt import errors as E
from flashckpt.commit.layout import Manifest
from flashckpt.saver.committer import Committer
from flashckpt.saver.housekeeping import NEEDS_RECORDS, Records
from flashckpt.saver.lastwords import LastWords
from flashckpt.saver.persist import PersistQueues
from flashckpt.saver.replica import ReplicaService
from flashckpt.saver.report import inspect
from flashckpt.saver.segments import SegmentPool
from flashckpt.saver.state import ClientInfo, SaverState, log
from flashckpt.transport import messages as M
from flashckpt.transport.messages import parse_request
from flashckpt.transport.wire import peer_uid, recv_msg, send_msg
from flashckpt.util.lease import pid_running

__all__ = ["ControlServer"]


class _Watch:
    """Whether process ``pid`` (the job's launcher) still runs: a pidfd where Linux has them (immune to
    pid reuse once opened), else ``kill(pid, 0)``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None
        self._gone = False
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
        except (AttributeError, OSError):
            pass

    def gone(self) -> bool:
        if self._gone:
            return True
        if self._fd is not None:
            self._gone = bool(select.select([self._fd], [], [], 0)[0])  # readable once it exited
        else:
            self._gone = not pid_running(self.pid)
        return self._gone

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ControlServer:
    """The control server of one saver (see the module docstring)."""

    def __init__(self, state: SaverState, *, pool: SegmentPool, persist: PersistQueues, committer: Committer,
                 last_words: LastWords, records: Records, replica: ReplicaService) -> None:
        self.state = state
        self.pool = pool
        self.persist = persist
        self.committer = committer
        self.last_words = last_words
        self.records = records
        self.replica = replica
        self.sock: socket.socket | None = None  # bound by the server (CheckpointSaver.start)
        self.ever_clients = 0  # hellos so far
        self.session_final = False  # every client of this session said a final goodbye (so far)
        self.agent: _Watch | None = None  # the launcher of the job, when it has one
        self._queues: dict[str, collections.deque[Any]] = collections.defaultdict(collections.deque)
        self._dicts: dict[str, dict[str, Any]] = collections.defaultdict(dict)
        self._layouts_checked = 0.0  # when ``_tidy_layouts`` last looked (monotonic)
        self._layouts_busy = False

    def close_socket(self) -> None:
        """Stops accepting (the saver exits)."""
        if self.sock is not None:
            try:  # wakes the accept loop (a close alone leaves a blocked accept() waiting)
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
            self.sock = None

    def status(self, cursor: int, since: int = -1) -> dict[str, Any]:
        st = self.state
        events, seq = st.events_since(since)
        with st.cv:
            return {"committed": list(st.committed), "errors": st.errors[cursor:], "commits": list(st.commits),
                    "cursor": len(st.errors), "inflight": st.inflight,
                    "last_persist_s": st.stats.last_persist_s, "records_ready": self.records.ready,
                    "events": events, "event_seq": seq}

    def wait(self, timeout: float, cursor: int, since: int = -1) -> dict[str, Any]:
        st = self.state
        deadline = time.monotonic() + timeout if timeout > 0 else None
        with st.cv:
            while st.inflight > 0:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise E.CheckpointTimeoutError(
                        f"wait(): {st.inflight} persist(s) still running after {timeout:.0f} s")
                st.cv.wait(timeout=min(left, 1.0) if left is not None else 1.0)
        return self.status(cursor, since)

    # ------------------------------------------------------------------ connections
    def accept_loop(self) -> None:
        cid = 0
        while not self.state.stop.is_set():
            sock = self.sock
            if sock is None:
                return
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            try:
                if peer_uid(conn) != os.getuid():
                    log.warning("refused a connection from another uid")
                    conn.close()
                    continue
            except OSError:
                conn.close()
                continue
            cid += 1
            self.state.spawn(self._serve_conn, f"conn{cid}", conn, cid)

    def _serve_conn(self, conn: socket.socket, cid: int) -> None:
        info: ClientInfo | None = None
        try:
            while True:
                try:
                    msg = recv_msg(conn)
                except E.ProtocolError as e:
                    log.warning("rejected a malformed control message: %s", e)
                    send_msg(conn, {"ok": False, "error": str(e), "kind": "ProtocolError"})
                    return
                # Every reply echoes its request's id: a client that gave up on a request (a timeout)
                # recognizes the late reply and discards it instead of taking it for a later one's.
                echo = {"id": msg["id"]} if "id" in msg else {}
                try:
                    req = parse_request(msg)
                except E.ProtocolError as e:  # reply, rather than drop the connection
                    send_msg(conn, {"ok": False, "error": str(e), "kind": "ProtocolError", **echo})
                    continue
                if isinstance(req, M.Hello):
                    info = ClientInfo(req.rank, req.local_rank, req.pid, persists=req.persists, commit=req.commit,
                                       world_size=req.world_size, replicated=req.replicated)
                    if not self._attach(cid, info, req.agent_pid):
                        send_msg(conn, {"ok": False, "kind": "SaverError",
                                        "error": "the saver is shutting down; start or reach the next one", **echo})
                        return
                try:
                    if type(req) in NEEDS_RECORDS:
                        self.records.await_ready(req.OP, self.state.knobs.records_timeout_s)
                    reply: dict[str, Any] = {"ok": True, **self._DISPATCH[type(req)](self, req, info).to_wire()}
                except E.FlashCheckpointError as e:
                    reply = {"ok": False, "error": str(e), "kind": type(e).__name__}
                except (KeyError, TypeError, ValueError) as e:
                    reply = {"ok": False, "error": f"bad {req.OP!r} request: {e!r}", "kind": "ProtocolError"}
                except OSError as e:
                    reply = {"ok": False, "error": f"{req.OP}: {e}", "kind": "PersistError"}
                send_msg(conn, {**reply, **echo})
                if isinstance(req, M.Bye):
                    return
        except (ConnectionError, OSError):
            pass
        finally:
            conn.close()
            with self.state.cv:
                gone = self.state.clients.pop(cid, None)
                if gone is not None and not gone.final:
                    self.session_final = False
                    if gone.said_bye:  # close(release=False): a restart is to load the snapshots
                        log.info("client rank %d (pid %d) left keeping its snapshots for a restart", gone.rank,
                                 gone.pid)
                    else:
                        log.warning("client rank %d (pid %d) disconnected without goodbye", gone.rank, gone.pid)
                    if self.state.knobs.last_words and not self.state.stop.is_set():
                        self.state.inflight += 1  # keeps the saver alive until the last words are written
                        self.state.spawn(self.last_words.thread, "last-words")
                if not self.state.clients:
                    self.state.idle_since = time.monotonic()
                self.state.cv.notify_all()

    def _attach(self, cid: int, info: ClientInfo, agent: int) -> bool:
        """Registers a client that said hello; False when the saver is exiting (its runtime dir is about to
        be removed)."""
        with self.state.cv:
            if self.state.stop.is_set():
                return False
            if not self.state.clients:
                self.session_final = True  # a new session of clients begins
            if agent > 0 and (self.agent is None or self.agent.pid != agent):
                if self.agent is not None:
                    self.agent.close()
                self.agent = _Watch(agent)
            self.state.clients[cid] = info
            self.ever_clients += 1
            if info.persists:  # who persists what, for last words after a crash
                self.state.persisters[info.local_rank] = info
        return True

    # ------------------------------------------------------------------ requests (the dispatch table below)
    def _on_hello(self, req: M.Hello, info: ClientInfo | None) -> M.Reply:
        local = self.state.local.root if self.state.local is not None else ""
        if req.local_dir != local:
            raise E.InvalidArgumentError(
                f"CheckpointEngine(local_dir={req.local_dir or None!r}): this job's saver on this node (pid "
                f"{os.getpid()}) was started with local_dir={local or None!r}; every engine of a job gives the "
                "same local_dir (or FLASHCKPT_LOCAL_DIR). Close the other engines first, or give this one the "
                "same local_dir")
        self.replica.hello(req)
        return M.HelloReply(pid=os.getpid(), **self.status(0))

    def _on_await_records(self, req: M.AwaitRecords, info: ClientInfo | None) -> M.Reply:
        self.records.await_ready("the engine's first use of the commit records", req.timeout_s)
        with self.state.cv:
            return M.RecordsReply(committed=list(self.records.start_committed))

    def _on_inventory(self, req: M.Inventory, info: ClientInfo | None) -> M.Reply:
        return self.replica.inventory()

    def _on_inspect(self, req: M.Inspect, info: ClientInfo | None) -> M.Reply:
        return inspect(self.state, self.replica, req)

    def _on_fetch(self, req: M.Fetch, info: ClientInfo | None) -> M.Reply:
        return self.replica.fetch(req)

    def _on_alloc(self, req: M.Alloc, info: ClientInfo | None) -> M.Reply:
        nslots = req.nslots if req.nslots is not None else self.state.knobs.slots
        return M.AllocReply(path=self.pool.alloc(req.local_rank, req.meta_cap, req.data_cap, nslots))

    def _on_persist(self, req: M.Persist, info: ClientInfo | None) -> M.Reply:
        self.persist.enqueue(req)
        self.pool.reap_quietly(req.local_rank)
        return M.StatusReply(**self.status(req.cursor, req.since))

    def _on_status(self, req: M.Status, info: ClientInfo | None) -> M.Reply:
        if req.local_rank is not None:
            self.pool.reap_quietly(req.local_rank)
        self._tidy_layouts(info)
        return M.StatusReply(**self.status(req.cursor, req.since))

    _LAYOUTS_EVERY_S = 2.0

    def _tidy_layouts(self, info: ClientInfo | None) -> None:
        """After a job changed its number of ranks (a resharded resume), gives the earlier layout's memory back
        once storage holds a newer state of the job as it is now: looked at from a trainer's news request, at
        most every 2 s and only while this node holds snapshots of another number of ranks, in the background
        (the newest commit is read from storage)."""
        if info is None or info.world_size <= 0 or not self.records.ready or self._layouts_busy:
            return
        now = time.monotonic()
        if now < self._layouts_checked + self._LAYOUTS_EVERY_S:
            return
        self._layouts_checked = now
        if not self.pool.other_layouts(info.world_size):
            return
        self._layouts_busy = True
        self.state.spawn(self._release_layouts, "layouts", info.world_size)

    def _release_layouts(self, world: int) -> None:
        try:
            layout = self.state.layout
            committed = layout.committed_steps()
            if committed:
                self.release_layouts_before(layout.read_manifest(committed[-1]), world)
        except (OSError, ValueError, TypeError, E.FlashCheckpointError) as e:
            log.warning("giving back the memory of an earlier layout of the job: %s", e)
        finally:
            self._layouts_busy = False

    def after_commit(self, m: Manifest) -> None:
        """On the commit thread, after this saver committed ``m``: the memory of an earlier layout of the job
        goes back at once (a job that ends right after its commit sends no further news request)."""
        if not self.pool.other_layouts(m.world_size):
            return
        try:
            self.release_layouts_before(m, m.world_size)
        except (OSError, ValueError, TypeError, E.FlashCheckpointError) as e:
            log.warning("giving back the memory of an earlier layout of the job: %s", e)

    def release_layouts_before(self, m: Manifest, world: int) -> None:
        """Removes the segments of another number of ranks than ``world`` older than commit ``m`` of it."""
        before = min(m.saved_at_ranks().values(), default=0.0)
        if m.world_size != world or before <= 0:
            return  # storage holds nothing newer of this layout yet: the earlier one may still be needed
        removed, freed = self.pool.release_layouts(world, before)
        if removed:
            log.info("event=layout_released world=%d step=%d segments=%d bytes=%d: the snapshots of another number "
                     "of ranks are older than committed step %d of this one (%s)", world, m.step, len(removed),
                     freed, m.step, ", ".join(os.path.basename(p) for p in removed))

    def _on_wait(self, req: M.Wait, info: ClientInfo | None) -> M.Reply:
        return M.StatusReply(**self.wait(req.timeout_s, req.cursor, req.since))

    def _on_last_words(self, req: M.LastWords, info: ClientInfo | None) -> M.Reply:
        timeout = req.timeout_s if req.timeout_s is not None else self.state.knobs.commit_timeout_s
        step = self.last_words.save_shm_to_storage(timeout=timeout)
        return M.LastWordsReply(step=step, **self.status(req.cursor, req.since))

    def _on_delete_steps(self, req: M.DeleteSteps, info: ClientInfo | None) -> M.Reply:
        if req.background:
            self.committer.schedule_delete_steps(list(req.steps))
            return M.DeleteStepsReply(scheduled=list(req.steps))
        return M.DeleteStepsReply(deleted=self.committer.delete_steps_now(list(req.steps), newest=req.newest))

    def _on_delete_path(self, req: M.DeletePath, info: ClientInfo | None) -> M.Reply:
        steps = self.committer.schedule_delete_path(self.state.storage.normpath(req.path))
        return M.DeletePathReply(missing=True) if steps is None else M.DeletePathReply(scheduled=steps)

    def _on_give_way(self, req: M.GiveWay, info: ClientInfo | None) -> M.Reply:
        # Another job of this user is short of shared memory: an idle saver (clients came and went, none is
        # attached, no work) persists what is newer than its last commit and exits.
        with self.state.cv:
            st = self.state
            idle = bool(self.ever_clients) and not st.clients and st.inflight == 0 and not st.stop.is_set()
            if req.dry_run:
                return M.GiveWayReply(idle=idle, idle_s=time.monotonic() - self.state.idle_since)
            if idle:
                self.state.signalled = True  # last words, then exit
                self.state.stop.set()
                self.state.cv.notify_all()
        return M.GiveWayReply(giving_way=idle)

    def _on_bye(self, req: M.Bye, info: ClientInfo | None) -> M.Reply:
        """A goodbye: ``final`` (released: the last words come before the saver exits) or not (kept for a
        restart: persisted at once). Every intent keeps the newest snapshot (``serve_forever``)."""
        if info is not None:
            info.final = req.final
            info.said_bye = True
        return M.Ok()

    def _on_q_put(self, req: M.QueuePut, info: ClientInfo | None) -> M.Reply:
        with self.state.cv:
            self._queues[req.name].append(req.item)
            self.state.cv.notify_all()
        return M.Ok()

    def _on_q_get(self, req: M.QueueGet, info: ClientInfo | None) -> M.Reply:
        deadline = time.monotonic() + req.timeout_s
        with self.state.cv:
            while not self._queues[req.name]:
                left = deadline - time.monotonic()
                if left <= 0 or self.state.stop.is_set():
                    return M.QueueGetReply(found=False)
                self.state.cv.wait(timeout=left)
            return M.QueueGetReply(found=True, item=self._queues[req.name].popleft())

    def _on_q_size(self, req: M.QueueSize, info: ClientInfo | None) -> M.Reply:
        with self.state.cv:
            return M.QueueSizeReply(size=len(self._queues[req.name]))

    def _on_d_update(self, req: M.DictUpdate, info: ClientInfo | None) -> M.Reply:
        with self.state.cv:
            self._dicts[req.name].update(req.items)
        return M.Ok()

    def _on_d_get(self, req: M.DictGet, info: ClientInfo | None) -> M.Reply:
        with self.state.cv:
            return M.DictGetReply(items=dict(self._dicts[req.name]))

    # One handler per request type (messages.REQUESTS lists them all; test_messages checks none is missing).
    _DISPATCH: ClassVar[dict[type[M.Request[Any]], Callable[..., M.Reply]]] = {
        M.Hello: _on_hello, M.Alloc: _on_alloc, M.Persist: _on_persist, M.Status: _on_status, M.Wait: _on_wait,
        M.LastWords: _on_last_words, M.DeleteSteps: _on_delete_steps, M.DeletePath: _on_delete_path,
        M.GiveWay: _on_give_way, M.Bye: _on_bye, M.QueuePut: _on_q_put, M.QueueGet: _on_q_get,
        M.QueueSize: _on_q_size, M.DictUpdate: _on_d_update, M.DictGet: _on_d_get, M.Inventory: _on_inventory,
        M.Inspect: _on_inspect, M.Fetch: _on_fetch, M.AwaitRecords: _on_await_records,
    }
