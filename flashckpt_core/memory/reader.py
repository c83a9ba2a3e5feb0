"""Reading the snapshots a job holds in this node's shared memory.

``SnapshotReader`` is the public way in, for adapters and tools: from a checkpoint dir (the job found as
the engine finds it) or from an engine, it lists the live snapshots of a local rank (step, the path each is
to be persisted to, the time of its save) and reads one back as a state dict (a ``FileSet`` for sets),
decoding Python objects under the same ``weights_only`` rules as a load from storage. It only reads: no
saver is started, no lease taken, and a slot is accepted only when it is COMPLETE and untouched by the
read (``read_snapshot``). The snapshot writer (``snapshot_writer.SharedMemoryHandler``) builds on it.

Example::

    from flashckpt.memory.reader import SnapshotReader

    with SnapshotReader("/ckpt") as reader:            # local rank 0 of the job of /ckpt on this node
        for info in reader.snapshots():                # newest save first
            print(info.step, info.name, info.wall_time)
        sd = reader.load()                             # the newest one; reader.load(step) for another
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from flashckpt import errors as E
from flashckpt.config import Knobs, job_dir
from flashckpt.format.files import FILES_KEY, FileSet, is_fileset_tree
from flashckpt.format.into import Into
from flashckpt.format.segment import (
    COMPLETE,
    Segment,
    SlotHeader,
    _page,
    backup_paths,
    live_snapshots,
    local_ranks,
    segment_paths,
    unreadable,
    writer_lease_path,
)
from flashckpt.format.tensormeta import TensorMeta, build_tensor, contiguous_strides, dtype_from_name
from flashckpt.format.tree import decode_opaque, gc_paused, split_opaque, tensor_paths, unflatten
from flashckpt.storage import locations, registry
from flashckpt.util import cuda as _cuda
from flashckpt.util.copy import Copier, file_reader
from flashckpt.util.lease import describe_holder, live_holder

__all__ = ["SnapshotReader", "SnapshotInfo", "Snapshot", "HeldView", "read_snapshot", "view_held", "job_in_memory"]

log = logging.getLogger(__name__)


class EngineLike(Protocol):
    """What a reader takes from a ``CheckpointEngine`` it is given (the engine room is above this one)."""

    knobs: Knobs
    job_dir: str
    weights_only: bool

_CPU = torch.device("cpu")


@dataclass(frozen=True)
class _Prestaged:
    """A slot's data page-locked ahead of a load (``SnapshotReader.prestage``): the snapshot's generation,
    the registered range, and the page-locking's (ok, seconds)."""

    generation: int
    addr: int
    nbytes: int
    future: Future[tuple[bool, float]]

    def locked(self) -> float | None:
        """Seconds the page-locking took once it ended; None where it failed (waits for it)."""
        try:
            ok, secs = self.future.result()
        except Exception:  # a driver error: the restore copies as without pre-staging
            return None
        return secs if ok else None


@dataclass
class Snapshot:
    """A snapshot copied out of shared memory: its step, state dict (a tree; a ``FileSet``'s encoding for
    sets), the path it is to be persisted to (``name``) and its bytes of tensor data."""

    step: int
    state_dict: Any
    name: str
    nbytes: int


@dataclass(frozen=True)
class SnapshotInfo:
    """One live snapshot in memory: its step, the path ``save`` was given (where it is persisted; "" when
    none was named), the wall time of its save, and the global rank that saved it and the number of ranks
    of its job (None where a segment of an older version did not record them)."""

    step: int
    name: str
    wall_time: float
    rank: int | None = None
    world_size: int | None = None


def job_in_memory(checkpoint_dir: str | os.PathLike[str]) -> bool:
    """Whether this node has the runtime dir of the job that checkpoints into ``checkpoint_dir`` (found as
    the engine finds it: the checkpoint dir, ``FLASHCKPT_JOB_ID`` / ``TORCHELASTIC_RUN_ID``): a saver of
    it runs, or left snapshots a restart may load. Cheap; reads and starts nothing."""
    return os.path.isdir(_job_dir_of(checkpoint_dir, Knobs.from_env()))


