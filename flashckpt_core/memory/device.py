"""Device-to-host copies into shared-memory slots: ``DeviceCopies``.

A snapshot of CUDA tensors copies them on a side stream straight into its slot, after the work already
queued on the current stream: with the native fast path, the plan's hundreds of copies are queued in one C++
call (one ``cudaMemcpyBatchAsync`` where the runtime torch loaded is CUDA 13, else one ``cudaMemcpyAsync`` a
copy; ``csrc/fastpath.cpp``, ``util.cuda``), else one ``copy_`` each from Python. DMA straight into the slot
needs the slot page-locked (registered with the driver), which costs about 0.05 s per GB on a faulted slot: by
default (``FLASHCKPT_CUDA_REGISTER=background``) that runs on a thread of its own, and a snapshot into a slot
not locked yet leaves its copies to ``finish`` (the overlapped snapshot's thread), which waits for the lock
and copies straight into the slot (``_Unlocked``; through two pinned bounce buffers where the driver refuses
the lock, or with ``FLASHCKPT_CUDA_UNLOCKED=bounce``): the training thread never waits for a page-locking.
With ``inline`` the slot is registered at its first use, on the training thread (as before).

A slot the saver gave back (its pages left the file) or a segment that is closed is unregistered, since the
registration alone would still pin the old pages. Used by the writer (``memory.writer``) only, under its
one-call-at-a-time rule: not thread-safe (the registration thread touches only its futures). Imports
``format`` and ``util`` only (``util.cuda`` holds the driver calls).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from flashckpt.config import knob
from flashckpt.format.segment import FLAG_UNRESERVED, Segment
from flashckpt.memory.plan import SnapshotPlan
from flashckpt.util import cuda as _cuda

__all__ = ["DeviceCopies", "BOUNCE_BYTES"]

BOUNCE_BYTES = 64 << 20  # each of the two pinned bounce buffers of a slot not page-locked yet
Key = tuple[str, int]


class DeviceCopies:
    """One writer's device-to-host copies and the slots it registered.

    Attributes:
        registered: (segment path, slot) -> the registered address (0: the driver refused; copied through the
            bounce buffers).
        register_s: (segment path, slot) -> seconds its page-locking took (the cost moved off the training path).
    """

    def __init__(self) -> None:
        self.registered: dict[Key, int] = {}
        self.register_s: dict[Key, float] = {}
        self._pending: dict[Key, tuple[int, Future[bool]]] = {}
        self._stream: Any = None
        self._registrar: ThreadPoolExecutor | None = None
        self._bounce: list[torch.Tensor] = []

    def copy(self, seg: Segment, slot: int, tensors: list[torch.Tensor], plan: SnapshotPlan, *,
             native: Any = None, ptrs: Any = None, host_copy: Callable[[list[tuple[int, int, int]]], None],
             ready: Any = None) -> Any:
        """Queues the device-to-host copies of ``plan.device_copies`` (tensor index, offset in the slot's data
        area, bytes) of ``tensors`` into slot ``slot``, ordered after ``ready`` (an event recorded at ``save``;
        None: the work already queued on the current stream); returns what completes them: an event
        (``synchronize()``), or, for a slot not locked, ``_Unlocked``, whose ``synchronize()`` runs the copies
        (``host_copy`` copies (dst, src, bytes) host tasks: the writer's copy threads, for the bounce route)."""
        key = (seg.path, slot)
        self._settle(key)
        addr = seg.base + seg.slot_off(slot)
        if key not in self.registered:
            if knob("cuda_register") == "inline":
                t0 = time.perf_counter()
                self.registered[key] = addr if _cuda.register(addr, seg.slot_size) else 0
                self.register_s[key] = time.perf_counter() - t0
            elif key not in self._pending:
                dev = tensors[plan.device_copies[0][0]].device
                self._pending[key] = (addr, self._registrar_pool().submit(self._register, key, addr,
                                                                          seg.slot_size, dev))
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=tensors[plan.device_copies[0][0]].device)
        if ready is None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._stream.device))
        data = seg.base + seg.data_off(slot)

        def dma() -> Any:
            assert self._stream is not None
            self._stream.wait_event(ready)
            if native is not None and plan.device_copies_packed and _cuda.runtime_fn("cudaMemcpyAsync"):
                return _cuda.copy_to_host_native(native, self._stream, data, ptrs, plan.device_copies_packed)
            return _cuda.copy_to_host(self._stream, [(tensors[i], data + off, n) for i, off, n in plan.device_copies])

        if self.registered.get(key):
            return dma()
        # Not locked yet, or refused (0): the snapshot thread waits for the lock, or takes the bounce buffers.
        return _Unlocked(self, key, dma, data, [(tensors[i], off, n) for i, off, n in plan.device_copies], host_copy,
                         ready)

    # ------------------------------------------------------------------ registration
    def _registrar_pool(self) -> ThreadPoolExecutor:
        if self._registrar is None:
            self._registrar = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-pagelock")
        return self._registrar

    def _register(self, key: Key, addr: int, nbytes: int, device: torch.device) -> bool:
        """On the registration thread: page-locks one slot, for every context (the thread's device is the
        tensors', so no other device gets a context)."""
        torch.cuda.set_device(device)
        t0 = time.perf_counter()
        ok = _cuda.register(addr, nbytes, _cuda.PORTABLE)
        self.register_s[key] = time.perf_counter() - t0
        return ok

    def _settle(self, key: Key, *, wait: bool = False) -> None:
        """Moves a finished background registration of ``key`` into ``registered`` (waits for it with ``wait``)."""
        pending = self._pending.get(key)
        if pending is None or not (wait or pending[1].done()):
            return
        del self._pending[key]
        addr, fut = pending
        try:
            ok = fut.result()
        except Exception:  # a driver error: the slot is copied through the bounce buffers (never registered)
            ok = False
        self.registered[key] = addr if ok else 0

    def wait_registered(self) -> None:
        """Waits for every background registration (tests, and before a segment is let go)."""
        for key in list(self._pending):
            self._settle(key, wait=True)

    def bounce_buffers(self, size: int) -> list[torch.Tensor]:
        """The two pinned bounce buffers, of at least ``min(size, BOUNCE_BYTES)`` bytes (made on first use)."""
        size = min(size, BOUNCE_BYTES)
        if not self._bounce or self._bounce[0].numel() < size:
            self._bounce = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        return self._bounce

    # ------------------------------------------------------------------ letting go
    def release_stale(self, seg: Segment) -> None:
        """Unregisters the slots of ``seg`` the saver gave back since they were registered: their pages
        left the file (a later reserve maps new ones), and the registration alone still pins the old."""
        for key in [k for k in (*self.registered, *self._pending) if k[0] == seg.path]:
            if seg.header(key[1]).flags & FLAG_UNRESERVED:
                self.drop(key)

    def drop(self, key: Key) -> None:
        """Unregisters one slot (segment path, slot), if registered (waiting for its registration to end)."""
        self._settle(key, wait=True)
        self.register_s.pop(key, None)
        addr = self.registered.pop(key, 0)
        if addr:
            _cuda.unregister(addr)

    def forget(self, seg: Segment) -> None:
        """Unregisters every slot of ``seg`` (before it is closed or replaced)."""
        for key in [k for k in (*self.registered, *self._pending) if k[0] == seg.path]:
            self.drop(key)

    def close(self) -> None:
        """Ends the registration thread and frees the bounce buffers (after ``forget`` of every segment)."""
        self.wait_registered()
        if self._registrar is not None:
            self._registrar.shutdown(wait=True)
            self._registrar = None
        self._bounce = []


