"""Checkpoint dirs whose commit records did not come along: what they hold, and ``flashckpt adopt``.

The records of a checkpoint dir on a file system live beside it (``_records``): they follow a rename
in its parent (found by the dir's inode, moved at the next claim), and a dir reached through a symbolic
link has the records of its real path. A copy (``cp -r``) or a move to another parent directory takes
the files without the records, and a load finds no committed step there: flashckpt cannot tell a
complete step from a partial one without its manifest, so it uses none of those files, and says so
(``unrecorded``: ``load()`` logs it and puts it in ``LoadResult.note``, ``flashckpt ls`` prints it).
``adopt`` (``flashckpt adopt DIR --from ORIGINAL``) gives such a dir the committed steps of the records
written for the dir it came from, each file checked (size and checksum) against them first; nothing of
the original is changed. Records kept inside a dir (``<dir>/.flashckpt``) travel with it anyway.

Torch-free; reads only, except ``adopt`` (which writes the new records of ``DIR`` only).
"""

from __future__ import annotations

import logging
import os

from flashckpt import errors as E
from flashckpt.commit import records_store as _records
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.manifest import Manifest
from flashckpt.commit.protocol import repair
from flashckpt.commit.removal import intent_paths
from flashckpt.format.names import META
from flashckpt.storage.registry import storage_for

__all__ = ["unrecorded", "adopt", "copied_from"]

log = logging.getLogger(__name__)

_LIMIT = 10000  # files looked at in a dir without records


def _files(layout: CommitLayout, local: str) -> list[str]:
    """Files in ``local`` (relative, at most ``_LIMIT``) that no uncommitted step of this dir is writing."""
    pending = {p for s in layout.uncommitted_steps() for p in intent_paths(layout, s)}
    suffix = layout.storage.temp_suffix or "\0"
    out: list[str] = []
    for top, dirs, names in os.walk(local):
        dirs[:] = sorted(d for d in dirs if d != META)
        for n in sorted(names):
            p = os.path.join(top, n)
            if p not in pending and not n.endswith(suffix) and not n.startswith(".flashckpt-probe-"):
                out.append(os.path.relpath(p, local))
        if len(out) >= _LIMIT:
            break
    return out


def copied_from(root: str) -> list[tuple[str, list[int]]]:
    """Records beside ``root``'s real path, other than its own, whose committed steps ``root`` holds
    whole (every file with its committed size): (the dir they were written for, those steps), most steps
    first. Reads only."""
    real = os.path.realpath(root)
    top = os.path.join(os.path.dirname(real), META)
    own = _records.home(real)
    if not _records.usable_top(top):
        return []
    out = []
    for n in sorted(os.listdir(top)):
        path = os.path.join(top, n)
        if path == own or n == _records.LOCK_NAME or n.startswith(_records.LEFTOVERS):
            continue
        steps = _records.whole_steps(_records.committed_in(path), real)
        if steps:
            out.append((_records.bound_dir(path) or os.path.join(os.path.dirname(real), n), steps))
    return sorted(out, key=lambda ds: -len(ds[1]))


def unrecorded(layout: CommitLayout) -> str | None:
    """Why ``load()`` uses none of the files a checkpoint dir holds: it has no committed step, yet holds
    files (other than those of a step being written); None otherwise, and for a dir in an object store
    (whose records are inside it, so they travel with a copy). Reads only."""
    local = layout.storage.local_path(layout.root)
    if local is None or not os.path.isdir(local) or layout.committed_steps():
        return None
    files = _files(layout, local)
    if not files:
        return None
    shown = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
    msg = (f"{layout.root} holds {len(files)}{'+' if len(files) >= _LIMIT else ''} file(s) ({shown}) but no "
           "step that flashckpt committed there, so load() uses none of them: without a commit record "
           "flashckpt cannot tell a complete step from a partial one. A copy of a checkpoint dir, or a move "
           "to another parent directory, leaves its commit records behind, beside the original dir "
           "(in <its parent>/.flashckpt/<its name>). ")
    try:
        sources = copied_from(local)
    except E.CheckpointDirError as e:  # the note only: what load() returned does not depend on it
        return msg + f"Looking beside it for the records it may have come from failed: {e}"
    if sources:
        src, steps = sources[0]
        return msg + (f"It holds the committed steps {steps} of {src}: `flashckpt adopt {layout.root} --from "
                      f"{src}` checks every file against those records and makes the steps this dir's")
    return msg + (f"`flashckpt adopt {layout.root} --from <the dir it was copied or moved from>` checks every "
                  "file against that dir's records and makes its steps this dir's; or load a file you trust "
                  "with load(resume_path=...)")


