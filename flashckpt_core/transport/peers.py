"""The cross-node memory replica's shared pieces: backup groups, the peer book, and the wire between savers.

Torch-free: the saver uses it as it is. The saver's side (serving peers, sending backups, fetching a lost
node's shards) is ``saver/replica``; the trainer's side (which node holds what, at load) is ``agreement``.

**Groups.** Nodes are numbered ``rank // local_world_size``. With group size ``g`` and stride ``s`` (default
``nnodes // g``), node ``i`` of the block of ``g * s`` consecutive nodes that holds it is grouped with the nodes
``s`` apart from it in that block: pairs by default, nodes ``i`` and ``i + nnodes/2``, so that a group spans the
two halves of the job (two racks, two switches). A node left alone (a job whose node count the block does not
divide) backs up to its neighbour.

**Peers.** Each saver of a multi-node job listens on TCP and publishes where in the peer book, a small JSON
file per node in the job's commit records (``<records>/peers/<job>/node-<i>.json``): host, port, the saver's
instance id and the ranks it serves. The book also holds the job's secret (0600); a connection proves it holds
it (HMAC-SHA256 of the server's nonce) before anything else is said.

**Wire.** JSON frames (``_protocol.send_msg``) for requests and replies; a slot image (metadata, tensor bytes
and blob of one COMPLETE slot) follows its header frame as raw bytes, sent with ``sendfile`` from the segment
file and received straight into the receiving segment's slot.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import select
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flashckpt import errors as E
from flashckpt.config import ReplicaKnobs
from flashckpt.storage import locations
from flashckpt.storage.base import CheckpointStorage
from flashckpt.transport.wire import PeerClosed, recv_msg, send_msg

__all__ = ["ReplicaKnobs", "backup_group", "partners", "PeerBook", "NodePlan", "across_nodes", "takes_over_rank0",
           "ReshardPlan", "reshard_plan", "node_key",
           "connect", "accept", "advertised_host", "Pacer", "send_range", "recv_into"]


def backup_group(node: int, nnodes: int, size: int = 2, stride: int = 0) -> list[int]:
    """The nodes of ``node``'s backup group, itself included, ascending (see the module's doc)."""
    if not 0 <= node < nnodes:
        raise E.InvalidArgumentError(f"backup_group: node {node} is not in 0..{nnodes - 1}")
    size = max(1, min(size, nnodes))
    stride = stride or max(1, nnodes // size)
    block = size * stride
    base = node // block * block
    first = base + (node - base) % stride
    group = [n for n in range(first, base + block, stride) if n < nnodes]
    if len(group) == 1 and nnodes > 1 and size > 1:
        group = sorted({node, (node - 1) % nnodes})
    return group


def partners(node: int, nnodes: int, size: int = 2, stride: int = 0) -> list[int]:
    """The nodes ``node`` sends its backups to: the others of its group."""
    return [n for n in backup_group(node, nnodes, size, stride) if n != node]


def advertised_host(knobs: ReplicaKnobs) -> str:
    """The address this node's peers reach it at (see ``ReplicaKnobs.host``)."""
    if knobs.host:
        return knobs.host
    master = os.environ.get("MASTER_ADDR", "")
    if master:
        try:  # the local address of the route to the rendezvous host: no packet is sent
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT", "29500") or 29500)))
                return str(s.getsockname()[0])
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class PeerBook:
    """Where the savers of one job listen, and the job's secret, in its commit records."""

    def __init__(self, storage: CheckpointStorage, records_dir: str, job: str) -> None:
        self.storage = storage
        self.dir = locations.join(records_dir, "peers", job)

    def _node_path(self, node: int) -> str:
        return locations.join(self.dir, f"node-{node:05d}.json")

    def publish(self, node: int, entry: dict[str, Any]) -> None:
        self.storage.write_bytes(self._node_path(node), json.dumps({**entry, "node": node}).encode())

    def withdraw(self, node: int, instance: str) -> None:
        """Removes ``node``'s entry if it is still the one saver ``instance`` published (it moved to another
        node index; a saver that took the index since keeps its entry)."""
        path = self._node_path(node)
        try:
            if json.loads(self.storage.read_bytes(path)).get("instance") == instance:
                self.storage.remove(path)
        except (OSError, ValueError, AttributeError, E.FlashCheckpointError):
            pass

    def read(self) -> dict[int, dict[str, Any]]:
        """node -> its entry (unreadable entries are left out)."""
        out: dict[int, dict[str, Any]] = {}
        try:
            names = self.storage.listdir(self.dir)
        except (FileNotFoundError, NotADirectoryError):
            return out
        for name in names:
            if not (name.startswith("node-") and name.endswith(".json")):
                continue
            try:
                entry = json.loads(self.storage.read_bytes(locations.join(self.dir, name)))
                if isinstance(entry, dict) and isinstance(entry.get("port"), int):
                    out[int(entry["node"])] = entry
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

    def secret(self) -> bytes:
        """The job's secret, made by the first saver that asks (an atomic create: every saver reads the same)."""
        path = locations.join(self.dir, "secret")
        for _ in range(50):
            try:
                raw = self.storage.read_bytes(path)
                if len(raw) >= 32:
                    return raw
            except FileNotFoundError:
                pass
            local = self.storage.local_path(path)
            try:
                if local is not None:  # made whole and private under a name of its own, then linked (never replaces)
                    os.makedirs(os.path.dirname(local), exist_ok=True)
                    tmp = f"{local}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                    try:
                        os.write(fd, secrets.token_bytes(32))
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    try:
                        os.link(tmp, local)
                    finally:
                        os.unlink(tmp)
                else:
                    self.storage.write_new(path, secrets.token_bytes(32))
            except (FileExistsError, E.AlreadyExistsError):
                pass
            except (OSError, E.FlashCheckpointError):  # a racing writer of an object store: read what won
                pass
            time.sleep(0.02)
        raise E.SaverError(f"could not read or create the replica secret {path}")