class _Unlocked:
    """The copies of a snapshot into a slot not page-locked (yet), done by ``synchronize()`` (in ``finish``: the
    overlapped snapshot's thread): it waits for the slot's page-locking and then takes one DMA straight into it
    (``dma``: the same copies as a locked slot's, after the work queued before ``save``); where the driver
    refused to lock the slot, or with ``FLASHCKPT_CUDA_UNLOCKED=bounce``, through two pinned bounce buffers in
    turn (a round of up to ``BOUNCE_BYTES`` each), each copied on into the slot by the copy threads while the
    next round's DMA runs. Measured on an H200, waiting for the lock (0.05 s per GB on a faulted slot) and one
    DMA beat the bounce route, whose copies contend with the locking: 80 against 104 ms at 1 GB, 250 against
    353 ms at 4 GB."""

    def __init__(self, owner: DeviceCopies, key: Key, dma: Callable[[], Any], data: int,
                 items: list[tuple[torch.Tensor, int, int]], host_copy: Callable[[list[tuple[int, int, int]]], None],
                 ready: Any) -> None:
        self._owner, self._key, self._dma = owner, key, dma
        self._data, self._items, self._host_copy = data, items, host_copy
        self._stream: torch.cuda.Stream = owner._stream
        self._ready = ready
        self._done = False

    def synchronize(self) -> None:
        if self._done:
            return
        self._done = True
        if knob("cuda_unlocked") != "bounce":
            self._owner._settle(self._key, wait=True)
            if self._owner.registered.get(self._key):
                self._dma().synchronize()
                return
        self._bounce()

    def _bounce(self) -> None:
        total = sum(n for _, _, n in self._items)
        if not total:
            return
        bufs = self._owner.bounce_buffers(total)
        self._stream.wait_event(self._ready)
        inflight: list[tuple[torch.cuda.Event, list[tuple[int, int, int]]] | None] = [None, None]

        def drain(b: int) -> None:
            job = inflight[b]
            if job is not None:
                job[0].synchronize()
                self._host_copy(job[1])
                inflight[b] = None

        flats = [_cuda._bytes_of(t.untyped_storage(), 0, n) for t, _off, n in self._items]
        k = 0
        for k, chunk in enumerate(_cuda.buffer_rounds([n for _, _, n in self._items], bufs[0].numel())):
            b = k % 2
            drain(b)  # the buffer's previous round is in the slot: it may be refilled
            buf = bufs[b]
            with torch.cuda.stream(self._stream):
                for i, pos, n, at in chunk:
                    buf[at:at + n].copy_(flats[i][pos:pos + n], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._stream)
            base = buf.data_ptr()
            inflight[b] = (ev, [(self._data + self._items[i][1] + pos, base + at, n) for i, pos, n, at in chunk])
        drain((k + 1) % 2)  # the older of the two rounds in flight first
        drain(k % 2)
