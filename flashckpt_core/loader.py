"""Reading committed checkpoints from storage, for one rank: a step's files (or ``FileSet``), a file a
user names, through the storage backend (a local file is opened directly; others are read through the
backend), verified against the manifest when it lists them."""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import Any

import torch

from . import errors as E
from . import locations
from .commit import CommitLayout
from .files import FileEntry, FileSet

__all__ = ["StorageLoader"]

log = logging.getLogger(__name__)


class StorageLoader:
    """Loads rank ``rank``'s committed files of the checkpoint dir ``layout`` describes.

    Args:
        layout: the checkpoint dir's commit layout (its storage backend reads the files).
        rank: the rank whose files ``load_step`` reads (replicated steps: rank 0's for every rank).
        weights_only: ``torch.load(weights_only=...)``.
        resolve: what a user's ``resume_path`` names (``CheckpointEngine.resolve``).
    """

    def __init__(self, layout: CommitLayout, rank: int, *, weights_only: bool,
                 resolve: Callable[[str], str]) -> None:
        self.layout = layout
        self.rank = rank
        self.weights_only = weights_only
        self._resolve = resolve

    def path_of(self, step: int, rank: int | None = None) -> str | None:
        r = self.rank if rank is None else rank
        base = self.layout.base(step, r)
        if base is not None:
            return base
        files = self.layout.read_manifest(step).files_for(r)
        return self.layout.abs(files[0].path) if len(files) == 1 else None

    def load_step(self, step: int) -> Any:
        files = self.layout.read_manifest(step).files_for(self.rank)
        if any(f.name for f in files):
            return self.load_fileset(files)
        if len(files) != 1:
            raise E.CheckpointCorruptError(f"load(): step {step} lists {len(files)} files for rank "
                                           f"{self.rank}; expected one")
        return self.torch_load(self.layout.abs(files[0].path))

    def load_fileset(self, files: list[Any]) -> FileSet:
        fs = FileSet()
        for f in files:
            path = self.layout.abs(f.path)
            if f.fmt == "torch":
                fs[f.name] = FileEntry("torch", self.torch_load(path), f.kind)
            else:
                fs[f.name] = FileEntry("raw", [self.layout.storage.read_bytes(path)], f.kind)
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
            except E.FlashCheckpointError:
                parts.append(f"step {s}: <damaged manifest>")
        more = f" (and {len(steps) - limit} older)" if len(steps) > limit else ""
        return f"committed steps in {self.layout.root}{more}: " + "; ".join(parts)

    def load_file(self, path: str) -> Any:
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
                        return self.load_fileset(listed)
            for f in m.all_files():
                if f.path == rel:
                    bad = self.mismatch(f, step)
                    if bad:
                        raise E.CheckpointCorruptError("load(): " + bad[0])
                    return self.torch_load(path)
        return self.torch_load(path)

    def mismatch(self, f: Any, step: int) -> list[str]:
        path = self.layout.abs(f.path)
        if self.layout.storage.checksum(path) != (f.size, f.xxh3):
            return [f"{path} does not match the manifest of step {step}"]
        return []

    def torch_load(self, path: str) -> Any:
        try:
            storage = self.layout.storage  # through the backend; a local file is opened directly
            local = storage.local_path(path)
            if local is not None:
                return torch.load(local, map_location="cpu", weights_only=self.weights_only)
            with storage.open_read(path) as f:
                return torch.load(f, map_location="cpu", weights_only=self.weights_only)
        except Exception as e:
            if self.weights_only and "weights_only" in str(e):
                raise E.FlashCheckpointError(
                    f"load(): {path} holds Python objects that torch.load(weights_only=True) refuses. If the "
                    "checkpoint is trusted, construct the engine with weights_only=False.") from e
            raise
