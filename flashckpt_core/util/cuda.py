"""The CUDA side of snapshots and restores: page-locking ranges of a shared-memory segment and the copies
between CUDA tensors and a segment.

A snapshot copies device-to-host straight into the slot it writes: the slot is page-locked once
(``cudaHostRegister``), so the copies are asynchronous DMA on a side stream and a snapshot's pause is the
time to queue them (overlapped) or the PCIe transfer itself (blocking). Only the slot's own range is
registered, never the whole segment: registering pins (and so allocates) every page of its range, and a
segment's spare slot is meant to hold no memory until it is needed. A slot that the saver gave back
(``FLAG_UNRESERVED``: its pages punched out of the file) is unregistered before anything is copied into
it again, since its registration still pins the pages that left the file.

A restore copies host-to-device straight from the segment into the model's CUDA tensors (or new ones), on
the current stream of each device, and waits for them before the slot's generation is checked again (a
torn snapshot is never returned). How, by ``FLASHCKPT_CUDA_LOAD``:

- ``staged`` (default): through a few pinned staging buffers of 64 MiB, filled by the copy threads (``preadv``
  from the segment file) while the previous buffer's DMA runs: no page-locking of the slot, whose cost
  (about 0.1 s per GB, measured on an H100 host) is paid once per slot by a writer but would be paid by
  every restore;
- ``register``: the slot's range page-locked for the restore, one DMA straight from it;
- ``pageable``: plain copies from the mapping (the driver stages them through its own buffers).

``benchmarks/bench_gpu.py`` measures the three against the PCIe limits.
"""

from __future__ import annotations

import array
import ctypes
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from flashckpt import errors as E
from flashckpt.config import knob
from flashckpt.util import native as _native

__all__ = ["register", "unregister", "copy_to_host", "copy_to_host_native", "copy_to_device", "queue_to_device",
           "synchronize", "copy_to_device_staged", "buffer_rounds", "load_mode", "runtime_fn", "batch_fn", "PORTABLE"]

log = logging.getLogger(__name__)
_warned = False
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


