"""The saver's shared memory: allocating segments (``posix_fallocate``: a full /dev/shm is an error at
allocation, never a SIGBUS), making room, the spare slots of two-slot segments, reaping old segments."""

from __future__ import annotations

import os
import stat
import time

from flashckpt import errors as E
from flashckpt.format.segment import (
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
    lock_path,
    segment_path,
    segment_paths,
)
from flashckpt.saver._base import SaverBase, log
from flashckpt.transport import messages as M
from flashckpt.transport.ipc import SharedLock
from flashckpt.transport.spawn import SOCKET_NAME
from flashckpt.transport.wire import Client


class SegmentsPart(SaverBase):
    def _alloc(self, local_rank: int, meta_cap: int, data_cap: int, nslots: int) -> str:
        if not (0 <= local_rank < 1 << 16) or meta_cap <= 0 or data_cap < 0 or nslots not in (1, 2):
            raise E.ProtocolError(f"alloc: bad arguments {local_rank=} {meta_cap=} {data_cap=} {nslots=}")
        with self._cv:
            lock = self._alloc_locks[local_rank]
        with lock:  # one allocation of a local rank at a time: each gets the next epoch
            return self._alloc_locked(local_rank, meta_cap, data_cap, nslots)

    def _alloc_locked(self, local_rank: int, meta_cap: int, data_cap: int, nslots: int) -> str:
        existing = segment_paths(self.job_dir, local_rank)
        epoch = existing[-1][0] + 1 if existing else 0
        # Two slots come with spares: their memory is reserved only while persists hold slots (one per slot
        # held, see _prepare_spares), so only their header pages are needed now.
        spare = self.knobs.spare_slots if nslots == 2 else 0
        need = 4096 + nslots * (4096 + _page(meta_cap) + _page(data_cap)) + spare * 4096
        free = self._shm_free()
        if need > free:  # first this job's own spare slots, then other jobs' idle savers
            self._release_spares_now()
            free = self._shm_free()
        if need > free:
            free = self._make_room(need)
        if need > free:  # last, this node's backups of other nodes' snapshots: its own come first
            free = self._drop_backups(need)
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
        self._segments[path] = Segment(path, populate=False)
        log.info("allocated %s: %d slot(s) and %d spare(s), %d bytes", path, nslots, spare, need)
        self._reap_segments(local_rank)
        return path

    def _make_room(self, need: int) -> int:
        """Asks the idle savers of this user's other jobs (no client, no work: kept only for their grace
        period) to give way, the longest idle first, until ``need`` bytes are free. Each persists what
        is newer than its last commit, then exits and frees its shared memory. Returns the bytes free."""
        if self.knobs.shm_limit_bytes and \
                self.knobs.shm_limit_bytes - sum(seg.reserved_bytes() for seg in self._segments.values()) < need:
            return self._shm_free()  # this job's own limit binds: other jobs' memory would not help
        root = os.path.dirname(self.job_dir)
        idle: list[tuple[float, str, Client]] = []
        try:
            names = os.listdir(root)
        except OSError:
            return self._shm_free()
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
        free = self._shm_free()
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
                free = self._shm_free()
        finally:
            for _, _, c in idle:
                c.close()
        return free

    def _shm_free(self) -> int:
        st = os.statvfs(self.job_dir)
        free = st.f_bavail * st.f_frsize
        if self.knobs.shm_limit_bytes:
            used = sum(seg.reserved_bytes() for seg in self._segments.values())
            free = min(free, max(0, self.knobs.shm_limit_bytes - used))
        return free

    def _reap_segments(self, local_rank: int) -> None:
        """Unlinks older segments of ``local_rank`` once none of their slots is pinned or pending.

        Their newest snapshot stays readable until the newest segment holds a complete one."""
        paths = segment_paths(self.job_dir, local_rank)
        if len(paths) < 2:
            return
        newest = self._segment(paths[-1][1])
        # a snapshot of this local rank's trainer, not only a copy fetched after a node loss: until it trains
        # on, the older segments hold its previous rank's snapshots, which a peer's restore may be fetching
        if not any(h.state == COMPLETE and not h.flags & FLAG_FETCHED
                   for h in (newest.header(i) for i in range(newest.nslots))):
            return
        with SharedLock(lock_path(self.job_dir, local_rank)):
            for _epoch, path in paths[:-1]:
                seg = self._segment(path)
                if any(seg.header(i).flags & FLAGS_BUSY for i in range(seg.nslots)):
                    continue
                os.unlink(path)
                self._segments.pop(path).close()

    def _prepare_spares(self, seg: Segment) -> None:
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

    def _release_spares(self, seg: Segment, *, blocking: bool = True, force: bool = False) -> None:
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

    def _spare_keeper(self) -> None:
        """Reserves spare slots as soon as persists are queued (``_spares_wanted``, set by ``_enqueue``) or
        held, and gives them back once no persist has held a slot for the hold period."""
        while not self._stop.is_set():
            self._spares_wanted.wait(1.0)
            self._spares_wanted.clear()
            try:
                segs = list(self._segments.values())
            except RuntimeError:  # changed size meanwhile: next round
                continue
            for seg in segs:
                try:
                    if any(seg.header(i).flags & FLAGS_BUSY for i in range(seg.nslots)):
                        self._prepare_spares(seg)
                    else:
                        self._release_spares(seg, blocking=False)
                except (OSError, ValueError, E.FlashCheckpointError) as e:  # ValueError: unmapped meanwhile
                    log.debug("the spare slots of %s: %s", seg.path, e)

    def _release_spares_now(self) -> None:
        """/dev/shm is short: every spare slot not held for a persist gives its memory back at once."""
        for seg in list(self._segments.values()):
            try:
                self._release_spares(seg, force=True)
            except (OSError, ValueError, E.FlashCheckpointError) as e:
                log.warning("giving back the spare slots of %s: %s", seg.path, e)

    def _reap_quietly(self, local_rank: int) -> None:
        """Reaps outgrown segments after a snapshot (see ``_reap_segments``), never failing the request.

        ``_alloc`` alone cannot free them: when it runs, the new segment holds no snapshot yet, so the
        old one must stay; it becomes free only once the trainer completed a snapshot in the new one,
        which the trainer's next persist or status request tells us."""
        try:
            self._reap_segments(local_rank)
            paths = segment_paths(self.job_dir, local_rank)
            if paths:
                self._release_spares(self._segment(paths[-1][1]), blocking=False)
        except (OSError, E.FlashCheckpointError) as e:
            log.warning("freeing outgrown segments of local rank %d: %s", local_rank, e)

    def _segment(self, path: str) -> Segment:
        seg = self._segments.get(path)
        if seg is None:
            seg = self._segments[path] = Segment(path, populate=False)
        return seg

