"""Raw byte copies on several threads: the memcpy limit is the target of every snapshot."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from flashckpt import errors as E

__all__ = ["Copier", "SMALL_COPY", "CopyOp", "file_reader"]

# Copies below this run on the calling thread: a thread hand-off costs more than it saves.
_INLINE_BYTES = 4 << 20
# Below this a copy is "small" and stays on the calling thread, so the workers never fight for the GIL
# over thousands of tiny calls (ctypes releases the GIL around every memmove); snapshot plans hand
# these to the native fast path in one call when it is built.
SMALL_COPY = 256 << 10

_memmove = ctypes.memmove

# (destination address, source, bytes): the source is an address for memmove, a file offset for reads.
CopyOp = Callable[[int, int, int], object]


def file_reader(fd: int) -> CopyOp:
    """A copy op whose source is an offset in file ``fd``: ``preadv`` into the destination address.

    From a tmpfs file this is one kernel copy out of the page cache, without mapping the source into this
    process: a restarted trainer that maps a 1 GB snapshot pays ~260k page-table entries (60-90 ms on 4 KiB
    pages, as much again as the copy) before or while it copies; ``preadv`` skips that (docs/benchmarks.md)."""

    def read(dst: int, off: int, n: int) -> None:
        while n > 0:
            got = os.preadv(fd, [(ctypes.c_char * n).from_address(dst)], off)
            if got <= 0:
                raise E.SharedMemoryError(f"short read at offset {off} of a shared-memory segment ({n} bytes "
                                          "missing): it was truncated")
            dst, off, n = dst + got, off + got, n - got

    return read


def _run(tasks: list[tuple[int, int, int]], op: CopyOp = _memmove) -> None:
    for dst, src, n in tasks:
        op(dst, src, n)


class Copier:
    """Copies (dst_address, src_address, nbytes) tasks, splitting large ones across threads.

    The caller thread takes part in every copy; ``threads - 1`` workers are started once. Not
    thread-safe: one ``run`` at a time. Close it with ``close()``.
    """

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = (ThreadPoolExecutor(self.threads - 1, thread_name_prefix="flashckpt-copy")
                      if self.threads > 1 else None)

    def run(self, tasks: list[tuple[int, int, int]], extra: Callable[[], None] | None = None,
            extra_work: int = 0, op: CopyOp = _memmove) -> None:
        """Runs the copies with ``op`` (memmove; ``file_reader`` for sources that are file offsets);
        ``extra`` (other copying, worth about ``extra_work`` bytes of memmove) runs on the calling thread
        first, and the threads' shares of ``tasks`` are balanced around it."""
        total = 0
        for t in tasks:
            total += t[2]
        if self._pool is None or total < _INLINE_BYTES:
            if extra is not None:
                extra()
            _run(tasks, op)
            return
        small = [t for t in tasks if t[2] < SMALL_COPY]
        large = [t for t in tasks if t[2] >= SMALL_COPY]
        large_total = total - sum(t[2] for t in small)
        nbins = self.threads
        per = max(1, -(-(large_total + extra_work) // nbins))
        bins: list[list[tuple[int, int, int]]] = [[] for _ in range(nbins)]
        cur, filled = 0, min(extra_work, per)
        for dst, src, n in large:
            while n > 0:
                take = n if cur == nbins - 1 else min(n, per - filled)
                bins[cur].append((dst, src, take))
                dst, src, n, filled = dst + take, src + take, n - take, filled + take
                if filled >= per and cur < nbins - 1:
                    cur, filled = cur + 1, 0
        futures = [self._pool.submit(_run, b, op) for b in bins[1:] if b]
        try:
            if extra is not None:
                extra()
            _run(bins[0], op)
            _run(small, op)
        finally:
            for f in futures:
                f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
