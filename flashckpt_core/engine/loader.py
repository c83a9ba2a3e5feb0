"""Reading committed checkpoints from storage, for one rank: a step's files (or ``FileSet``), a file a
user names, through the storage backend, verified against the manifest when it lists them.

A local file is opened directly (``torch.load``). A file in a store without local paths (an object store)
is read with ranged reads straight into the tensors' memory, or into the caller's tensors, and its checksum
checked on the way (``remote_load``). ``into`` (the caller's tensors) is filled by the same rule from every
source (``_into``). A step every rank loads the same file of (replicated:
DDP) is downloaded once per node, into the job's runtime dir in shared memory, and mapped by every local
rank (``torch.load(mmap=True)``); those downloads go at the next save (``drop_downloads``)."""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
from collections.abc import Callable
from typing import Any

import torch
import xxhash
from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.manifest import Manifest
from flashckpt.engine.remote_load import load_remote
from flashckpt.format.files import FileEntry, FileSet
from flashckpt.format.into import Into
from flashckpt.storage import locations
from flashckpt.storage.base import FileRecord
from flashckpt.transport.ipc import SharedLock

__all__ = ["StorageLoader"]

log = logging.getLogger(__name__)


class StorageLoader:
    """Loads rank ``rank``'s committed files of the checkpoint dir ``layout`` describes.

    Args:
        layout: the checkpoint dir's commit layout (its storage backend reads the files).
        rank: the rank whose files ``load_step`` reads (replicated steps: rank 0's for every rank).
        weights_only: ``torch.load(weights_only=...)``.
        resolve: what a user's ``resume_path`` names (``CheckpointEngine.resolve``).
        cache_dir: where a download several local ranks read is kept (the job's runtime dir).
        world_size: the number of ranks of the job: a step that holds no state of one of them is refused
            (``load_step``) on every rank alike.
    """

    def __init__(self, layout: CommitLayout, rank: int, *, weights_only: bool,
                 resolve: Callable[[str], str], cache_dir: str | None = None, world_size: int | None = None) -> None:
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self.weights_only = weights_only
        self._resolve = resolve
        self.cache_dir = cache_dir  # the job's runtime dir: downloads shared by the node's ranks
        self.last_bytes = 0  # bytes the last load_step read

    def path_of(self, step: int, rank: int | None = None) -> str | None:
        r = self.rank if rank is None else rank
        base = self.layout.base(step, r)
        if base is not None:
            return base
        files = self.layout.read_manifest(step).files_for(r)
        return self.layout.abs(files[0].path) if len(files) == 1 else None

    def load_step(self, step: int, *, into: Any = None) -> Any:
        """This rank's files of committed ``step`` (a ``FileSet`` for sets; ``into`` as for
        ``CheckpointEngine.load``).

        Raises:
            CheckpointCorruptError: a file does not match the manifest (read from an object store; a
                local file is verified before, by ``CommitLayout.verify``).
            RankStateNotFoundError: the step holds no state of this rank, or of another rank of the job
                (saved by fewer ranks; every rank reads the same manifest and refuses alike).
        """
        m = self.layout.read_manifest(step)
        own_state(m, self.rank, self.world_size, self.layout.root)
        files = m.files_for(self.rank)
        self.last_bytes = sum(f.size for f in files)
        if any(f.name for f in files):
            return self.load_fileset(files, into=into, shared=m.replicated)
        if len(files) != 1:
            raise E.CheckpointCorruptError(f"load(): step {step} lists {len(files)} files for rank "
                                           f"{self.rank}; expected one")
        return self.torch_load(self.layout.abs(files[0].path), record=files[0], into=into, shared=m.replicated)

    def load_fileset(self, files: list[Any], *, into: Any = None, shared: bool = False) -> FileSet:
        fs = FileSet()
        for f in files:
            path = self.layout.abs(f.path)
            if f.fmt == "torch":
                sub = into.get(f.name) if isinstance(into, dict) else None
                fs[f.name] = FileEntry("torch", self.torch_load(path, record=f, into=sub, shared=shared), f.kind)
            else:
                data = self.layout.storage.read_bytes(path)
                if self.layout.storage.local_path(path) is None and xxhash.xxh3_64_hexdigest(data) != f.xxh3:
                    raise E.CheckpointCorruptError(f"{path}: its checksum does not match the manifest")
                fs[f.name] = FileEntry("raw", [data], f.kind)
        return fs

    def resume_target(self, resume_path: str) -> str:
        """The file (or ``FileSet`` directory) ``load(resume_path)`` reads; a clear error when it is
        outside the checkpoint dir or missing."""
        path = self._resolve(resume_path)
        if not locations.inside(path, self.layout.root):
            raise E.CheckpointDirError(
                f"load(resume_path={resume_path!r}): {path} is outside the checkpoint dir {self.layout.root}. "
                "load() reads this checkpoint dir only: pass the file (or FileSet directory) of one of its "
                f"committed steps, as saved ({self.committed_listing()}), or no resume_path for the newest; "
                "for another directory, construct a checkpointer on it")
        if not (self.layout.storage.exists(path) or self.layout.storage.isdir(path)):
            raise E.CheckpointNotFoundError(errno.ENOENT, f"load(resume_path={resume_path!r}): no such file or directory "
                                    f"({path}); {self.committed_listing()}", resume_path)
        return path

    def committed_listing(self, limit: int = 10) -> str:
        """The committed steps and this rank's paths, for error messages."""
        steps = self.layout.committed_steps()
        if not steps:
            return f"{self.layout.root} holds no committed step"
        parts = []
        for s in steps[-limit:]:
            try:
                parts.append(f"step {s}: {self.path_of(s)}")
            except E.CheckpointCorruptError:
                parts.append(f"step {s}: <damaged manifest>")
        more = f" (and {len(steps) - limit} older)" if len(steps) > limit else ""
        return f"committed steps in {self.layout.root}{more}: " + "; ".join(parts)

    def load_file(self, path: str, *, into: Any = None) -> Any:
        """The file (or ``FileSet`` directory) ``path`` that ``load(resume_path)`` names, verified against the
        manifest that lists it (when one does); ``into`` as for ``CheckpointEngine.load``."""
        rel = self.layout.rel(path)
        for step in reversed(self.layout.committed_steps()):
            try:
                m = self.layout.read_manifest(step)
            except E.CheckpointCorruptError as e:
                log.warning("load(%s): skipping step %d: %s", path, step, e)
                continue
            if rel in m.extra.get("bases", {}).values():
                for r, b in m.extra["bases"].items():
                    if b == rel:
                        listed = m.files[int(r)]
                        bad = [p for f in listed for p in self.mismatch(f, step)]
                        if bad:
                            raise E.CheckpointCorruptError("load(): " + "; ".join(bad))
                        return self.load_fileset(listed, into=into)
            for f in m.all_files():
                if f.path == rel:
                    bad = self.mismatch(f, step)
                    if bad:
                        raise E.CheckpointCorruptError("load(): " + bad[0])
                    return self.torch_load(path, into=into)
        return self.torch_load(path, into=into)

    def mismatch(self, f: Any, step: int) -> list[str]:
        path = self.layout.abs(f.path)
        if self.layout.storage.checksum(path) != (f.size, f.xxh3):
            return [f"{path} does not match the manifest of step {step}"]
        return []

    def torch_load(self, path: str, *, record: FileRecord | None = None, into: Any = None,
                   shared: bool = False) -> Any:
        """``torch.load`` of ``path`` through the backend (see the module docstring); ``record``: its
        manifest entry (size and checksum), ``shared``: the node's other ranks read it too; ``into``: the
        caller's tensors to fill (``CheckpointEngine.load``; the rule: ``_into``)."""
        try:
            storage = self.layout.storage  # through the backend; a local file is opened directly
            local = storage.local_path(path)
            if local is not None:
                sd = torch.load(local, map_location="cpu", weights_only=self.weights_only)
            elif record is None:
                with storage.open_read(path) as f:
                    sd = torch.load(f, map_location="cpu", weights_only=self.weights_only)
            else:
                cached = self._download(path, record) if shared and self.cache_dir else None
                if cached is None:  # ranged reads, into the tensors of ``into`` where they can go straight
                    return load_remote(storage, path, size=record.size, xxh3=record.xxh3,
                                       weights_only=self.weights_only, into=into)
                sd = torch.load(cached, map_location="cpu", weights_only=self.weights_only, mmap=True)
        except (OSError, MemoryError, E.FlashCheckpointError):
            raise  # the machine's (a read, memory) or already said
        except Exception as e:
            raise _load_failure(path, e, weights_only=self.weights_only) from e
        return Into(into).fill(sd, source=path)

    def _download(self, path: str, rec: FileRecord) -> str | None:
        """The node's one download of ``path`` in the job's runtime dir (the first rank downloads it under
        a lock, verified; the others find it there); None where shared memory cannot hold it."""
        assert self.cache_dir is not None  # checked by the caller
        final = os.path.join(self.cache_dir, f"{_DOWNLOAD}{rec.xxh3}-{rec.size}")
        with SharedLock(final + ".lock"):
            if os.path.exists(final):
                return final
            tmp = f"{final}.{os.getpid()}.tmp"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                try:
                    if rec.size:
                        os.posix_fallocate(fd, 0, rec.size)
                except OSError as e:  # no room: each rank reads for itself
                    log.info("load(): no room in %s for a shared download of %s (%s)", self.cache_dir, path, e)
                    os.unlink(tmp)
                    return None
                if rec.size:
                    with mmap.mmap(fd, rec.size) as mm:
                        view = memoryview(mm)
                        try:
                            self.layout.storage.read_into(path, 0, view)
                            digest = xxhash.xxh3_64_hexdigest(view)
                        finally:
                            view.release()
                else:
                    digest = xxhash.xxh3_64_hexdigest(b"")
                if digest != rec.xxh3:
                    os.unlink(tmp)
                    raise E.CheckpointCorruptError(f"{path}: checksum {digest} != {rec.xxh3} in the manifest")
                os.rename(tmp, final)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
            finally:
                os.close(fd)
        return final

    def drop_downloads(self) -> None:
        """Removes the shared downloads (a rank that mapped one keeps its mapping)."""
        if not self.cache_dir:
            return
        try:
            names = os.listdir(self.cache_dir)
        except OSError:
            return
        for n in names:
            if n.startswith(_DOWNLOAD) and not n.endswith((".lock", ".tmp")):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.cache_dir, n))
                    os.unlink(os.path.join(self.cache_dir, n + ".lock"))