def _job_dir_of(checkpoint_dir: str | os.PathLike[str], knobs: Knobs) -> str:
    return job_dir(locations.normpath(registry.checkpoint_location(checkpoint_dir, "SnapshotReader")), knobs)


def read_snapshot(seg: Segment, slot: int, copier: Copier, *, step: int | None = None,
                  weights_only: bool = False, into: Any = None, pinned: bool = False) -> Snapshot | None:
    """Copies slot ``slot`` out of shared memory; None when it is not a COMPLETE, untorn snapshot.

    With ``into`` (a state-dict tree), the tensors of ``into`` that the rule of ``_into`` matches (same key
    path, dtype and shape; a plain contiguous CPU or CUDA tensor) are filled and returned in place of the
    snapshot's, most straight from the slot (no new memory, one copy at memcpy or PCIe speed); the others
    are left alone (one warning names them). Snapshot tensors that fill nothing are copied into new
    storages, on the GPU they were saved from where this process has it. ``pinned``: the slot's data is
    page-locked in this mapping already (``SnapshotReader.prestage``): one DMA straight from it."""
    h = seg.header(slot)
    if h.state != COMPLETE or (step is not None and h.step != step):
        return None
    with gc_paused(), seg.read_fd() as fd:
        return _read_slot(seg, slot, h, copier, fd, weights_only=weights_only, into=into, pinned=pinned)


class HeldView:
    """A snapshot read in place: its state dict's tensors are views of the segment's mapping (no copy; CPU
    tensors whatever device they were saved from), valid while the view is open. ``intact()`` says whether the
    slot still holds the same snapshot (check it after using the tensors: a slot overwritten meanwhile was a
    torn read). The mapping lives as long as the view or a tensor viewing it."""

    def __init__(self, seg: Segment, slot: int, h: SlotHeader, snapshot: Snapshot) -> None:
        self.seg, self.slot, self.header, self.snapshot = seg, slot, h, snapshot

    def intact(self) -> bool:
        return _intact(self.seg, self.slot, self.header)


def _held_slots(job_dir: str, rank: int, world: int, step: int) -> tuple[list[tuple[Segment, int, SlotHeader]],
                                                                            list[Segment]]:
    """Every live snapshot of ``rank``'s ``step`` saved by a job of ``world`` ranks in this node's segments
    (any local rank's, and backups), newest save first; and every segment opened (the caller closes those)."""
    groups = [segment_paths(job_dir, lr) for lr in local_ranks(job_dir)] + list(backup_paths(job_dir).values())
    found: list[tuple[Segment, int, SlotHeader]] = []
    opened: list[Segment] = []
    try:
        for paths in groups:
            segs = []
            for _epoch, path in paths:
                try:
                    segs.append(Segment(path, populate=False))
                except (FileNotFoundError, E.FlashCheckpointError):
                    continue  # reaped since it was listed
                except OSError as e:
                    raise unreadable("open the shared-memory segment", path, e) from e
            opened += segs
            found += [x for x in live_snapshots(segs)
                      if x[2].rank == rank and x[2].world_size == world and x[2].step == step]
    except BaseException:
        for seg in opened:
            seg.close()
        raise
    return sorted(found, key=lambda x: x[2].wall_time, reverse=True), opened


def view_held(job_dir: str, rank: int, world: int, step: int, *, weights_only: bool = False) -> HeldView | None:
    """Global rank ``rank``'s snapshot of ``step``, saved by a job of ``world`` ranks, as views of whichever
    segment of this node holds it: any local rank's (the node's own ranks, and copies fetched from a peer) or a
    backup of another node's (its newest save of that step when several hold one). No copy: a reader that needs
    only parts of it (a resharded load: the rank that reads is not the rank that saved) copies those. None when
    no segment here holds it."""
    found, opened = _held_slots(job_dir, rank, world, step)
    keep: Segment | None = None
    try:
        for seg, i, h in found:
            with gc_paused():
                meta = seg.read_meta(i, h)
                metas = [TensorMeta.from_json(v) for v in meta["tensors"]]
                data = seg.data_off(i)
                view = memoryview(seg.mm)
                regions: dict[tuple[int, int], torch.UntypedStorage] = {}
                for m in metas:
                    key = (m.offset, m.nbytes)
                    if key not in regions:
                        regions[key] = (torch.frombuffer(view[data + m.offset: data + m.offset + m.nbytes],
                                                         dtype=torch.uint8).untyped_storage()
                                        if m.nbytes else torch.UntypedStorage(0))
                tensors = [build_tensor(regions[(m.offset, m.nbytes)], m) for m in metas]
                blob_off = data + h.tensor_bytes
                blob = seg.mm[blob_off: blob_off + h.blob_len]
                opaque = [decode_opaque(b, weights_only=weights_only) for b in split_opaque(blob, meta["opaque"])]
                state = unflatten(meta["tree"], tensors, opaque)
            held = HeldView(seg, i, h, Snapshot(h.step, state, meta.get("name", ""), h.tensor_bytes))
            if held.intact():
                keep = seg
                return held
        return None
    finally:
        for seg in opened:
            if seg is not keep:
                seg.close()