def _mac(secret: bytes, nonce: bytes) -> str:
    return hmac.new(secret, b"flashckpt-replica\0" + nonce, hashlib.sha256).hexdigest()


def connect(host: str, port: int, secret: bytes, *, timeout: float) -> socket.socket:
    """A connection to a peer saver that has accepted this side's proof of the job's secret.

    Raises:
        OSError: the peer cannot be reached (or is gone) within ``timeout``.
        SaverError: the peer refused the proof (another job's saver on that port).
    """
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = recv_msg(sock)
        send_msg(sock, {"mac": _mac(secret, bytes.fromhex(str(hello.get("nonce", ""))))})
        answer = recv_msg(sock)
        if not answer.get("ok"):
            raise E.SaverError(f"the saver at {host}:{port} refused this job's secret")
        return sock
    except BaseException:
        sock.close()
        raise


def accept(sock: socket.socket, secret: bytes, *, timeout: float) -> bool:
    """The server's side of ``connect``: whether the peer proved the job's secret."""
    sock.settimeout(timeout)
    nonce = secrets.token_bytes(16)
    send_msg(sock, {"nonce": nonce.hex()})
    ok = hmac.compare_digest(str(recv_msg(sock).get("mac", "")), _mac(secret, nonce))
    send_msg(sock, {"ok": ok})
    return ok


class Pacer:
    """Holds a sender to ``mbps`` MB/s (0: no cap), over windows of ~50 ms."""

    def __init__(self, mbps: float) -> None:
        self.rate = mbps * 1e6
        self.t0 = time.monotonic()
        self.sent = 0

    def chunk(self) -> int:
        return 8 << 20 if not self.rate else max(256 << 10, min(8 << 20, int(self.rate * 0.05)))

    def account(self, n: int) -> None:
        self.sent += n
        if self.rate:
            ahead = self.sent / self.rate - (time.monotonic() - self.t0)
            if ahead > 0:
                time.sleep(ahead)


