"""AcceleratorCheckpointer: flash checkpoints for HuggingFace Accelerate (``Accelerator.save_state`` /
``load_state``), memory first, persisted in the background in Accelerate's own layout.

``save_state`` runs Accelerate's own ``save_state`` with its output aimed at a private scratch directory
and captures the files it writes there (``Capture``: tensors into shared memory, small files as bytes);
``load_state`` lays a memory snapshot out as files (``SnapshotDir``) for Accelerate's ``load_state``.
Also exported by ``flashckpt.integrations.hf``.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

from flashckpt import CheckpointEngine, FileSet, StorageType
from flashckpt import errors as E
from flashckpt.engine import Located

from ._kit import Adapter, barrier
from ._kit_files import Capture, SnapshotDir, all_ranks_files, scratch, scratch_root

if TYPE_CHECKING:
    from .hf import FlashCkptConfig

__all__ = ["AcceleratorCheckpointer", "StorageType"]


class AcceleratorCheckpointer(Adapter):
    """``Accelerator.save_state`` / ``load_state`` through flashckpt: memory first, persisted in the
    background in Accelerate's own layout (``model.safetensors``, ``optimizer.bin``, ``scheduler.bin``,
    ``random_states_<rank>.pkl``, ...), so ``accelerator.load_state(dir)`` reads it without flashckpt.

    Args:
        accelerator: the ``accelerate.Accelerator`` whose prepared objects are saved.
        checkpoint_dir: where checkpoints live (flashckpt's bookkeeping goes beside it, to
            ``<parent>/.flashckpt/<name>/``); with
            ``ProjectConfiguration(automatic_checkpoint_naming=True)`` it defaults to the project dir, the
            checkpoints go to ``<project_dir>/checkpoints/checkpoint_<i>`` as Accelerate names them, and
            ``total_limit`` is the retention.
        config: a ``flashckpt.integrations.hf.FlashCkptConfig``; its ``scratch_dir`` is used (the other
            fields are the Trainer's).

    Example::

        ckpt = AcceleratorCheckpointer(accelerator, "/ckpt")
        ckpt.load_state()                       # newest, from memory when it has it; no-op when none
        for step in range(start, steps):
            ...
            ckpt.save_state(f"/ckpt/step_{step}", step=step, storage_type=StorageType.MEMORY)
        ckpt.close()

    Every process calls every method (as with ``Accelerator.save_state``).
    """

    def __init__(self, accelerator: Any, checkpoint_dir: str | None = None, *,
                 config: FlashCkptConfig | None = None) -> None:
        pc = accelerator.project_configuration
        self.accelerator = accelerator
        self.config = config
        self.scratch_dir: str | None = getattr(config, "scratch_dir", None)
        self.automatic = bool(pc.automatic_checkpoint_naming)
        if checkpoint_dir is None:
            if not self.automatic:
                raise E.InvalidArgumentError("AcceleratorCheckpointer(checkpoint_dir=None): pass the directory checkpoints go "
                                 "to, or use ProjectConfiguration(automatic_checkpoint_naming=True)")
            # The project dir, not its checkpoints/ (where Accelerate expects only checkpoint_<i> folders).
            checkpoint_dir = accelerator.project_dir
        limit = pc.total_limit if self.automatic and pc.total_limit else 0
        self.engine = CheckpointEngine(checkpoint_dir, max_to_keep=limit, replicated=False,
                                       weights_only=accelerator.distributed_type.value != "DEEPSPEED")
        self.checkpoint_dir = self.engine.checkpoint_dir
        self.last_load: Located | None = None

    def save_state(self, output_dir: str | None = None, *, step: int | None = None,
                   storage_type: StorageType = StorageType.DISK, **kwargs: Any) -> str:
        """Like ``Accelerator.save_state``; returns the checkpoint's directory.

        Args:
            output_dir: the checkpoint's directory inside ``checkpoint_dir``; with automatic checkpoint
                naming, leave it None (``checkpoint_<iteration>``).
            step: the checkpoint's step (increasing); with automatic naming, the iteration.
            storage_type: MEMORY (a snapshot only) or DISK (also persisted in the background).
            kwargs: passed to ``Accelerator.save_state`` (``safe_serialization``, ...).
        """
        pc = self.accelerator.project_configuration
        if self.automatic:
            if output_dir is not None:
                raise E.InvalidArgumentError("save_state(output_dir=...): automatic checkpoint naming picks the directory; "
                                 "leave output_dir None")
            step = pc.iteration if step is None else step
            output_dir = os.path.join(self.accelerator.project_dir, "checkpoints", f"checkpoint_{pc.iteration}")
        if output_dir is None or step is None:
            raise E.InvalidArgumentError("save_state(): pass output_dir and step=<the training step> (flashckpt orders "
                             "checkpoints by step)")
        target = os.path.abspath(output_dir)
        rel = self.engine.layout.rel(target)
        fs = FileSet()
        with scratch(scratch_root(self.scratch_dir), os.path.basename(target), prefix="flashckpt-hf-") as tmp:
            cap = Capture(tmp, fs)
            auto = pc.automatic_checkpoint_naming
            pc.automatic_checkpoint_naming = False  # save_state must write where we say and delete nothing
            try:
                with cap:
                    self.accelerator.save_state(tmp, **kwargs)
            finally:
                pc.automatic_checkpoint_naming = auto
            cap.collect()
            self.engine.save(step, fs, path=rel, storage_type=storage_type)
        return target

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> Located:
        """Like ``Accelerator.load_state``: the newest checkpoint every process has (from memory when it
        holds it), or ``input_dir``. Returns where it came from (``source`` "none": nothing to load)."""
        loc = self.engine.locate()
        want = os.path.abspath(input_dir) if input_dir is not None else None
        if loc.source == "memory" and loc.step is not None and loc.path and (want is None or want == loc.path):
            files = all_ranks_files(self.engine.load_memory(loc.step))
            with SnapshotDir(scratch_root(self.scratch_dir), os.path.basename(loc.path),
                             prefix="flashckpt-hf-resume-") as view:
                for name, e in files.items():
                    if e.kind != "tracker":
                        view.write(name, e)
                self.accelerator.load_state(view.dir, **kwargs)
        elif want is not None:
            self.accelerator.load_state(want, **kwargs)
            loc = Located(None, "storage", want)
        elif loc.source == "storage" and loc.path:
            self.accelerator.load_state(loc.path, **kwargs)
        if self.automatic and loc.source != "none":
            m = re.search(r"(\d+)$", os.path.basename(loc.path or ""))
            if m:
                self.accelerator.project_configuration.iteration = int(m.group(1)) + 1
        self.last_load = loc
        return loc

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every checkpoint saved so far is committed (on every process); raises a persist error."""
        self.engine.wait(timeout)
        barrier()
