"""The node-local tier beside a durable checkpoint dir: where it is, how a durable path maps onto it, and
uploading a locally committed step to the durable tier.

A job with a local tier (``CheckpointEngine(..., local_dir=...)``, ``FLASHCKPT_LOCAL_DIR``) has each node's
saver write its ranks' files into the local dir first, at the same path relative to the root as on the
durable tier (the framework's own layout), with the local dir's own commit records (a ``CommitLayout``
over a ``PosixDiskStorage`` of it: done markers, manifest, tracker). ``upload_step`` then copies one
locally committed step to the durable tier and writes this node's done markers there; the durable commit
itself is ``commit.protocol.commit_step`` over the durable layout, run by global rank 0's node.

A local manifest records in its ``extra``: ``tier_ranks`` (the ranks of this node it holds) and
``durable_spec`` (what the durable commit needs: ranks, world size, replicated, extra; only on global rank
0's node), so that a later saver (or ``flashckpt upload``) can finish the durable commit after a crash.

Imports the storage layer and ``commit`` below it; torch-free; called from the saver's threads and the CLI.
"""

from __future__ import annotations

import gc
import mmap
import os
import shutil
from dataclasses import replace
from typing import Any

from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.manifest import Manifest, record_from_json
from flashckpt.storage import locations
from flashckpt.storage.base import CheckpointStorage, FileRecord
from flashckpt.storage.posix import PosixDiskStorage

__all__ = ["check_local_dir", "local_layout", "local_target", "upload_step", "pending_uploads", "durable_spec_of",
           "DURABLE_ROOT", "belongs", "foreign_steps"]

#: A local manifest's key naming the checkpoint dir (the durable tier's root) its step belongs to: a local dir
#: used for two checkpoint dirs must never upload or load one's steps as the other's.
DURABLE_ROOT = "durable_root"


def belongs(m: Manifest, durable_root: str) -> bool:
    """Whether the local tier's manifest ``m`` is a step of the checkpoint dir ``durable_root``."""
    return m.extra.get(DURABLE_ROOT) == durable_root


def foreign_steps(local: CommitLayout, durable_root: str) -> dict[int, str]:
    """The local tier's committed steps of another checkpoint dir than ``durable_root``: step -> that dir
    ("?" where the manifest does not say)."""
    return {s: str(m.extra.get(DURABLE_ROOT, "?")) for s, m in local.committed_manifests().items()
            if not belongs(m, durable_root)}


def check_local_dir(local_dir: str | os.PathLike[str], durable_root: str, durable: CheckpointStorage,
                    what: str = "CheckpointEngine") -> str:
    """The local tier's absolute, normalized path.

    Raises:
        InvalidArgumentError: ``local_dir`` is a URL (the local tier is a directory of this node), or it and
            the durable checkpoint dir overlap (one inside the other).
    """
    given = os.fspath(local_dir)
    if locations.is_url(given) and not given.startswith("file://"):
        raise E.InvalidArgumentError(
            f"{what}(local_dir={given!r}): the local tier is a directory on this node (a local disk or NVMe "
            "mount such as /nvme/run), not a URL; give the object store as checkpoint_dir instead")
    path = os.path.abspath(given[len("file://"):] if given.startswith("file://") else given)
    durable_local = durable.local_path(durable_root)
    if durable_local is not None:
        a, b = os.path.realpath(path), os.path.realpath(durable_local)
        if a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep):
            raise E.InvalidArgumentError(
                f"{what}(local_dir={given!r}): it overlaps the checkpoint dir {durable_root} (one lies inside the "
                "other); give the local tier a directory of its own, outside the checkpoint dir")
    return locations.normpath(path)


def local_layout(local_dir: str, job: str = "") -> CommitLayout:
    """The commit records of the local tier ``local_dir`` (a POSIX directory)."""
    return CommitLayout(local_dir, PosixDiskStorage(), job=job)


def local_target(durable: CommitLayout, local: CommitLayout, path: str) -> str:
    """Where ``path`` (on the durable tier) lies on the local tier: the same path relative to the root."""
    rel = durable.rel(path)
    return local.root if rel == "." else locations.join(local.root, rel)


