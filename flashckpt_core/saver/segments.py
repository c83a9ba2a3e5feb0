"""The saver's segment pool: every shared-memory segment in the job's runtime dir, its own ranks' and the
backups of other nodes' ranks. Allocating (``posix_fallocate``: a full /dev/shm is an error at allocation,
never a SIGBUS), making room, the spare slots of two-slot segments, holding a slot for a persist, adopting
the segments of an earlier saver, reaping old segments.

Imports the layers below the saver and ``saver.state``. Its methods run on the request threads, the persist
threads, the spare keeper and the peer threads at once: the segment map changes only by assignment or
``pop`` of one path, a slot's header under the segment's ``SharedLock``, an allocation of a local rank under
that rank's allocation lock."""

from __future__ import annotations

import collections
import contextlib
import os
import stat
import threading
import time
from collections.abc import Iterator

from flashckpt import errors as E
from flashckpt.format.segment import (
    BACKUP_BASE,
    COMPLETE,
    EMPTY,
    FLAG_FETCHED,
    FLAG_PINNED,
    FLAG_UNRESERVED,
    FLAGS_BUSY,
    WRITING,
    Segment,
    SlotHeader,
    _page,
    backup_paths,
    live_snapshots,
    local_ranks,
    lock_path,
    segment_path,
    segment_paths,
)
from flashckpt.saver.state import SaverState, log
from flashckpt.transport import messages as M
from flashckpt.transport.ipc import SharedLock
from flashckpt.transport.spawn import SOCKET_NAME
from flashckpt.transport.wire import Client

__all__ = ["SegmentPool", "BACKUP_BASE", "backup_paths", "own_local_ranks"]

own_local_ranks = local_ranks  # the local ranks with segments of their own here (not backups)


