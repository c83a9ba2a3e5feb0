"""The saver's side of the cross-node memory replica (``flashckpt.transport.peers``: groups, peer book, wire).

In a job of several nodes each saver runs a peer service on TCP: it receives its group partners' backups,
answers what it holds (``inventory``), sends a snapshot it holds to a node that lost its memory
(``fetch``), and persists what it holds of a rank whose own node cannot (``persist_held``: a commit, or last
words, that would otherwise wait for a lost node). After each memory snapshot of a local rank, a sender thread
sends it to the partners (sharded state only: with replicated state every node holds it already), paced to the
bandwidth cap, from a slot flagged ``FLAG_SENDING`` (no snapshot overwrites it meanwhile).

A backup lives in a segment of its own, ``bak-r<rank>-e<epoch>.shm`` (two slots), under the slot rules of
every segment: the slot is WRITING (new generation) while it is received and COMPLETE only once every byte
arrived, the metadata checksum matched and the sender saw its source slot unchanged after sending (a torn send
is never used). The newest complete backup is never the slot the next one is received into.

The node's backups live in the segment pool (``saver.segments``: ``backup_segment``, ``drop_backups``); what a
node persists of a lost rank is the persist queues' (``persist_held``); deciding who persists what after a
node loss (asking the peers) is ``saver.recovery``'s. Imports the layers below the saver and ``saver.state``,
``saver.segments``, ``saver.persist``. Runs on the request threads (hello, inventory, fetch), one thread per
peer connection, the peer accept thread and the backup sender; the peer state ``Replica`` changes under
``SaverState.cv`` (ranks, node) or ``Replica.lock`` (backup segments).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import xxhash
from flashckpt import errors as E
from flashckpt.format.segment import (
    COMPLETE,
    EMPTY,
    FLAG_FETCHED,
    FLAG_SENDING,
    FLAGS_BUSY,
    WRITING,
    Segment,
    SlotHeader,
    live_snapshots,
    lock_path,
    segment_paths,
)
from flashckpt.saver.persist import PersistQueues
from flashckpt.saver.segments import SegmentPool, own_local_ranks
from flashckpt.saver.state import SaverState, log
from flashckpt.transport import messages as M
from flashckpt.transport.ipc import SharedLock
from flashckpt.transport.peers import (
    Pacer,
    PeerBook,
    ReplicaKnobs,
    accept,
    advertised_host,
    connect,
    partners,
    recv_into,
    send_range,
)
from flashckpt.transport.wire import PeerClosed, recv_msg, send_msg

__all__ = ["ReplicaService", "Replica"]


@dataclass
class Replica:
    """The peer service's state: this node in the job's groups, its listener, what it sent, its partners."""

    knobs: ReplicaKnobs
    book: PeerBook
    secret: bytes
    node: int
    nnodes: int
    host: str
    listener: socket.socket
    port: int
    replicated: bool = False
    world_size: int = 0
    instance: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    ranks: dict[int, int] = field(default_factory=dict)  # local rank -> global rank, as of its newest hello
    sent: dict[int, tuple[str, int, int]] = field(default_factory=dict)  # local rank -> (path, slot, generation)
    conns: dict[int, tuple[str, socket.socket]] = field(default_factory=dict)  # partner node -> (instance, connection)
    lock: threading.Lock = field(default_factory=threading.Lock)  # backup segments: create, choose a slot, reap
    unreachable: set[int] = field(default_factory=set)  # partners already reported unreachable
    sent_bytes: int = 0
    send_seconds: float = 0.0


class ReplicaService:
    """The peer service of one saver (see the module docstring); ``rep`` is None until the first hello of a
    multi-node job starts it."""

    def __init__(self, state: SaverState, pool: SegmentPool, persist: PersistQueues) -> None:
        self.state = state
        self.pool = pool
        self.persist = persist
        self.job_dir = state.job_dir
        self.knobs = state.knobs
        self.rep: Replica | None = None

    # ------------------------------------------------------------------ start
    def hello(self, req: M.Hello) -> None:
        """Starts the peer service at the first hello of a multi-node job, and publishes the ranks served."""
        nnodes = max(1, req.world_size // max(1, req.local_world_size))
        if nnodes < 2 and self.rep is None:
            return
        # (A job that shrank to one node keeps its peer service, with no partners: nothing to back up to.)
        node = req.rank // max(1, req.local_world_size)
        moved_from = None
        with self.state.cv:
            rep = self.rep
            if rep is None:
                rep = self.rep = self._start(node, nnodes)
            elif node != rep.node or nnodes != rep.nnodes:
                # A restart's rendezvous may give this node another group rank (torch ranks the agents by
                # their sorted addresses: a node that joins may come before a survivor): the groups follow.
                moved_from, rep.node, rep.nnodes = rep.node, node, nnodes
                rep.ranks.clear()
                rep.unreachable.clear()
                for _inst, conn in rep.conns.values():
                    conn.close()
                rep.conns.clear()
            rep.ranks[req.local_rank] = req.rank
            rep.replicated = req.replicated
            rep.world_size = req.world_size
        if moved_from is not None and moved_from != node:
            log.info("event=replica_node_moved from=%d to=%d", moved_from, node)
            rep.book.withdraw(moved_from, rep.instance)
        self._publish()

    def _start(self, node: int, nnodes: int) -> Replica:
        knobs = ReplicaKnobs.from_env()
        book = PeerBook(self.state.storage, self.state.layout.meta, self.state.layout.job)
        host = advertised_host(knobs)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        lsock = socket.socket(family, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((host, 0))
        lsock.listen(64)
        rep = Replica(knobs, book, book.secret(), node, nnodes, host, lsock, lsock.getsockname()[1])
        self.state.spawn(self._peer_accept_loop, "peer-accept", rep)
        if knobs.mode != "off":
            self.state.spawn(self._backup_sender, "backup-send", rep)
        log.info("event=replica node=%d nnodes=%d peer=%s:%d partners=%s mbps=%s", node, nnodes, host, rep.port,
                 partners(node, nnodes, knobs.group_size, knobs.stride) if knobs.mode != "off" else "off",
                 knobs.mbps or "uncapped")
        return rep

    def _publish(self) -> None:
        rep = self.rep
        if rep is None:
            return
        try:
            rep.book.publish(rep.node, {"host": rep.host, "port": rep.port, "instance": rep.instance,
                                        "ranks": sorted(rep.ranks.values()), "pid": os.getpid(), "t": time.time()})
        except OSError as e:
            log.error("could not publish this saver's peer address in %s: %s", rep.book.dir, e)

    def stop(self) -> None:
        """Closes the peer connections and the listener (the saver exits)."""
        rep = self.rep
        if rep is None:
            return
        for _inst, conn in list(rep.conns.values()):
            conn.close()
        with contextlib.suppress(OSError):
            rep.listener.shutdown(socket.SHUT_RDWR)
        rep.listener.close()

    def inventory(self) -> M.InventoryReply:
        """What this node holds in memory (own snapshots and backups) and persists, for a peer or a trainer."""
        rep = self.rep
        held = []
        for kind, lr, _seg, _i, h in self.pool.held():
            held.append({"rank": -1 if h.rank is None else h.rank, "step": h.step, "wall_time": h.wall_time,
                         "seq": h.seq, "kind": kind, "local_rank": lr, "fetched": bool(h.flags & FLAG_FETCHED),
                         "world": h.world})
        with self.state.cv:
            persisting = [[s, r] for s, st in self.state.steps.items() for r in st.ranks if st.status != "failed"]
        if rep is None:
            return M.InventoryReply(held=held, persisting=persisting)
        return M.InventoryReply(node=rep.node, instance=rep.instance, host=rep.host, port=rep.port, held=held,
                                persisting=persisting)

    # ------------------------------------------------------------------ peer service
    def _peer_accept_loop(self, rep: Replica) -> None:
        n = 0
        while not self.state.stop.is_set():
            try:
                conn, _addr = rep.listener.accept()
            except OSError:
                return
            n += 1
            self.state.spawn(self._serve_peer, f"peer{n}", rep, conn)

    def _serve_peer(self, rep: Replica, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not accept(conn, rep.secret, timeout=rep.knobs.loss_s * 5):
                log.warning("refused a peer connection without this job's secret")
                return
            conn.settimeout(None)
            niced = False
            while not self.state.stop.is_set():
                try:
                    req = recv_msg(conn)
                except (ConnectionError, E.SaverError):
                    return
                op = req.get("op")
                if op == "push":
                    if not niced:  # a partner's backups: received below training, as they are sent (a restore's
                        # fetch, on a connection of its own, is not)
                        niced = True
                        with contextlib.suppress(OSError):
                            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.knobs.persist_nice)
                    self._receive_backup(rep, conn, req)
                elif op == "fetch":
                    self._send_held(conn, int(req["rank"]), int(req["step"]), int(req.get("world", 0)))
                elif op == "inventory":
                    send_msg(conn, {"ok": True, **self.inventory().to_wire()})
                elif op == "persist_held":
                    send_msg(conn, {"ok": True, "ranks": self.persist.persist_held(int(req["step"]),
                                                                             [int(r) for r in req["ranks"]])})
                else:
                    send_msg(conn, {"ok": False, "error": f"unknown peer operation {op!r}"})
        except (OSError, ValueError, KeyError, TypeError, E.FlashCheckpointError) as e:
            log.warning("peer connection ended: %s", e)
        finally:
            conn.close()

    # ------------------------------------------------------------------ sending a slot
    @contextlib.contextmanager
    def _sending(self, seg: Segment, slot: int, generation: int) -> Iterator[bool]:
        """Flags the slot FLAG_SENDING while it is sent (no snapshot overwrites it); yields False when it no
        longer holds ``generation``."""
        lock = SharedLock(lock_path(self.job_dir, seg.local_rank))
        with lock:
            h = seg.header(slot)
            ok = h.state == COMPLETE and h.generation == generation
            mine = ok and not h.flags & FLAG_SENDING
            if mine:
                seg.set_flags(slot, h.flags | FLAG_SENDING)
        try:
            yield ok
        finally:
            if mine:
                with lock:
                    h = seg.header(slot)
                    if h.generation == generation:
                        seg.set_flags(slot, h.flags & ~FLAG_SENDING)

    @staticmethod
    def _slot_frame(seg: Segment, h: SlotHeader) -> dict[str, Any]:
        return {"rank": -1 if h.rank is None else h.rank, "world": h.world, "step": h.step, "seq": h.seq,
                "wall_time": h.wall_time, "meta_len": h.meta_len, "meta_xxh": h.meta_xxh, "tensor_bytes": h.tensor_bytes,
                "blob_len": h.blob_len, "meta_cap": seg.meta_cap, "data_cap": seg.data_cap}

    def _send_slot(self, conn: socket.socket, seg: Segment, slot: int, h: SlotHeader, head: dict[str, Any],
                   pacer: Pacer | None) -> None:
        """The header frame ``head``, the slot's metadata and data (sendfile), and whether the slot was
        intact throughout."""
        send_msg(conn, {**head, **self._slot_frame(seg, h)})
        fd = os.open(seg.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            send_range(conn, fd, seg.meta_off(slot), h.meta_len, pacer)
            send_range(conn, fd, seg.data_off(slot), h.tensor_bytes + h.blob_len, pacer)
        finally:
            os.close(fd)
        send_msg(conn, {"intact": seg.header(slot).generation == h.generation})

    def _send_held(self, conn: socket.socket, rank: int, step: int, world: int = 0) -> None:
        found = self.pool.find_held(rank, step, world)
        if found is None:
            send_msg(conn, {"ok": False, "error": f"no snapshot of step {step} of rank {rank} here"})
            return
        _kind, seg, slot, h = found
        with self._sending(seg, slot, h.generation) as ok:
            if not ok:
                send_msg(conn, {"ok": False, "error": f"the snapshot of step {step} was overwritten meanwhile"})
                return
            t0 = time.perf_counter()
            self._send_slot(conn, seg, slot, h, {"ok": True}, None)
        self.state.note("replica_fetch_sent", rank=rank, step=step, bytes=h.tensor_bytes + h.blob_len,
                        seconds=time.perf_counter() - t0)

    # ------------------------------------------------------------------ receiving a slot
    def _receive_slot(self, conn: socket.socket, hdr: dict[str, Any], seg: Segment, slot: int, *, seq: int,
                      lock: SharedLock, flags: int = 0) -> bool:
        """Receives the slot image announced by ``hdr`` into ``slot`` of ``seg`` (claimed WRITING here), and
        marks it COMPLETE (with ``flags``) only when whole and intact; True when it did."""
        meta_len, nbytes = int(hdr["meta_len"]), int(hdr["tensor_bytes"]) + int(hdr["blob_len"])
        if meta_len > seg.meta_cap or nbytes > seg.data_cap:
            raise E.ProtocolError(f"a slot image of {meta_len}+{nbytes} bytes does not fit {seg.path}")
        with lock:
            gen = seg.header(slot).generation + 1
            seg.write_header(slot, SlotHeader(WRITING, 0, int(hdr["step"]), gen, 0, 0, 0, 0, 0.0, seq, 0))
        ok = False
        try:
            view = memoryview(seg.mm)
            try:
                recv_into(conn, view[seg.meta_off(slot): seg.meta_off(slot) + meta_len])
                recv_into(conn, view[seg.data_off(slot): seg.data_off(slot) + nbytes])
                meta_ok = xxhash.xxh64_intdigest(view[seg.meta_off(slot): seg.meta_off(slot) + meta_len]) == \
                    int(hdr["meta_xxh"])
            finally:
                view.release()
            ok = bool(recv_msg(conn).get("intact")) and meta_ok
            return ok
        finally:
            rank = int(hdr["rank"])
            with lock:
                if ok:
                    seg.write_header(slot, SlotHeader(COMPLETE, flags, int(hdr["step"]), gen, meta_len, int(hdr["meta_xxh"]),
                                                      int(hdr["tensor_bytes"]), int(hdr["blob_len"]),
                                                      float(hdr["wall_time"]), seq, rank + 1 if rank >= 0 else 0,
                                                      int(hdr.get("world", 0))))
                elif seg.header(slot).generation == gen:
                    seg.write_header(slot, SlotHeader(EMPTY, 0, -1, gen, 0, 0, 0, 0, 0.0, seq, 0))

    def _receive_backup(self, rep: Replica, conn: socket.socket, hdr: dict[str, Any]) -> None:
        rank = int(hdr["rank"])
        nbytes = int(hdr["meta_len"]) + int(hdr["tensor_bytes"]) + int(hdr["blob_len"])
        with rep.lock:
            try:
                seg = self.pool.backup_segment(rank, int(hdr["meta_cap"]), int(hdr["data_cap"]), int(hdr["step"]))
            except E.SharedMemoryError as e:
                seg, error = None, str(e)
            slot = None
            if seg is not None:
                lock = SharedLock(lock_path(self.job_dir, seg.local_rank))
                with lock:
                    hs = [seg.header(i) for i in range(seg.nslots)]
                    done = [i for i, h in enumerate(hs) if h.state == COMPLETE]
                    newest = max(done, key=lambda i: hs[i].seq) if done else -1
                    free = [i for i, h in enumerate(hs) if i != newest and not h.flags & FLAGS_BUSY]
                    slot = free[0] if free else None
                    error = "every backup slot is busy (being persisted or sent)"
        if seg is None or slot is None:
            self._drain(conn, nbytes)
            send_msg(conn, {"ok": False, "error": error})
            return
        t0 = time.perf_counter()
        ok = self._receive_slot(conn, hdr, seg, slot, seq=int(hdr["seq"]), lock=lock)
        if ok:
            self.pool.reap_backups(rank)
        send_msg(conn, {"ok": ok, "error": "" if ok else "the snapshot changed while it was sent"})
        self.state.note("backup_received", rank=rank, step=int(hdr["step"]), bytes=nbytes,
                        seconds=time.perf_counter() - t0, ok=ok)

    @staticmethod
    def _drain(conn: socket.socket, nbytes: int) -> None:
        buf = bytearray(1 << 20)
        while nbytes > 0:
            k = conn.recv_into(buf, min(nbytes, len(buf)))
            if k == 0:
                raise PeerClosed("the peer closed the connection mid-transfer")
            nbytes -= k
        recv_msg(conn)  # the trailer

    # ------------------------------------------------------------------ sending backups
    def _backup_sender(self, rep: Replica) -> None:
        """After each memory snapshot of a local rank, sends it to the partners (sharded state only)."""
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.knobs.persist_nice)
        while not self.state.stop.wait(0.02):
            if rep.replicated:
                continue
            for lr in own_local_ranks(self.job_dir):
                try:
                    segs = [self.pool.segment(p) for _e, p in segment_paths(self.job_dir, lr)]
                    live = live_snapshots(segs)
                except (OSError, E.FlashCheckpointError):
                    continue
                if not live:
                    continue
                seg, slot, h = live[0]
                key = (seg.path, slot, h.generation)
                if rep.sent.get(lr) == key or h.rank is None:
                    continue
                if h.rank != rep.ranks.get(lr) or h.flags & FLAG_FETCHED:
                    # a previous rank's snapshot (ranks moved at a restart) or a copy fetched from a peer: not
                    # this trainer's; the peers hold them already, and a restore may be reading them right now
                    rep.sent[lr] = key
                    continue
                rep.sent[lr] = key
                self._send_backup(rep, seg, slot, h)

    def _send_backup(self, rep: Replica, seg: Segment, slot: int, h: SlotHeader) -> None:
        targets = partners(rep.node, rep.nnodes, rep.knobs.group_size, rep.knobs.stride)
        if not targets:
            return
        book = rep.book.read()
        with self._sending(seg, slot, h.generation) as ok:
            if not ok:
                return
            for node in targets:
                t0 = time.perf_counter()
                try:
                    conn = self._partner(rep, node, book)
                    self._send_slot(conn, seg, slot, h, {"op": "push"}, Pacer(rep.knobs.mbps))
                    reply = recv_msg(conn)
                except (OSError, E.FlashCheckpointError, ValueError) as e:
                    old = rep.conns.pop(node, None)
                    if old is not None:
                        old[1].close()
                    if node not in rep.unreachable:
                        rep.unreachable.add(node)
                        log.warning("backup of rank %s step %d to node %d failed: %s (retried with the next "
                                    "snapshot)", h.rank, h.step, node, e)
                    continue
                rep.unreachable.discard(node)
                dt = time.perf_counter() - t0
                rep.sent_bytes += h.tensor_bytes + h.blob_len
                rep.send_seconds += dt
                if reply.get("ok"):
                    self.state.note("backup_sent", rank=h.rank, step=h.step, node=node,
                                    bytes=h.tensor_bytes + h.blob_len, seconds=dt)
                else:
                    log.warning("node %d did not keep the backup of rank %s step %d: %s", node, h.rank, h.step,
                                reply.get("error"))

    def _partner(self, rep: Replica, node: int, book: dict[int, dict[str, Any]]) -> socket.socket:
        entry = book.get(node)
        if entry is None:
            raise E.SaverError(f"node {node} has not published its saver's address yet")
        cached = rep.conns.get(node)
        if cached is not None:
            if cached[0] == entry.get("instance"):
                return cached[1]
            cached[1].close()  # another saver is node ``node`` now (a fresh node, or ranks that moved)
        conn = connect(str(entry["host"]), int(entry["port"]), rep.secret, timeout=rep.knobs.loss_s)
        conn.settimeout(max(30.0, rep.knobs.loss_s))
        rep.conns[node] = (str(entry.get("instance")), conn)
        return conn

    # ------------------------------------------------------------------ fetching a lost node's snapshot
    def fetch(self, req: M.Fetch) -> M.FetchReply:
        """Fetches a snapshot a restarted trainer needs from the first of ``req.sources`` (peers) that sends it
        whole, into a new segment of its local rank (flagged FLAG_FETCHED)."""
        rep = self.rep
        if rep is None:
            raise E.SaverError("fetch: this saver has no peer service (a single-node job)")
        errors = []
        for src in req.sources:
            t0 = time.perf_counter()
            try:
                conn = connect(str(src["host"]), int(src["port"]), rep.secret, timeout=rep.knobs.loss_s)
            except (OSError, E.FlashCheckpointError) as e:
                errors.append(f"{src.get('host')}:{src.get('port')}: {e}")
                continue
            try:
                conn.settimeout(max(30.0, rep.knobs.loss_s))
                send_msg(conn, {"op": "fetch", "rank": req.rank, "step": req.step, "world": req.world})
                hdr = recv_msg(conn)
                if not hdr.get("ok"):
                    errors.append(f"{src.get('host')}:{src.get('port')}: {hdr.get('error')}")
                    continue
                path = self.pool.alloc(req.local_rank, int(hdr["meta_cap"]), int(hdr["data_cap"]), self.knobs.slots)
                seg = self.pool.segment(path)
                lock = SharedLock(lock_path(self.job_dir, req.local_rank))
                with lock:
                    seq = 1 + max((seg2.header(i).seq for _e, p in segment_paths(self.job_dir, req.local_rank)
                                   for seg2 in [self.pool.segment(p)] for i in range(seg2.nslots)), default=0)
                if self._receive_slot(conn, hdr, seg, 0, seq=seq, lock=lock, flags=FLAG_FETCHED):
                    nbytes = int(hdr["tensor_bytes"]) + int(hdr["blob_len"])
                    dt = time.perf_counter() - t0
                    self.state.note("replica_fetch", rank=req.rank, step=req.step, local_rank=req.local_rank,
                                    bytes=nbytes, seconds=dt, peer=f"{src.get('host')}:{src.get('port')}")
                    return M.FetchReply(path=path, nbytes=nbytes, seconds=dt)
                errors.append(f"{src.get('host')}:{src.get('port')}: the snapshot changed while it was sent")
            except (OSError, ValueError, KeyError, E.FlashCheckpointError) as e:
                errors.append(f"{src.get('host')}:{src.get('port')}: {e}")
            finally:
                conn.close()
        raise E.SaverError(f"fetch of step {req.step} of rank {req.rank}: no source could send it ({'; '.join(errors)})")

    # ------------------------------------------------------------------ persisting for a lost node
