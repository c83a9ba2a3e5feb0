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
torn snapshot is never returned). ``FLASHCKPT_CUDA_LOAD_PIN`` (default 1) registers the slot's range for
the duration of the restore; 0 copies from pageable memory (the driver stages it), which
``benchmarks/bench_gpu.py`` measures against.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterable

import torch

__all__ = ["register", "unregister", "copy_to_host", "copy_to_device", "load_pinned"]

log = logging.getLogger(__name__)
_warned = False
_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


def _clear_last_error() -> None:
    """A failed runtime call leaves its error as the thread's last error, which the next kernel launch
    check of torch would report as its own: read it back (and so reset it) where libcudart is loaded."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # only the copy torch loaded
        except OSError:
            continue
        try:
            lib.cudaGetLastError()
        except AttributeError:
            continue
        return


def register(addr: int, nbytes: int) -> bool:
    """Page-locks ``[addr, addr + nbytes)`` for DMA; True when the caller must ``unregister`` it. False where
    the range is page-locked already (by this process's writer), or where the driver refuses (one warning
    per process): the copies then still work, synchronously through the driver's staging buffers."""
    global _warned
    if nbytes <= 0:
        return False
    rc = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, 0))
    if rc == 0:
        return True
    _clear_last_error()
    if rc == _ALREADY_REGISTERED:  # this process's writer page-locked the slot: the copies are DMA already
        return False
    if not _warned:
        _warned = True
        log.warning("cudaHostRegister of %d bytes of shared memory failed (CUDA error %d): snapshots and restores "
                    "of CUDA tensors copy through pageable memory (slower, correct)", nbytes, rc)
    return False


def unregister(addr: int) -> None:
    if int(torch.cuda.cudart().cudaHostUnregister(addr)) != 0:
        _clear_last_error()


def load_pinned() -> bool:
    """Whether a restore page-locks the slot it reads (``FLASHCKPT_CUDA_LOAD_PIN``, default on)."""
    return os.environ.get("FLASHCKPT_CUDA_LOAD_PIN", "1").lower() not in ("0", "false", "no", "off")


def _bytes_of(t: torch.Tensor, nbytes: int, byte_offset: int = 0) -> torch.Tensor:
    """A flat uint8 tensor over ``nbytes`` of ``t``'s storage from ``byte_offset`` (any dtype, any device)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), byte_offset, (nbytes,), (1,))


def _host(addr: int, nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor over ``nbytes`` of (mapped) memory at ``addr``: no copy, no ownership."""
    buf = (ctypes.c_uint8 * nbytes).from_address(addr)
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)


def copy_to_host(stream: torch.cuda.Stream, items: Iterable[tuple[torch.Tensor, int, int]]) -> torch.cuda.Event:
    """Queues ``(tensor, host address, nbytes)`` device-to-host copies of whole storages on ``stream``,
    after the work already queued on the current stream; returns the event that completes them. The
    caller keeps the tensors alive (and unchanged) until the event completed."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for t, addr, n in items:
            _host(addr, n).copy_(_bytes_of(t, n), non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return done


def copy_to_device(items: list[tuple[torch.UntypedStorage, int, int, int]]) -> None:
    """Copies ``(CUDA storage, byte offset in it, host address, nbytes)`` host-to-device, on the current
    stream of each storage's device, and returns once every copy is done (the source may be overwritten
    after that)."""
    devices = set()
    for st, start, addr, n in items:
        dst = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, start, (n,), (1,))
        dst.copy_(_host(addr, n), non_blocking=True)
        devices.add(st.device)
    for d in devices:
        torch.cuda.current_stream(d).synchronize()
