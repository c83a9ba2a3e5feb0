"""The shared-memory segment format: segment and slot headers, slot states and flags, the paths of a job's
segments, locks and writer leases, ``Segment`` (a mapped segment file) and ``live_snapshots``.

Torch-free: the saver daemon uses it as it is. What goes into a slot is the snapshot writer's
(``snapshot_writer``); reading one back is ``snapshot_reader``'s.

Segment file (one per local rank and allocation epoch, created 0600 by the saver)::

    [0, 4096)            segment header: magic, version, nslots, slot_size, meta_cap, data_cap, local_rank
    slot i at 4096 + i * slot_size:
      [0, 4096)          slot header: state, flags, step, generation, meta_len, meta_xxh64,
                         tensor_bytes, blob_len, wall_time, seq, owner (the global rank + 1),
                         world (the number of ranks of the job that saved it)
      [4096, +meta_cap)  metadata (JSON, no pickle)
      [.., +data_cap)    tensor storages (each 64-byte aligned), then the opaque blob

``seq`` orders the snapshots of a local rank by save (it grows across segments and trainer restarts);
"newest" always means the highest ``seq``, never the highest step. A snapshot is superseded once a
later save of the same or a lower step is COMPLETE (the newest save of a step wins, and a lower step
starts a new timeline): readers see only the live ones, ``live_snapshots``.

A trainer never writes the slot holding the newest COMPLETE snapshot (with two or more slots), nor a
slot pinned by the saver (a persist reading it) or pending (a persist requested but not started): so a
kill at any point of a copy leaves the newest complete snapshot intact. The default segment has two
slots plus spares (``FLAG_UNRESERVED``, ``FLASHCKPT_SPARE_SLOTS``, 4): their header pages exist but their
memory is reserved only while persists hold slots (one spare per slot held, reserved by the saver as a
persist is queued, or by a snapshot that finds no other slot), and given back by the saver once no
persist holds a slot (``Segment.release``); so a snapshot never waits for a persist, and the spares'
memory is held only while persists run. When /dev/shm cannot hold another slot, or every slot is held,
the snapshot waits (bounded) for a persist instead and logs how long. Readers accept a slot only when it is
COMPLETE and its generation is unchanged after the read. Slot flags change only under the segment's
SharedLock.
"""

from __future__ import annotations

import ctypes
import errno
import functools
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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import xxhash
from flashckpt import errors as E

__all__ = ["Segment", "SlotHeader", "SlotRef", "EMPTY", "WRITING", "COMPLETE", "FLAG_PINNED", "FLAG_PENDING",
           "FLAG_UNRESERVED", "FLAG_SENDING", "FLAG_FETCHED", "FLAGS_BUSY", "PAGE", "live_snapshots", "segment_paths",
           "segment_path", "local_ranks", "lock_path", "writer_lease_path", "advise_huge_pages", "unreadable",
           "BACKUP_BASE", "backup_paths"]

log = logging.getLogger(__name__)

SEG_MAGIC = b"FLCKSEG1"
SEG_VERSION = 1
_SEG_HDR = struct.Struct("<8sIIQQQiq")
_SLOT_HDR = struct.Struct("<IIqQQQQQdQqq")  # zeros past wall_time read as seq 0, owner 0, world 0 (older segments)
PAGE = 4096
EMPTY, WRITING, COMPLETE = 0, 1, 2
FLAG_PINNED = 1   # the saver is reading this slot
FLAG_PENDING = 2  # a persist of this slot was requested and has not finished
FLAG_UNRESERVED = 4  # the slot's memory (all but its header page) is not reserved: reserve before writing
FLAG_SENDING = 8  # the saver is sending this slot to a peer (a backup, or a lost node's fetch)
FLAG_FETCHED = 16  # a copy fetched from a peer's memory after a node loss, not a snapshot of this node's trainer
FLAGS_BUSY = FLAG_PINNED | FLAG_PENDING | FLAG_SENDING  # the saver holds the slot: no snapshot may overwrite it

_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23
_MADV_REMOVE = 9
_SEG_RE = re.compile(r"seg-r(\d+)-e(\d+)\.shm")


