"""Compatibility names: the shared-memory code lives in ``segment`` (the segment format),
``snapshot_writer`` (``SharedMemoryHandler``, the snapshot planning) and ``snapshot_reader`` (the public
``SnapshotReader``). Import from those; this module only re-exports what was importable here before.
"""

from __future__ import annotations

from .segment import (
    COMPLETE,
    EMPTY,
    FLAG_PENDING,
    FLAG_PINNED,
    FLAG_UNRESERVED,
    PAGE,
    WRITING,
    Segment,
    SlotHeader,
    SlotRef,
    advise_huge_pages,
    live_snapshots,
    lock_path,
    segment_path,
    segment_paths,
    writer_lease_path,
)
from .snapshot_reader import Snapshot, read_snapshot
from .snapshot_writer import Allocator, SharedMemoryHandler

__all__ = ["SharedMemoryHandler", "Segment", "SlotHeader", "SlotRef", "Snapshot", "EMPTY", "WRITING", "COMPLETE",
           "FLAG_PINNED", "FLAG_PENDING", "FLAG_UNRESERVED", "PAGE", "Allocator", "advise_huge_pages",
           "live_snapshots", "lock_path", "read_snapshot", "segment_path", "segment_paths", "writer_lease_path"]
