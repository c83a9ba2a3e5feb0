"""Raw byte copies on several threads: the memcpy limit is the target of every snapshot."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["Copier", "SMALL_COPY"]

# Copies below this run on the calling thread: a thread hand-off costs more than it saves.
_INLINE_BYTES = 4 << 20
# Below this a copy is "small" and stays on the calling thread, so the workers never fight for the GIL
# over thousands of tiny calls (ctypes releases the GIL around every memmove); snapshot plans hand
# these to the native fast path in one call when it is built.
SMALL_COPY = 256 << 10

_memmove = ctypes.memmove


def _run(tasks: list[tuple[int, int, int]]) -> None:
    mv = _memmove
    for dst, src, n in tasks:
        mv(dst, src, n)


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
            extra_work: int = 0) -> None:
        """Runs the copies; ``extra`` (other copying, worth about ``extra_work`` bytes of memmove) runs
        on the calling thread first, and the threads' shares of ``tasks`` are balanced around it."""
        total = 0
        for t in tasks:
            total += t[2]
        if self._pool is None or total < _INLINE_BYTES:
            if extra is not None:
                extra()
            _run(tasks)
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
        futures = [self._pool.submit(_run, b) for b in bins[1:] if b]
        try:
            if extra is not None:
                extra()
            _run(bins[0])
            _run(small)
        finally:
            for f in futures:
                f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