def _page(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def segment_paths(job_dir: str, local_rank: int) -> list[tuple[int, str]]:
    """(epoch, path) of every segment of ``local_rank`` in ``job_dir``, oldest first; [] when the job has no
    runtime dir here.

    Raises:
        SharedMemoryError: the dir could not be listed (EMFILE, EACCES...): what it holds is unknown, which
            is not "no snapshots" (a load would silently fall back to an older committed step).
    """
    prefix = f"seg-r{local_rank:03d}-e"
    out = []
    for name in _segment_names(job_dir):
        m = _SEG_RE.fullmatch(name) if name.startswith(prefix) else None
        if m:
            out.append((int(m.group(2)), os.path.join(job_dir, name)))
    return sorted(out)


#: A backup segment's local-rank field (and lock): BACKUP_BASE + the global rank it backs up.
BACKUP_BASE = 100_000
_BAK_RE = re.compile(r"bak-r(\d+)-e(\d+)\.shm")


def backup_paths(job_dir: str) -> dict[int, list[tuple[int, str]]]:
    """rank -> (epoch, path) of its backup segments in ``job_dir`` (a partner node's snapshots, received by
    this node's saver), oldest first; {} when the job has no runtime dir here.

    Raises:
        SharedMemoryError: the dir could not be listed (see ``segment_paths``).
    """
    out: dict[int, list[tuple[int, str]]] = {}
    for name in _segment_names(job_dir):
        m = _BAK_RE.fullmatch(name)
        if m:
            out.setdefault(int(m.group(1)), []).append((int(m.group(2)), os.path.join(job_dir, name)))
    return {r: sorted(v) for r, v in out.items()}


def local_ranks(job_dir: str) -> list[int]:
    """The local ranks that have segments in ``job_dir``, ascending; [] when the job has no runtime dir here.

    Raises:
        SharedMemoryError: the dir could not be listed (see ``segment_paths``).
    """
    return sorted({int(m.group(1)) for n in _segment_names(job_dir) if (m := _SEG_RE.fullmatch(n))})


def _segment_names(job_dir: str) -> list[str]:
    """The names in ``job_dir`` ([] when it does not exist); SharedMemoryError when it cannot be listed."""
    try:
        return os.listdir(job_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        raise unreadable("list the shared-memory segments in", job_dir, e) from e


def unreadable(what: str, path: str, e: OSError) -> E.SharedMemoryError:
    """The error for shared memory that exists but could not be read: names the path and the errno, and
    says that nothing older is loaded instead."""
    code = errno.errorcode.get(e.errno or 0, str(e.errno))
    hint = (" Raise the open-files limit (ulimit -n) or close files this process holds, then call again."
            if e.errno in (errno.EMFILE, errno.ENFILE) else "")
    return E.SharedMemoryError(
        f"could not {what} {path} ({code}: {e.strerror}): the snapshots there cannot be read now, and are not "
        f"taken for absent (a load would then return an older committed step instead).{hint}")


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
    owner: int = 0  # the global rank that saved it, plus one (0: not recorded, an older segment)
    world: int = 0  # the number of ranks of the job that saved it (0: not recorded)

    @property
    def rank(self) -> int | None:
        """The global rank whose snapshot this is; None where the segment predates the field."""
        return self.owner - 1 if self.owner > 0 else None

    @property
    def world_size(self) -> int | None:
        """The number of ranks of the job that saved it; None where not recorded."""
        return self.world if self.world > 0 else None


@dataclass(frozen=True)
class SlotRef:
    """Which slot of which segment holds a snapshot, and at which generation."""

    path: str
    slot: int
    generation: int
    step: int



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
            self._inode = (st.st_dev, st.st_ino)
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
                os.pwrite(fd, _SLOT_HDR.pack(EMPTY, flags, -1, 0, 0, 0, 0, 0, 0.0, 0, 0, 0), PAGE + i * slot_size)
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
                            h.generation, h.meta_len, h.meta_xxh, h.tensor_bytes, h.blob_len, h.wall_time, h.seq, h.owner,
                            h.world)
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
        """Maps slot ``i``'s first ``nbytes`` of data in one go before it is read from the mapping
        (MADV_POPULATE_READ, Linux >= 5.14): faulting the source in while huge-page destinations fault
        too is ~15x slower. Best effort: older kernels simply fault on read."""
        start = self.data_off(i) // PAGE * PAGE
        length = min(self.size - start, _page(nbytes + self.data_off(i) - start))
        if length > 0:
            self._advise(_MADV_POPULATE_READ, start, length)

    @property
    def huge_pages(self) -> bool:
        """Whether the segment file has huge pages (``huge_page_tmpfs``): then its mapping, one fault per
        2 MiB, is a source as fast as resident memory."""
        return huge_page_tmpfs(os.path.dirname(self.path))

    @contextmanager
    def read_fd(self) -> Iterator[int | None]:
        """A read-only descriptor of this very segment file (None where it is gone or replaced), for
        ``_copy.file_reader``: reading a slot with ``preadv`` avoids mapping its 4 KiB pages into this
        process (1.0-1.1x a ``copy_`` of the bytes, against 1.5-2x for faulting them in)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            yield None
            return
        try:
            st = os.fstat(fd)
            yield fd if (st.st_dev, st.st_ino) == self._inode else None
        finally:
            os.close(fd)

    def replaced(self) -> bool:
        """Whether ``path`` no longer names this mapping's file: removed (a wiped runtime dir) or replaced.
        A stat that fails otherwise cannot tell, and says no."""
        try:
            st = os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return True
        except OSError:
            return False
        return (st.st_dev, st.st_ino) != self._inode

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
    The live steps of each rank (``owner``) thus strictly decrease along the list."""
    found = []
    for seg in segs:
        for i in range(seg.nslots):
            h = seg.header(i)
            if h.state == COMPLETE:
                found.append((h.seq, seg.epoch, i, seg, h))
    found.sort(key=lambda x: x[:3], reverse=True)
    out: list[tuple[Segment, int, SlotHeader]] = []
    last: dict[int, int] = {}  # owner -> the step of its newest live snapshot so far
    for _seq, _epoch, i, seg, h in found:
        # Each rank's snapshots are a timeline of their own: a local rank whose global rank changed (a restart
        # that renumbered the nodes) still holds its old rank's snapshots, which a peer may need.
        if h.owner not in last or h.step < last[h.owner]:
            out.append((seg, i, h))
            last[h.owner] = h.step
    return out



_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_libc: Any = None


@functools.lru_cache(maxsize=16)
def huge_page_tmpfs(directory: str) -> bool:
    """Whether files in ``directory`` get transparent huge pages: it lies on a tmpfs mounted with
    ``huge=always`` or ``huge=within_size``, or the kernel forces them on every tmpfs (``shmem_enabled``)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            if "[force]" in f.read():
                return True
        with open("/proc/self/mountinfo") as f:
            mounts = f.read().splitlines()
    except OSError:
        return False
    real = os.path.realpath(directory)
    best, huge = "", False
    for line in mounts:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best = point
            huge = tail[0] == "tmpfs" and any(o in ("huge=always", "huge=within_size") for o in tail[2].split(","))
    return huge


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

