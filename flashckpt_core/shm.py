"""Shared-memory segments with snapshot slots, and the trainer-side SharedMemoryHandler.

Segment file (one per local rank and allocation epoch, created 0600 by the saver)::

    [0, 4096)            segment header: magic, version, nslots, slot_size, meta_cap, data_cap, local_rank
    slot i at 4096 + i * slot_size:
      [0, 4096)          slot header: state, flags, step, generation, meta_len, meta_xxh64,
                         tensor_bytes, blob_len, wall_time, seq
      [4096, +meta_cap)  metadata (JSON, no pickle)
      [.., +data_cap)    tensor storages (each 64-byte aligned), then the opaque blob

``seq`` orders the snapshots of a local rank by save (it grows across segments and trainer restarts);
"newest" always means the highest ``seq``, never the highest step. A snapshot is superseded once a
later save of the same or a lower step is COMPLETE (the newest save of a step wins, and a lower step
starts a new timeline): readers see only the live ones, ``live_snapshots``.

A trainer never writes the slot holding the newest COMPLETE snapshot (with two or more slots), nor a
slot pinned by the saver (a persist reading it) or pending (a persist requested but not started): so a
kill at any point of a copy leaves the newest complete snapshot intact. The default segment has two
slots plus a spare (``FLAG_UNRESERVED``): its header page exists but its memory is reserved only when
a snapshot finds every other slot busy (one persisting, the other the newest), and given back by the
saver once no persist holds a slot (``Segment.release``); so a snapshot never waits for a persist and
the third slot's memory is held only while a persist runs. When /dev/shm cannot hold it, the snapshot
waits (bounded) for the persist instead and says so in the log. Readers accept a slot only when it is
COMPLETE and its generation is unchanged after the read. Slot flags change only under the segment's
SharedLock.
"""

from __future__ import annotations

import array
import ctypes
import gc
import glob
import json
import logging
import mmap
import os
import re
import stat
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from . import _native
from . import errors as E
from ._copy import Copier
from ._lease import Lease, pid_running, read_holder
from ._tree import (
    Flat,
    SnapshotPlan,
    TensorMeta,
    _key_str,
    _path_to,
    build_tensor,
    contiguous_strides,
    decode_opaque,
    dtype_name,
    encode_opaque,
    flatten,
    flatten_like,
    plan_snapshot,
    signature_of,
    split_opaque,
    tensor_paths,
    tensors_by_path,
    unflatten,
)
from .files import FILES_KEY
from .ipc import SharedLock

__all__ = ["SharedMemoryHandler", "Segment", "SlotHeader", "SlotRef", "Snapshot", "EMPTY", "WRITING", "COMPLETE",
           "FLAG_PINNED", "FLAG_PENDING", "FLAG_UNRESERVED", "live_snapshots", "segment_paths"]

log = logging.getLogger(__name__)

SEG_MAGIC = b"FLCKSEG1"
SEG_VERSION = 1
_SEG_HDR = struct.Struct("<8sIIQQQiq")
_SLOT_HDR = struct.Struct("<IIqQQQQQdQ")  # zeros past wall_time read as seq 0 (older segments)
PAGE = 4096
EMPTY, WRITING, COMPLETE = 0, 1, 2
FLAG_PINNED = 1   # the saver is reading this slot
FLAG_PENDING = 2  # a persist of this slot was requested and has not finished
FLAG_UNRESERVED = 4  # the slot's memory (all but its header page) is not reserved: reserve before writing
_BUSY = FLAG_PINNED | FLAG_PENDING

_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23
_MADV_REMOVE = 9
_SEG_RE = re.compile(r"seg-r(\d+)-e(\d+)\.shm$")