def _read_slot(seg: Segment, slot: int, h: SlotHeader, copier: Copier, fd: int | None, *,
               weights_only: bool, into: Any, pinned: bool = False) -> Snapshot | None:
    meta = seg.read_meta(slot, h)
    metas = [TensorMeta.from_json(v) for v in meta["tensors"]]
    data = seg.data_off(slot)  # sources are offsets in the segment file until the copy op is chosen
    tasks: list[tuple[int, int, int]] = []
    # (CUDA storage, byte offset in it, offset in the segment, bytes): copied host-to-device from the mapping
    device_tasks: list[tuple[torch.UntypedStorage, int, int, int]] = []
    fill, direct = _plan_direct(into, meta, metas, data, tasks, device_tasks)
    # From a page-locked slot (pre-staged) the device copies are queued as soon as they are planned, and the
    # host-side work below runs while they do; they are waited for before the slot is checked a last time.
    queued: set[torch.device] = set()

    def queue_planned() -> None:
        if pinned and device_tasks:
            queued.update(_cuda.queue_to_device([(st, off, seg.base + src, n) for st, off, src, n in device_tasks]))
            device_tasks.clear()

    queue_planned()
    regions = _plan_regions(metas, direct, data, tasks, device_tasks)
    queue_planned()
    _copy_to_host(seg, slot, h, copier, fd, tasks, into_new_memory=bool(regions))
    if device_tasks:
        _read_to_device(seg, slot, h, copier, fd, device_tasks)
    blob_off = seg.data_off(slot) + h.tensor_bytes
    blob = seg.mm[blob_off: blob_off + h.blob_len]
    if not _intact(seg, slot, h):
        return None  # overwritten while we read: torn (its plain leaves are never decoded)
    # Opaque leaves are decoded by a trainer only (never the saver), and with weights_only only into
    # the types torch.load(weights_only=True) accepts.
    opaque = [decode_opaque(b, weights_only=weights_only) for b in split_opaque(blob, meta["opaque"])]
    tensors = _assemble_tensors(metas, direct, regions)
    state = fill.fill(unflatten(meta["tree"], tensors, opaque), source=f"memory (step {h.step})")
    if queued:
        _cuda.synchronize(queued)
        if not _intact(seg, slot, h):
            return None  # overwritten while the queued copies read it: torn
    return Snapshot(h.step, state, meta.get("name", ""), h.tensor_bytes)


def _intact(seg: Segment, slot: int, h: SlotHeader) -> bool:
    """Whether slot ``slot`` still holds the snapshot of header ``h`` (COMPLETE, same generation)."""
    h2 = seg.header(slot)
    return h2.state == COMPLETE and h2.generation == h.generation


