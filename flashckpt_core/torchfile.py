"""``torch.save`` files as ``FileSet`` parts: the bytes ``torch.save`` writes, with every storage's data
left in place as a tensor part, so a file is staged in shared memory with one copy of its tensors and
persisted byte for byte as ``torch.save(obj, buffer)`` writes it.

``torch.save`` runs under ``torch.serialization.skip_data`` into a sink that records the bytes written
and the gaps seeked over (one per non-empty storage, in the order of the archive's ``data/<key>``
records). A second pickling pass with the same protocol lists the storages in the order ``torch.save``
numbers them (first appearance while pickling); each gap is filled by a uint8 view of its storage.
Differences from a plain ``torch.save`` of the same object into a buffer: none in layout; the zip
CRC-32 of the data records is 0 and ``.data/serialization_id`` differs (``torch.load`` checks neither).
A ``torch.save`` to a path names the archive's records after the file (``model_optim_rng/...``), one
to a buffer ``archive/...``; ``torch.load`` reads both.

``PartsReader`` reads such parts back with ``torch.load`` without joining them first.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from .errors import FlashCheckpointError
from .files import tensor_view

__all__ = ["torch_save_parts", "parts_size", "PartsReader", "load_parts"]


class _Sink:
    """Write-only stream recording, in order, the bytes written and the gaps ``torch.save`` seeks over
    under ``skip_data`` (a gap is recorded as its length, an int)."""

    def __init__(self) -> None:
        self.pos = 0
        self.events: list[bytes | int] = []

    def write(self, b: Any) -> int:
        data = bytes(b)
        if data:
            self.events.append(data)
        self.pos += len(data)
        return len(data)

    def seek(self, off: int, whence: int = 0) -> int:
        new = off if whence == 0 else self.pos + off if whence == 1 else -1
        if new < self.pos:
            raise OSError("torch_save_parts: torch.save seeked backwards; unsupported")
        if new > self.pos:
            self.events.append(new - self.pos)
        self.pos = new
        return new

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


class _Null:
    def write(self, b: Any) -> int:
        return len(b)


def _storages_in_save_order(obj: Any) -> list[torch.UntypedStorage]:
    """The storages ``torch.save(obj)`` writes, in its key order (first appearance while pickling,
    deduplicated by the underlying storage, as ``torch.serialization._save`` numbers them)."""
    seen: dict[int, torch.UntypedStorage] = {}

    class _Walker(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            st: Any
            if isinstance(o, torch.storage.TypedStorage):
                st = o._untyped_storage
            elif torch.is_storage(o):
                st = o
            else:
                return None
            key = st._cdata
            if key not in seen:
                seen[key] = st
            return ("storage", key)

    _Walker(_Null(), protocol=torch.serialization.DEFAULT_PROTOCOL).dump(obj)
    return list(seen.values())


def _u8(st: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


def torch_save_parts(obj: Any) -> list[Any]:
    """``torch.save(obj, buffer)`` as parts: bytes, and uint8 views of the storages (any device, no copy)
    where their data goes. ``b"".join`` of the parts' bytes is a ``torch.save`` file of ``obj``.

    The views alias ``obj``'s tensors: snapshot them (``CheckpointEngine.save``) before those change.

    Raises:
        FlashCheckpointError: this torch writes ``torch.save`` files in a way the split does not expect.
    """
    sink = _Sink()
    with torch.serialization.skip_data():
        storages = _storages_in_save_order(obj)
        torch.save(obj, sink)  # type: ignore[arg-type]  # a file-like object: only write/seek/tell/flush
    filled = iter([st for st in storages if st.nbytes() > 0])
    parts: list[Any] = []
    pending = bytearray()
    for ev in sink.events:
        if isinstance(ev, bytes):
            pending += ev
            continue
        st = next(filled, None)
        if st is None or st.nbytes() != ev:
            raise FlashCheckpointError(
                f"torch_save_parts: torch {torch.__version__} left a gap of {ev} bytes where flashckpt expected "
                f"{'no storage' if st is None else f'a storage of {st.nbytes()} bytes'}; its torch.save layout "
                "is not the one flashckpt expects")
        if pending:
            parts.append(bytes(pending))
            pending = bytearray()
        parts.append(_u8(st))
    if next(filled, None) is not None:
        raise FlashCheckpointError(f"torch_save_parts: torch {torch.__version__} wrote fewer storages than the "
                                   "object holds; its torch.save layout is not the one flashckpt expects")
    if pending:
        parts.append(bytes(pending))
    return parts


def parts_size(parts: list[Any]) -> int:
    """Bytes the parts make up when written one after another."""
    return sum(len(p) if isinstance(p, (bytes, bytearray, memoryview)) else p.numel() * p.element_size()
               for p in parts)


def _part_view(p: Any) -> memoryview:
    return memoryview(p) if isinstance(p, (bytes, bytearray, memoryview)) else tensor_view(p)


class PartsReader(io.RawIOBase):
    """A seekable read-only stream over parts (bytes and CPU tensors, their bytes in C order), for
    ``torch.load`` without joining the parts into one buffer first."""

    def __init__(self, parts: list[Any]) -> None:
        super().__init__()
        self._views = [_part_view(p) for p in parts]
        self._starts: list[int] = []
        pos = 0
        for v in self._views:
            self._starts.append(pos)
            pos += len(v)
        self._size = pos
        self._pos = 0
        self._i = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, off: int, whence: int = 0) -> int:
        base = 0 if whence == 0 else self._pos if whence == 1 else self._size
        self._pos = max(0, base + off)
        self._i = 0
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = 0
        while n < len(out) and self._pos < self._size:
            while self._i + 1 < len(self._views) and self._starts[self._i + 1] <= self._pos:
                self._i += 1
            while self._starts[self._i] > self._pos:
                self._i -= 1
            v = self._views[self._i]
            off = self._pos - self._starts[self._i]
            k = min(len(out) - n, len(v) - off)
            if k <= 0:
                self._i += 1
                continue
            out[n:n + k] = v[off:off + k]
            n += k
            self._pos += k
        return n

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self._size - self._pos
        buf = bytearray(max(0, min(size, self._size - self._pos)))
        got = self.readinto(buf)
        return bytes(buf[:got])


def load_parts(parts: list[Any], *, weights_only: bool = True) -> Any:
    """``torch.load`` of a file held as parts, onto the CPU."""
    stream: Any = PartsReader(parts)
    return torch.load(stream, map_location="cpu", weights_only=weights_only)