def _page(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def segment_paths(job_dir: str, local_rank: int) -> list[tuple[int, str]]:
    """(epoch, path) of every segment of ``local_rank`` in ``job_dir``, oldest first."""
    out = []
    for p in glob.glob(os.path.join(job_dir, f"seg-r{local_rank:03d}-e*.shm")):
        m = _SEG_RE.search(p)
        if m:
            out.append((int(m.group(2)), p))
    return sorted(out)


def segment_path(job_dir: str, local_rank: int, epoch: int) -> str:
    return os.path.join(job_dir, f"seg-r{local_rank:03d}-e{epoch:06d}.shm")


def lock_path(job_dir: str, local_rank: int) -> str:
    return os.path.join(job_dir, f"seg-r{local_rank:03d}.lock")


def writer_lease_path(job_dir: str, local_rank: int) -> str:
    """The lease the one writer of ``local_rank``'s segments holds (see ``_lease``)."""
    return os.path.join(job_dir, f"writer-r{local_rank:03d}.lease")


@dataclass(frozen=True)
class SlotHeader:
    state: int
    flags: int
    step: int
    generation: int
    meta_len: int
    meta_xxh: int
    tensor_bytes: int
    blob_len: int
    wall_time: float
    seq: int = 0


@dataclass(frozen=True)
class SlotRef:
    """Which slot of which segment holds a snapshot, and at which generation."""

    path: str
    slot: int
    generation: int
    step: int


@dataclass
class Snapshot:
    step: int
    state_dict: Any
    name: str
    nbytes: int


class Segment:
    """A mapped segment file. Both trainers and the saver use it; creation is the saver's. The persist
    worker maps it ``readonly``: it only reads snapshots, and cannot change a slot's header."""

    def __init__(self, path: str, *, populate: bool = True, readonly: bool = False) -> None:
        self.path = path
        fd = os.open(path, (os.O_RDONLY if readonly else os.O_RDWR) | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise E.SharedMemoryError(f"segment {path} is not a regular file of this user (uid {st.st_uid}); "
                                          "set FLASHCKPT_RUNTIME_DIR to a directory of your own")
            size = st.st_size
            if size < PAGE:
                raise E.SharedMemoryError(f"segment {path} is truncated ({size} bytes)")
            # Not MAP_POPULATE: it would fault in (and so allocate) an unreserved spare slot too.
            prot = mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        magic, ver, nslots, slot_size, meta_cap, data_cap, local_rank, epoch = _SEG_HDR.unpack_from(self.mm, 0)
        if magic != SEG_MAGIC or ver != SEG_VERSION:
            self.mm.close()
            raise E.SharedMemoryError(f"{path} is not a flashckpt segment (version {SEG_VERSION})")
        self.nslots, self.slot_size = nslots, slot_size
        self.meta_cap, self.data_cap = meta_cap, data_cap
        self.local_rank, self.epoch = local_rank, epoch
        self.size = size
        # A read-only mapping (the persist worker's) has no writable address to copy into.
        self._cbuf: Any = None
        self.base = 0
        if not readonly:
            self._cbuf = (ctypes.c_char * size).from_buffer(self.mm)
            self.base = ctypes.addressof(self._cbuf)
            if populate:  # map the reserved slots' pages up front, so the first copy does not fault page by page
                self._advise(_MADV_POPULATE_WRITE, 0, PAGE)
                for i in range(nslots):
                    if not self.header(i).flags & FLAG_UNRESERVED:
                        self._advise(_MADV_POPULATE_WRITE, self.slot_off(i), slot_size)

    def _advise(self, advice: int, start: int, length: int) -> None:
        try:
            self.mm.madvise(advice, start, length)
        except (OSError, ValueError, AttributeError):  # best effort (MADV_POPULATE_*: Linux >= 5.14)
            pass

    @staticmethod
    def create(path: str, *, local_rank: int, epoch: int, nslots: int, meta_cap: int, data_cap: int,
               spare: int = 0) -> int:
        """Creates a segment file and reserves its memory (fallocate, so a full /dev/shm fails here,
        not with SIGBUS later), except that of the last ``spare`` slots: only their header pages are
        reserved and they are flagged ``FLAG_UNRESERVED``. Returns the bytes reserved."""
        meta_cap, data_cap = _page(meta_cap), _page(data_cap)
        slot_size = PAGE + meta_cap + data_cap
        size = PAGE + nslots * slot_size
        reserved = size - spare * (slot_size - PAGE)
        # A name of its own: an allocation racing this one never meets its temporary file.
        tmp = f"{path}.{os.getpid()}-{threading.get_native_id()}-{time.monotonic_ns()}.tmp"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise E.SharedMemoryError(f"could not create the segment {path} of local rank {local_rank}: {e}") from e
        try:
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, PAGE + (nslots - spare) * slot_size)
                for i in range(nslots - spare, nslots):
                    os.posix_fallocate(fd, PAGE + i * slot_size, PAGE)
            except OSError as e:
                raise E.SharedMemoryError(
                    f"could not reserve {reserved} bytes of shared memory for local rank {local_rank} in "
                    f"{os.path.dirname(path)} ({e}); free space there or lower the snapshot size") from e
            hdr = _SEG_HDR.pack(SEG_MAGIC, SEG_VERSION, nslots, slot_size, meta_cap, data_cap, local_rank, epoch)
            os.pwrite(fd, hdr, 0)
            for i in range(nslots):
                flags = FLAG_UNRESERVED if i >= nslots - spare else 0
                os.pwrite(fd, _SLOT_HDR.pack(EMPTY, flags, -1, 0, 0, 0, 0, 0, 0.0, 0), PAGE + i * slot_size)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        try:
            os.link(tmp, path)  # never replaces a segment another allocation created
        except OSError as e:
            raise E.SharedMemoryError(f"could not create the segment {path} of local rank {local_rank}: {e}") from e
        finally:
            os.unlink(tmp)
        return reserved

    def reserved_bytes(self) -> int:
        """Bytes of shared memory this segment holds (an unreserved slot holds only its header page)."""
        return self.size - sum(self.slot_size - PAGE for i in range(self.nslots)
                               if self.header(i).flags & FLAG_UNRESERVED)

    def reserve(self, i: int, *, clear_flag: bool = True) -> None:
        """Reserves slot ``i``'s memory (fallocate), faults it in, and (with ``clear_flag``, the caller
        holding the segment's lock) clears its FLAG_UNRESERVED. Raises OSError (ENOSPC) when /dev/shm
        cannot hold it."""
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.posix_fallocate(fd, self.slot_off(i), self.slot_size)
        finally:
            os.close(fd)
        self._advise(_MADV_POPULATE_WRITE, self.slot_off(i), self.slot_size)
        if clear_flag:
            self.set_flags(i, self.header(i).flags & ~FLAG_UNRESERVED)

    def release(self, i: int) -> None:
        """Gives slot ``i``'s memory back (all but its header page: MADV_REMOVE punches the hole). The
        caller holds the segment's lock and has flagged it EMPTY, FLAG_UNRESERVED and FLAG_PINNED (so no
        writer takes it meanwhile)."""
        self._advise(_MADV_REMOVE, self.slot_off(i) + PAGE, self.slot_size - PAGE)

    def slot_off(self, i: int) -> int:
        return PAGE + i * self.slot_size

    def meta_off(self, i: int) -> int:
        return self.slot_off(i) + PAGE

    def data_off(self, i: int) -> int:
        return self.slot_off(i) + PAGE + self.meta_cap

    def header(self, i: int) -> SlotHeader:
        return SlotHeader(*_SLOT_HDR.unpack_from(self.mm, self.slot_off(i)))

    def write_header(self, i: int, h: SlotHeader) -> None:
        # Fields first, state last: a reader never sees COMPLETE with stale fields.
        off = self.slot_off(i)
        _SLOT_HDR.pack_into(self.mm, off, WRITING if h.state == COMPLETE else h.state, h.flags, h.step,
                            h.generation, h.meta_len, h.meta_xxh, h.tensor_bytes, h.blob_len, h.wall_time, h.seq)
        if h.state == COMPLETE:
            struct.pack_into("<I", self.mm, off, COMPLETE)

    def set_flags(self, i: int, flags: int) -> None:
        struct.pack_into("<I", self.mm, self.slot_off(i) + 4, flags)

    def hold_pending(self, i: int, generation: int, step: int | None = None) -> bool:
        """Flags slot ``i`` PENDING (a persist of it is coming: no snapshot may overwrite it) when it still
        holds the COMPLETE snapshot of ``generation`` (and ``step``); False when it was overwritten. The
        caller holds the segment's lock."""
        h = self.header(i)
        if h.state != COMPLETE or h.generation != generation or (step is not None and h.step != step):
            return False
        self.set_flags(i, h.flags | FLAG_PENDING)
        return True

    def release_pending(self, i: int, generation: int) -> None:
        """Clears slot ``i``'s PENDING flag if it still holds ``generation``. The caller holds the lock."""
        h = self.header(i)
        if h.generation == generation:
            self.set_flags(i, h.flags & ~FLAG_PENDING)

    def read_meta(self, i: int, h: SlotHeader) -> dict[str, Any]:
        raw = self.mm[self.meta_off(i): self.meta_off(i) + h.meta_len]
        if xxhash.xxh64_intdigest(raw) != h.meta_xxh:
            raise E.CheckpointCorruptError(f"slot {i} of {self.path}: metadata checksum mismatch")
        return json.loads(raw)

    def populate(self, i: int, nbytes: int) -> None:
        """Maps slot ``i``'s first ``nbytes`` of data in one go before it is read (MADV_POPULATE_READ,
        Linux >= 5.14): faulting the source page by page while huge-page destinations fault too is
        ~15x slower. Best effort: older kernels simply fault on read."""
        start = self.data_off(i) // PAGE * PAGE
        length = min(self.size - start, _page(nbytes + self.data_off(i) - start))
        if length <= 0:
            return
        try:
            self.mm.madvise(_MADV_POPULATE_READ, start, length)
        except (OSError, ValueError, AttributeError):
            pass

    def complete_steps(self) -> list[tuple[int, int]]:
        """(step, slot) of every live COMPLETE snapshot of this segment, oldest save first (superseded ones,
        see ``live_snapshots``, left out)."""
        return [(h.step, i) for _seg, i, h in live_snapshots([self])][::-1]

    def close(self) -> None:
        del self._cbuf
        try:
            self.mm.close()
        except BufferError:  # a zero-copy tensor still views it; the mapping goes with that tensor
            log.debug("segment %s still has views; leaving the mapping to the garbage collector", self.path)


def live_snapshots(segs: list[Segment]) -> list[tuple[Segment, int, SlotHeader]]:
    """The live COMPLETE snapshots of one local rank's ``segs``, newest save (highest ``seq``) first.

    A snapshot is superseded (left out) when a later save's COMPLETE snapshot has the same or a lower
    step: the newest save of a step wins, and a step lower than the newest starts a new timeline, which
    abandons the newer steps of the old one. Superseded slots are not touched: they are dropped from
    view only once their successor is COMPLETE, so a kill mid-copy of that successor still leaves them.
    The live steps thus strictly decrease along the list."""
    found = []
    for seg in segs:
        for i in range(seg.nslots):
            h = seg.header(i)
            if h.state == COMPLETE:
                found.append((h.seq, seg.epoch, i, seg, h))
    found.sort(key=lambda x: x[:3], reverse=True)
    out: list[tuple[Segment, int, SlotHeader]] = []
    for _seq, _epoch, i, seg, h in found:
        if not out or h.step < out[-1][2].step:
            out.append((seg, i, h))
    return out


def read_snapshot(seg: Segment, slot: int, copier: Copier, *, step: int | None = None,
                  weights_only: bool = False, into: Any = None) -> Snapshot | None:
    """Copies slot ``slot`` out of shared memory; None when it is not a COMPLETE, untorn snapshot.

    With ``into`` (a state-dict tree), a snapshot tensor whose key path, dtype and shape match a
    contiguous CPU tensor of ``into`` is copied straight into that tensor, which is returned in its
    place: no new memory, one copy at memcpy speed. Other tensors are copied into new storages."""
    h = seg.header(slot)
    if h.state != COMPLETE or (step is not None and h.step != step):
        return None
    meta = seg.read_meta(slot, h)
    metas = [TensorMeta.from_json(v) for v in meta["tensors"]]
    data = seg.base + seg.data_off(slot)
    seg.populate(slot, h.tensor_bytes)
    direct: dict[int, torch.Tensor] = {}
    tasks = []
    if into is not None:
        targets = tensors_by_path(into)
        paths = tensor_paths(meta["tree"])
        if paths and all(len(p) >= 3 and p[0] == FILES_KEY and p[2] == "d" for p in paths):
            paths = [(p[1], *p[3:]) for p in paths]  # a FileSet: ``into`` is {file name: tree}
        for i, (m, path) in enumerate(zip(metas, paths)):
            t = targets.get(path)
            if (t is not None and not t.is_cuda and t.layout == torch.strided and t.is_contiguous()
                    and tuple(t.shape) == m.shape and dtype_name(t.dtype) == m.dtype
                    and m.stride == contiguous_strides(m.shape) and m.device == "cpu"):
                n = t.numel() * t.element_size()
                start = m.storage_offset * t.element_size()
                if start + n > m.nbytes:
                    continue  # not a view inside its region (cannot happen for a valid snapshot)
                if n:
                    tasks.append((t.data_ptr(), data + m.offset + start, n))
                direct[i] = t
    regions: dict[tuple[int, int], torch.UntypedStorage] = {}
    for i, m in enumerate(metas):
        key = (m.offset, m.nbytes)
        if i in direct or key in regions:
            continue
        st = torch.UntypedStorage(m.nbytes)
        regions[key] = st
        if m.nbytes:
            advise_huge_pages(st.data_ptr(), m.nbytes)
            tasks.append((st.data_ptr(), data + m.offset, m.nbytes))
    copier.run(tasks)
    blob_off = seg.data_off(slot) + h.tensor_bytes
    blob = seg.mm[blob_off: blob_off + h.blob_len]
    h2 = seg.header(slot)
    if h2.state != COMPLETE or h2.generation != h.generation:
        return None  # overwritten while we read: torn
    # Opaque leaves are decoded by a trainer only (never the saver), and with weights_only only into
    # the types torch.load(weights_only=True) accepts.
    opaque = [decode_opaque(b, weights_only=weights_only) for b in split_opaque(blob, meta["opaque"])]
    tensors = []
    for i, m in enumerate(metas):
        if i in direct:
            tensors.append(direct[i])
            continue
        t = build_tensor(regions[(m.offset, m.nbytes)], m)
        if m.device != "cpu":
            t = _to_device(t, m.device)
        tensors.append(t)
    return Snapshot(h.step, unflatten(meta["tree"], tensors, opaque), meta.get("name", ""), h.tensor_bytes)


_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_libc: Any = None


def advise_huge_pages(addr: int, nbytes: int) -> None:
    """Asks for transparent huge pages on the 2 MiB-aligned part of a fresh buffer before it is first
    written: one fault per 2 MiB instead of per 4 KiB (a 1 GB copy into new memory goes from ~1 s of
    page faults to ~0.1 s where THP is in "madvise" mode). Best effort; a no-op where unsupported."""
    global _libc
    if nbytes < 2 * _HUGE or not sys.platform.startswith("linux"):
        return
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return
    start = (addr + _HUGE - 1) // _HUGE * _HUGE
    end = (addr + nbytes) // _HUGE * _HUGE
    if end > start:
        _libc.madvise(start, end - start, _MADV_HUGEPAGE)


def _to_device(t: torch.Tensor, device: str) -> torch.Tensor:
    dev = torch.device(device)
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        return t
    return t.to(dev)


Allocator = Callable[[int, int, int], str]


_DEAD_HOLDER_WAIT_S = 10.0


def _take_writer_lease(job_dir: str, local_rank: int, info: dict[str, Any]) -> Lease:
    """The writer lease of ``local_rank``'s segments, or SharedMemoryError naming its holder."""
    path = writer_lease_path(job_dir, local_rank)
    lease = Lease(path)
    try:
        ok = lease.try_acquire({"local_rank": local_rank, **info})
    except OSError as e:
        raise E.SharedMemoryError(f"could not take the writer lease {path}: {e}") from e
    holder = read_holder(path) if not ok else {}
    pid = holder.get("pid")
    if not ok and isinstance(pid, int) and pid != os.getpid() and not pid_running(pid):
        # A holder that was just killed: its threads may still be exiting (its pid already a zombie) and
        # its files still open for a moment. Its lease frees when they are gone.
        ok = lease.try_acquire({"local_rank": local_rank, **info}, timeout=_DEAD_HOLDER_WAIT_S)
    if ok:
        return lease
    if not pid:
        who = "another process"
    elif pid == os.getpid():
        who = f"this process (pid {pid})"
    elif isinstance(pid, int) and not pid_running(pid):
        who = f"a process that pid {pid} (exited) forked and that still holds its lease"
    else:
        who = f"pid {pid}"
    extra = ", ".join(f"{k} {holder[k]}" for k in ("rank", "checkpoint_dir") if k in holder)
    raise E.SharedMemoryError(
        f"local rank {local_rank}'s shared-memory snapshots in {job_dir} are already written by {who}"
        f"{' (' + extra + ')' if extra else ''}; two writers would tear each other's checkpoints. Close "
        "the other CheckpointEngine first, or give each job its own FLASHCKPT_JOB_ID or checkpoint dir.")
"""(local_rank, meta_cap, data_cap) -> path of a new segment created by the saver."""


class SharedMemoryHandler:
    """The trainer's side of one local rank's segment: writes snapshots, reads them back.

    Args:
        local_rank: whose segment.
        job_dir: the job's runtime dir.
        allocate: asks the saver for a new segment; None for a read-only handler. A handler with an
            allocator is the one writer of ``local_rank``'s segments: from its first save it holds their
            writer lease until ``close`` (released by the kernel if the process dies), and a second
            writer's save is refused. Reading takes no lease.
        copier: the thread pool that copies bytes (one is made when None).
        slot_wait_timeout: bound on waiting for a free slot while both are busy persisting.
        weights_only: decode opaque leaves of loaded snapshots only into the types
            ``torch.load(weights_only=True)`` accepts; a writer then refuses, before writing anything, a
            state dict holding a leaf that would not load back under those rules.
        writer_info: what the writer lease says about its holder (JSON), for a refused second writer.

    Not thread-safe. While ``save_state_dict`` runs the caller must not mutate the tensors it passed;
    once it returns they are the caller's again.
    """

    def __init__(self, local_rank: int, job_dir: str, *, allocate: Allocator | None = None,
                 copier: Copier | None = None, slot_wait_timeout: float = 600.0,
                 weights_only: bool = False, writer_info: dict[str, Any] | None = None) -> None:
        self.local_rank = local_rank
        self.job_dir = job_dir
        self._allocate = allocate
        self._lease: Lease | None = None
        self._writer_info = writer_info or {}
        self._own_copier = copier is None
        self._copier = copier or Copier(1)
        self._lock = SharedLock(lock_path(job_dir, local_rank))
        self._seg: Segment | None = None
        self._plan: SnapshotPlan | None = None
        self._tree_cache: tuple[SnapshotPlan, Any, str] | None = None
        self._readers: dict[str, Segment] = {}
        self._cuda_registered: set[str] = set()
        self._stream: Any = None
        self.slot_wait_timeout = slot_wait_timeout
        self.weights_only = weights_only
        self._seq = -1  # the highest save sequence number seen; -1 until the live segments were read
        self._warned_spare: set[str] = set()
        self._loadable: set[int] = set()  # digests of opaque leaves known to load under weights_only

    # ------------------------------------------------------------------ write
    def save_state_dict(self, step: int, state_dict: Any, ckpt_name: str = "") -> SlotRef:
        """Copies ``state_dict`` into a free slot and marks it COMPLETE; see ``start_save``."""
        return self.start_save(step, state_dict, ckpt_name)()

    def start_save(self, step: int, state_dict: Any, ckpt_name: str = "") -> Callable[[], SlotRef]:
        """Plans the snapshot, claims a free slot and queues device-to-host copies; returns ``finish``,
        which copies the host tensors and marks the slot COMPLETE (on any thread; the overlapped mode
        runs it in the background while training goes on).

        Args:
            step: the training step the snapshot belongs to.
            state_dict: the tree to snapshot. Its tensors must not change until ``finish`` returned.
            ckpt_name: where the snapshot is to be persisted (kept in its metadata).

        Raises:
            InvalidStateDictError: something in ``state_dict`` cannot be stored (nothing was written).
            SharedMemoryError: /dev/shm cannot hold the snapshot, or another writer holds this local
                rank's segments (the message names it; nothing was written).
            CheckpointTimeoutError: no slot became free within ``slot_wait_timeout``.
        """
        if self._lease is None and self._allocate is not None:
            self._lease = _take_writer_lease(self.job_dir, self.local_rank, self._writer_info)
        # The walk allocates ~5 containers per tensor; with thousands of tensors that triggers full
        # garbage collections in the middle of the pause. Nothing here creates reference cycles.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            native = _native.get()
            cached = self._tree_cache
            if cached and native is not None:
                ts = native.flatten_like(state_dict, cached[1], torch.nn.Parameter, OrderedDict)
                flat = Flat(cached[1], ts, []) if ts is not None else None
            else:
                flat = flatten_like(state_dict, cached[1], check_tensors=native is None) if cached else None
            if flat is None:
                flat = flatten(state_dict, check_tensors=native is None)
            if native is not None:
                # One C++ call for the signature and storage addresses (and the tensor checks).
                nsig, nptrs, bad = native.scan(flat.tensors, torch.nn.Parameter)
                if bad >= 0:
                    flatten(state_dict)  # raises, naming the key
                    raise E.InvalidStateDictError(f"save(): tensor {bad} of the state dict cannot be stored")
                plan = self._plan
                if plan is None or plan.native_signature != nsig:
                    sig, _ = signature_of(flat.tensors)
                    plan = self._plan = plan_snapshot(flat.tensors, sig, native_signature=nsig)
            else:
                sig, ptrs = signature_of(flat.tensors)
                if self._plan is None or self._plan.signature != sig:
                    self._plan = plan_snapshot(flat.tensors, sig)
                plan = self._plan
            blob, lengths = encode_opaque(flat.opaque)
            if self.weights_only and flat.opaque:
                self._check_loadable(state_dict, flat.opaque, blob, lengths)
            meta = self._meta_json(step, ckpt_name, flat, plan, lengths)
            seg = self._segment_for(len(meta), plan.tensor_bytes + len(blob))
            slot = self._acquire_slot(seg)
            try:
                device_done = self._copy_cuda(seg, slot, [(flat.tensors[i], off, n) for i, off, n in plan.device_copies]) \
                    if plan.device_copies else None
            except BaseException:
                self._set_state(seg, slot, EMPTY)
                raise
        finally:
            if gc_was_enabled:
                gc.enable()
        if native is not None:
            addr = array.array("q", nptrs)
            large = [(off, addr[i], n) for i, off, n in plan.large_copies]
        else:
            large = [(off, ptrs[i], n) for i, off, n in plan.copies]
        # The copies read the tensors by address: they are kept alive until finish() is done with them. An
        # overlapped save's caller may drop its state dict at once (``save(step, {"w": torch.ones(3)})``),
        # and a freed tensor's memory is reused or unmapped under the background copy.
        sources: list[torch.Tensor] | None = flat.tensors
        del flat

        def finish() -> SlotRef:
            nonlocal sources
            try:
                data = seg.base + seg.data_off(slot)
                small = None
                if native is not None and plan.small_copies_packed:
                    def small() -> None:
                        native.copy_storages(data, nptrs, plan.small_copies_packed)
                self._copier.run([(data + off, src, n) for off, src, n in large], small, plan.small_copy_work)
                if blob:
                    off = seg.data_off(slot) + plan.tensor_bytes
                    seg.mm[off: off + len(blob)] = blob
                moff = seg.meta_off(slot)
                seg.mm[moff: moff + len(meta)] = meta
                if device_done is not None:
                    device_done.synchronize()
            except BaseException:
                self._set_state(seg, slot, EMPTY)
                raise
            finally:
                sources = None  # copied (or failed): the caller's tensors are free to go
            h0 = seg.header(slot)
            gen = h0.generation
            seg.write_header(slot, SlotHeader(COMPLETE, 0, step, gen, len(meta), xxhash.xxh64_intdigest(meta),
                                              plan.tensor_bytes, len(blob), time.time(), h0.seq))
            return SlotRef(seg.path, slot, gen, step)

        return finish

    def _check_loadable(self, root: Any, opaque: list[Any], blob: bytes, lengths: list[int]) -> None:
        """Refuses, before anything is written, an opaque leaf that ``torch.load(weights_only=True)`` (and
        a memory load under the same rules) would refuse at resume time. Each distinct leaf (by its
        pickle's digest) is checked once, so a training loop saving the same objects pays a hash per
        leaf, and a state dict of tensors and plain values nothing at all."""
        import io

        from torch import _weights_only_unpickler

        pos = 0
        for x, n in zip(opaque, lengths, strict=True):
            raw = blob[pos:pos + n]
            pos += n
            key = xxhash.xxh64_intdigest(raw)
            if key in self._loadable:
                continue
            try:
                _weights_only_unpickler.load(io.BytesIO(raw), encoding="utf-8")
            except Exception as e:
                cls = type(x)
                found = re.search(r"GLOBAL ([\w.]+)", str(e))
                name = found.group(1) if found else f"{cls.__module__}.{cls.__qualname__}"
                raise E.InvalidStateDictError(
                    f"save(): the value at {_key_str(_path_to(root, x))} ({cls.__module__}.{cls.__qualname__}) would "
                    f"not load back: weights_only loading, the default, refuses {name}. Nothing was saved. Either "
                    f"allow it, before saving and loading: torch.serialization.add_safe_globals([{name}]); or, for "
                    "checkpoints you trust, construct the engine / checkpointer with weights_only=False; or save "
                    "plain values instead (e.g. vars(args) for an argparse.Namespace)") from e
            if len(self._loadable) >= 4096:
                self._loadable.clear()
            self._loadable.add(key)

    def _meta_json(self, step: int, name: str, flat: Flat, plan: SnapshotPlan, lengths: list[int]) -> bytes:
        head = json.dumps({"v": 1, "step": step, "name": name, "opaque": lengths}, separators=(",", ":"))
        # The tree's JSON is reused while the tree (plain leaves included) is unchanged: comparing the
        # skeletons is much cheaper than encoding thousands of entries again.
        cached = self._tree_cache
        if cached is not None and cached[0] is plan and (cached[1] is flat.skeleton or cached[1] == flat.skeleton):
            tail = cached[2]
        else:
            tree = json.dumps(flat.skeleton, separators=(",", ":"))
            tail = ',"tree":' + tree + ',"tensors":' + plan.metas_json + "}"
            self._tree_cache = (plan, flat.skeleton, tail)
        return (head[:-1] + tail).encode()

    def _segment_for(self, meta_len: int, data_len: int) -> Segment:
        seg = self._seg
        if seg is None:
            paths = segment_paths(self.job_dir, self.local_rank)
            if paths:
                seg = self._seg = Segment(paths[-1][1])
        if seg is not None and meta_len <= seg.meta_cap and data_len <= seg.data_cap:
            return seg
        if self._allocate is None:
            raise E.SharedMemoryError("this SharedMemoryHandler is read-only (no allocator)")
        meta_cap = max(2 * meta_len, 64 << 10)
        data_cap = data_len + max(data_len // 64, 64 << 10)  # slack for growing plain leaves
        path = self._allocate(self.local_rank, meta_cap, data_cap)
        if self._seg is not None:
            self._unregister(self._seg)
            self._seg.close()
        self._seg = Segment(path)
        return self._seg

    def _next_seq(self, seg: Segment) -> int:
        """The save sequence number of a new snapshot: above every snapshot of this local rank in memory
        (all live segments, the first time; a restarted trainer goes on from what it finds)."""
        if self._seq < 0:
            for _epoch, path in segment_paths(self.job_dir, self.local_rank):
                try:
                    other = self._open(path)
                except (OSError, E.FlashCheckpointError):
                    continue
                self._seq = max([self._seq] + [other.header(i).seq for i in range(other.nslots)])
        self._seq = max([self._seq] + [seg.header(i).seq for i in range(seg.nslots)]) + 1
        return self._seq

    def _acquire_slot(self, seg: Segment) -> int:
        """Claims a slot to write: never one pinned or pending for a persist, never (with two or more
        slots) the one holding the newest COMPLETE snapshot; an empty or the oldest reserved slot first,
        else the spare, reserved now. Waits (bounded) when none is left: every slot busy persisting, or
        /dev/shm cannot hold the spare."""
        deadline = time.monotonic() + self.slot_wait_timeout
        delay = 0.0005
        spare_failed = False
        while True:
            with self._lock:
                hs = [seg.header(i) for i in range(seg.nslots)]
                newest = max((i for i, h in enumerate(hs) if h.state == COMPLETE),
                             key=lambda i: (hs[i].seq, i), default=None)
                free = [i for i, h in enumerate(hs) if not h.flags & _BUSY and (i != newest or seg.nslots == 1)]
                free.sort(key=lambda i: (bool(hs[i].flags & FLAG_UNRESERVED), hs[i].state == COMPLETE, hs[i].seq))
                for i in free:
                    h = hs[i]
                    if h.flags & FLAG_UNRESERVED:
                        if spare_failed:
                            continue
                        try:
                            seg.reserve(i)
                        except OSError as e:
                            spare_failed = True
                            if seg.path not in self._warned_spare:
                                self._warned_spare.add(seg.path)
                                log.warning(
                                    "save(step): /dev/shm cannot hold the spare snapshot slot of local rank %d "
                                    "(%d bytes: %s) while a persist holds the other; this and later snapshots "
                                    "wait for the persist (up to %.0f s) instead. Enlarge /dev/shm to avoid "
                                    "the wait.", self.local_rank, seg.slot_size, e, self.slot_wait_timeout)
                            continue
                    seq = self._next_seq(seg)
                    seg.write_header(i, SlotHeader(WRITING, 0, h.step, h.generation + 1, 0, 0, 0, 0, 0.0, seq))
                    return i
            if time.monotonic() >= deadline:
                raise E.CheckpointTimeoutError(
                    f"save(): every shared-memory slot of local rank {self.local_rank} stayed busy persisting "
                    f"for {self.slot_wait_timeout:.0f} s; storage is slower than the persist interval. "
                    "Persist less often, or check that the saver is alive (flashckpt ls).")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _set_state(self, seg: Segment, slot: int, state: int) -> None:
        with self._lock:
            struct.pack_into("<I", seg.mm, seg.slot_off(slot), state)

    def _copy_cuda(self, seg: Segment, slot: int, items: list[tuple[torch.Tensor, int, int]]) -> Any:
        """Queues device-to-host copies on a side stream into the (pinned) segment, ordered after the
        work already queued on the current stream; returns the event that completes them."""
        if seg.path not in self._cuda_registered and torch.cuda.is_available():
            # Page-lock the segment once so the copies are true asynchronous DMA.
            torch.cuda.cudart().cudaHostRegister(seg.base, seg.size, 0)
            self._cuda_registered.add(seg.path)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for t, off, n in items:
                dst = torch.frombuffer(seg.mm, dtype=torch.uint8, count=n, offset=seg.data_off(slot) + off)
                src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def mark_pending(self, ref: SlotRef) -> None:
        """Flags ``ref``'s slot as awaiting a persist, so no later snapshot overwrites it first."""
        seg = self._open(ref.path)
        with self._lock:
            if not seg.hold_pending(ref.slot, ref.generation):
                raise E.FlashCheckpointError(f"step {ref.step}: its slot was overwritten before its persist")

    def clear_pending(self, ref: SlotRef) -> None:
        seg = self._open(ref.path)
        with self._lock:
            seg.release_pending(ref.slot, ref.generation)

    def _open(self, path: str) -> Segment:
        """The segment at ``path``: the one we write, else a cached read-only mapping (not prefaulted:
        a reader touches only the slot it reads)."""
        if self._seg is not None and self._seg.path == path:
            return self._seg
        seg = self._readers.get(path)
        if seg is None:
            seg = self._readers[path] = Segment(path, populate=False)
        return seg

    def _forget_removed(self, live: list[tuple[int, str]]) -> None:
        names = {p for _, p in live}
        for path in [p for p in self._readers if p not in names]:
            self._readers.pop(path).close()

    # ------------------------------------------------------------------- read
    def _live(self) -> list[tuple[Segment, int, SlotHeader]]:
        """``live_snapshots`` of every live segment of this local rank, newest save first."""
        live = segment_paths(self.job_dir, self.local_rank)
        self._forget_removed(live)
        segs = []
        for _epoch, path in live:
            try:
                segs.append(self._open(path))
            except (OSError, E.FlashCheckpointError):
                continue
        return live_snapshots(segs)

    def memory_snapshots(self) -> list[tuple[int, float]]:
        """(step, wall time of the save) of the live COMPLETE snapshots of this local rank, newest save
        first (superseded ones left out, see ``live_snapshots``; the steps strictly decrease)."""
        return [(h.step, h.wall_time) for _seg, _i, h in self._live()]

    def memory_steps(self) -> list[int]:
        """Steps of the live COMPLETE snapshots held in shared memory for this local rank, newest first."""
        return [s for s, _t in self.memory_snapshots()]

    def snapshot_name(self, step: int) -> str | None:
        """Where the COMPLETE snapshot of ``step`` is to be persisted (its ``ckpt_name``); None if absent."""
        for seg, i, h in self._live():
            if h.step == step:
                try:
                    return str(seg.read_meta(i, h).get("name", ""))
                except (ValueError, E.FlashCheckpointError):
                    return None
        return None

    def load_snapshot(self, step: int | None = None, *, into: Any = None) -> Snapshot | None:
        """The newest live COMPLETE snapshot (or the one of ``step``), copied out of shared memory (into
        the matching tensors of ``into`` where given; see ``read_snapshot``)."""
        for seg, i, h in self._live():
            if step is not None and h.step != step:
                continue
            snap = read_snapshot(seg, i, self._copier, step=h.step, weights_only=self.weights_only, into=into)
            if snap is not None and snap.step == h.step:
                return snap
        return None

    def load_state_dict(self, step: int | None = None) -> Any:
        """The state dict of the newest snapshot in memory (or of ``step``); ``{}`` when there is none."""
        snap = self.load_snapshot(step)
        return {} if snap is None else snap.state_dict

    def _unregister(self, seg: Segment) -> None:
        if seg.path in self._cuda_registered:
            torch.cuda.cudart().cudaHostUnregister(seg.base)
            self._cuda_registered.discard(seg.path)

    def close(self) -> None:
        try:
            self._close_segments()
        finally:
            if self._lease is not None:
                self._lease.release(unlink=False)  # the saver removes it with the runtime dir
                self._lease = None

    def _close_segments(self) -> None:
        for seg in self._readers.values():
            seg.close()
        self._readers.clear()
        if self._seg is not None:
            self._unregister(self._seg)
            self._seg.close()
            self._seg = None
        if self._own_copier:
            self._copier.close()