def _plan_direct(into: Any, meta: dict[str, Any], metas: list[TensorMeta], data: int,
                 tasks: list[tuple[int, int, int]],
                 device_tasks: list[tuple[torch.UntypedStorage, int, int, int]]) -> tuple[Into, dict[int, torch.Tensor]]:
    """The fill rule of ``into`` (a ``FileSet``'s encoding when the snapshot is a set) and the tensors of
    ``into`` that take a snapshot tensor straight from the slot, by its index; appends their copies to
    ``tasks`` (host) and ``device_tasks`` (host-to-device). ``data``: the slot's data area in the segment."""
    direct: dict[int, torch.Tensor] = {}
    fill = Into(into)
    if not fill:
        return fill, direct
    paths = tensor_paths(meta["tree"])
    if paths and all(len(p) >= 3 and p[0] == FILES_KEY and p[2] == "d" for p in paths):
        fill = Into(FileSet.encode_into(into))  # a FileSet: ``into`` is {file name: tree}
    # Straight from the slot into the tensors ``into`` gives (the rule: ``_into``) where the snapshot
    # tensor is laid out contiguously: a CPU tensor takes the bytes by a host copy, a CUDA tensor
    # host-to-device, whatever device the snapshot came from. ``fill.fill`` copies the other matches.
    for i, (m, path) in enumerate(zip(metas, paths)):
        t = fill.target(path, dtype_from_name(m.dtype), m.shape, (m.conj, m.neg))
        if t is None or m.stride != contiguous_strides(m.shape):
            continue
        n = t.numel() * t.element_size()
        start = m.storage_offset * t.element_size()
        if start + n > m.nbytes:
            continue  # not a view inside its region (cannot happen for a valid snapshot)
        if n and t.is_cuda:
            device_tasks.append((t.untyped_storage(), int(t.storage_offset()) * t.element_size(),
                                 data + m.offset + start, n))
        elif n:
            tasks.append((t.data_ptr(), data + m.offset + start, n))
        direct[i] = t
    return fill, direct


def _plan_regions(metas: list[TensorMeta], direct: dict[int, torch.Tensor], data: int,
                  tasks: list[tuple[int, int, int]],
                  device_tasks: list[tuple[torch.UntypedStorage, int, int, int]],
                  ) -> dict[tuple[int, int], torch.UntypedStorage]:
    """New storages for the snapshot's regions no tensor of ``direct`` takes, by (offset, bytes), on the
    device each was saved from where this process has it; appends their copies to ``tasks`` /
    ``device_tasks``."""
    regions: dict[tuple[int, int], torch.UntypedStorage] = {}
    for i, m in enumerate(metas):
        key = (m.offset, m.nbytes)
        if i in direct or key in regions:
            continue
        dev = _device_of(m.device)
        st = torch.UntypedStorage(m.nbytes, device=dev)
        regions[key] = st
        if m.nbytes and dev.type == "cuda":
            device_tasks.append((st, 0, data + m.offset, m.nbytes))
        elif m.nbytes:  # (no MADV_HUGEPAGE: its compaction stalls made such loads 2-3x slower, docs/benchmarks.md)
            tasks.append((st.data_ptr(), data + m.offset, m.nbytes))
    return regions


def _copy_to_host(seg: Segment, slot: int, h: SlotHeader, copier: Copier, fd: int | None,
                  tasks: list[tuple[int, int, int]], *, into_new_memory: bool) -> None:
    """Runs the host copies ``tasks`` (sources: offsets in the segment) of slot ``slot``."""
    # preadv from the file, except on a huge-page tmpfs when every tensor goes into an existing one: then
    # the mapping (one fault per 2 MiB) is as fast as resident memory. Into new memory, preadv stays ahead
    # either way (the kernel faults the destination in; a memmove faulting both sides is up to 15x slower).
    if fd is None or (seg.huge_pages and not into_new_memory):
        seg.populate(slot, h.tensor_bytes)
        copier.run([(dst, seg.base + off, n) for dst, off, n in tasks])
    else:
        copier.run(tasks, op=file_reader(fd))


def _assemble_tensors(metas: list[TensorMeta], direct: dict[int, torch.Tensor],
                      regions: dict[tuple[int, int], torch.UntypedStorage]) -> list[torch.Tensor]:
    """The snapshot's tensors in order: the ``into`` tensor filled straight, else one built on its region."""
    tensors = []
    for i, m in enumerate(metas):
        if i in direct:
            tensors.append(direct[i])
            continue
        tensors.append(build_tensor(regions[(m.offset, m.nbytes)], m))
    return tensors