_DOWNLOAD = "dl-"  # names of the shared downloads in the job's runtime dir

# What torch.load(weights_only=True) says when its rules, not the file, refuse what a file holds.
_REFUSED = ("Unsupported global", "unsupported GLOBAL", "allowlisted", "must be imported to load")


def _load_failure(path: str, e: Exception, *, weights_only: bool) -> E.FlashCheckpointError:
    """What a failed ``torch.load`` of ``path`` means. The loader's rules refusing an object (weights-only
    loading, or a class this process cannot import) are the same for every step that holds it: an error
    that says how to load it, never a step back. Anything else means the file is not what a ``torch.save``
    wrote (it matched its manifest, so it was written so): a damaged step, which ``load()`` passes over for
    the previous one (``CheckpointCorruptError``)."""
    msg = str(e)
    if weights_only and any(s in msg for s in _REFUSED):
        cause = next((line.strip() for line in msg.splitlines() if any(s in line for s in _REFUSED)), "")
        return E.FlashCheckpointError(
            f"load(): {path} holds Python objects that torch.load(weights_only=True) refuses ({cause}). Allow "
            "them before loading (torch.serialization.add_safe_globals, as when they were saved) or, if the "
            "checkpoint is trusted, construct the engine with weights_only=False.")
    if isinstance(e, (ImportError, AttributeError)):
        return E.FlashCheckpointError(
            f"load(): {path} holds a Python object whose class this process cannot find ({type(e).__name__}: {e}); "
            "import the module that defines it before loading.")
    return E.CheckpointCorruptError(f"load(): {path} matches its manifest but torch.load cannot read it "
                                    f"({type(e).__name__}: {msg.splitlines()[0] if msg else ''})")



