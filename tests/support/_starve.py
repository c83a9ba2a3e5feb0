"""A process starved of file descriptors, for tests of what the library does when ``open`` fails with EMFILE
(used in test processes and in the scripts they run)."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator


@contextlib.contextmanager
def starved_fds(free: int, limit: int = 256) -> Iterator[None]:
    """Inside the block, this process has only ``free`` file descriptors left (its soft limit lowered to at most
    ``limit``, every other descriptor taken by /dev/null); all is given back on leaving."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, limit), hard))
    held: list[int] = []
    try:
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        for _ in range(free):
            os.close(held.pop())
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
