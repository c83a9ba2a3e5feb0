"""AcceleratorCheckpointer: flash checkpoints for HuggingFace Accelerate (``Accelerator.save_state`` /
``load_state``), memory first, persisted in the background in Accelerate's own layout.

``save_state`` runs Accelerate's own ``save_state`` with its output aimed at a private scratch directory
and captures the files it writes there (``Capture``: tensors into shared memory, small files as bytes);
``load_state`` lays a memory snapshot out as files (``SnapshotDir``) for Accelerate's ``load_state``.
The checkpoint dir may be in a store (``s3://bucket/prefix``): a load from there downloads the committed
step's files into a private scratch directory (``fetch_step``), checks them against the step's manifest and
lets Accelerate read that copy. Also exported by ``flashckpt.integrations.hf``.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Protocol

from flashckpt import CheckpointEngine, FileSet, StorageType
from flashckpt import errors as E
from flashckpt.engine.adapter import AdapterBase, LoadAttempt, Opened, is_stored
from flashckpt.engine.collective import barrier
from flashckpt.engine.engine import Located
from flashckpt.integrations._kit_files import (
    Capture,
    SnapshotDir,
    all_ranks_files,
    committed_step_of,
    fetch_step,
    scratch,
    scratch_root,
)
from flashckpt.storage import locations

__all__ = ["AcceleratorCheckpointer", "StorageType"]

log = logging.getLogger(__name__)


class _Config(Protocol):
    """What ``AcceleratorCheckpointer`` reads of a ``flashckpt.integrations.hf.FlashCkptConfig``."""

    scratch_dir: str | None
    storage_options: dict[str, Any] | None
    local_dir: str | None
    local_max_to_keep: int


class AcceleratorCheckpointer(AdapterBase):
    """``Accelerator.save_state`` / ``load_state`` through flashckpt: memory first, persisted in the
    background in Accelerate's own layout (``model.safetensors``, ``optimizer.bin``, ``scheduler.bin``,
    ``random_states_<rank>.pkl``, ...), so ``accelerator.load_state(dir)`` reads it without flashckpt.

    Args:
        accelerator: the ``accelerate.Accelerator`` whose prepared objects are saved.
        checkpoint_dir: where checkpoints live (flashckpt's bookkeeping goes beside it, to
            ``<parent>/.flashckpt/<name>/``); with
            ``ProjectConfiguration(automatic_checkpoint_naming=True)`` it defaults to the project dir, the
            checkpoints go to ``<project_dir>/checkpoints/checkpoint_<i>`` as Accelerate names them, and
            ``total_limit`` is the retention. It may be the URL of a store (``s3://bucket/run``; records
            inside it, in ``.flashckpt/``): ``output_dir`` then names a directory in it (a URL, or a path
            relative to it), automatic naming puts ``checkpoints/checkpoint_<i>`` in it, and a load from
            the store downloads the step into ``scratch_dir`` first.
        config: a ``flashckpt.integrations.hf.FlashCkptConfig``; its ``scratch_dir``, ``storage_options``,
            ``local_dir`` and ``local_max_to_keep`` are used (the other fields are the Trainer's).
        storage_options: options of the store's backend (``s3://``: ``flashckpt.storage.s3.options.S3Options``
            fields such as ``endpoint_url``); default: the config's.
        local_dir: a node-local directory (NVMe, a local disk) as the fast tier: a DISK save commits there
            first (the same relative path as under ``checkpoint_dir``) and the node's saver uploads it in the
            background; ``load_state()`` reads it when this node's copy holds every process's files of the
            newest step (``source`` "local"), else ``checkpoint_dir``. Default: the config's, else
            FLASHCKPT_LOCAL_DIR (unset: no local tier).
        local_max_to_keep: checkpoints the local tier keeps (0 keeps all; one not yet uploaded is never
            deleted); default: the config's, else 2.

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
                 config: _Config | None = None, storage_options: dict[str, Any] | None = None,
                 local_dir: str | os.PathLike[str] | None = None, local_max_to_keep: int | None = None) -> None:
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
        if storage_options is None:
            storage_options = getattr(config, "storage_options", None)
        self.engine = CheckpointEngine(checkpoint_dir, max_to_keep=limit, replicated=False,
                                       weights_only=accelerator.distributed_type.value != "DEEPSPEED",
                                       storage_options=storage_options,
                                       local_dir=local_dir if local_dir is not None else getattr(config, "local_dir", None),
                                       local_max_to_keep=(local_max_to_keep if local_max_to_keep is not None
                                                          else getattr(config, "local_max_to_keep", 2)))
        self.checkpoint_dir = self.engine.checkpoint_dir
        self.last_load: Located | None = None

    def save_state(self, output_dir: str | None = None, *, step: int | None = None,
                   storage_type: StorageType = StorageType.DISK, **kwargs: Any) -> str:
        """Like ``Accelerator.save_state``; returns the checkpoint's directory.

        Args:
            output_dir: the checkpoint's directory inside ``checkpoint_dir`` (in a store: its URL, or a path
                relative to ``checkpoint_dir``); with automatic checkpoint naming, leave it None
                (``checkpoint_<iteration>``).
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
            # In a store, under the checkpoint dir (the project dir is local); else as Accelerate names them.
            home = self.checkpoint_dir if self._in_store else self.accelerator.project_dir
            output_dir = locations.join(home, "checkpoints", f"checkpoint_{pc.iteration}")
        if output_dir is None or step is None:
            raise E.InvalidArgumentError("save_state(): pass output_dir and step=<the training step> (flashckpt orders "
                             "checkpoints by step)")
        target = self._target(output_dir)
        rel = self.engine.layout.rel(target)
        fs = FileSet()
        with scratch(scratch_root(self.scratch_dir), locations.basename(target), prefix="flashckpt-hf-") as tmp:
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

    @property
    def _in_store(self) -> bool:
        return locations.is_url(self.checkpoint_dir)

    def _target(self, path: str) -> str:
        """The location ``path`` (``output_dir`` / ``input_dir``) names: an absolute local path; in a store,
        a URL as given or a relative path inside the checkpoint dir."""
        if self._in_store:
            return locations.resolve_in(self.checkpoint_dir, "", path, "output_dir")
        return os.path.abspath(locations.local_dir(path, "AcceleratorCheckpointer"))

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> Located:
        """Like ``Accelerator.load_state``: the newest checkpoint every process has (from memory when it
        holds it, else the newest committed one whose checksums verify, falling back to older ones), or
        ``input_dir``. A checkpoint in a store is downloaded into ``scratch_dir`` (and checked against its
        manifest) for Accelerate to read. Returns where it came from (``source`` "none": nothing to load).

        Raises:
            InvalidArgumentError: ``input_dir`` is in a store but is not a committed checkpoint of this
                checkpoint dir.
            CheckpointCorruptError: the checkpoint in the store does not match its manifest.
        """
        want = self._target(input_dir) if input_dir is not None else None

        def refuse(loc: Located) -> str:
            return f"{want} is asked for" if not loc.path or (want is not None and want != loc.path) else ""

        def from_memory(loc: Located, fs: Any) -> Opened:
            assert loc.path is not None  # refuse() passed it
            files = all_ranks_files(fs)
            with SnapshotDir(scratch_root(self.scratch_dir), locations.basename(loc.path),
                             prefix="flashckpt-hf-resume-") as view:
                for name, e in files.items():
                    if e.kind != "tracker":
                        view.write(name, e)
                self.accelerator.load_state(view.dir, **kwargs)
            return Opened(None, loc.step, loc.path)

        def from_storage(attempt: LoadAttempt) -> Opened | None:
            if want is not None:
                self._load_from(want, None, **kwargs)
                return Opened(None, None, want)
            loc = attempt.stored()
            if not is_stored(loc) or not loc.path:
                return None
            self._load_from(loc.path, loc.step, **kwargs)  # "local": this node's whole copy, a local directory
            return Opened(None, loc.step, loc.path, source=loc.source)

        # a step saved by another number of processes: the union of their files (DDP), not ZeRO or FSDP shards
        reshard = self.accelerator.distributed_type.value not in ("DEEPSPEED", "FSDP", "MEGATRON_LM")
        r = self.resolve_load(op="load_state()", event="accelerate_load", logger=log, refuse=refuse,
                              from_memory=from_memory, from_storage=from_storage, reshard=reshard)
        loc = Located(r.step, r.source, r.path)
        if self.automatic and loc.source != "none":
            m = re.search(r"(\d+)$", locations.basename(loc.path or ""))
            if m:
                self.accelerator.project_configuration.iteration = int(m.group(1)) + 1
        self.last_load = loc
        return loc

    def _load_from(self, path: str, step: int | None, **kwargs: Any) -> None:
        """``Accelerator.load_state`` of a persisted checkpoint: a local directory as it is; one in a store
        downloaded first (``step``: its committed step, None to look it up)."""
        if not locations.is_url(path):
            self.accelerator.load_state(path, **kwargs)
            return
        layout = self.engine.layout
        step = committed_step_of(layout, path) if step is None else step
        if step is None:
            raise E.InvalidArgumentError(
                f"load_state({path!r}): not a committed checkpoint of {self.checkpoint_dir} (being persisted, never "
                f"saved, or elsewhere); committed: {layout.committed_steps()}. Pass no input_dir for the newest")
        with SnapshotDir(scratch_root(self.scratch_dir), locations.basename(path),
                         prefix="flashckpt-hf-resume-") as view:
            fetch_step(view, layout, step, path)
            log.info("event=load step=%d source=storage path=%s (downloaded)", step, path)
            self.accelerator.load_state(view.dir, **kwargs)

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every checkpoint saved so far is committed (on every process); raises a persist error."""
        self.engine.wait(timeout)
        barrier()