def own_state(m: Manifest, rank: int, world_size: int | None, root: str) -> None:
    """Refuses step ``m`` when it holds no files of ``rank`` or of another rank of a job of ``world_size``
    ranks (``RankStateNotFoundError``, the same on every rank); a step of more ranks than the job (each rank
    loads its own files) is logged on rank 0."""
    missing = m.ranks_without_state(world_size) if world_size else []
    if not missing and (m.replicated or rank in m.files):
        if world_size and m.world_size != world_size and not m.replicated and rank == 0:
            log.warning("load(): step %d of %s was saved by %d ranks and this job has %d: each rank loads its own "
                        "files; the state of ranks %d-%d is not loaded", m.step, root, m.world_size, world_size,
                        world_size, m.world_size - 1)
        return
    missing = missing or [rank]
    raise E.RankStateNotFoundError(
        f"load(): committed step {m.step} of {root} holds no state of rank{'s' if len(missing) > 1 else ''} "
        f"{', '.join(map(str, missing))}: it was saved by {m.world_size} ranks (0-{m.world_size - 1}) and this job has "
        f"{world_size or rank + 1}. Each rank loads its own state and none is handed another rank's, so no rank loads. "
        "Restart with the number of ranks that saved it, load a file with load(resume_path=...), or save with an "
        "adapter whose checkpoints reshard (FSDP/DCP) or with replicated=True (DDP: every rank loads rank 0's state)")