PORTABLE = 1  # cudaHostRegisterPortable: the range is page-locked for every CUDA context of the process
_runtime: ctypes.CDLL | None = None
_runtime_looked = False


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded (never another copy), or None where none is loaded."""
    global _runtime, _runtime_looked
    if not _runtime_looked:
        _runtime_looked = True
        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
            try:
                lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # only the copy torch loaded
                lib.cudaGetLastError  # noqa: B018 (a CUDA runtime indeed)
            except (OSError, AttributeError):
                continue
            _runtime = lib
            break
    return _runtime


def runtime_fn(name: str) -> int:
    """The address of the CUDA runtime function ``name`` in the runtime torch loaded; 0 where there is none
    (a CPU build, or a runtime linked into torch statically): the callers then copy from Python."""
    lib = _cudart()
    if lib is None:
        return 0
    try:
        return int(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0)
    except AttributeError:
        return 0


_batch_refused = False  # the runtime refused a batch once: copies are queued one by one from then on


def batch_fn() -> int:
    """The address of ``cudaMemcpyBatchAsync`` where the runtime torch loaded is CUDA 13 or later (whose
    declaration ``csrc/fastpath.cpp`` follows; CUDA 12.8's has another argument), ``FLASHCKPT_CUDA_BATCH`` is
    on (the default) and no batch was refused; else 0."""
    lib = _cudart()
    if lib is None or _batch_refused or not knob("cuda_batch"):
        return 0
    version = ctypes.c_int(0)
    try:
        if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0 or version.value < 13000:
            return 0
    except AttributeError:
        return 0
    return runtime_fn("cudaMemcpyBatchAsync")


def _queue(native: Any, stream: torch.cuda.Stream, base: int, ptrs: bytes, copies: bytes, kind: int) -> None:
    """Queues a plan's packed copies on ``stream`` in one native call: one ``cudaMemcpyBatchAsync`` where the
    runtime has it, else one ``cudaMemcpyAsync`` each (also when a batch is refused: every copy queued again,
    the same bytes to the same place). Raises FlashCheckpointError when the runtime refuses a copy."""
    global _batch_refused
    s = int(stream.cuda_stream)
    fn = batch_fn() if s else 0  # a batch is refused on the legacy default stream
    if fn:
        code = native.memcpy_batch_async(fn, s, base, ptrs, copies, kind)
        if code == 0:
            return
        _clear_last_error()
        _batch_refused = True
        log.warning("cudaMemcpyBatchAsync refused a batch (CUDA error %d): copies are queued one by one", code)
    failed, code = native.memcpy_async(runtime_fn("cudaMemcpyAsync"), s, base, ptrs, copies, kind)
    if failed >= 0:
        _clear_last_error()
        raise E.FlashCheckpointError(f"the {'device-to-host' if kind == 2 else 'host-to-device'} copy {failed} of a "
                                     f"snapshot's CUDA tensors failed (cudaMemcpyAsync: CUDA error {code})")


def _clear_last_error() -> None:
    """A failed runtime call leaves its error as the thread's last error, which the next kernel launch
    check of torch would report as its own: read it back (and so reset it) where libcudart is loaded."""
    lib = _cudart()
    if lib is not None:
        lib.cudaGetLastError()


def register(addr: int, nbytes: int, flags: int = 0) -> bool:
    """Page-locks ``[addr, addr + nbytes)`` for DMA; True when the caller must ``unregister`` it. False where
    the range is page-locked already (by this process's writer), or where the driver refuses (one warning
    per process): the caller then copies another way (a writer through its bounce buffers, a restore through
    the driver's staging buffers).
    ``flags``: ``PORTABLE`` for a range registered off the thread (and so maybe the context) that copies."""
    global _warned
    if nbytes <= 0:
        return False
    rc = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, flags))
    if rc == 0:
        return True
    _clear_last_error()
    if rc == _ALREADY_REGISTERED:  # this process's writer page-locked the slot: the copies are DMA already
        return False
    if not _warned:
        _warned = True
        log.warning("cudaHostRegister of %d bytes of shared memory failed (CUDA error %d): snapshots of CUDA tensors "
                    "copy through pinned bounce buffers and restores through pageable memory (slower, correct)",
                    nbytes, rc)
    return False


def unregister(addr: int) -> None:
    if int(torch.cuda.cudart().cudaHostUnregister(addr)) != 0:
        _clear_last_error()


def load_mode() -> str:
    """How a restore copies to the GPU: ``FLASHCKPT_CUDA_LOAD`` (staged, register or pageable)."""
    return str(knob("cuda_load"))


def _bytes_of(st: torch.UntypedStorage, byte_offset: int, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over ``nbytes`` of storage ``st`` from ``byte_offset`` (any device)."""
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, byte_offset, (nbytes,), (1,))


def _host(addr: int, nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor over ``nbytes`` of (mapped) memory at ``addr``: no copy, no ownership."""
    buf = (ctypes.c_uint8 * nbytes).from_address(addr)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)


def copy_to_host(stream: torch.cuda.Stream, items: Iterable[tuple[torch.Tensor, int, int]]) -> torch.cuda.Event:
    """Queues ``(tensor, host address, nbytes)`` device-to-host copies of whole storages on ``stream`` (which
    the caller ordered after the work they follow); returns the event that completes them. The caller keeps
    the tensors alive (and unchanged) until the event completed."""
    with torch.cuda.stream(stream):
        for t, addr, n in items:
            _host(addr, n).copy_(_bytes_of(t.untyped_storage(), 0, n), non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return done


def copy_to_host_native(native: Any, stream: torch.cuda.Stream, base: int, ptrs: bytes, copies: bytes) -> torch.cuda.Event:
    """``copy_to_host`` in one call of the native fast path (``_queue``): the plan's packed (tensor index,
    offset, bytes) ``copies`` from the storages at ``ptrs`` (the native scan's) to ``base + offset``, on
    ``stream`` (which the caller ordered after the work they follow)."""
    _queue(native, stream, base, ptrs, copies, 2)
    done = torch.cuda.Event()
    done.record(stream)
    return done


def copy_to_device(items: list[tuple[torch.UntypedStorage, int, int, int]]) -> None:
    """Copies ``(CUDA storage, byte offset in it, host address, nbytes)`` host-to-device, on the current
    stream of each storage's device, and returns once every copy is done (the source may be overwritten
    after that)."""
    synchronize(queue_to_device(items))


def queue_to_device(items: list[tuple[torch.UntypedStorage, int, int, int]]) -> set[torch.device]:
    """Queues ``copy_to_device``'s copies and returns the devices whose current streams carry them (wait with
    ``synchronize``; the host memory must stay unchanged until then). With the native fast path and one
    device, the copies are queued in one C++ call (a restore of hundreds of tensors from Python costs ~20 µs
    a tensor)."""
    devices = {st.device for st, *_ in items}
    fn = runtime_fn("cudaMemcpyAsync") if len(devices) == 1 else 0
    ext = _native.get() if fn else None
    if ext is not None:
        ptrs = array.array("q", [st.data_ptr() + start for st, start, _a, _n in items]).tobytes()
        copies = array.array("q", [v for k, (_st, _s, addr, n) in enumerate(items) for v in (k, addr, n)]).tobytes()
        stream = torch.cuda.current_stream(next(iter(devices)))
        try:
            _queue(ext, stream, 0, ptrs, copies, 1)
        except E.FlashCheckpointError:
            stream.synchronize()  # the copies queued before the refused one are done before the error
            raise
    else:
        for st, start, addr, n in items:
            _bytes_of(st, start, n).copy_(_host(addr, n), non_blocking=True)
    return devices


def synchronize(devices: set[torch.device]) -> None:
    """Waits for the work queued on the current stream of each of ``devices``."""
    for d in devices:
        torch.cuda.current_stream(d).synchronize()


STAGE_BYTES = 64 << 20
_STAGES = 3


def buffer_rounds(sizes: list[int], size: int) -> Iterator[list[tuple[int, int, int, int]]]:
    """Packs items of ``sizes`` bytes, in order, into rounds of a buffer of ``size`` bytes, splitting an item
    across rounds where it does not fit: yields each round as (item index, offset in the item, bytes, offset
    in the buffer), every round but the last full."""
    chunk: list[tuple[int, int, int, int]] = []
    filled = 0
    for i, n in enumerate(sizes):
        pos = 0
        while pos < n:
            take = min(n - pos, size - filled)
            chunk.append((i, pos, take, filled))
            filled += take
            pos += take
            if filled == size:
                yield chunk
                chunk, filled = [], 0
    if chunk:
        yield chunk


def copy_to_device_staged(items: list[tuple[torch.UntypedStorage, int, int, int]],
                          read: Callable[[list[tuple[int, int, int]]], None]) -> None:
    """Copies ``(CUDA storage, byte offset in it, source, nbytes)`` host-to-device through pinned staging
    buffers: ``read([(buffer address, source, nbytes), ...])`` fills a buffer (the copy threads), then its
    DMA is queued on the current stream of each device it feeds while the next buffer is filled. Returns
    once every copy is done."""
    total = sum(n for *_, n in items)
    size = min(STAGE_BYTES, total)
    if not size:
        return
    bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(min(_STAGES, -(-total // size)))]
    pending: list[list[torch.cuda.Event]] = [[] for _ in bufs]
    for k, chunk in enumerate(buffer_rounds([n for *_, n in items], size)):
        b = k % len(bufs)
        for ev in pending[b]:
            ev.synchronize()  # the buffer's previous DMA is done: it may be refilled
        buf = bufs[b]
        base = buf.data_ptr()
        read([(base + at, items[i][2] + pos, n) for i, pos, n, at in chunk])
        devices = set()
        for i, pos, n, at in chunk:
            st, off = items[i][0], items[i][1]
            _bytes_of(st, off + pos, n).copy_(buf[at:at + n], non_blocking=True)
            devices.add(st.device)
        events = []
        for d in devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(d))
            events.append(ev)
        pending[b] = events
    for events in pending:
        for ev in events:
            ev.synchronize()
