"""``FlashDeepSpeedCheckpointEngine``: the DeepSpeed ``CheckpointEngine`` that ``DeepSpeedCheckpointer``
installs as ``engine.checkpoint_engine``. While the checkpointer captures a save it collects DeepSpeed's
state dicts into a ``FileSet`` (``DsCapture``) and snapshots them at DeepSpeed's ``commit``; while it serves
a load (``DsServe``) it answers DeepSpeed's reads from memory or through a storage backend; otherwise every
call goes to the engine it replaced.

Imports DeepSpeed's checkpoint-engine interface and flashckpt's core. DeepSpeed calls it from the training
thread; one save or load at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
from flashckpt import FlashCheckpointError
from flashckpt.engine.routing import path_inside
from flashckpt.format.files import FileSet
from flashckpt.integrations._kit_files import Capture
from flashckpt.storage import locations

__all__ = ["FlashDeepSpeedCheckpointEngine", "DsCapture", "DsServe"]

class DsCapture(Capture):
    """One ``save_checkpoint`` in progress: the files DeepSpeed hands over (through the checkpoint engine,
    so nothing is patched: ``rel`` names them, ``files`` holds them), and how to commit them."""

    def __init__(self, tag: str, set_dir: str, files: FileSet, on_commit: Callable[[DsCapture], None]) -> None:
        super().__init__(set_dir, files)
        self.root = set_dir  # as given (normalized): Capture makes it a local absolute path, which a URL is not
        self.tag = tag
        self.on_commit = on_commit  # run at DeepSpeed's commit
        self.committed = False
        self.error: BaseException | None = None
        self.pause_s = 0.0


@dataclass(frozen=True)
class DsServe:
    """One served load in progress: DeepSpeed's reads of ``names`` under ``set_dir`` come from
    ``read(name, map_location)`` (a snapshot's trees, or files read through the storage backend)."""

    set_dir: str
    names: frozenset[str]
    read: Callable[[str, Any], Any]


class FlashDeepSpeedCheckpointEngine(CheckpointEngine):
    """DeepSpeed ``CheckpointEngine`` that ``DeepSpeedCheckpointer`` installs as ``engine.checkpoint_engine``.

    DeepSpeed calls, on every rank: ``create(info)``, then ``makedirs`` / ``save(state_dict, path)`` for
    each file this rank writes, then ``commit(info)``; on load, ``load(path)`` for each file it reads.
    While the checkpointer captures a save, ``save`` collects the state dicts (no copy yet: DeepSpeed does
    not touch them before ``commit``) and ``commit`` snapshots them; while it serves a memory load,
    ``load`` returns the snapshot's trees. Otherwise every call goes to the engine it replaced.
    """

    def __init__(self, inner: CheckpointEngine) -> None:
        super().__init__(None)
        self.name = "FlashDeepSpeedCheckpointEngine"
        self.inner = inner
        self.capture: DsCapture | None = None
        self.serve: DsServe | None = None

    def create(self, info: CheckpointCommitInfo) -> None:
        if self.capture is None:
            self.inner.create(info)
        elif str(info.tag) != self.capture.tag:
            raise FlashCheckpointError(f"DeepSpeed is saving tag {info.tag!r} while flashckpt captures tag "
                                       f"{self.capture.tag!r}")

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        # The saver creates the tag directory when it persists; a memory snapshot leaves no trace on storage;
        # a store has no directories to make.
        if self.capture is not None and (path_inside(path, self.capture.root) or locations.is_url(path)):
            return
        self.inner.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        cap = self.capture
        if cap is None:
            self.inner.save(state_dict, path)
            return
        name = cap.rel(path)
        if name is None:
            raise FlashCheckpointError(f"DeepSpeed saves {path}, outside the tag directory {cap.root} that "
                                       "flashckpt captures; this DeepSpeed feature is not supported by "
                                       "DeepSpeedCheckpointer (save it with engine.save_checkpoint)")
        cap.files.add_torch(name, state_dict)

    def load(self, path: str, map_location: Any = None) -> Any:
        srv = self.serve
        if srv is None:
            return self.inner.load(path, map_location=map_location)
        name = os.path.relpath(os.path.abspath(path), srv.set_dir).replace(os.sep, "/")
        if name not in srv.names:
            raise FlashCheckpointError(f"DeepSpeed reads {name!r}, which the checkpoint being loaded does not hold "
                                       f"(it holds {sorted(srv.names)})")
        return srv.read(name, map_location)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        cap = self.capture
        if cap is None:
            return bool(self.inner.commit(info))
        # An error here must not skip DeepSpeed's closing barrier (the other ranks would hang in it): it
        # is kept and raised by save_checkpoint once DeepSpeed returns.
        try:
            cap.on_commit(cap)
            cap.committed = True
        except BaseException as e:  # noqa: B036 - re-raised by DeepSpeedCheckpointer.save_checkpoint
            cap.error = e
        return cap.committed

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return bool(self.inner.is_data_parallel_writer(dp_rank))

    def preserves_storage_sharing(self) -> bool:
        return bool(self.inner.preserves_storage_sharing())