def durable_spec_of(m: Manifest) -> dict[str, Any] | None:
    """The durable commit spec a local manifest records (None: this node does not commit the step)."""
    spec = m.extra.get("durable_spec")
    return spec if isinstance(spec, dict) else None


def pending_uploads(local: CommitLayout, durable: CommitLayout) -> list[int]:
    """The locally committed steps, in commit order, that are not (yet) committed on the durable tier and were
    committed locally after the durable tier's newest commit (a step older than it is never uploaded: it
    would not be the newest there)."""
    dur = durable.committed_manifests()
    newest_at = max((m.extra.get("saved_at", 0.0) for m in dur.values()), default=0.0)
    out = []
    for s, m in local.committed_manifests().items():
        if s in dur or not belongs(m, durable.root):
            continue
        if float(m.extra.get("saved_at", 0.0)) >= float(newest_at):
            out.append(s)
    return out


def _upload_file(durable: CheckpointStorage, src: str, dst: str) -> FileRecord:
    """Copies the local file ``src`` to ``dst`` on the durable tier (whole or not at all: a POSIX dir by
    temp + rename, an object store by one upload that is visible once complete)."""
    if durable.posix_files:
        def fill(tmp: str) -> None:
            shutil.copyfile(src, tmp)

        return durable.write_file(dst, fill)
    with open(src, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return durable.write_parts(dst, [b""])
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return durable.write_parts(dst, [memoryview(mm)])
        finally:
            gc.collect()  # drop the views of the map before it closes
            try:
                mm.close()
            except BufferError:  # views still held by a failure's traceback: unmapped when they go, and the
                pass  # failure itself is what the caller sees (not "cannot close exported pointers exist")


def upload_step(local: CommitLayout, durable: CommitLayout, step: int) -> Manifest:
    """Uploads this node's files of locally committed ``step`` to the durable tier and writes their done
    markers there (an intent first, so that a crash mid-upload is cleaned up like any half-written step).
    A file whose durable path holds another committed step's file is uploaded staged and moved into place
    at the durable commit (as a persist does); tracker files are always staged. Returns the local manifest.

    Raises:
        CheckpointCorruptError: a local file is gone or does not match its local manifest (size or checksum).
        OSError / FlashCheckpointError: what the durable store raised.
    """
    m = local.read_manifest(step)
    committed = durable.committed_paths()
    trackers = [record_from_json(t, "extra.trackers") for t in m.extra.get("trackers", [])]
    bases = m.extra.get("bases", {})
    saved = m.extra.get("saved_at_ranks", {})
    first = min(m.files) if m.files else None
    for r in sorted(m.files):
        mine = list(m.files[r]) + (trackers if r == first else [])
        durable.clear_markers(step, r)
        durable.write_intent(step, r, [durable.abs(f.path) for f in mine if f.kind != "tracker"])
        recs = []
        for i, f in enumerate(mine):
            final = durable.abs(f.path)
            staged = (durable.staged_path(step, r, 90000 + i)
                      if f.kind == "tracker" or durable.storage.normpath(final) in committed else "")
            src = local.abs(f.path)
            if not os.path.exists(src):  # the local dir emptied under the saver: not a store failure to retry
                raise E.CheckpointCorruptError(f"uploading step {step}: the local file {src} is gone (was the local "
                                               "dir emptied?); the step is not uploaded")
            rec = _upload_file(durable.storage, src, staged or final)
            if (rec.size, rec.xxh3) != (f.size, f.xxh3) and f.kind == "tracker":
                continue  # rewritten locally by a newer step since (a fixed name): that step carries it
            if (rec.size, rec.xxh3) != (f.size, f.xxh3):
                raise E.CheckpointCorruptError(
                    f"uploading step {step}: the local file {src} has size {rec.size} / checksum {rec.xxh3}, not "
                    f"{f.size} / {f.xxh3} as its local manifest says; the local copy is damaged (not uploaded)")
            recs.append(replace(f, path=final, staged=staged))
        base = bases.get(str(r), "")
        durable.write_done(step, r, recs, base=durable.abs(base) if base else "", saved_at=float(saved.get(str(r), 0.0)))
    return m
