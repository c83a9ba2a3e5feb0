"""Durability on POSIX file systems: ``fsync_dir`` makes a directory's entries (files created, renamed or
removed in it) survive a crash. Imports nothing of flashckpt; safe from any thread."""

from __future__ import annotations

import os

__all__ = ["fsync_dir"]


def fsync_dir(path: str) -> None:
    """fsyncs the directory ``path`` (its entries: names created, renamed or removed in it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