class SegmentPool:
    """The segments of one saver (see the module docstring)."""

    def __init__(self, state: SaverState) -> None:
        self.state = state
        self.job_dir = state.job_dir
        self.knobs = state.knobs
        self.segments: dict[str, Segment] = {}
        self._alloc_locks: dict[int, threading.Lock] = collections.defaultdict(threading.Lock)
        self._persist_seen = -float("inf")  # monotonic time of the last persist activity (spare slot hold)
        self._spares_wanted = threading.Event()  # a persist was queued: the spare keeper reserves spares

    # ------------------------------------------------------------------ the map of segments
    def segment(self, path: str) -> Segment:
        seg = self.segments.get(path)
        if seg is None:
            seg = self.segments[path] = Segment(path, populate=False)
        return seg

    def adopt(self, dir_fd: int) -> None:
        """Segments survive a killed saver: keep them, clearing flags of persists that died with it."""
        for name in os.listdir(dir_fd):
            if not name.endswith(".shm"):
                continue
            path = os.path.join(self.job_dir, name)
            try:
                seg = Segment(path, populate=False)
            except (OSError, E.FlashCheckpointError):
                os.unlink(name, dir_fd=dir_fd)
                continue
            with SharedLock(lock_path(self.job_dir, seg.local_rank)):
                for i in range(seg.nslots):
                    seg.set_flags(i, seg.header(i).flags & ~FLAGS_BUSY)
            self.segments[path] = seg
            log.info("adopted segment %s (steps %s)", path, [s for s, _ in seg.complete_steps()])

    def holds_snapshot(self) -> bool:
        """Whether a segment holds a complete snapshot (something a restarted trainer could load)."""
        for path in list(self.segments):
            try:
                if self.segments[path].complete_steps():
                    return True
            except (OSError, ValueError, E.FlashCheckpointError):
                return True  # unreadable: keep it rather than drop it
        return False

    def close(self) -> None:
        """Unmaps every segment (the saver exits)."""
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()

    def held(self) -> Iterator[tuple[str, int, Segment, int, SlotHeader]]:
        """(kind, local rank, segment, slot, header) of every live snapshot here: own ("own", by local rank)
        and backups ("backup", local rank -1)."""
        for lr in own_local_ranks(self.job_dir):
            segs = [self.segment(p) for _e, p in segment_paths(self.job_dir, lr)]
            for seg, i, h in live_snapshots(segs):
                yield "own", lr, seg, i, h
        for _rank, paths in backup_paths(self.job_dir).items():
            segs = [self.segment(p) for _e, p in paths]
            for seg, i, h in live_snapshots(segs):
                yield "backup", -1, seg, i, h

    def find_held(self, rank: int, step: int, world: int = 0) -> tuple[str, Segment, int, SlotHeader] | None:
        """The newest live snapshot of ``step`` of ``rank`` held here (any rank's with -1; with ``world``, saved
        by a job of that many ranks), own ones first."""
        best = None
        for kind, _lr, seg, i, h in self.held():
            if h.step == step and (rank < 0 or h.rank == rank) and (not world or h.world == world):
                key = (kind == "own", h.seq)
                if best is None or key > best[0]:
                    best = (key, (kind, seg, i, h))
        return None if best is None else best[1]

    # ------------------------------------------------------------------ holding a slot for a persist
    def hold_slot(self, job: M.Persist) -> bool:
        """Flags a saver-made persist's slot PENDING (as a trainer does for its persists), so that no
        snapshot overwrites it before the persist pins it; False when it was overwritten already."""
        seg = self.segment(job.seg_path)
        with SharedLock(lock_path(self.job_dir, seg.local_rank)):
            return seg.hold_pending(job.slot, job.generation, job.step)

    def unhold_slot(self, job: M.Persist) -> None:
        seg = self.segment(job.seg_path)
        with SharedLock(lock_path(self.job_dir, seg.local_rank)):
            seg.release_pending(job.slot, job.generation)

    # ------------------------------------------------------------------ allocating
    def alloc(self, local_rank: int, meta_cap: int, data_cap: int, nslots: int) -> str:
        if not (0 <= local_rank < 1 << 16) or meta_cap <= 0 or data_cap < 0 or nslots not in (1, 2):
            raise E.ProtocolError(f"alloc: bad arguments {local_rank=} {meta_cap=} {data_cap=} {nslots=}")
        with self.state.cv:
            lock = self._alloc_locks[local_rank]
        with lock:  # one allocation of a local rank at a time: each gets the next epoch
            return self._alloc_locked(local_rank, meta_cap, data_cap, nslots)

    def _alloc_locked(self, local_rank: int, meta_cap: int, data_cap: int, nslots: int) -> str:
        existing = segment_paths(self.job_dir, local_rank)
        epoch = existing[-1][0] + 1 if existing else 0
        # Two slots come with spares: their memory is reserved only while persists hold slots (one per slot
        # held, see prepare_spares), so only their header pages are needed now.
        spare = self.knobs.spare_slots if nslots == 2 else 0
        need = 4096 + nslots * (4096 + _page(meta_cap) + _page(data_cap)) + spare * 4096
        free = self.shm_free()
        if need > free:  # first this job's own spare slots, then other jobs' idle savers
            self._release_spares_now()
            free = self.shm_free()
        if need > free:
            free = self._make_room(need)
        if need > free:  # last, this node's backups of other nodes' snapshots: its own come first
            free = self.drop_backups(need)
        if need > free:
            raise E.SharedMemoryError(
                f"local rank {local_rank} needs {need} bytes ({need / 2**30:.2f} GiB) of shared memory for "
                f"{nslots} snapshot slot(s) but only {free} bytes are free in {self.job_dir} (ENOSPC: no space "
                "left for the snapshot). Enlarge /dev/shm "
                "(docker run --shm-size=..., a Kubernetes emptyDir with medium: Memory), use FLASHCKPT_SLOTS=1, "
                "or checkpoint less state per rank.")
        path = segment_path(self.job_dir, local_rank, epoch)
        Segment.create(path, local_rank=local_rank, epoch=epoch, nslots=nslots + spare,
                       meta_cap=meta_cap, data_cap=data_cap, spare=spare)
        self.segments[path] = Segment(path, populate=False)
        log.info("allocated %s: %d slot(s) and %d spare(s), %d bytes", path, nslots, spare, need)
        self._reap_segments(local_rank)
        return path

    def _make_room(self, need: int) -> int:
        """Asks the idle savers of this user's other jobs (no client, no work: kept only for their grace
        period) to give way, the longest idle first, until ``need`` bytes are free. Each persists what
        is newer than its last commit, then exits and frees its shared memory. Returns the bytes free."""
        if self.knobs.shm_limit_bytes and \
                self.knobs.shm_limit_bytes - sum(seg.reserved_bytes() for seg in self.segments.values()) < need:
            return self.shm_free()  # this job's own limit binds: other jobs' memory would not help
        idle = self._idle_savers()
        free = self.shm_free()
        try:
            for idle_s, d, c in idle:
                if free >= need:
                    break
                try:
                    if not c.request(M.GiveWay()).giving_way:
                        continue
                except E.FlashCheckpointError:
                    continue
                log.warning("event=give_way job_dir=%s idle_s=%.0f: it persists its newest snapshot and exits "
                            "to free shared memory for this job", d, idle_s)
                deadline = time.monotonic() + self.knobs.term_timeout_s
                while os.path.exists(os.path.join(d, SOCKET_NAME)) and time.monotonic() < deadline:
                    time.sleep(0.05)
                free = self.shm_free()
        finally:
            for _, _, c in idle:
                c.close()
        return free

    def _idle_savers(self) -> list[tuple[float, str, Client]]:
        """(idle seconds, runtime dir, a connection) of this user's other jobs' idle savers, the longest idle
        first."""
        root = os.path.dirname(self.job_dir)
        idle: list[tuple[float, str, Client]] = []
        try:
            names = os.listdir(root)
        except OSError:
            return idle
        for name in names:
            d = os.path.join(root, name)
            try:
                st = os.lstat(d)
            except OSError:
                continue
            if d == self.job_dir or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            try:
                c = Client(os.path.join(d, SOCKET_NAME), timeout=10)
            except OSError:
                continue
            try:
                r = c.request(M.GiveWay(dry_run=True))
            except E.FlashCheckpointError:
                r = M.GiveWayReply()
            if r.idle:
                idle.append((r.idle_s, d, c))
            else:
                c.close()
        idle.sort(key=lambda x: -x[0])
        return idle

    def shm_free(self) -> int:
        st = os.statvfs(self.job_dir)
        free = st.f_bavail * st.f_frsize
        if self.knobs.shm_limit_bytes:
            used = sum(seg.reserved_bytes() for seg in self.segments.values())
            free = min(free, max(0, self.knobs.shm_limit_bytes - used))
        return free

    # ------------------------------------------------------------------ reaping
    def _reap_segments(self, local_rank: int) -> None:
        """Unlinks older segments of ``local_rank`` once none of their slots is pinned or pending.

        Their newest snapshot stays readable until the newest segment holds a complete one."""
        paths = segment_paths(self.job_dir, local_rank)
        if len(paths) < 2:
            return
        newest = self.segment(paths[-1][1])
        # a snapshot of this local rank's trainer, not only a copy fetched after a node loss: until it trains
        # on, the older segments hold its previous rank's snapshots, which a peer's restore may be fetching
        if not any(h.state == COMPLETE and not h.flags & FLAG_FETCHED
                   for h in (newest.header(i) for i in range(newest.nslots))):
            return
        with SharedLock(lock_path(self.job_dir, local_rank)):
            for _epoch, path in paths[:-1]:
                seg = self.segment(path)
                if any(seg.header(i).flags & FLAGS_BUSY for i in range(seg.nslots)):
                    continue
                os.unlink(path)
                self.segments.pop(path).close()

    def reap_quietly(self, local_rank: int) -> None:
        """Reaps outgrown segments after a snapshot (see ``_reap_segments``), never failing the request.

        ``alloc`` alone cannot free them: when it runs, the new segment holds no snapshot yet, so the
        old one must stay; it becomes free only once the trainer completed a snapshot in the new one,
        which the trainer's next persist or status request tells us."""
        try:
            self._reap_segments(local_rank)
            paths = segment_paths(self.job_dir, local_rank)
            if paths:
                self.release_spares(self.segment(paths[-1][1]), blocking=False)
        except (OSError, E.FlashCheckpointError) as e:
            log.warning("freeing outgrown segments of local rank %d: %s", local_rank, e)

    # ------------------------------------------------------------------ spare slots
    def want_spares(self) -> None:
        """A persist was queued (or the saver stops): wakes the spare keeper."""
        self._spares_wanted.set()

    def persist_activity(self) -> None:
        """A persist holds a slot, or just let it go: the spares are kept for the hold period from now."""
        self._persist_seen = time.monotonic()

    def prepare_spares(self, seg: Segment) -> None:
        """Reserves and faults in spare slots while persists (or backups) hold slots, off the trainer's pause,
        so that two reserved slots are always free of them: one holds the newest snapshot, the next snapshot
        goes into the other, and so a snapshot never waits for a persist. Called as a persist is queued
        (through the spare keeper) and as it begins; the trainer reserves a spare itself when this has not
        run yet (first-touching fresh shared memory costs ~0.8 s per GB). Best effort: when /dev/shm cannot
        hold one, the snapshot that finds no slot waits for a persist (and logs the wait)."""
        if seg.nslots < 3:
            return
        for _ in range(seg.nslots):
            hs = [seg.header(i) for i in range(seg.nslots)]
            free = sum(1 for h in hs if not h.flags & (FLAGS_BUSY | FLAG_UNRESERVED))
            spares = [i for i, h in enumerate(hs) if h.flags & FLAG_UNRESERVED and not h.flags & FLAG_PINNED]
            if free >= 2 or not spares:
                return
            i = min(spares, key=lambda i: (hs[i].seq, i))  # the one a snapshot would take first
            try:
                seg.reserve(i, clear_flag=False)  # no lock held: fallocate is idempotent
            except OSError as e:
                log.warning("could not reserve a spare snapshot slot of %s (%d bytes): %s; a snapshot taken "
                            "while persists hold the other slots will wait for one", seg.path, seg.slot_size, e)
                return
            with SharedLock(lock_path(self.job_dir, seg.local_rank)):
                h = seg.header(i)
                if h.flags & FLAG_UNRESERVED and not h.flags & FLAG_PINNED:
                    seg.set_flags(i, h.flags & ~FLAG_UNRESERVED)

    def release_spares(self, seg: Segment, *, blocking: bool = True, force: bool = False) -> None:
        """Gives back the memory of a segment's reserved slots beyond two once none is held for a persist (or
        a backup): the spares are needed only while persists run. They are kept for
        ``FLASHCKPT_SPARE_HOLD_S`` after the last persist (reserving one again costs a first touch of fresh
        memory, which the next snapshot during a persist would pay), unless ``force`` (/dev/shm is short).
        The slots given back are the oldest that are neither being written nor the newest complete one
        (empty ones first). Without ``blocking`` it does nothing while the segment's lock is taken (a
        request handler never waits on a trainer)."""
        if seg.nslots < 3:
            return
        if not force and time.monotonic() - self._persist_seen < self.knobs.spare_hold_s:
            return
        lock = SharedLock(lock_path(self.job_dir, seg.local_rank))
        if not lock.acquire(blocking=blocking):
            return
        try:
            hs = [seg.header(i) for i in range(seg.nslots)]
            if any(h.flags & FLAGS_BUSY for h in hs):
                return
            reserved = [i for i, h in enumerate(hs) if not h.flags & FLAG_UNRESERVED]
            newest = max((i for i in reserved if hs[i].state == COMPLETE), key=lambda i: (hs[i].seq, i), default=None)
            idle = sorted((i for i in reserved if i != newest and hs[i].state != WRITING),
                          key=lambda i: (hs[i].state == COMPLETE, hs[i].seq))
            gone = idle[:max(0, len(reserved) - 2)]
            for i in gone:
                h = hs[i]
                seg.write_header(i, SlotHeader(EMPTY, FLAG_UNRESERVED | FLAG_PINNED, -1, h.generation + 1,
                                               0, 0, 0, 0, 0.0, h.seq))
        finally:
            lock.release()
        for i in gone:
            seg.release(i)  # outside the lock: FLAG_PINNED keeps writers away meanwhile
        if gone:
            with SharedLock(lock_path(self.job_dir, seg.local_rank)):
                for i in gone:
                    seg.set_flags(i, seg.header(i).flags & ~FLAG_PINNED)

    def spare_keeper(self) -> None:
        """The spare keeper's thread: reserves spare slots as soon as persists are queued (``want_spares``)
        or held, and gives them back once no persist has held a slot for the hold period."""
        while not self.state.stop.is_set():
            self._spares_wanted.wait(1.0)
            self._spares_wanted.clear()
            try:
                segs = list(self.segments.values())
            except RuntimeError:  # changed size meanwhile: next round
                continue
            for seg in segs:
                try:
                    if any(seg.header(i).flags & FLAGS_BUSY for i in range(seg.nslots)):
                        self.prepare_spares(seg)
                    else:
                        self.release_spares(seg, blocking=False)
                except (OSError, ValueError, E.FlashCheckpointError) as e:  # ValueError: unmapped meanwhile
                    log.debug("the spare slots of %s: %s", seg.path, e)

    def _release_spares_now(self) -> None:
        """/dev/shm is short: every spare slot not held for a persist gives its memory back at once."""
        for seg in list(self.segments.values()):
            try:
                self.release_spares(seg, force=True)
            except (OSError, ValueError, E.FlashCheckpointError) as e:
                log.warning("giving back the spare slots of %s: %s", seg.path, e)

    # ------------------------------------------------------------------ backups of other nodes' ranks
    def backup_segment(self, rank: int, meta_cap: int, data_cap: int, step: int) -> Segment:
        """The newest backup segment of ``rank``, made (a new epoch) when there is none or it is too small
        (room made, if need be, from backups of ranks whose newest backup is older than ``step``: after a
        restart that moved the ranks, those of ranks no partner serves any more)."""
        paths = backup_paths(self.job_dir).get(rank, [])
        if paths:
            seg = self.segment(paths[-1][1])
            if seg.meta_cap >= meta_cap and seg.data_cap >= data_cap:
                return seg
        epoch = paths[-1][0] + 1 if paths else 0
        path = os.path.join(self.job_dir, f"bak-r{rank:05d}-e{epoch:06d}.shm")
        need = 4096 + 2 * (4096 + meta_cap + data_cap)
        if need > self.shm_free() and self.drop_backups(need, keep=rank, older_than=step) < need:
            raise E.SharedMemoryError(f"no room in {self.job_dir} for a backup of rank {rank} ({need} bytes)")
        Segment.create(path, local_rank=BACKUP_BASE + rank, epoch=epoch, nslots=2, meta_cap=meta_cap,
                       data_cap=data_cap)
        seg = self.segments[path] = Segment(path, populate=False)
        log.info("event=backup_segment rank=%d path=%s bytes=%d", rank, path, need)
        return seg

    def drop_backups(self, need: int, *, keep: int = -1, older_than: int | None = None) -> int:
        """Removes backup segments until ``need`` bytes of shared memory are free: those whose newest backup
        is the oldest first, never one being persisted or sent, nor ``keep``'s; with ``older_than``, only
        those whose newest backup is of an older step. Returns the bytes free. (A node's own snapshots come
        before second copies of its partners': a backup dropped costs redundancy, not a checkpoint.)"""
        free = self.shm_free()
        found = []
        for rank, paths in backup_paths(self.job_dir).items():
            if rank == keep:
                continue
            for _epoch, path in paths:
                seg = self.segment(path)
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
                    self.segments.pop(path).close()
            if older_than is not None:  # e.g. a rank that moved to another node at a restart
                log.info("event=backup_dropped rank=%d path=%s: older than step %d, whose backup needs the room",
                         rank, path, older_than)
            else:
                log.warning("event=backup_dropped rank=%d path=%s: shared memory is short, and this node's own "
                            "snapshots come first (a loss of rank %d's node now resumes from its other copies or "
                            "from storage)", rank, path, rank)
            free = self.shm_free()
        return free

    # ------------------------------------------------------------------ an earlier layout of the job
    def other_layouts(self, world: int) -> float:
        """The wall time of the newest snapshot here (own segments and backups) saved by a job of another number
        of ranks than ``world``; 0 when there is none (or ``world`` is not known)."""
        newest = 0.0
        if world <= 0:
            return newest
        for _kind, _lr, _seg, _i, h in self.held():
            if h.world and h.world != world:
                newest = max(newest, h.wall_time)
        return newest

    def release_layouts(self, world: int, before: float) -> tuple[list[str], int]:
        """Gives back the memory of an earlier layout of the job (another number of ranks than ``world``, the
        job's now) once storage holds a newer state: removes every segment whose snapshots were all saved by
        another number of ranks before ``before`` (the snapshot time of the newest commit): backups, copies
        fetched for a resharded load, the segments of a local rank the job no longer has. Never a segment with a
        slot being persisted, sent or received, nor one without a snapshot (just allocated). Returns the paths
        removed and their bytes."""
        groups = [segment_paths(self.job_dir, lr) for lr in local_ranks(self.job_dir)]
        groups += list(backup_paths(self.job_dir).values())
        removed, freed = [], 0
        for paths in groups:
            for _epoch, path in paths:
                seg = self.segment(path)
                with SharedLock(lock_path(self.job_dir, seg.local_rank)):
                    hs = [seg.header(i) for i in range(seg.nslots)]
                    done = [h for h in hs if h.state == COMPLETE]
                    if not done or any(h.flags & FLAGS_BUSY or h.state == WRITING for h in hs):
                        continue
                    if any(not h.world or h.world == world or h.wall_time >= before for h in done):
                        continue
                    freed += seg.reserved_bytes()
                    os.unlink(path)
                    with contextlib.suppress(BufferError):
                        self.segments.pop(path).close()
                    removed.append(path)
        return removed, freed

    def reap_backups(self, rank: int) -> None:
        """Removes a rank's older backup segments once the newest holds a complete backup."""
        paths = backup_paths(self.job_dir).get(rank, [])
        for _epoch, path in paths[:-1]:
            seg = self.segment(path)
            with SharedLock(lock_path(self.job_dir, seg.local_rank)):
                if any(seg.header(i).flags & FLAGS_BUSY for i in range(seg.nslots)):
                    continue
                os.unlink(path)
                self.segments.pop(path).close()
