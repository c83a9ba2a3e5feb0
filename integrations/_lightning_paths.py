"""The paths of Lightning checkpoints as ``FlashCheckpointIO`` sees them: where flashckpt writes a path
(``local_path``: a local file, a store a flashckpt backend serves, or neither), the checkpoint dir a plugin
keeps, links and removals, which ``storage_options`` are flashckpt's, the committed single-file steps and
their manifest records, ``find_resume_path`` (the newest checkpoint in memory or on storage), and a
``map_location`` applied to a memory snapshot.

Imports torch (lazily) and flashckpt's core; not Lightning. Nothing here is collective; the served-scheme
cache is filled under the GIL.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from flashckpt import CheckpointEngine, StorageType
from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.engine.routing import path_inside
from flashckpt.integrations._kit_files import SnapshotDir, scratch_root
from flashckpt.memory.reader import SnapshotReader
from flashckpt.storage import locations, registry
from flashckpt.storage.base import FileRecord, file_checksum, local_dir, url_scheme
from flashckpt.storage.registry import storage_for

__all__ = ["served", "local_path", "dir_of", "link_target", "remove_path", "storage_type_of", "single_file_steps",
           "map_tensors", "find_resume_path", "stored_record", "read_stored"]

log = logging.getLogger("flashckpt.integrations.lightning")


_SERVED: dict[str, bool] = {}  # URL scheme -> whether a flashckpt storage backend serves it


def served(url: str) -> bool:
    """Whether a flashckpt storage backend serves ``url``'s scheme (``s3``; backends registered later count)."""
    scheme = url_scheme(url)
    if not _SERVED.get(scheme):
        try:
            storage_for(url).close()
            _SERVED[scheme] = True
        except E.InvalidArgumentError:
            return False
    return True


def local_path(path: Any, op: str) -> str | None:
    """Where flashckpt writes ``path``: its absolute local path, or its normalized URL in a store a flashckpt
    backend serves (``s3://...``); None for other URLs (``memory://``, ...), which ``TorchCheckpointIO``
    handles through fsspec."""
    p = os.fspath(path)
    if url_scheme(p) != "file":
        return locations.normpath(p) if served(p) else None
    return os.path.abspath(local_dir(p, op))


def dir_of(d: str | os.PathLike[str] | None, what: str) -> str | None:
    """A checkpoint dir as the plugin keeps it: absolute local path or normalized URL (a URL no backend serves
    is refused, naming those installed)."""
    if not d:
        return None
    loc = registry.checkpoint_location(d, what)
    return loc if locations.is_url(loc) else os.path.abspath(loc)


def link_target(path: str) -> str:
    """``path`` with a final symbolic link resolved (``save_last="link"`` makes ``last.ckpt`` one); a URL as is."""
    if locations.is_url(path):
        return path
    seen = 0
    while os.path.islink(path) and seen < 40:
        path = os.path.abspath(os.path.join(os.path.dirname(path), os.readlink(path)))
        seen += 1
    return path


def remove_path(path: str) -> None:
    """Removes a file, a symbolic link or a directory (DeepSpeed checkpoints are directories); nothing for a
    URL (a store's objects are removed by the saver)."""
    if locations.is_url(path):
        return
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def storage_type_of(storage_options: Any, memory_only: bool) -> StorageType | None:
    """What ``storage_options`` asks of flashckpt; None for options that are not flashckpt's (they go
    to Lightning's ``TorchCheckpointIO``, as with a Trainer without the plugin)."""
    if memory_only:
        return StorageType.MEMORY
    if storage_options is None:
        return StorageType.DISK
    if isinstance(storage_options, StorageType):
        return storage_options
    if isinstance(storage_options, str) and storage_options.lower() in ("memory", "mem", "disk"):
        return StorageType.DISK if storage_options.lower() == "disk" else StorageType.MEMORY
    return None


def single_file_steps(layout: CommitLayout) -> dict[int, str]:
    """Committed steps of ``layout`` whose manifest lists one file: step -> its absolute path."""
    out = {}
    for step in layout.committed_steps():
        try:
            files = layout.read_manifest(step).files_for(0)
        except E.CheckpointCorruptError:  # damaged: not this one (a manifest that cannot be read is raised)
            continue
        if len(files) == 1 and not files[0].name:
            out[step] = layout.abs(files[0].path)
    return out


def map_tensors(tree: Any, map_location: Any) -> Any:
    """Applies a ``torch.load``-style ``map_location`` to the CPU tensors of a memory snapshot."""
    import torch

    if map_location is None:
        return tree
    if isinstance(map_location, dict):
        map_location = map_location.get("cpu")
        if map_location is None:
            return tree

    def move(t: torch.Tensor) -> torch.Tensor:
        if callable(map_location):
            st = map_location(t.untyped_storage(), "cpu")
            dev = st.device if isinstance(st, (torch.UntypedStorage, torch.TypedStorage)) else t.device
            return t if dev == t.device else t.to(dev)
        return t.to(map_location)

    return _walk(tree, move)


