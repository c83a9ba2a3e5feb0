"""The snapshot writer: copies a state dict into a slot of shared memory, by its plan.

The plan (``memory.plan.plan_snapshot``) lays out every distinct tensor storage once (64-byte aligned), and
is reused while the state dict's structure is unchanged (``signature_of``, or the native scan's signature).
``SharedMemoryHandler`` is the trainer's side of one local rank's segments: it claims a slot (never the
newest COMPLETE one, nor one a persist holds; see ``segment``), copies the tensors and the opaque blob in
and marks the slot COMPLETE. It reads snapshots back as a ``SnapshotReader`` does.
"""

from __future__ import annotations

import array
import io
import json
import logging
import re
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from flashckpt import errors as E
from flashckpt.config import knob
from flashckpt.format.segment import (
    COMPLETE,
    EMPTY,
    FLAG_PENDING,
    FLAG_PINNED,
    FLAG_SENDING,
    FLAG_UNRESERVED,
    FLAGS_BUSY,
    WRITING,
    Segment,
    SlotHeader,
    SlotRef,
    lock_path,
    segment_paths,
    unreadable,
)
from flashckpt.format.tree import (
    Flat,
    _key_str,
    _path_to,
    check_tensor,
    encode_opaque,
    flatten,
    flatten_like,
    gc_paused,
)
from flashckpt.memory.device import DeviceCopies
from flashckpt.memory.plan import SnapshotPlan, plan_snapshot, signature_of
from flashckpt.memory.reader import SnapshotReader
from flashckpt.memory.writer_lease import take_writer_lease
from flashckpt.transport.ipc import SharedLock
from flashckpt.util import native as _native
from flashckpt.util.copy import Copier
from flashckpt.util.lease import Lease

__all__ = ["SharedMemoryHandler", "Allocator"]

log = logging.getLogger(__name__)

Allocator = Callable[[int, int, int], str]
"""(local_rank, meta_cap, data_cap) -> path of a new segment created by the saver."""


def _holders(hs: list[SlotHeader], newest: int | None) -> str:
    """What holds a segment's slots, for a log line: "step 1 (being persisted), step 3 (the newest snapshot)"."""
    out = []
    for i, h in enumerate(hs):
        what = ["being persisted" if h.flags & FLAG_PINNED else "queued to persist"] \
            if h.flags & (FLAG_PINNED | FLAG_PENDING) else []
        if h.flags & FLAG_SENDING:
            what.append("being sent to a partner node")
        if i == newest:
            what.append("the newest snapshot")
        if what:
            out.append(f"step {h.step} ({', '.join(what)})")
    return ", ".join(out) or "none"


@dataclass(frozen=True)
class _HostCopy:
    """What ``start_save`` leaves to its ``finish``: the claimed slot of ``seg``, the plan, the metadata and
    opaque blob to write, the large host copies as (offset, source address, bytes), the native extension
    (None without it) with the storage addresses it copies the small ones from, and the device copies' event."""

    seg: Segment
    slot: int
    step: int
    plan: SnapshotPlan
    meta: bytes
    blob: bytes
    large: list[tuple[int, int, int]]
    native: Any
    ptrs: Any
    device_done: Any


# A snapshot's tensors as ``_scan`` tells them apart: the native scan's packed signature, or the Python one.
Signature = bytes | tuple[Any, ...]


@dataclass(frozen=True)
class _Ready:
    """What a deferred snapshot's copies wait for: the event recorded at ``save`` on the current stream of
    the device of its CUDA tensors."""

    device: torch.device
    event: Any


def _refuse(root: Any, t: torch.Tensor) -> None:
    """Raises the InvalidStateDictError for tensor ``t`` of ``root``, which the native scan found unstorable."""
    check_tensor(t, _path_to(root, t))
    raise E.InvalidStateDictError(f"save(): the tensor at {_key_str(_path_to(root, t))} cannot be stored")