def _sources(src: str) -> list[str]:
    """The records written for checkpoint dir ``src``: its records (wherever ``_records.place`` finds
    them), and the records retired when a new dir took its name."""
    found = [_records.place(src).path]
    real = os.path.realpath(src)
    top = os.path.join(os.path.dirname(real), META)
    if _records.usable_top(top):
        for n in sorted(os.listdir(top)):
            path = os.path.join(top, n)
            if n.startswith(_records.RETIRED) and _records.bound_dir(path) in (real, os.path.abspath(src)):
                found.append(path)
    return [p for p in dict.fromkeys(found) if os.path.isdir(p) and not os.path.islink(p)]


def _intact(layout: CommitLayout, m: Manifest) -> str | None:
    """What is wrong with the files of ``m`` in ``layout``'s checkpoint dir (sizes and checksums), or None."""
    for f in m.all_files():
        path = layout.abs(f.path)
        try:
            size, digest = layout.storage.checksum(path)
        except FileNotFoundError:
            return f"{path} is missing"
        if (size, digest) != (f.size, f.xxh3):
            return f"{path} differs from the file committed (size {size}, checksum {digest}; committed {f.size}, " \
                   f"{f.xxh3})"
    return None


def adopt(dst: str, src: str, *, dry_run: bool = False) -> list[str]:
    """Gives the checkpoint dir ``dst`` (a copy or a move of checkpoint dir ``src``) the committed steps
    of ``src``'s records whose files ``dst`` holds intact (every file's size and checksum as committed),
    in records of its own (bound to it), in the same commit order; ``src`` and its records are left as
    they are. With ``dry_run``, says what it would do and changes nothing.

    Returns:
        What was done (or would be), one line each.

    Raises:
        CheckpointDirError: ``dst`` is not a local directory, already has committed steps or a live job,
            or holds no step of ``src`` intact (the message says what differs).
    """
    storage = storage_for(dst)
    root = storage.normpath(dst)
    where = f"flashckpt adopt {dst} --from {src}"
    if storage.local_path(root) is None:
        raise E.CheckpointDirError(f"{where}: {dst} is in an object store, which keeps a checkpoint dir's records "
                                   "inside it (<dir>/.flashckpt): copy that prefix along with the dir")
    if not os.path.isdir(root):
        raise E.CheckpointDirError(f"{where}: {dst} is not a directory")
    target = CommitLayout(root, storage)
    if target.committed_steps():
        raise E.CheckpointDirError(f"{where}: {dst} already has committed steps {target.committed_steps()} (records "
                                   f"in {target.meta}); adopt only into a dir without any")
    if target.home.live_jobs():
        raise E.CheckpointDirError(f"{where}: jobs {target.home.live_jobs()} are saving to {dst}; adopt once they "
                                   "stopped")
    best: tuple[str, dict[int, Manifest], list[str]] | None = None
    for records in _sources(src):
        manifests, problems = {}, []
        for s, m in sorted(_records.committed_in(records).items(), key=lambda sm: (sm[1].seq, sm[0])):
            why = _intact(target, m)
            if why is None:
                manifests[s] = m
            else:
                problems.append(f"step {s}: {why}")
        if best is None or len(manifests) > len(best[1]):
            best = (records, manifests, problems)
    if best is None:
        raise E.CheckpointDirError(f"{where}: no commit records of {src} were found (looked for "
                                   f"{_records.place(src).path} and records retired beside it)")
    records, manifests, problems = best
    if not manifests:
        raise E.CheckpointDirError(f"{where}: no committed step of {src} (records {records}) is intact in {dst}: " +
                                   "; ".join(problems or ["they have no committed step"]))
    lines = [f"step {p}: not adopted" for p in problems]
    lines += [f"step {s}: adopted ({len(m.all_files())} file(s) checked)" for s, m in manifests.items()]
    if dry_run:
        return [f"would adopt: {line}" for line in lines]
    if target.beside:
        top, name = os.path.split(_records.home(root))
        with _records.locked_parent(top) as top_fd:
            if os.path.isdir(target.meta) and target.meta != os.path.join(top, name):
                raise E.CheckpointDirError(f"{where}: {dst} has records elsewhere ({target.meta})")
            _records.bind(top_fd, name, root)
            target = CommitLayout(root, storage)
            _write(target, manifests)
    else:
        _write(target, manifests)
    log.info("adopted steps %s of %s (records %s) into %s (records %s)", list(manifests), src, records, dst,
             target.meta)
    return lines + [f"{dst}: its commit records are {target.meta}, bound to it"]


def _write(target: CommitLayout, manifests: dict[int, Manifest]) -> None:
    """Writes ``manifests`` into ``target``'s records, then its tracker."""
    for s, m in manifests.items():
        target.storage.write_bytes(target.manifest_path(s), m.to_json())
    repair(target)
