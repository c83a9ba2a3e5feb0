"""The adapter kit, files: capturing a framework's writes into a ``FileSet``, and laying a memory snapshot
out as files for a framework to read.

- ``Capture``: while entered, ``torch.save`` and ``safetensors.torch.save_file`` calls aimed into ``root``
  are captured as tensor trees (nothing serialized; the tensors are copied once, into shared memory);
  ``collect`` adds the other files written there (JSON, pickles) as bytes. Other paths pass through.
  ``Capture(root, patch=False)`` only names paths (``rel``) for adapters whose framework hands its writes
  over through an interface of its own (DeepSpeed's checkpoint engine).
- ``SnapshotDir``: a private temporary directory holding a snapshot's files (written, downloaded from a
  store, or empty placeholders for a framework that only looks for them), removed by ``close``; named
  after its process, so that one a killed process left is removed by the next one made in the same place
  and by ``flashckpt gc`` (``flashckpt.util.owned_dirs``).
- ``scratch_root`` / ``scratch``: where such directories go (``/dev/shm`` when it is writable).
- ``committed_step_of`` / ``fetch_step``: a committed step of a directory in a store, downloaded and checked
  against its manifest (for the HF Trainer and Accelerate, whose loaders read a local directory).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from typing import Any, Self

import torch
from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.engine.collective import exchange_files, world
from flashckpt.engine.reshard import Resharded
from flashckpt.engine.routing import rel_inside, swapped
from flashckpt.format.files import FileEntry, FileSet, write_entry
from flashckpt.storage import locations
from flashckpt.storage.base import CheckpointStorage, file_checksum
from flashckpt.util.owned_dirs import owned_dir, scratch_roots, sweep_once

log = logging.getLogger(__name__)

__all__ = ["Capture", "SnapshotDir", "scratch_root", "scratch", "write_entry", "all_ranks_files", "committed_step_of",
           "fetch_step"]

_TREE_MIN_BYTES = 1 << 16  # torch.save'd trees with fewer tensor bytes are captured as their exact bytes
_PATCH_LOCK = threading.Lock()
# Modules that bind ``safetensors.torch.save_file`` under their own name (checked at capture time).
_SAFETENSORS_USERS = ("transformers.modeling_utils", "transformers.trainer", "peft.peft_model",
                      "peft.utils.save_and_load", "accelerate.utils.other", "accelerate.checkpointing")


class Capture:
    """Routes the writes aimed into ``root`` into ``files`` (see the module docstring)."""

    def __init__(self, root: str, files: FileSet | None = None) -> None:
        self.root = os.path.abspath(root)
        self.files = FileSet() if files is None else files
        self._swaps: Any = None

    def rel(self, path: Any) -> str | None:
        """The name of ``path`` in the set when it lies inside ``root`` (see ``path_inside``), else None."""
        return rel_inside(path, self.root)

    def __enter__(self) -> Self:
        import safetensors.torch as st

        _PATCH_LOCK.acquire()
        try:
            orig_torch_save, orig_st_save = torch.save, st.save_file

            def torch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
                rel = self.rel(f)
                if rel is None:
                    return orig_torch_save(obj, f, *args, **kwargs)
                if _tensor_bytes(obj, _TREE_MIN_BYTES) >= _TREE_MIN_BYTES:
                    self.files.add_torch(rel, obj)
                else:
                    buf = io.BytesIO()
                    orig_torch_save(obj, buf, *args, **kwargs)
                    self.files.add_raw(rel, buf.getvalue())
                return None

            def save_file(tensors: dict[str, torch.Tensor], filename: Any, metadata: dict[str, str] | None = None) -> None:
                rel = self.rel(filename)
                if rel is None:
                    return orig_st_save(tensors, filename, metadata=metadata)
                self.files.add_safetensors(rel, dict(tensors), metadata=metadata)
                return None

            swaps: list[tuple[Any, str, Any]] = [(torch, "save", torch_save), (st, "save_file", save_file)]
            for name in _SAFETENSORS_USERS:
                mod = sys.modules.get(name)
                for attr in ("safe_save_file", "save_file"):
                    if mod is not None and getattr(mod, attr, None) is orig_st_save:
                        swaps.append((mod, attr, save_file))
            self._swaps = swapped(swaps)
            self._swaps.__enter__()
        except BaseException:
            _PATCH_LOCK.release()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        swaps, self._swaps = self._swaps, None
        try:
            if swaps is not None:
                swaps.__exit__(None, None, None)
        finally:
            _PATCH_LOCK.release()

    def collect(self) -> None:
        """Adds every file written into ``root`` (and not captured) to the set, as its bytes."""
        for dirpath, _dirs, names in os.walk(self.root):
            for n in sorted(names):
                path = os.path.join(dirpath, n)
                rel = os.path.relpath(path, self.root).replace(os.sep, "/")
                if rel not in self.files:
                    with open(path, "rb") as f:
                        self.files.add_raw(rel, f.read())


def _tensor_bytes(obj: Any, stop: int) -> int:
    """Bytes of the tensors in ``obj`` (containers walked), counting stops once ``stop`` is reached."""
    total = 0
    todo = [obj]
    while todo and total < stop:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return total


def scratch_root(scratch_dir: str | None = None) -> str:
    """``scratch_dir``, else ``/dev/shm`` when it is writable, else the system temp dir."""
    return scratch_dir or scratch_roots()[0]


@contextlib.contextmanager
def scratch(root: str, name: str, *, prefix: str = "flashckpt-") -> Iterator[str]:
    """A private empty directory ``<root>/<tmp>/<name>`` (removed afterwards)."""
    with SnapshotDir(root, name, prefix=prefix) as d:
        yield d.dir


class SnapshotDir:
    """A snapshot's files in a private directory ``dir`` = ``<base>/<name>``, ``base`` a new temporary
    directory in ``root`` (None: the system temp dir), for a framework that reads checkpoints from a
    directory. ``close`` removes ``base``. ``base`` is named after this process (``prefix`` is
    ``flashckpt-<kind>-``); the first one a process makes in ``root`` removes those that processes killed
    meanwhile left there (``_owned_dirs``)."""

    def __init__(self, root: str | None, name: str, *, prefix: str = "flashckpt-") -> None:
        sweep_once(root)
        self.base = owned_dir(root, prefix)
        self.dir = os.path.join(self.base, *name.split("/"))
        try:
            os.makedirs(self.dir)
        except BaseException:
            self.close()
            raise

    def path(self, name: str) -> str:
        return os.path.join(self.dir, *name.split("/"))

    def write(self, name: str, e: FileEntry) -> None:
        """The file ``name`` with the entry's content."""
        write_entry(self.path(name), e)

    def fetch(self, name: str, storage: CheckpointStorage, location: str, *, size: int | None = None) -> str:
        """The file ``name``, downloaded from ``location`` through ``storage`` (ranged reads, several at once,
        straight into the file's pages); returns its local path. For a framework that reads a checkpoint
        from a local directory when the checkpoint dir is in a store."""
        p = self.path(name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        local = storage.local_path(location)
        if local is not None:
            shutil.copyfile(local, p)
            return p
        n = storage.size(location) if size is None else size
        with open(p, "wb+") as f:
            if n:
                f.truncate(n)
                import mmap

                with mmap.mmap(f.fileno(), n) as mm:
                    view = memoryview(mm)
                    try:
                        storage.read_into(location, 0, view)
                    finally:
                        view.release()
        return p

    def touch(self, name: str) -> None:
        """An empty placeholder ``name``: answers a framework's ``glob`` / ``os.path.exists``, while its
        reads are served from memory."""
        p = self.path(name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        open(p, "wb").close()

    def close(self) -> None:
        if self.base:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = ""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def all_ranks_files(mine: FileSet | Resharded, *, group: Any = None) -> FileSet:
    """The union of every rank's files of one step (each rank holds its own, and keeps it; a file it lacks
    comes from the lowest rank that has it). Collective: every rank of ``group`` calls it. Given a ``Resharded``
    (a step saved by another number of ranks, on every rank), the union of the old ranks' files, each from the
    lowest old rank holding it, read from this node's memory or fetched into it; no collective."""
    if isinstance(mine, Resharded):
        union = FileSet()
        for r in range(mine.world):
            old = mine.state(r)
            for name, e in (old.items() if isinstance(old, FileSet) else ()):
                union.setdefault(name, e)
        return union
    if world(group) == 1:
        return mine
    got = exchange_files({n: (e.format, e.kind, e.data) for n, e in mine.items()}, sorted(mine), None,
                         group=group, what="all_ranks_files()")
    merged = FileSet(mine)
    for name, (fmt, kind, data) in sorted(got.items()):
        merged[name] = FileEntry(fmt, data, kind)
    return merged


# ------------------------------------------------------------------------------------------ store copies
def committed_step_of(layout: CommitLayout, base: str) -> int | None:
    """The most recently committed step whose rank-0 file set lives in the directory ``base``, or None."""
    want = locations.normpath(base)
    for step in reversed(layout.committed_steps()):
        try:
            if layout.base(step, 0) == want:
                return step
        except E.CheckpointCorruptError as e:  # a damaged manifest: not this one (one that cannot be read raises)
            log.warning("%s: step %d: %s", layout.root, step, e)
    return None


def fetch_step(view: SnapshotDir, layout: CommitLayout, step: int, base: str) -> None:
    """Downloads committed ``step``'s files under the directory ``base`` (every rank's: frameworks read
    other ranks' files, such as rank 0's weights) into ``view``, each under its name inside ``base``, and
    checks each copy against the manifest (size and xxh3), for a framework that reads a local directory.

    Raises:
        CheckpointCorruptError: a copy does not match the manifest (the stored file is damaged).
    """
    manifest = layout.read_manifest(step)
    rel = layout.rel(base)
    prefix = "" if rel == "." else rel.rstrip("/") + "/"
    done: set[str] = set()
    for f in manifest.all_files():
        if not f.path.startswith(prefix) or f.path[len(prefix):] in done:
            continue  # a tracker file outside the step's directory, or a name another rank lists too
        name = f.path[len(prefix):]
        # The stored size, not the manifest's: a damaged, shorter object then fails the check below rather
        # than a ranged read past its end (SnapshotDir.fetch's mmap then hides that error behind a BufferError).
        local = view.fetch(name, layout.storage, layout.abs(f.path))
        if file_checksum(local) != (f.size, f.xxh3):
            raise E.CheckpointCorruptError(f"{layout.abs(f.path)} does not match the manifest of step {step} "
                                           "(damaged in the store); resume from an older committed step")
        done.add(name)
