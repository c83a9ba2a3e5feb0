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
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import xxhash
from flashckpt import errors as E
from flashckpt.commit.protocol import commit_spec
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
    local_ranks,
    lock_path,
    segment_paths,
)
from flashckpt.saver._base import SaverBase, log
from flashckpt.transport import messages as M
from flashckpt.transport.ipc import SharedLock
from flashckpt.transport.peers import (
    Pacer,
    PeerBook,
    ReplicaKnobs,
    accept,
    across_nodes,
    advertised_host,
    connect,
    partners,
    recv_into,
    send_range,
    takes_over_rank0,
)
from flashckpt.transport.wire import PeerClosed, recv_msg, send_msg

__all__ = ["ReplicaPart", "BACKUP_BASE", "backup_paths"]

#: A backup segment's local-rank field (and lock): BACKUP_BASE + the global rank it backs up.
BACKUP_BASE = 100_000
_BAK_RE = re.compile(r"bak-r(\d+)-e(\d+)\.shm$")


def backup_paths(job_dir: str) -> dict[int, list[tuple[int, str]]]:
    """rank -> (epoch, path) of its backup segments in ``job_dir``, oldest first."""
    out: dict[int, list[tuple[int, str]]] = {}
    try:
        names = os.listdir(job_dir)
    except FileNotFoundError:
        return out
    for name in names:
        m = _BAK_RE.match(name)
        if m:
            out.setdefault(int(m.group(1)), []).append((int(m.group(2)), os.path.join(job_dir, name)))
    return {r: sorted(v) for r, v in out.items()}


own_local_ranks = local_ranks  # the local ranks with segments of their own here (not backups)


@dataclass
class _Replica:
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


