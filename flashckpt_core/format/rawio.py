"""Read-only, seekable files over a known number of bytes: ``SeekableReader`` (the position), which the
ranged view of a stored file (``remote_load.RangeFile``) extends, and ``ViewsReader`` (memoryviews read one
after another), which the S3 request bodies (``_s3io.Body``) and the parts of a ``torch.save`` file
(``torchfile.PartsReader``) are."""

from __future__ import annotations

import bisect
import io
from typing import Any


def part_view(part: Any) -> memoryview:
    """A file part's bytes (bytes-like, or a CPU tensor's bytes in C order) as a flat byte memoryview, no copy
    for bytes and contiguous tensors."""
    if isinstance(part, (bytes, bytearray, memoryview)):
        return memoryview(part).cast("B")
    from flashckpt.format.files import tensor_view  # torch: only where tensors are written (never in the saver itself)

    return tensor_view(part)


class SeekableReader(io.RawIOBase):
    """Position bookkeeping over ``_size`` bytes: ``seek`` (clamped at 0), ``tell``, readable, seekable."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self._size = size
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, off: int, whence: int = io.SEEK_SET) -> int:
        base = 0 if whence == io.SEEK_SET else self._pos if whence == io.SEEK_CUR else self._size
        self._pos = max(0, base + off)
        self._moved()
        return self._pos

    def _moved(self) -> None:
        """Called after every seek (a subclass drops a cursor it keeps)."""


class ViewsReader(SeekableReader):
    """The bytes of ``views`` (flat byte memoryviews) one after another, read without joining them first."""

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views
        self._starts: list[int] = []
        n = 0
        for v in views:
            self._starts.append(n)
            n += len(v)
        super().__init__(n)

    def _view(self, n: int) -> memoryview:
        """Up to ``n`` bytes from the current position, within one view (the position is below the size)."""
        i = bisect.bisect_right(self._starts, self._pos) - 1
        at = self._pos - self._starts[i]
        return self._views[i][at: at + n]

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        got = 0
        while got < len(out) and self._pos < self._size:
            v = self._view(len(out) - got)
            out[got:got + len(v)] = v
            got += len(v)
            self._pos += len(v)
        return got

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = self._size - self._pos
        buf = bytearray(max(0, min(size, self._size - self._pos)))
        return bytes(buf[:self.readinto(buf)])
