"""Device-to-host copies into shared-memory slots: ``DeviceCopies``.

A snapshot of CUDA tensors copies them on a side stream straight into its slot, after the work already
queued on the current stream. Each slot is page-locked (registered with the driver) at its first use, so
the copies run at full speed; a slot the saver gave back (its pages left the file) or a segment that is
closed is unregistered, since the registration alone would still pin the old pages. Used by the writer
(``memory.writer``) only, under its one-call-at-a-time rule: not thread-safe. Imports ``format`` and
``util`` only (``util.cuda`` holds the driver calls).
"""

from __future__ import annotations

from typing import Any

import torch
from flashckpt.format.segment import FLAG_UNRESERVED, Segment
from flashckpt.util import cuda as _cuda

__all__ = ["DeviceCopies"]


class DeviceCopies:
    """One writer's device-to-host copies and the slots it registered.

    Attributes:
        registered: (segment path, slot) -> the registered address (0: the driver refused; copied unpinned).
    """

    def __init__(self) -> None:
        self.registered: dict[tuple[str, int], int] = {}
        self._stream: Any = None

    def copy(self, seg: Segment, slot: int, items: list[tuple[torch.Tensor, int, int]]) -> Any:
        """Queues device-to-host copies of (tensor, offset in the slot's data area, bytes) on a side stream
        into the slot (page-locked at its first use), ordered after the work already queued on the current
        stream; returns the event that completes them (``util.cuda``)."""
        key = (seg.path, slot)
        if key not in self.registered:
            addr = seg.base + seg.slot_off(slot)
            self.registered[key] = addr if _cuda.register(addr, seg.slot_size) else 0
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        data = seg.base + seg.data_off(slot)
        return _cuda.copy_to_host(self._stream, [(t, data + off, n) for t, off, n in items])

    def release_stale(self, seg: Segment) -> None:
        """Unregisters the slots of ``seg`` the saver gave back since they were registered: their pages
        left the file (a later reserve maps new ones), and the registration alone still pins the old."""
        for key in [k for k in self.registered if k[0] == seg.path]:
            if seg.header(key[1]).flags & FLAG_UNRESERVED:
                self.drop(key)

    def drop(self, key: tuple[str, int]) -> None:
        """Unregisters one slot (segment path, slot), if registered."""
        addr = self.registered.pop(key, 0)
        if addr:
            _cuda.unregister(addr)

    def forget(self, seg: Segment) -> None:
        """Unregisters every slot of ``seg`` (before it is closed or replaced)."""
        for key in [k for k in self.registered if k[0] == seg.path]:
            self.drop(key)