class ReplicaPart(SaverBase):
    _rep: _Replica | None

    # ------------------------------------------------------------------ start
    def _replica_hello(self, req: M.Hello) -> None:
        """Starts the peer service at the first hello of a multi-node job, and publishes the ranks served."""
        nnodes = max(1, req.world_size // max(1, req.local_world_size))
        if nnodes < 2:
            return
        node = req.rank // max(1, req.local_world_size)
        moved_from = None
        with self._cv:
            rep = self._rep
            if rep is None:
                rep = self._rep = self._start_replica(node, nnodes)
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

    def _start_replica(self, node: int, nnodes: int) -> _Replica:
        knobs = ReplicaKnobs.from_env()
        book = PeerBook(self.storage, self.layout.meta, self.layout.job)
        host = advertised_host(knobs)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        lsock = socket.socket(family, socket.SOCK_STREAM)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((host, 0))
        lsock.listen(64)
        rep = _Replica(knobs, book, book.secret(), node, nnodes, host, lsock, lsock.getsockname()[1])
        self._spawn(self._peer_accept_loop, "peer-accept", rep)
        if knobs.mode != "off":
            self._spawn(self._backup_sender, "backup-send", rep)
        log.info("event=replica node=%d nnodes=%d peer=%s:%d partners=%s mbps=%s", node, nnodes, host, rep.port,
                 partners(node, nnodes, knobs.group_size, knobs.stride) if knobs.mode != "off" else "off",
                 knobs.mbps or "uncapped")
        return rep

    def _publish(self) -> None:
        rep = self._rep
        if rep is None:
            return
        try:
            rep.book.publish(rep.node, {"host": rep.host, "port": rep.port, "instance": rep.instance,
                                        "ranks": sorted(rep.ranks.values()), "pid": os.getpid(), "t": time.time()})
        except OSError as e:
            log.error("could not publish this saver's peer address in %s: %s", rep.book.dir, e)

    def _stop_replica(self) -> None:
        rep = self._rep
        if rep is None:
            return
        for _inst, conn in list(rep.conns.values()):
            conn.close()
        with contextlib.suppress(OSError):
            rep.listener.shutdown(socket.SHUT_RDWR)
        rep.listener.close()

    # ------------------------------------------------------------------ what this node holds
    def _held(self) -> Iterator[tuple[str, int, Segment, int, SlotHeader]]:
        """(kind, local rank, segment, slot, header) of every live snapshot here: own ("own", by local rank)
        and backups ("backup", local rank -1)."""
        for lr in own_local_ranks(self.job_dir):
            segs = [self._segment(p) for _e, p in segment_paths(self.job_dir, lr)]
            for seg, i, h in live_snapshots(segs):
                yield "own", lr, seg, i, h
        for _rank, paths in backup_paths(self.job_dir).items():
            segs = [self._segment(p) for _e, p in paths]
            for seg, i, h in live_snapshots(segs):
                yield "backup", -1, seg, i, h

    def _inventory(self) -> M.InventoryReply:
        rep = self._rep
        held = []
        for kind, lr, _seg, _i, h in self._held():
            held.append({"rank": -1 if h.rank is None else h.rank, "step": h.step, "wall_time": h.wall_time,
                         "seq": h.seq, "kind": kind, "local_rank": lr, "fetched": bool(h.flags & FLAG_FETCHED),
                         "world": h.world})
        with self._cv:
            persisting = [[s, r] for s, st in self._steps.items() for r in st.ranks if st.status != "failed"]
        if rep is None:
            return M.InventoryReply(held=held, persisting=persisting)
        return M.InventoryReply(node=rep.node, instance=rep.instance, host=rep.host, port=rep.port, held=held,
                                persisting=persisting)

    def _find_held(self, rank: int, step: int) -> tuple[str, Segment, int, SlotHeader] | None:
        """The newest live snapshot of ``step`` of ``rank`` held here (any rank's with -1), own ones first."""
        best = None
        for kind, _lr, seg, i, h in self._held():
            if h.step == step and (rank < 0 or h.rank == rank):
                key = (kind == "own", h.seq)
                if best is None or key > best[0]:
                    best = (key, (kind, seg, i, h))
        return None if best is None else best[1]

    # ------------------------------------------------------------------ peer service
    def _peer_accept_loop(self, rep: _Replica) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                conn, _addr = rep.listener.accept()
            except OSError:
                return
            n += 1
            self._spawn(self._serve_peer, f"peer{n}", rep, conn)

    def _serve_peer(self, rep: _Replica, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not accept(conn, rep.secret, timeout=rep.knobs.loss_s * 5):
                log.warning("refused a peer connection without this job's secret")
                return
            conn.settimeout(None)
            niced = False
            while not self._stop.is_set():
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
                    self._send_held(conn, int(req["rank"]), int(req["step"]))
                elif op == "inventory":
                    send_msg(conn, {"ok": True, **self._inventory().to_wire()})
                elif op == "persist_held":
                    send_msg(conn, {"ok": True, "ranks": self._persist_held(int(req["step"]),
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

    def _send_held(self, conn: socket.socket, rank: int, step: int) -> None:
        found = self._find_held(rank, step)
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
        log.info("event=replica_fetch_sent rank=%d step=%d bytes=%d seconds=%.3f", rank, step,
                 h.tensor_bytes + h.blob_len, time.perf_counter() - t0)

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

    def _backup_segment(self, rep: _Replica, rank: int, meta_cap: int, data_cap: int, step: int) -> Segment:
        """The newest backup segment of ``rank``, made (a new epoch) when there is none or it is too small
        (room made, if need be, from backups of ranks whose newest backup is older than ``step``: after a
        restart that moved the ranks, those of ranks no partner serves any more)."""
        paths = backup_paths(self.job_dir).get(rank, [])
        if paths:
            seg = self._segment(paths[-1][1])
            if seg.meta_cap >= meta_cap and seg.data_cap >= data_cap:
                return seg
        epoch = paths[-1][0] + 1 if paths else 0
        path = os.path.join(self.job_dir, f"bak-r{rank:05d}-e{epoch:06d}.shm")
        need = 4096 + 2 * (4096 + meta_cap + data_cap)
        if need > self._shm_free() and self._drop_backups(need, keep=rank, older_than=step) < need:
            raise E.SharedMemoryError(f"no room in {self.job_dir} for a backup of rank {rank} ({need} bytes)")
        Segment.create(path, local_rank=BACKUP_BASE + rank, epoch=epoch, nslots=2, meta_cap=meta_cap,
                       data_cap=data_cap)
        seg = self._segments[path] = Segment(path, populate=False)
        log.info("event=backup_segment rank=%d path=%s bytes=%d", rank, path, need)
        return seg

    def _receive_backup(self, rep: _Replica, conn: socket.socket, hdr: dict[str, Any]) -> None:
        rank = int(hdr["rank"])
        nbytes = int(hdr["meta_len"]) + int(hdr["tensor_bytes"]) + int(hdr["blob_len"])
        with rep.lock:
            try:
                seg = self._backup_segment(rep, rank, int(hdr["meta_cap"]), int(hdr["data_cap"]), int(hdr["step"]))
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
            self._reap_backups(rank)
        send_msg(conn, {"ok": ok, "error": "" if ok else "the snapshot changed while it was sent"})
        log.info("event=backup_received rank=%d step=%d bytes=%d seconds=%.3f ok=%s", rank, int(hdr["step"]),
                  nbytes, time.perf_counter() - t0, ok)

    @staticmethod
    def _drain(conn: socket.socket, nbytes: int) -> None:
        buf = bytearray(1 << 20)
        while nbytes > 0:
            k = conn.recv_into(buf, min(nbytes, len(buf)))
            if k == 0:
                raise PeerClosed("the peer closed the connection mid-transfer")
            nbytes -= k
        recv_msg(conn)  # the trailer

    def _drop_backups(self, need: int, *, keep: int = -1, older_than: int | None = None) -> int:
        """Removes backup segments until ``need`` bytes of shared memory are free: those whose newest backup
        is the oldest first, never one being persisted or sent, nor ``keep``'s; with ``older_than``, only
        those whose newest backup is of an older step. Returns the bytes free. (A node's own snapshots come
        before second copies of its partners': a backup dropped costs redundancy, not a checkpoint.)"""
        free = self._shm_free()
        found = []
        for rank, paths in backup_paths(self.job_dir).items():
            if rank == keep:
                continue
            for _epoch, path in paths:
                seg = self._segment(path)
                newest = max((h for h in (seg.header(i) for i in range(seg.nslots)) if h.state == COMPLETE),
                             key=lambda h: h.seq, default=None)
                if older_than is None or newest is None or newest.step < older_than:
                    found.append((-1 if newest is None else newest.seq, rank, path, seg))
        for _seq, rank, path, seg in sorted(found, key=lambda f: f[0]):
            if free >= need:
                break
            with SharedLock(lock_path(self.job_dir, seg.local_rank)):
                if any(h.flags & FLAGS_BUSY or h.state == WRITING for h in (seg.header(i) for i in range(seg.nslots))):
                    continue  # being persisted, sent or received
                os.unlink(path)
                with contextlib.suppress(BufferError):  # a receive that just chose it: it fails, the sender retries
                    self._segments.pop(path).close()
            if older_than is not None:  # e.g. a rank that moved to another node at a restart
                log.info("event=backup_dropped rank=%d path=%s: older than step %d, whose backup needs the room",
                         rank, path, older_than)
            else:
                log.warning("event=backup_dropped rank=%d path=%s: shared memory is short, and this node's own "
                            "snapshots come first (a loss of rank %d's node now resumes from its other copies or "
                            "from storage)", rank, path, rank)
            free = self._shm_free()
        return free

    def _reap_backups(self, rank: int) -> None:
        """Removes a rank's older backup segments once the newest holds a complete backup."""
        paths = backup_paths(self.job_dir).get(rank, [])
        for _epoch, path in paths[:-1]:
            seg = self._segment(path)
            with SharedLock(lock_path(self.job_dir, seg.local_rank)):
                if any(seg.header(i).flags & FLAGS_BUSY for i in range(seg.nslots)):
                    continue
                os.unlink(path)
                self._segments.pop(path).close()

    # ------------------------------------------------------------------ sending backups
    def _backup_sender(self, rep: _Replica) -> None:
        """After each memory snapshot of a local rank, sends it to the partners (sharded state only)."""
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.knobs.persist_nice)
        while not self._stop.wait(0.02):
            if rep.replicated:
                continue
            for lr in own_local_ranks(self.job_dir):
                try:
                    segs = [self._segment(p) for _e, p in segment_paths(self.job_dir, lr)]
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

    def _send_backup(self, rep: _Replica, seg: Segment, slot: int, h: SlotHeader) -> None:
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
                    log.info("event=backup_sent rank=%s step=%d node=%d bytes=%d seconds=%.3f", h.rank, h.step,
                             node, h.tensor_bytes + h.blob_len, dt)
                else:
                    log.warning("node %d did not keep the backup of rank %s step %d: %s", node, h.rank, h.step,
                                reply.get("error"))

    def _partner(self, rep: _Replica, node: int, book: dict[int, dict[str, Any]]) -> socket.socket:
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
    def _fetch(self, req: M.Fetch) -> M.FetchReply:
        rep = self._rep
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
                send_msg(conn, {"op": "fetch", "rank": req.rank, "step": req.step})
                hdr = recv_msg(conn)
                if not hdr.get("ok"):
                    errors.append(f"{src.get('host')}:{src.get('port')}: {hdr.get('error')}")
                    continue
                path = self._alloc(req.local_rank, int(hdr["meta_cap"]), int(hdr["data_cap"]), self.knobs.slots)
                seg = self._segment(path)
                lock = SharedLock(lock_path(self.job_dir, req.local_rank))
                with lock:
                    seq = 1 + max((seg2.header(i).seq for _e, p in segment_paths(self.job_dir, req.local_rank)
                                   for seg2 in [self._segment(p)] for i in range(seg2.nslots)), default=0)
                if self._receive_slot(conn, hdr, seg, 0, seq=seq, lock=lock, flags=FLAG_FETCHED):
                    nbytes = int(hdr["tensor_bytes"]) + int(hdr["blob_len"])
                    dt = time.perf_counter() - t0
                    log.info("event=replica_fetch rank=%d step=%d local_rank=%d bytes=%d seconds=%.3f from=%s:%s",
                             req.rank, req.step, req.local_rank, nbytes, dt, src.get("host"), src.get("port"))
                    return M.FetchReply(path=path, nbytes=nbytes, seconds=dt)
                errors.append(f"{src.get('host')}:{src.get('port')}: the snapshot changed while it was sent")
            except (OSError, ValueError, KeyError, E.FlashCheckpointError) as e:
                errors.append(f"{src.get('host')}:{src.get('port')}: {e}")
            finally:
                conn.close()
        raise E.SaverError(f"fetch of step {req.step} of rank {req.rank}: no source could send it ({'; '.join(errors)})")

    # ------------------------------------------------------------------ persisting for a lost node
    def _persist_held(self, step: int, ranks: list[int]) -> list[int]:
        """Persists what this node holds of ``step`` for ``ranks`` (own snapshots first, then backups), unless
        this saver already writes it; returns the ranks it writes (now or already)."""
        out = []
        with self._last_words_lock:
            for rank in ranks:
                with self._cv:
                    st = self._steps.get(step)
                    if st is not None and rank in st.ranks and st.status != "failed":
                        out.append(rank)
                        continue
                kind = self._persist_held_copy(rank, step, rank)
                if kind is None:
                    continue
                log.warning("event=persist_held step=%d rank=%d from=%s", step, rank, kind)
                out.append(rank)
        return out

    def _persist_held_copy(self, rank: int, step: int, find: int, commit: dict[str, Any] | None = None) -> str | None:
        """Queues the persist of ``step`` for ``rank`` from the copy held here of ``find``'s snapshot (-1: any
        rank's), with ``commit`` when given; its kind ("own", "backup"), or None when there is no such copy
        (or it was overwritten, or names no path). The caller holds ``_last_words_lock``."""
        found = self._find_held(find, step)
        if found is None:
            return None
        kind, seg, slot, h = found
        try:
            name = str(seg.read_meta(slot, h).get("name", ""))
        except (E.FlashCheckpointError, ValueError):
            return None
        if not name:
            return None
        job = M.Persist(step=step, rank=rank, local_rank=seg.local_rank, seg_path=seg.path, slot=slot,
                        generation=h.generation, path=name, commit=commit)
        if not self._hold_slot(job):
            return None
        try:
            self._enqueue(job)
        except BaseException:
            self._unhold_slot(job)
            raise
        return kind

    def _ask_peers(self, rep: _Replica, msg: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """``msg``'s reply from every other peer in the book that answers within the loss bound."""
        replies: dict[int, dict[str, Any]] = {}

        def ask(node: int, entry: dict[str, Any]) -> None:
            try:
                conn = connect(str(entry["host"]), int(entry["port"]), rep.secret, timeout=rep.knobs.loss_s)
            except (OSError, E.FlashCheckpointError):
                return
            try:
                conn.settimeout(rep.knobs.loss_s * 2)
                send_msg(conn, msg)
                replies[node] = recv_msg(conn)
            except (OSError, E.FlashCheckpointError):
                pass
            finally:
                conn.close()

        entries: dict[str, tuple[int, dict[str, Any]]] = {}  # one question per saver (an entry may be stale)
        for n, e in sorted(rep.book.read().items()):
            if e.get("instance") != rep.instance:
                entries[str(e.get("instance"))] = (n, e)
        threads = [threading.Thread(target=ask, args=ne, daemon=True) for ne in entries.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(rep.knobs.loss_s * 3 + 1)
        return replies

    def _recover_missing(self, step: int, missing: list[int]) -> list[int]:
        """A commit of ``step`` has waited the loss bound for ``missing`` ranks: has someone write them.

        Each missing rank is persisted by whoever holds it: its own node's saver (alive, or a fresh one that
        fetched it) or else a backup holder, this saver included. Returns the ranks that nobody writes and
        nobody holds: lost with their node and without a backup."""
        rep = self._rep
        if rep is None:
            return []
        invs = [*self._ask_peers(rep, {"op": "inventory"}).values(), {**self._inventory().to_wire(), "self": True}]
        covered = {int(r) for inv in invs for s, r in inv.get("persisting", []) if s == step}
        holders: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}  # rank -> (preference, node, inventory)
        for inv in invs:
            for e in inv.get("held", []):
                if e.get("step") == step and e.get("rank") in missing:
                    pref = 0 if e.get("kind") == "own" else 1
                    holders.setdefault(int(e["rank"]), []).append((pref, int(inv.get("node", -1)), inv))
        todo: dict[str, tuple[dict[str, Any], list[int]]] = {}  # instance -> (its inventory, ranks to write)
        lost = []
        for r in missing:
            if r in covered:
                continue
            if r not in holders:
                lost.append(r)
                continue
            inv = min(holders[r], key=lambda h: h[:2])[2]
            todo.setdefault(str(inv.get("instance")), (inv, []))[1].append(r)
        for inv, ranks in todo.values():
            if inv.get("self"):
                self._persist_held(step, ranks)
                continue
            try:
                conn = connect(str(inv["host"]), int(inv["port"]), rep.secret, timeout=rep.knobs.loss_s)
                try:
                    conn.settimeout(rep.knobs.loss_s * 2)
                    send_msg(conn, {"op": "persist_held", "step": step, "ranks": ranks})
                    log.warning("event=persist_held_asked step=%d ranks=%s node=%s answer=%s", step, ranks,
                                inv.get("node"), recv_msg(conn).get("ranks"))
                finally:
                    conn.close()
            except (OSError, KeyError, E.FlashCheckpointError) as e:
                log.warning("asking node %s to persist ranks %s of step %d: %s", inv.get("node"), ranks, step, e)
        return lost

    # ------------------------------------------------------------------ last words for a lost rank 0
    def _newest_across_nodes(self) -> tuple[int | None, list[dict[str, Any]]]:
        """The newest step of a multi-node job that every rank can get from memory, its own node's or a
        peer's (``across_nodes`` over every answering saver's inventory), and those peers' inventories; None
        in a single-node job, and when there is none (a rank lost with its whole backup group, or peers that
        no longer answer after a normal end: then each node persists its own newest, as a single node does)."""
        rep = self._rep
        if rep is None or rep.world_size < 2:
            return None, []
        with self._cv:
            newest_committed = self._committed[-1] if self._committed else -1
        peers = list(self._ask_peers(rep, {"op": "inventory"}).values())
        invs = [*peers, self._inventory().to_wire()]
        plan = across_nodes(invs, list(range(rep.world_size)), replicated=rep.replicated,
                            saved_at=self._saved_at(newest_committed), newest_committed=newest_committed,
                            world_size=rep.world_size)
        if plan.step is None:
            if plan.partial is not None:
                log.warning("last words: step %d is in memory, but no saver that answered holds ranks %s (lost "
                            "with their node and its backup group, or their saver has ended): this node persists "
                            "its own newest snapshot, which commits only if their files come", plan.partial,
                            list(plan.missing))
            return None, peers
        return plan.step, peers

    def _take_over_commit(self, timeout: float | None, limit: int | None, peers: list[dict[str, Any]]) -> int | None:
        """Last words on a node whose saver does not commit (global rank 0 was elsewhere): when rank 0's own
        saver is gone (its node lost), the survivor that holds rank 0's newest snapshot (sharded state: a
        backup of it; replicated state: its own copy), the lowest-numbered if several do, persists it with the
        commit, so the newest step is committed as well. The commit then has the lost node's other ranks
        written by whoever holds them (``_recover_missing``). Waits for the commit; returns its step, or None
        when there is nothing to take over (``takes_over_rank0``, over ``peers``: the inventories that chose
        ``limit``; a rank 0 saver alive shows its own snapshot there, whenever its last words start)."""
        rep = self._rep
        with self._cv:
            newest_committed = self._committed[-1] if self._committed else -1
        if rep is None or limit is None:
            return None
        step = limit  # the newest step every rank can get: the one the survivors persist
        if step == newest_committed:
            return None
        if not takes_over_rank0(step, self._inventory().to_wire(), peers, node=rep.node, replicated=rep.replicated):
            return None
        with self._last_words_lock:  # once, when last words are asked twice (a crash seen here and by the agent)
            with self._cv:
                st = self._steps.get(step)
                queued = st is not None and 0 in st.ranks and st.commits_here and st.status != "failed"
            if not queued:
                kind = self._persist_held_copy(0, step, -1 if rep.replicated else 0,
                                               commit_spec(rep.world_size, rep.replicated))
                if kind is None:
                    return None
                log.warning("event=last_words_for_rank0 step=%d from=%s: global rank 0's saver is gone; this "
                            "survivor commits the step", step, kind)
        self._wait_step(step, timeout)
        return step