def _device_of(device: str) -> torch.device:
    """Where a snapshot tensor saved on ``device`` is restored: that CUDA device where this process has it
    (as ``torch.load`` without ``map_location``), else the CPU (a restore on a machine without the GPU)."""
    if not device.startswith("cuda"):
        return _CPU
    dev = torch.device(device)
    if not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count():
        return _CPU
    return dev


def _read_to_device(seg: Segment, slot: int, h: SlotHeader, copier: Copier, fd: int | None,
                    tasks: list[tuple[torch.UntypedStorage, int, int, int]]) -> None:
    """Copies slot ``slot``'s regions host-to-device as ``FLASHCKPT_CUDA_LOAD`` says (``_cuda``); the sources
    are offsets in the segment. Returns when the copies are done."""
    mode = _cuda.load_mode()
    if mode == "staged":
        if fd is not None:
            _cuda.copy_to_device_staged(tasks, lambda t: copier.run(t, op=file_reader(fd)))
        else:
            seg.populate(slot, h.tensor_bytes)
            _cuda.copy_to_device_staged(tasks, lambda t: copier.run([(d, seg.base + s, n) for d, s, n in t]))
        return
    seg.populate(slot, h.tensor_bytes)
    start = seg.data_off(slot)
    pinned = mode == "register" and _cuda.register(seg.base + start, _page(h.tensor_bytes))
    try:
        _cuda.copy_to_device([(st, off, seg.base + src, n) for st, off, src, n in tasks])
    finally:
        if pinned:
            _cuda.unregister(seg.base + start)


def _unregister_after(p: _Prestaged) -> None:
    """Unregisters a pre-staged range once its page-locking ended (when it succeeded)."""
    if p.locked() is not None:
        _cuda.unregister(p.addr)