def _walk(x: Any, move: Any) -> Any:
    """``x`` with ``move`` applied to its tensors (dicts, lists and plain tuples walked; a dict keeps its type)."""
    import torch

    if isinstance(x, torch.Tensor):
        return move(x)
    if isinstance(x, dict):
        out = type(x)() if type(x) is not dict else {}
        for k, v in x.items():
            out[k] = _walk(v, move)
        return out
    if isinstance(x, list):
        return [_walk(v, move) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_walk(v, move) for v in x)
    return x


def find_resume_path(checkpoint_dir: str, *, storage_options: dict[str, Any] | None = None) -> str | None:
    """The path of the newest checkpoint flashckpt saved under ``checkpoint_dir``, or None.

    Looks at this node's shared memory (snapshots the job's saver still holds, including memory-only
    ones and saves whose persist has not finished) and at the committed checkpoints on storage whose
    file exists, and returns the path of the newest. Pass it as ``trainer.fit(ckpt_path=...)``:
    ``FlashCheckpointIO.load_checkpoint`` then serves it from memory when memory holds it, even if
    the file is not (yet) on storage. Reads only; safe to call in every process before ``fit``.
    The job is found as the engine finds it (the checkpoint dir, ``FLASHCKPT_JOB_ID`` /
    ``TORCHELASTIC_RUN_ID``), so call it with the same environment as the run that saved.

    ``checkpoint_dir`` may be a store's URL (``s3://bucket/run``, with the backend's ``storage_options``):
    there a committed checkpoint counts only when its object matches its manifest (size and checksum:
    the object is read), falling back to the previous committed one.
    """
    root = dir_of(checkpoint_dir, "find_resume_path")
    assert root is not None  # dir_of refuses an empty dir
    best: tuple[int, str | None] = (-1, None)
    with SnapshotReader(root, local_rank=0) as reader:  # sees nothing where the job has no runtime dir here
        for info in reader.snapshots():
            if info.name:
                best = (info.step, info.name)
                break
    storage = storage_for(root, storage_options)
    try:
        layout = CommitLayout(root, storage)
        if layout.records_in_use():  # records of a deleted dir of this name are not ours
            for step, path in sorted(single_file_steps(layout).items(), reverse=True):
                if step <= best[0]:
                    break
                if not locations.is_url(path):
                    if os.path.exists(path):
                        best = (step, path)
                        break
                    continue
                problems = layout.verify(step)
                if not problems:
                    best = (step, path)
                    break
                log.warning("find_resume_path(%s): %s is damaged (%s); trying the previous committed checkpoint",
                            root, path, "; ".join(problems[:3]))
    finally:
        storage.close()
    return best[1]


def stored_record(layout: CommitLayout, path: str) -> FileRecord | None:
    """The record of ``path`` in the most recently committed manifest that lists it, or None."""
    try:
        rel = layout.rel(path)
    except E.CheckpointDirError:
        return None
    for step in reversed(layout.committed_steps()):
        try:
            files = layout.read_manifest(step).all_files()
        except E.CheckpointCorruptError:
            continue
        for f in files:
            if f.path == rel:
                return f
    return None


def read_stored(target: str, io: Any, kw: dict[str, Any], *, engine: CheckpointEngine | None, checkpoint_dir: str | None,
                storage_options: dict[str, Any] | None, scratch_dir: str | None) -> dict[str, Any]:
    """``target`` in a store: downloaded into a private scratch dir, checked against the manifest that lists
    it (the engine's records, else those of ``checkpoint_dir`` or of ``target``'s directory), read by
    ``TorchCheckpointIO`` (Lightning's own reader ``io``, with ``kw``), removed."""
    if engine is not None and path_inside(target, engine.checkpoint_dir):
        return _read_copy(engine.layout, target, io, kw, scratch_dir)
    root = checkpoint_dir if checkpoint_dir and path_inside(target, checkpoint_dir) else locations.parent(target)
    storage = storage_for(root, storage_options)
    try:
        return _read_copy(CommitLayout(root, storage), target, io, kw, scratch_dir)
    finally:
        storage.close()


def _read_copy(layout: CommitLayout, target: str, io: Any, kw: dict[str, Any], scratch_dir: str | None) -> dict[str, Any]:
    record = stored_record(layout, target)
    with SnapshotDir(scratch_root(scratch_dir), "load", prefix="flashckpt-lightning-") as d:
        local = d.fetch(locations.basename(target), layout.storage, target)
        if record is not None and file_checksum(local) != (record.size, record.xxh3):
            raise E.CheckpointCorruptError(
                f"FlashCheckpointIO.load_checkpoint({target!r}): the object does not match its manifest (damaged "
                "in the store); resume from FlashCheckpointIO.resume_path(), which falls back to the previous "
                "committed checkpoint")
        return dict(io.load_checkpoint(local, **kw))