class SharedMemoryHandler(SnapshotReader):
    """The trainer's side of one local rank's segment: writes snapshots, reads them back (as a
    ``SnapshotReader``; a handler without an allocator is one, made from a runtime dir).

    Args:
        local_rank: whose segment.
        job_dir: the job's runtime dir.
        allocate: asks the saver for a new segment; None for a read-only handler. A handler with an
            allocator is the one writer of ``local_rank``'s segments: from its first save it holds their
            writer lease until ``close`` (released by the kernel if the process dies), and a second
            writer's save is refused. Reading takes no lease.
        copier: the thread pool that copies bytes (one is made when None).
        slot_wait_timeout: bound on waiting for a free slot while every slot is held for persists.
        weights_only: decode opaque leaves of loaded snapshots only into the types
            ``torch.load(weights_only=True)`` accepts; a writer then refuses, before writing anything, a
            state dict holding a leaf that would not load back under those rules.
        writer_info: what the writer lease says about its holder (JSON), for a refused second writer; its
            ``rank`` and ``world_size`` are recorded in every slot it writes.
        rank / world_size / own_only: which snapshots it reads as its own (see ``SnapshotReader``): an
            engine's handler reads its rank's snapshots of its number of ranks, none another live process
            writes.

    Not thread-safe. While ``save_state_dict`` runs the caller must not mutate the tensors it passed;
    once it returns they are the caller's again.
    """

    def __init__(self, local_rank: int, job_dir: str, *, allocate: Allocator | None = None,
                 copier: Copier | None = None, slot_wait_timeout: float = 600.0,
                 weights_only: bool = False, writer_info: dict[str, Any] | None = None, rank: int | None = None,
                 world_size: int | None = None, own_only: bool = False) -> None:
        self._setup(local_rank, job_dir, copier or Copier(1), own_copier=copier is None, weights_only=weights_only,
                    rank=rank, world_size=world_size, own_only=own_only)
        self._allocate = allocate
        self._lease: Lease | None = None
        self._writer_info = writer_info or {}
        # The global rank recorded in each slot it writes (+1; 0: unknown), so that a restart whose ranks moved
        # between nodes, and a peer holding this slot as a backup, know whose shard it is.
        rank = self._writer_info.get("rank")
        self._owner = int(rank) + 1 if isinstance(rank, int) and rank >= 0 else 0
        # And the number of ranks of its job: a restart with another number never takes a plain engine's
        # snapshot for its own (each rank's state belongs to that layout).
        world = self._writer_info.get("world_size")
        self._world = int(world) if isinstance(world, int) and world > 0 else 0
        self._lock = SharedLock(lock_path(job_dir, local_rank))
        self._seg: Segment | None = None
        self._plan: SnapshotPlan | None = None
        self._tree_cache: tuple[SnapshotPlan, Any, str] | None = None
        self._deferred_bytes: int | None = None  # pending_bytes of a deferred snapshot
        self._device = DeviceCopies()
        self.slot_wait_timeout = slot_wait_timeout
        self._seq = -1  # the highest save sequence number seen; -1 until the live segments were read
        self._loadable: set[int] = set()  # digests of opaque leaves known to load under weights_only

    # ------------------------------------------------------------------ write
    def save_state_dict(self, step: int, state_dict: Any, ckpt_name: str = "") -> SlotRef:
        """Copies ``state_dict`` into a free slot and marks it COMPLETE; see ``start_save``."""
        return self.start_save(step, state_dict, ckpt_name)()

    def start_save(self, step: int, state_dict: Any, ckpt_name: str = "", *,
                   defer: bool = False) -> Callable[[], SlotRef]:
        """Plans the snapshot, claims a free slot and queues device-to-host copies; returns ``finish``,
        which copies the host tensors and marks the slot COMPLETE (on any thread; the overlapped mode
        runs it in the background while training goes on).

        Args:
            step: the training step the snapshot belongs to.
            state_dict: the tree to snapshot. Its tensors must not change until ``finish`` returned.
            ckpt_name: where the snapshot is to be persisted (kept in its metadata).
            defer: ``finish`` runs in the background (an overlapped save): (``FLASHCKPT_CUDA_DEFER``, on by
                default) a snapshot of CUDA tensors that needs a new plan (the first one, or a new structure) then leaves
                the plan, the segment, the slot and the queueing of its copies to ``finish`` too, ordered after
                the work queued before this call; the walk, the tensor checks and the encoding of plain leaves
                still run here.

        Raises:
            InvalidStateDictError: something in ``state_dict`` cannot be stored (nothing was written); a
                deferred snapshot raises the plan's own refusals (``plan_snapshot``) from ``finish``.
            SharedMemoryError: /dev/shm cannot hold the snapshot, or another writer holds this local
                rank's segments (the message names it; nothing was written).
            CheckpointTimeoutError: no slot became free within ``slot_wait_timeout``.
        """
        if self._lease is None and self._allocate is not None:
            self._lease = take_writer_lease(self.job_dir, self.local_rank, self._writer_info)
        # The walk allocates ~5 containers per tensor: no garbage collection in the middle of the pause.
        with gc_paused():
            native = _native.get()
            flat = self._flatten(state_dict, native)
            sig, ptrs = self._scan(state_dict, flat.tensors, native)
            blob, lengths = encode_opaque(flat.opaque, state_dict)
            if self.weights_only and flat.opaque:
                self._check_loadable(state_dict, flat.opaque, blob, lengths)
            self._deferred_bytes = None
            ready = self._deferrable(flat.tensors, sig) if defer and knob("cuda_defer") else None
            copy = None if ready is not None else \
                self._prepare(step, ckpt_name, state_dict, flat, native, sig, ptrs, blob, lengths, None)
        # The copies read the tensors by address: they are kept alive until finish() is done with them. An
        # overlapped save's caller may drop its state dict at once (``save(step, {"w": torch.ones(3)})``),
        # and a freed tensor's memory is reused or unmapped under the background copy.
        sources: list[torch.Tensor] | None = flat.tensors
        pending: Flat | None = flat if copy is None else None
        del flat

        def finish() -> SlotRef:
            nonlocal sources, pending, copy
            try:
                if copy is None:
                    assert pending is not None
                    with torch.cuda.device(ready.device if ready is not None else None), gc_paused():
                        copy = self._prepare(step, ckpt_name, state_dict, pending, native, sig, ptrs, blob,
                                             lengths, ready)
                    pending = None
                self._copy_host(copy)
            finally:
                sources = None  # copied (or failed): the caller's tensors are free to go
            return self._complete(copy)

        return finish

    @property
    def pending_bytes(self) -> int:
        """The tensor bytes of the snapshot just started: its plan's, or, while a deferred snapshot's plan is
        still to be made (``start_save(defer=True)``), the bytes of its tensors as they are (a view counts its
        own elements, a tensor tied to another counts again)."""
        if self._deferred_bytes is not None:
            return self._deferred_bytes
        return self._plan.tensor_bytes if self._plan is not None else 0

    def _deferrable(self, tensors: list[torch.Tensor], sig: Signature) -> _Ready | None:
        """For an overlapped save: when the snapshot needs a new plan (made in Python, ~20 µs a tensor) and
        holds CUDA tensors, an event on the current stream of their device (what ``finish``'s copies wait
        for); else None (planned here, as always). Needs the native scan (its signature tells a new plan)."""
        if not isinstance(sig, bytes) or (self._plan is not None and self._plan.native_signature == sig):
            return None
        dev = next((t.device for t in tensors if t.is_cuda), None)
        if dev is None:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
        self._deferred_bytes = sum(t.nbytes for t in tensors)
        return _Ready(dev, ev)

    def _prepare(self, step: int, ckpt_name: str, state_dict: Any, flat: Flat, native: Any, sig: Signature,
                 ptrs: Any, blob: bytes, lengths: list[int], ready: _Ready | None) -> _HostCopy:
        """The plan, metadata, segment and claimed slot of a snapshot, its device copies queued (after
        ``ready``'s event when given, else after the current stream's work): what ``finish`` completes."""
        plan = self._plan_of(state_dict, flat.tensors, sig)
        meta = self._meta_json(step, ckpt_name, flat, plan, lengths)
        on_device = sum(n for _i, _o, n in plan.device_copies)
        seg = self._segment_for(len(meta), plan.tensor_bytes + len(blob),
                                populate=on_device * 2 < plan.tensor_bytes or knob("cuda_register") != "background")
        if self._device.registered:
            self._device.release_stale(seg)
        slot = self._acquire_slot(seg, step)
        try:
            device_done = self._device.copy(seg, slot, flat.tensors, plan, native=native, ptrs=ptrs,
                                            host_copy=self._copier.run,
                                            ready=None if ready is None else ready.event) \
                if plan.device_copies else None
        except BaseException:
            self._set_state(seg, slot, EMPTY)
            raise
        if native is not None:
            addr = array.array("q", ptrs)
            large = [(off, addr[i], n) for i, off, n in plan.large_copies]
        else:
            large = [(off, ptrs[i], n) for i, off, n in plan.copies]
        return _HostCopy(seg, slot, step, plan, meta, blob, large, native, ptrs, device_done)

    def _flatten(self, state_dict: Any, native: Any) -> Flat:
        """The state dict's tensors, skeleton and opaque leaves: the last snapshot's skeleton reused while the
        tree keeps its structure and plain leaves (``flatten_like``, or the native extension's), else a new
        walk (``flatten``). The tensor checks are the native scan's when the extension is there."""
        cached = self._tree_cache
        if cached and native is not None:
            ts = native.flatten_like(state_dict, cached[1], torch.nn.Parameter, OrderedDict)
            flat = Flat(cached[1], ts, []) if ts is not None else None
        else:
            flat = flatten_like(state_dict, cached[1], check_tensors=native is None) if cached else None
        if flat is None:
            flat = flatten(state_dict, check_tensors=native is None, weights_only=self.weights_only)
        return flat

    def _scan(self, state_dict: Any, tensors: list[torch.Tensor], native: Any) -> tuple[Signature, Any]:
        """The signature of ``tensors`` (the native scan's bytes, or the Python tuple without the extension)
        and their storage addresses (the native scan's packed int64s, or a list). Raises InvalidStateDictError
        naming an unstorable tensor."""
        if native is not None:
            # One C++ call for the signature and storage addresses (and the tensor checks).
            nsig, nptrs, bad = native.scan(tensors, torch.nn.Parameter)
            if bad >= 0:
                _refuse(state_dict, tensors[bad])
            return nsig, nptrs
        try:
            return signature_of(tensors)
        except RuntimeError:
            for t in tensors:
                check_tensor(t, _path_to(state_dict, t))  # raises, naming the key
            raise

    def _plan_of(self, state_dict: Any, tensors: list[torch.Tensor], sig: Signature) -> SnapshotPlan:
        """The plan for ``tensors`` of signature ``sig`` (``_scan``'s; the last plan while it is unchanged).
        Raises InvalidStateDictError naming a tensor whose file would not load back."""

        def key_of(i: int) -> str:
            return _key_str(_path_to(state_dict, tensors[i]))

        plan = self._plan
        if isinstance(sig, bytes):
            if plan is None or plan.native_signature != sig:
                py_sig, _ = signature_of(tensors)
                plan = self._plan = plan_snapshot(tensors, py_sig, native_signature=sig, key_of=key_of)
            return plan
        if plan is None or plan.signature != sig:
            plan = self._plan = plan_snapshot(tensors, sig, key_of=key_of)
        return plan

    def _copy_host(self, c: _HostCopy) -> None:
        """``finish``'s copies into the claimed slot: the host tensors (small ones in one native call, large
        ones on the copier's threads), the opaque blob and the metadata; then waits for the device copies.
        On any failure the slot is left EMPTY."""
        seg, slot, plan = c.seg, c.slot, c.plan
        try:
            data = seg.base + seg.data_off(slot)
            small = None
            native = c.native
            if native is not None and plan.small_copies_packed:
                def small() -> None:
                    native.copy_storages(data, c.ptrs, plan.small_copies_packed)
            self._copier.run([(data + off, src, n) for off, src, n in c.large], small, plan.small_copy_work)
            if c.blob:
                off = seg.data_off(slot) + plan.tensor_bytes
                seg.mm[off: off + len(c.blob)] = c.blob
            moff = seg.meta_off(slot)
            seg.mm[moff: moff + len(c.meta)] = c.meta
            if c.device_done is not None:
                c.device_done.synchronize()
        except BaseException:
            self._set_state(seg, slot, EMPTY)
            raise

    def _complete(self, c: _HostCopy) -> SlotRef:
        """Marks the slot of a finished copy COMPLETE (its header: step, metadata digest, sizes, owner)."""
        seg, slot = c.seg, c.slot
        h0 = seg.header(slot)
        gen = h0.generation
        seg.write_header(slot, SlotHeader(COMPLETE, 0, c.step, gen, len(c.meta), xxhash.xxh64_intdigest(c.meta),
                                          c.plan.tensor_bytes, len(c.blob), time.time(), h0.seq, self._owner,
                                          self._world))
        return SlotRef(seg.path, slot, gen, c.step)

    def _check_loadable(self, root: Any, opaque: list[Any], blob: bytes, lengths: list[int]) -> None:
        """Refuses, before anything is written, an opaque leaf that ``torch.load(weights_only=True)`` (and
        a memory load under the same rules) would refuse at resume time. Each distinct leaf (by its
        pickle's digest) is checked once, so a training loop saving the same objects pays a hash per
        leaf, and a state dict of tensors and plain values nothing at all."""

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

    def _segment_for(self, meta_len: int, data_len: int, *, populate: bool = True) -> Segment:
        """The segment to write a snapshot of ``meta_len`` / ``data_len`` bytes into (a new one from the saver
        when the current one is too small). ``populate`` False: its slots are not faulted in up front (a
        snapshot mostly of CUDA tensors: the background page-locking maps them, off the training path)."""
        seg = self._seg
        if seg is None:
            paths = segment_paths(self.job_dir, self.local_rank)
            if paths:
                seg = self._seg = Segment(paths[-1][1], populate=populate)
        if seg is not None and meta_len <= seg.meta_cap and data_len <= seg.data_cap:
            return seg
        if self._allocate is None:
            raise E.SharedMemoryError("this SharedMemoryHandler is read-only (no allocator)")
        meta_cap = max(2 * meta_len, 64 << 10)
        data_cap = data_len + max(data_len // 64, 64 << 10)  # slack for growing plain leaves
        path = self._allocate(self.local_rank, meta_cap, data_cap)
        if self._seg is not None:
            self._device.forget(self._seg)
            self._seg.close()
        self._seg = Segment(path, populate=populate)
        return self._seg

    def _next_seq(self, seg: Segment) -> int:
        """The save sequence number of a new snapshot: above every snapshot of this local rank in memory
        (all live segments, the first time; a restarted trainer goes on from what it finds)."""
        if self._seq < 0:
            for _epoch, path in segment_paths(self.job_dir, self.local_rank):
                try:
                    other = self._open(path)
                except (FileNotFoundError, E.FlashCheckpointError):
                    continue  # removed since it was listed, or not a segment of ours
                except OSError as e:  # a sequence below its snapshots' would make this save look older
                    raise unreadable("open the shared-memory segment", path, e) from e
                self._seq = max([self._seq] + [other.header(i).seq for i in range(other.nslots)])
        self._seq = max([self._seq] + [seg.header(i).seq for i in range(seg.nslots)]) + 1
        return self._seq

    def _acquire_slot(self, seg: Segment, step: int) -> int:
        """Claims a slot to write: never one held for a persist (or a backup), never (with two or more slots)
        the one holding the newest COMPLETE snapshot; a reserved one first (empty, else the oldest), else a
        spare, reserved now. When none is left (every slot held: more persists in flight than spares, or
        /dev/shm cannot hold a spare) it waits, bounded, and logs the wait (``_wait_for_slot``)."""
        slot, why, refused = self._claim(seg, spares=True)
        return slot if slot is not None else self._wait_for_slot(seg, step, why, spares=not refused)

    def _claim(self, seg: Segment, *, spares: bool) -> tuple[int | None, str, bool]:
        """One try of ``_acquire_slot``: the slot claimed (WRITING, with a new generation and the next save
        sequence number), or None and why no slot could be taken (what held the slots, or /dev/shm's refusal
        of a spare); and whether /dev/shm refused a spare. ``spares``: reserving a spare may be tried."""
        with self._lock:
            hs = [seg.header(i) for i in range(seg.nslots)]
            newest = max((i for i, h in enumerate(hs) if h.state == COMPLETE),
                         key=lambda i: (hs[i].seq, i), default=None)
            free = [i for i, h in enumerate(hs) if not h.flags & FLAGS_BUSY and (i != newest or seg.nslots == 1)]
            free.sort(key=lambda i: (bool(hs[i].flags & FLAG_UNRESERVED), hs[i].state == COMPLETE, hs[i].seq))
            for i in free:
                h = hs[i]
                if h.flags & FLAG_UNRESERVED:
                    if not spares:
                        break
                    self._device.drop((seg.path, i))  # it pins the pages the saver gave back
                    try:
                        seg.reserve(i)
                    except OSError as e:  # the other spares would not fit either
                        return None, (f"/dev/shm cannot hold another slot ({seg.slot_size} bytes: {e}); "
                                      f"held: {_holders(hs, newest)}"), True
                seq = self._next_seq(seg)
                seg.write_header(i, SlotHeader(WRITING, 0, h.step, h.generation + 1, 0, 0, 0, 0, 0.0, seq))
                return i, "", False
            return None, f"every slot was held: {_holders(hs, newest)}", False

    def _wait_for_slot(self, seg: Segment, step: int, why: str, *, spares: bool) -> int:
        """Waits (bounded by ``slot_wait_timeout``) until a slot is free, claims it, and logs the wait once,
        at WARNING: its step, how long it took and ``why`` (what held the slots when it began). A snapshot is
        never skipped. ``spares`` False (/dev/shm refused one): only reserved slots are tried."""
        t0 = time.monotonic()
        delay = 0.0005
        while True:
            if time.monotonic() - t0 >= self.slot_wait_timeout:
                raise E.CheckpointTimeoutError(
                    f"save(step {step}): no shared-memory slot of local rank {self.local_rank} became free within "
                    f"{self.slot_wait_timeout:.0f} s ({why}); storage is slower than the persist interval. "
                    "Persist less often, or check that the saver is alive (flashckpt ls).")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
            slot, _, _ = self._claim(seg, spares=spares)
            if slot is not None:
                log.warning("save(step %d): waited %.3f s for a snapshot slot of local rank %d: %s. A snapshot waits "
                            "only while every slot is held (up to FLASHCKPT_SPARE_SLOTS spare slots, one per "
                            "persist in flight) or /dev/shm cannot hold another: persist less often, enlarge "
                            "/dev/shm or raise FLASHCKPT_SPARE_SLOTS", step, time.monotonic() - t0,
                            self.local_rank, why)
                return slot

    def _set_state(self, seg: Segment, slot: int, state: int) -> None:
        with self._lock:
            struct.pack_into("<I", seg.mm, seg.slot_off(slot), state)

    def mark_pending(self, ref: SlotRef) -> None:
        """Flags ``ref``'s slot as awaiting a persist, so no later snapshot overwrites it first."""
        seg = self._open(ref.path)
        with self._lock:
            if not seg.hold_pending(ref.slot, ref.generation, ref.step):
                raise E.FlashCheckpointError(f"step {ref.step}: its slot was overwritten before its persist")

    def clear_pending(self, ref: SlotRef) -> None:
        seg = self._open(ref.path)
        with self._lock:
            seg.release_pending(ref.slot, ref.generation)

    def _holds_lease(self, local_rank: int) -> bool:
        return local_rank == self.local_rank and self._lease is not None and self._lease.locked()

    def _open(self, path: str) -> Segment:
        """The segment at ``path``: the one we write, else a cached read-only mapping."""
        if self._seg is not None and self._seg.path == path:
            return self._seg
        return super()._open(path)

    def segment_gone(self) -> bool:
        """Whether the segment this writer maps was removed or replaced under it (a wiped runtime dir): what
        it copies there no longer reaches anyone."""
        return self._seg is not None and self._seg.replaced()

    def forget_segments(self) -> None:
        """Drops everything bound to the job's runtime dir as it was, after it was removed: the mappings, the
        writer lease (its file went with the dir) and the save sequence. The next save takes a new lease
        and a new segment from the new saver."""
        try:
            if self._seg is not None:
                self._device.forget(self._seg)
                self._seg.close()
                self._seg = None
            super().forget_segments()
        finally:
            self._seq = -1
            if self._lease is not None:
                self._lease.release(unlink=False)
                self._lease = None

    def close(self) -> None:
        try:
            self._close_segments()
        finally:
            if self._lease is not None:
                self._lease.release(unlink=False)  # the saver removes it with the runtime dir
                self._lease = None

    def _close_segments(self) -> None:
        try:
            if self._seg is not None:
                self._device.forget(self._seg)
                self._seg.close()
                self._seg = None
            self._device.close()
        finally:
            super().close()