class SnapshotReader:
    """Reads the live snapshots of one local rank of a job from this node's shared memory.

    Args:
        source: the checkpoint dir (a path or ``file://`` URL; the job is found as the engine finds it, so
            use the same environment as the run that saved), or a ``CheckpointEngine`` (its job).
        local_rank: whose snapshots (in replicated mode only local rank 0 holds any).
        weights_only: decode the Python objects of loaded snapshots only into the types
            ``torch.load(weights_only=True)`` accepts. Default: the engine's setting, else True.
        rank: only the snapshots global rank ``rank`` saved, wherever they are on this node: in
            ``local_rank``'s segments first, then in any other local rank's (a restart that numbered the
            node's ranks otherwise). Across local ranks the newest save is the one saved last (wall time).
        world_size: only the snapshots saved by a job of ``world_size`` ranks.

    A reader of a job that has no runtime dir on this node (``exists()`` False) sees no snapshots. Close it
    (or use it as a context manager) to unmap the segments. Not thread-safe.

    A reader reads whatever the segments hold, a live training's snapshots included (a tool inspecting a
    running job). An engine's own reads (``CheckpointEngine.load``, ``memory_steps``) are narrower: its
    rank's own snapshots, saved by a job of its number of ranks (unless replicated), and none in segments
    another live process writes (see ``own_only``).
    """

    def __init__(self, source: str | os.PathLike[str] | EngineLike, local_rank: int = 0, *,
                 weights_only: bool | None = None, rank: int | None = None,
                 world_size: int | None = None) -> None:
        if isinstance(source, (str, os.PathLike)):
            knobs = Knobs.from_env()
            jd = _job_dir_of(source, knobs)
            default = True
        else:
            knobs, jd, default = source.knobs, source.job_dir, source.weights_only
        self._setup(local_rank, jd, Copier(knobs.copy_threads), own_copier=True,
                    weights_only=default if weights_only is None else weights_only, rank=rank, world_size=world_size)

    @classmethod
    def for_job_dir(cls, local_rank: int, job_dir: str, *, copier: Copier | None = None,
                    weights_only: bool = False) -> SnapshotReader:
        """A reader of the job whose runtime dir is ``job_dir`` (the engine's own; adapters pass a
        checkpoint dir or an engine instead), sharing ``copier`` when given."""
        self = cls.__new__(cls)
        self._setup(local_rank, job_dir, copier or Copier(1), own_copier=copier is None, weights_only=weights_only)
        return self

    def _setup(self, local_rank: int, job_dir: str, copier: Copier, *, own_copier: bool, weights_only: bool,
               rank: int | None = None, world_size: int | None = None, own_only: bool = False) -> None:
        """``own_only``: a resuming engine's reader, which passes over the segments of a local rank whose
        writer lease a live process other than this one holds (their snapshots are that process's: another
        training on the same job key), saying so in the log."""
        self.local_rank = local_rank
        self.job_dir = job_dir
        self.weights_only = weights_only
        self.rank = rank
        self.world_size = world_size
        self._own_only = own_only
        self._said: set[tuple[Any, ...]] = set()  # reasons logged already (once each)
        self._copier = copier
        self._own_copier = own_copier
        self._readers: dict[str, Segment] = {}
        self._prestaged: dict[tuple[str, int], _Prestaged] = {}
        self._pagelock: ThreadPoolExecutor | None = None
        self._unpinning: list[Future[None]] = []

    def exists(self) -> bool:
        """Whether the job has a runtime dir on this node (see ``job_in_memory``)."""
        return os.path.isdir(self.job_dir)

    def _open(self, path: str) -> Segment:
        """The segment at ``path``: a cached mapping (not prefaulted: a reader touches only the slot it
        reads)."""
        seg = self._readers.get(path)
        if seg is not None and seg.replaced():  # a new runtime dir (the old one was wiped) reuses the name
            self._readers.pop(path).close()
            seg = None
        if seg is None:
            seg = self._readers[path] = Segment(path, populate=False)
        return seg

    def _forget_removed(self, live: list[tuple[int, str]]) -> None:
        names = {p for _, p in live}
        for path in [p for p in self._readers if p not in names]:
            self._unpin(path)
            self._readers.pop(path).close()

    # ------------------------------------------------------------------ pre-staging for the GPU
    def prestage(self) -> bool:
        """Page-locks (``cudaHostRegister``) the data of the newest live snapshot this reader serves, in the
        background, when it holds CUDA tensors of a device this process has: a restarted trainer's engine
        starts it at once (``FLASHCKPT_CUDA_PRESTAGE``), so the page-locking (0.15-0.33 s a GB slot on an H200) runs while
        the process builds its model, and ``load()`` copies the snapshot to the GPU at the PCIe limit, one DMA
        from the slot (it waits for a page-locking still running). Returns whether it started one. The
        registration goes once the snapshot was read (or at ``close``): it pins the slot's pages."""
        if not torch.cuda.is_available():  # first: on a machine without a GPU nothing else is looked at
            return False
        live = self._live()
        if not live:
            return False
        seg, i, h = live[0]
        if (seg.path, i) in self._prestaged or not h.tensor_bytes:
            return False
        with gc_paused():
            devices = {TensorMeta.from_json(v).device for v in seg.read_meta(i, h)["tensors"]}
        cuda = sorted(d for d in devices if d.startswith("cuda"))
        if not cuda:
            return False
        dev = _device_of(cuda[0])
        if dev.type != "cuda":
            return False
        addr, nbytes = seg.base + seg.data_off(i), _page(h.tensor_bytes)
        if self._pagelock is None:
            self._pagelock = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-prestage")

        def pagelock() -> tuple[bool, float]:
            torch.cuda.set_device(dev)
            t0 = time.perf_counter()
            ok = _cuda.register(addr, nbytes, _cuda.PORTABLE)
            return ok, time.perf_counter() - t0

        self._prestaged[(seg.path, i)] = _Prestaged(h.generation, addr, nbytes, self._pagelock.submit(pagelock))
        log.debug("pre-staging step %d (%d bytes of %s slot %d) for the GPU", h.step, nbytes, seg.path, i)
        return True

    def prestaged(self, wait: bool = True) -> float | None:
        """Seconds the pre-staging of the newest snapshot took (waiting for it with ``wait``); None when
        none was started, is still running (``wait=False``) or failed."""
        for p in self._prestaged.values():
            if wait or p.future.done():
                return p.locked()
        return None

    def _pinned(self, seg: Segment, i: int, h: SlotHeader) -> bool:
        """Whether slot ``i`` of ``seg`` holds the very snapshot pre-staged, page-locked in this mapping
        (waits for the page-locking when it still runs)."""
        p = self._prestaged.get((seg.path, i))
        if p is None or p.generation != h.generation or p.addr != seg.base + seg.data_off(i):
            return False
        return p.locked() is not None

    def _unpin(self, path: str | None = None, *, background: bool = False) -> None:
        """Unregisters the pre-staged slots of segment ``path`` (all with None): before they are unmapped, or,
        ``background``, on the page-locking thread once a load read them (never on the restore's path)."""
        for key in [k for k in self._prestaged if path is None or k[0] == path]:
            p = self._prestaged.pop(key)
            if background and self._pagelock is not None:
                self._unpinning.append(self._pagelock.submit(_unregister_after, p))
            else:
                _unregister_after(p)
        if not background:
            for fut in self._unpinning:
                fut.result()
            self._unpinning.clear()

    def forget_segments(self) -> None:
        """Unmaps every segment mapped so far (the job's runtime dir was removed: a new one is read anew)."""
        self._forget_removed([])

    def _live(self) -> list[tuple[Segment, int, SlotHeader]]:
        """The live snapshots this reader serves, newest save first: ``live_snapshots`` of this local rank's
        segments; with ``rank``, that rank's in any local rank's segments (see the class docstring); with
        ``world_size``, those of a job of that many ranks; with ``own_only``, none in segments that another
        live process writes."""
        every: list[tuple[int, str]] = []
        timelines = []
        others = [lr for lr in local_ranks(self.job_dir) if lr != self.local_rank] if self.rank is not None else []
        for lr in [self.local_rank, *others]:
            live = segment_paths(self.job_dir, lr)
            every += live
            segs = []
            for _epoch, path in live:
                try:
                    segs.append(self._open(path))
                except (FileNotFoundError, E.FlashCheckpointError):
                    continue  # removed since it was listed (the saver reaped it), or not a segment of ours
                except OSError as e:  # it is there and unreadable: its snapshots are unknown, not absent
                    raise unreadable("open the shared-memory segment", path, e) from e
            mine = [x for x in live_snapshots(segs) if self._wanted(x[2])]
            if mine and not (self._own_only and self.written_by_another(lr) is not None):
                timelines.append(mine)
        self._forget_removed(every)
        if len(timelines) <= 1:
            return timelines[0] if timelines else []
        # One rank's snapshots in several local ranks' segments (it moved): its own timeline, by wall time
        # (save sequences count per local rank), a later save of the same or a lower step superseding.
        merged = sorted((x for t in timelines for x in t), key=lambda x: x[2].wall_time, reverse=True)
        out: list[tuple[Segment, int, SlotHeader]] = []
        for x in merged:
            if not out or x[2].step < out[-1][2].step:
                out.append(x)
        return out

    def _wanted(self, h: SlotHeader) -> bool:
        """Whether the snapshot of header ``h`` is one this reader serves (``rank``, ``world_size``)."""
        if self.rank is not None and h.rank != self.rank:
            if h.rank is None and ("unrecorded",) not in self._said:
                self._said.add(("unrecorded",))
                log.info("rank %d: this node's memory holds snapshots whose rank was not recorded (saved by an "
                         "older version, step %d the newest): not loaded; storage decides", self.rank, h.step)
            return False
        if self.world_size is not None and h.world_size != self.world_size:
            key = ("world", h.world_size)
            if key not in self._said:
                self._said.add(key)
                log.warning("rank %s: this node's memory holds snapshots saved by a job of %s ranks (step %d the "
                            "newest of them); this job has %d, so they are not loaded (a rank's state belongs to the "
                            "number of ranks that saved it); storage decides", self.rank,
                            h.world_size or "an unrecorded number of", h.step, self.world_size)
            return False
        return True

    def written_by_another(self, local_rank: int | None = None) -> dict[str, Any] | None:
        """What the process other than this one that holds the writer lease of ``local_rank``'s segments
        (this reader's by default) says about itself (pid, rank, checkpoint dir), or None when none does
        (free: its writer closed its engine or died); always None unless ``own_only``. Logs the first time
        it finds one."""
        lr = self.local_rank if local_rank is None else local_rank
        if not self._own_only or self._holds_lease(lr):
            return None
        holder = live_holder(writer_lease_path(self.job_dir, lr))
        if holder is not None and ("writer", lr, holder.get("pid")) not in self._said:
            self._said.add(("writer", lr, holder.get("pid")))
            log.warning("local rank %d's snapshots in %s are written by %s, which holds their writer lease: they "
                        "are its state, not one this process saved, and are not loaded (storage decides). Give each "
                        "training its own FLASHCKPT_JOB_ID or checkpoint dir; to read them deliberately, use a "
                        "SnapshotReader", lr, self.job_dir, describe_holder(holder))
        return holder

    def _holds_lease(self, local_rank: int) -> bool:
        """Whether this reader holds ``local_rank``'s writer lease (a writer does, from its first save)."""
        return False

    def memory_snapshots(self) -> list[tuple[int, float]]:
        """(step, wall time of the save) of the live COMPLETE snapshots of this local rank, newest save
        first (superseded ones left out, see ``live_snapshots``; the steps strictly decrease)."""
        return [(h.step, h.wall_time) for _seg, _i, h in self._live()]

    def memory_steps(self) -> list[int]:
        """Steps of the live COMPLETE snapshots held in shared memory for this local rank, newest first.

        Raises:
            SharedMemoryError: a segment (or the runtime dir) is there but could not be read (the message
                names it and the errno, e.g. EMFILE): never taken for "no snapshot"."""
        return [s for s, _t in self.memory_snapshots()]

    def snapshot_name(self, step: int) -> str | None:
        """Where the COMPLETE snapshot of ``step`` is to be persisted (its ``ckpt_name``); None if absent."""
        for seg, i, h in self._live():
            if h.step == step:
                try:
                    with gc_paused():
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
            pinned = bool(self._prestaged) and self._pinned(seg, i, h)
            snap = read_snapshot(seg, i, self._copier, step=h.step, weights_only=self.weights_only, into=into,
                                 pinned=pinned)
            if pinned:
                self._unpin(seg.path, background=True)  # read: its pages need not stay locked
            if snap is not None and snap.step == h.step:
                return snap
        return None

    def load_state_dict(self, step: int | None = None) -> Any:
        """The state dict of the newest snapshot in memory (or of ``step``); ``{}`` when there is none."""
        snap = self.load_snapshot(step)
        return {} if snap is None else snap.state_dict

    def snapshots(self) -> list[SnapshotInfo]:
        """The live snapshots in memory, newest save first (superseded ones left out: the steps strictly
        decrease), each with the path it is to be persisted to."""
        out = []
        for seg, i, h in self._live():
            try:
                name = str(seg.read_meta(i, h).get("name", ""))
            except (ValueError, E.FlashCheckpointError):
                continue  # overwritten (or torn) since it was listed
            out.append(SnapshotInfo(h.step, name, h.wall_time, h.rank, h.world_size))
        return out

    def load(self, step: int | None = None, *, into: Any = None) -> Any:
        """The state dict of the newest live snapshot (or of ``step``): a ``FileSet`` for a snapshot of
        files. ``into`` as for ``CheckpointEngine.load``.

        Raises:
            FlashCheckpointError: memory holds no such snapshot (any more).
            InvalidStateDictError: ``weights_only`` and the snapshot holds an object it refuses.
        """
        snap = self.load_snapshot(step, into=into)
        if snap is None:
            which = "snapshot" if step is None else f"snapshot of step {step}"
            whose = f"rank {self.rank}" if self.rank is not None else f"local rank {self.local_rank}"
            raise E.FlashCheckpointError(
                f"SnapshotReader.load(): this node's shared memory holds no (or no longer the) {which} of "
                f"{whose} in {self.job_dir}; memory_steps() lists the steps it holds")
        sd = snap.state_dict
        return FileSet.decode(sd) if is_fileset_tree(sd) else sd

    def close(self) -> None:
        """Unmaps the segments (tensors loaded from them are copies and stay valid)."""
        self._unpin()
        if self._pagelock is not None:
            self._pagelock.shutdown(wait=True)
            self._pagelock = None
        for seg in self._readers.values():
            seg.close()
        self._readers.clear()
        if self._own_copier:
            self._copier.close()

    def __enter__(self) -> SnapshotReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
