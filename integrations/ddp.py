"""DdpCheckpointer: flash checkpoints for data-parallel training (DDP), where every rank holds the
same state.

Local rank 0 of every node copies the state into the node's shared memory, so any node can restart
from memory; global rank 0's saver persists the one copy that storage gets. Every rank loads it. The
checkpoint dir may be a local directory or a URL a storage backend serves (``s3://bucket/prefix``).

Example::

    checkpointer = DdpCheckpointer("/ckpt")
    sd = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    if step % 10 == 0:
        checkpointer.save_checkpoint(step, sd, storage_type=StorageType.MEMORY)
    if step % 100 == 0:
        checkpointer.save_checkpoint(step, sd, storage_type=StorageType.DISK)
    ...
    sd = checkpointer.load_checkpoint()   # {} when there is nothing to resume from
"""

from __future__ import annotations

import os
from typing import Any

from flashckpt import CheckpointEngine, StorageType
from flashckpt.commit.retention import CheckpointDeletionStrategy
from flashckpt.engine.adapter import AdapterBase
from flashckpt.engine.engine import LoadResult

__all__ = ["DdpCheckpointer", "StorageType"]


class DdpCheckpointer(AdapterBase):
    """Checkpointer for DDP (replicated state).

    Args:
        checkpoint_dir: where checkpoints are persisted (shared by all nodes): a local or mounted
            directory, a ``file://`` URL, or the URL of a storage backend (``s3://bucket/prefix``; a scheme
            no backend serves is refused with a ``CheckpointDirError``). Loads from a store read rank 0's
            file through the backend, checksum-verified, falling back to the previous committed step.
        deletion_strategy: which committed checkpoints to delete; None keeps the newest ``max_to_keep``.
        max_to_keep: committed checkpoints kept without a ``deletion_strategy`` (0 keeps all).
        process_group: the group whose ranks agree on what to load (default group when None).
        weights_only: load persisted files with ``torch.load(weights_only=True)``.
        overlap: ``save_checkpoint`` returns before the copy is done; call ``wait_snapshot()`` before
            the optimizer step (see ``CheckpointEngine.save``).
        local_dir: a node-local directory (NVMe, a local disk) as the fast tier: a DISK save commits there
            first and the node's saver uploads it to ``checkpoint_dir`` in the background; a load reads it
            when this node holds the newest step there (``last_load.source`` "local"), else
            ``checkpoint_dir``. None: FLASHCKPT_LOCAL_DIR (unset: no local tier).
        local_max_to_keep: steps the local tier keeps (0 keeps all; a step not yet uploaded is never
            deleted).
    """

    def __init__(self, checkpoint_dir: str, *, deletion_strategy: CheckpointDeletionStrategy | None = None,
                 max_to_keep: int = 0, process_group: Any = None, weights_only: bool = True,
                 overlap: bool = False, local_dir: str | os.PathLike[str] | None = None,
                 local_max_to_keep: int = 2) -> None:
        self.engine = CheckpointEngine(checkpoint_dir, max_to_keep=max_to_keep, deletion_strategy=deletion_strategy,
                                       replicated=True, process_group=process_group, weights_only=weights_only,
                                       overlap=overlap, local_dir=local_dir, local_max_to_keep=local_max_to_keep)
        self.checkpoint_dir = self.engine.checkpoint_dir

    def save_checkpoint(self, step: int, state_dict: Any, path: str = "",
                        storage_type: StorageType = StorageType.DISK) -> bool:
        """Snapshots ``state_dict`` to memory and, with DISK, persists it to ``path`` in the background.

        Call it on every rank (ranks that neither snapshot nor persist return at once). Returns once the
        copy is in shared memory; the state may then be changed. ``path`` defaults to
        ``<checkpoint_dir>/step_<step>/checkpoint.pt``; it is absolute, or relative as
        ``CheckpointEngine.resolve`` says: ``os.path.join(checkpoint_dir, f"checkpoint-{step}.pt")`` (DLRover's
        guide) means that file whether ``checkpoint_dir`` is absolute or relative, and a bare
        ``"checkpoint-10.pt"`` lies inside the checkpoint dir.
        """
        return self.engine.save(step, state_dict, path or None, storage_type)

    def wait_snapshot(self) -> None:
        """With ``overlap``: waits until the last snapshot is in memory; call it before the optimizer step."""
        self.engine.wait_snapshot()

    def load_checkpoint(self, resume_path: str = "", *, into: Any = None) -> Any:
        """The newest checkpoint every rank has, from memory when it holds it; ``{}`` when none.

        ``into`` (for example ``{"model": model.state_dict()}``) has a memory load copy straight into
        those tensors; see ``CheckpointEngine.load``."""
        return self.engine.load(resume_path, into=into)

    def wait_latest_checkpoint(self, timeout: float | None = 1800) -> None:
        """Blocks until every scheduled persist is committed; raises the first persist error."""
        self.engine.wait(timeout)

    @property
    def last_load(self) -> LoadResult | None:
        """Where the last ``load_checkpoint`` came from (step, "memory"/"local"/"storage"/"none", seconds)."""
        return self.engine.last_load