def send_range(sock: socket.socket, fd: int, offset: int, count: int, pacer: Pacer | None = None) -> None:
    """Sends ``count`` bytes of file ``fd`` from ``offset``: ``sendfile``, the kernel copies from the page
    cache (a tmpfs segment's own pages) into the socket, no user-space copy."""
    end = offset + count
    wait = sock.gettimeout()
    while offset < end:
        n = min(end - offset, pacer.chunk() if pacer else 64 << 20)
        try:
            sent = os.sendfile(sock.fileno(), fd, offset, n)
        except BlockingIOError:  # a socket with a timeout is non-blocking underneath: wait until it drains
            if not select.select([], [sock], [], wait)[1]:
                raise E.CheckpointTimeoutError(f"the peer took no data for {wait} s") from None
            continue
        if sent <= 0:
            raise PeerClosed("the peer stopped receiving")
        offset += sent
        if pacer:
            pacer.account(sent)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fills ``view`` from the socket (into a segment's mapping: one copy, kernel to shared memory)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 64 << 20))
        if k == 0:
            raise PeerClosed("the peer closed the connection mid-transfer")
        got += k


@dataclass(frozen=True)
class NodePlan:
    """The newest step every rank can get from memory across nodes (None: none), where each rank's copy is,
    and the newest step some node holds that not every rank can get (``partial``, for the warning)."""

    step: int | None
    sources: dict[int, list[dict[str, Any]]]  # rank -> holders: node, instance, host, port, kind, local_rank
    partial: int | None = None
    missing: tuple[int, ...] = ()


def node_key(inv: dict[str, Any]) -> str:
    """Which node an inventory is from: its saver instance, else host:port (the same for every rank of a node)."""
    return str(inv.get("instance") or f"{inv.get('host')}:{inv.get('port')}")


def _by_instance(inventories: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The inventories by saver instance (else host:port), the first of each kept: one per node."""
    nodes: dict[str, dict[str, Any]] = {}
    for inv in inventories:
        nodes.setdefault(node_key(inv), inv)
    return nodes


def _usable(e: dict[str, Any], *, replicated: bool, saved_at: dict[str, float], newest_committed: int,
            world_size: int | None) -> bool:
    """Whether held snapshot ``e`` may serve a restore (the rules of ``across_nodes``)."""
    rank, step, t = int(e.get("rank", -1)), int(e.get("step", -1)), float(e.get("wall_time", 0.0))
    if rank < 0 or step < 0:
        return False  # a slot of an older version: whose it is is not recorded
    if world_size and not replicated and int(e.get("world", 0)) != world_size:
        return False  # a rank's state of another number of ranks (or not recorded)
    ref = saved_at.get(str(rank)) if (not replicated or rank == 0) else None
    return not ((t < ref) if ref else (step < newest_committed))


def _copies_by_step(nodes: dict[str, dict[str, Any]], *, replicated: bool, saved_at: dict[str, float],
                    newest_committed: int, world_size: int | None) -> dict[int, dict[int, list[dict[str, Any]]]]:
    """{step: {rank: [holder: node, instance, host, port, kind, local_rank]}} of the usable snapshots that
    the nodes (by instance) hold."""
    avail: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for key, inv in nodes.items():
        for e in inv.get("held", []):
            if not _usable(e, replicated=replicated, saved_at=saved_at, newest_committed=newest_committed,
                           world_size=world_size):
                continue
            avail.setdefault(int(e.get("step", -1)), {}).setdefault(int(e.get("rank", -1)), []).append(
                {"node": inv.get("node", -1), "instance": key, "host": inv.get("host", ""),
                 "port": int(inv.get("port", 0)), "kind": e.get("kind", "own"), "local_rank": e.get("local_rank", -1)})
    return avail


def across_nodes(inventories: Sequence[dict[str, Any]], ranks: Sequence[int], *, replicated: bool,
                 saved_at: dict[str, float], newest_committed: int, world_size: int | None = None) -> NodePlan:
    """Picks, from what every node holds (its saver's ``Inventory`` reply: own snapshots and backups), the
    newest step of which every rank in ``ranks`` has a copy somewhere (replicated state: any copy), not older
    than the newest commit (``saved_at``: rank -> the wall time of the snapshot its committed files came from;
    unknown: a step not lower than ``newest_committed``); with ``world_size``, only copies saved by a job of
    that many ranks (replicated state: any). Pure: the caller gathers the inventories."""
    avail = _copies_by_step(_by_instance(inventories), replicated=replicated, saved_at=saved_at,
                            newest_committed=newest_committed, world_size=world_size)
    need = set(ranks)
    if replicated:
        valid = [s for s, by in avail.items() if by]
    else:
        valid = [s for s, by in avail.items() if need <= set(by)]
    best = max(valid, default=None)
    partial = max(avail, default=None)
    if best is None:
        missing = tuple(sorted(need - set(avail[partial]))) if partial is not None and not replicated else ()
        return NodePlan(None, {}, partial, missing)
    if replicated:
        everyone = [h for hs in avail[best].values() for h in hs]
        return NodePlan(best, {r: everyone for r in ranks}, partial)
    return NodePlan(best, {r: avail[best][r] for r in ranks}, partial)


@dataclass(frozen=True)
class ReshardPlan:
    """A step saved by another number of ranks (``world``) that the nodes' memory holds whole: for every rank
    of that job, the holders of its snapshot of ``step`` (``sources``: rank -> [node, instance, host, port, kind,
    local_rank], the holders of one rank in the order it is best read: own snapshots before backups). ``step``
    None: no such step; then ``partial`` is the newest (world, step) some node holds and ``missing`` the ranks of
    it that no answering node holds."""

    step: int | None
    world: int
    sources: dict[int, list[dict[str, Any]]]
    partial: tuple[int, int] | None = None
    missing: tuple[int, ...] = ()


def reshard_plan(inventories: Sequence[dict[str, Any]], *, world_size: int, newest_committed: int,
                 committed_world: int, saved_at: dict[str, float]) -> ReshardPlan:
    """Picks, from what every node holds (its saver's ``Inventory`` reply), the newest step saved by a job of
    another number of ranks than ``world_size`` of which every rank of that job has a copy on some node, and
    that is not older than the newest commit (``newest_committed``, saved by ``committed_world`` ranks;
    ``saved_at``: its rank -> the wall time of the snapshot its files came from, compared only for a snapshot
    of the same number of ranks, else the step). One step and one number of ranks for every rank's state:
    a rank whose shard no node holds makes the step unusable, never a mix of steps. Pure: the caller gathers
    the inventories."""
    avail: dict[tuple[int, int], dict[int, list[dict[str, Any]]]] = {}
    for key, inv in _by_instance(inventories).items():
        for e in inv.get("held", []):
            rank, step, world = int(e.get("rank", -1)), int(e.get("step", -1)), int(e.get("world", 0))
            if rank < 0 or step < 0 or world <= 0 or world == world_size or rank >= world:
                continue  # unrecorded, this job's own number of ranks (not resharded), or not a rank of it
            ref = saved_at.get(str(rank)) if world == committed_world else None
            if (float(e.get("wall_time", 0.0)) < ref) if ref else (step < newest_committed):
                continue  # older than the newest commit
            avail.setdefault((world, step), {}).setdefault(rank, []).append(
                {"node": inv.get("node", -1), "instance": key, "host": inv.get("host", ""),
                 "port": int(inv.get("port", 0)), "kind": e.get("kind", "own"), "local_rank": e.get("local_rank", -1)})
    whole = [ws for ws, by in avail.items() if set(by) == set(range(ws[0]))]
    if not whole:
        partial = max(avail, key=lambda ws: (ws[1], ws[0]), default=None)
        missing = tuple(sorted(set(range(partial[0])) - set(avail[partial]))) if partial is not None else ()
        return ReshardPlan(None, 0, {}, partial, missing)
    world, step = max(whole, key=lambda ws: (ws[1], ws[0]))
    sources = {r: sorted(hs, key=lambda h: h["kind"] != "own") for r, hs in sorted(avail[(world, step)].items())}
    return ReshardPlan(step, world, sources)


def _rank0_copies(inv: dict[str, Any], replicated: bool) -> set[int]:
    """The steps of which inventory ``inv`` holds a copy of global rank 0's state that its saver may persist
    for rank 0: a backup of rank 0's snapshot; replicated state: a snapshot of its own trainer's (any rank
    holds the whole state), not one fetched from a peer."""
    return {int(e.get("step", -1)) for e in inv.get("held", [])
            if ((e.get("kind") == "own" and not e.get("fetched")) if replicated
                else (e.get("kind") == "backup" and e.get("rank") == 0))}


def takes_over_rank0(step: int, here: dict[str, Any], peers: Sequence[dict[str, Any]], *, node: int,
                     replicated: bool) -> bool:
    """Whether the saver of node ``node`` (inventory ``here``), in its last words, persists and commits
    ``step`` for global rank 0, whose own saver should but may be gone with its node. It does when it holds
    a copy of rank 0's state of ``step`` (``_rank0_copies``), and no answering peer (``peers``: their
    inventories) persists rank 0 of ``step`` or newer, holds rank 0's own snapshot of ``step`` or newer (not
    a fetched copy: then rank 0's saver is alive, and commits in its own last words), or holds a copy too
    under a lower node number (that one takes over). Pure: the caller gathers the inventories."""
    if step not in _rank0_copies(here, replicated):
        return False
    for inv in peers:
        if any(int(s) >= step and int(r) == 0 for s, r in inv.get("persisting", [])):
            return False
        if any(e.get("kind") == "own" and e.get("rank") == 0 and not e.get("fetched") and int(e.get("step", -1)) >= step
               for e in inv.get("held", [])):
            return False
        if step in _rank0_copies(inv, replicated) and int(inv.get("node", -1)) < node:
            return False
    return True
