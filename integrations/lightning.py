"""FlashCheckpointIO: flash checkpoints for PyTorch Lightning (``lightning`` and ``pytorch_lightning`` 2.6).

Add the plugin to the ``Trainer`` and keep your ``ModelCheckpoint`` callbacks. Every checkpoint Lightning
saves is copied into the node's shared memory (training pauses for that copy only) and written to its
``.ckpt`` path in Lightning's own format (``torch.save`` of the checkpoint dict) in the background by
the node's saver daemon, which also writes the newest snapshot when the training process crashes.
``FlashMemorySnapshot`` adds memory-only snapshots between ``ModelCheckpoint`` saves; after a crash,
``resume_path()`` names the newest checkpoint and ``load_checkpoint`` serves it from memory; a worker that
``flashckpt-run`` restarted resumes from it by itself (``FlashMemorySnapshot`` does it; docs/lightning.md).

Example::

    from flashckpt.integrations.lightning import FlashCheckpointIO, FlashMemorySnapshot

    ckpt_io = FlashCheckpointIO("ckpts")
    trainer = L.Trainer(max_steps=1000, plugins=[ckpt_io], callbacks=[
        ModelCheckpoint(dirpath="ckpts", every_n_train_steps=100, save_top_k=3, monitor="step", mode="max"),
        FlashMemorySnapshot(every_n_train_steps=5)])
    trainer.fit(model, ckpt_path=ckpt_io.resume_path())   # None on a fresh start

Checkpoints may go to a store: ``FlashCheckpointIO("s3://bucket/run")`` with
``ModelCheckpoint(dirpath="s3://bucket/run")``. Lightning reaches such a dirpath through fsspec, whose
``s3://`` needs s3fs, which cannot be installed beside the boto3/botocore that flashckpt's S3 backend uses:
where s3fs is missing, importing this module serves fsspec's ``s3://`` read-only through flashckpt's backend
(``_lightning_fs``), and the plugin saves, loads (from memory, else a verified download) and removes the
checkpoints itself. See docs/lightning.md for what of Lightning's remote-dir features work.

The two Lightning packages have separate class trees (a ``lightning.Trainer`` refuses a
``pytorch_lightning`` plugin): ``FlashCheckpointIO`` / ``FlashMemorySnapshot`` are built on ``lightning``,
``PLFlashCheckpointIO`` / ``PLFlashMemorySnapshot`` on ``pytorch_lightning``. The package is imported
when a name is first used. DeepSpeed, sharded FSDP and ``ModelParallelStrategy`` with distributed
checkpoints save without ``CheckpointIO``; ``check_strategy`` (run by ``FlashMemorySnapshot``) refuses
them. See docs/lightning.md.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from typing import Any

from flashckpt import StorageType
from flashckpt import errors as E
from flashckpt.errors import UnsupportedStrategyError
from flashckpt.integrations._kit_resume import auto_resume as resume_wanted
from flashckpt.integrations._kit_resume import restart_count, resume_line
from flashckpt.integrations._lightning_io import _NAMES, _FlashIOImpl  # noqa: E402
from flashckpt.integrations._lightning_paths import dir_of, find_resume_path
from flashckpt.storage import locations
from flashckpt.util.lazy import lazy_attributes

# The four Lightning classes are imported on first use by the module's __getattr__ (their package with them).
__all__ = ["FlashCheckpointIO", "FlashMemorySnapshot", "PLFlashCheckpointIO", "PLFlashMemorySnapshot",  # noqa: F822
           "StorageType", "UnsupportedStrategyError", "check_strategy", "find_resume_path"]

log = logging.getLogger(__name__)



def _serve_s3_in_fsspec() -> bool:
    """Serves fsspec's ``s3://`` (``ModelCheckpoint(dirpath="s3://...")``) read-only through flashckpt's backend
    (``_lightning_fs.FlashStoreFileSystem``) where s3fs is not installed; an installed s3fs is left alone.
    Returns whether it did."""
    if importlib.util.find_spec("s3fs") is not None or importlib.util.find_spec("fsspec") is None:
        return False
    import fsspec

    fsspec.register_implementation("s3", f"{__package__}._lightning_fs.FlashStoreFileSystem", clobber=True)
    return True


_serve_s3_in_fsspec()


def check_strategy(strategy: Any) -> None:
    """Raises ``UnsupportedStrategyError`` when ``strategy`` would save without its ``CheckpointIO``.

    Lightning's DeepSpeed strategy (``deepspeed_engine.save_checkpoint``), FSDP with
    ``state_dict_type="sharded"`` and ``ModelParallelStrategy`` with ``save_distributed_checkpoint=True``
    (torch.distributed.checkpoint) write their checkpoints themselves: a ``FlashCheckpointIO`` given to
    them would never see a save. Also refuses ``FlashCheckpointIO`` wrapped in ``AsyncCheckpointIO``
    (it is asynchronous already, and would be called from another thread).
    """
    names = {c.__name__ for c in type(strategy).__mro__}
    why = None
    if "DeepSpeedStrategy" in names:
        why = ("DeepSpeedStrategy saves through deepspeed_engine.save_checkpoint, not CheckpointIO; use "
               "flashckpt.integrations.deepspeed for DeepSpeed, or a strategy that saves one .ckpt (ddp, fsdp with "
               "state_dict_type='full')")
    elif "FSDPStrategy" in names and getattr(strategy, "_state_dict_type", "full") == "sharded":
        why = ("FSDPStrategy(state_dict_type='sharded') saves with torch.distributed.checkpoint, not CheckpointIO; "
               "use FSDPStrategy(state_dict_type='full'), or flashckpt.integrations.fsdp for sharded checkpoints")
    elif "ModelParallelStrategy" in names and getattr(strategy, "_save_distributed_checkpoint", False):
        why = ("ModelParallelStrategy(save_distributed_checkpoint=True) saves with torch.distributed.checkpoint, "
               "not CheckpointIO; use ModelParallelStrategy(save_distributed_checkpoint=False)")
    elif "XLAFSDPStrategy" in names:
        why = "XLAFSDPStrategy is not supported by FlashCheckpointIO"
    if why:
        raise E.UnsupportedStrategyError(f"{type(strategy).__name__}: {why}.")
    io = getattr(strategy, "_checkpoint_io", None)
    if io is not None and not isinstance(io, _FlashIOImpl) and isinstance(getattr(io, "checkpoint_io", None),
                                                                         _FlashIOImpl):
        raise E.UnsupportedStrategyError(f"{type(io).__name__} wraps a FlashCheckpointIO: pass the FlashCheckpointIO "
                                       "itself in Trainer(plugins=[...]); it is asynchronous already")


# ---------------------------------------------------------------------------------------- the callback
class _MemorySnapshotImpl:
    """The body of ``FlashMemorySnapshot`` (mixed into each Lightning package's ``Callback``)."""

    _tree = "lightning"

    def __init_subclass__(cls, *, tree: str, **kwargs: Any) -> None:
        """The ``FlashMemorySnapshot`` of Lightning package ``tree``, documented and named as this module's."""
        super().__init_subclass__(**kwargs)
        cls._tree, cls.__module__, cls.__doc__ = tree, __name__, _CB_DOC

    def __init__(self, every_n_train_steps: int = 1, *, filename: str = "last-flash.ckpt",
                 dirpath: str | None = None) -> None:
        super().__init__()
        if not isinstance(every_n_train_steps, int) or every_n_train_steps < 1:
            raise E.InvalidArgumentError(f"FlashMemorySnapshot(every_n_train_steps={every_n_train_steps!r}): must be an "
                             "integer >= 1")
        if not filename or os.sep in filename or not filename.endswith(".ckpt"):
            raise E.InvalidArgumentError(f"FlashMemorySnapshot(filename={filename!r}): a file name ending in .ckpt, without "
                             "a directory (use dirpath=...)")
        self.every_n_train_steps = every_n_train_steps
        self.filename = filename
        self.dirpath = dir_of(dirpath, "FlashMemorySnapshot(dirpath)")
        self._io: _FlashIOImpl | None = None
        self._last_step = -1

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Checks that the Trainer saves through a ``FlashCheckpointIO`` of the same Lightning package."""
        io = trainer.strategy.checkpoint_io
        want = _NAMES[self._tree][0]
        if not isinstance(io, _FlashIOImpl) or io._tree != self._tree:
            got = repr(io) if isinstance(io, _FlashIOImpl) else type(io).__name__
            raise E.UnsupportedStrategyError(
                f"{type(self).__name__} needs the Trainer to save through {want}: pass "
                f"Trainer(plugins=[{want}(...)]) (the Trainer's CheckpointIO is {got})")
        check_strategy(trainer.strategy)
        self._io = io
        _disarm(trainer)
        if stage == "fit" and resume_wanted(io.auto_resume, op="FlashCheckpointIO(auto_resume)") \
                and not _ckpt_path_given(trainer, io):
            _arm_resume(trainer, io, io.checkpoint_dir or locations.parent(self.snapshot_path(trainer)))

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Takes back this fit's automatic resume when ``fit`` ended before it loaded (nothing is left armed)."""
        _disarm(trainer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if (self._io is None or step == 0 or step % self.every_n_train_steps or step == self._last_step
                or trainer.sanity_checking or trainer.fast_dev_run):
            return
        self._last_step = step
        with self._io.memory_only():
            trainer.save_checkpoint(self.snapshot_path(trainer), weights_only=False)

    def snapshot_path(self, trainer: Any) -> str:
        """Where the snapshots would be persisted: ``dirpath``, else the plugin's ``checkpoint_dir``, else
        the first ``ModelCheckpoint``'s dirpath, else ``<default_root_dir>/checkpoints``."""
        d = self.dirpath or (self._io.checkpoint_dir if self._io else None)
        if not d:
            cb = trainer.checkpoint_callback
            d = getattr(cb, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")
        return locations.join(dir_of(d, "FlashMemorySnapshot") or d, self.filename)



def _arm_resume(trainer: Any, io: _FlashIOImpl, d: str) -> None:
    """Makes this ``fit``, in a worker the launcher restarted and called without a ``ckpt_path``, resume as
    ``fit(ckpt_path=<the newest checkpoint in d>)`` would: global rank 0's ``find_resume_path`` (memory first)
    goes to every rank, and the checkpoint connector's ``resume_start``, which ``fit`` calls with the path
    Lightning selected before any hook ran, gets it in place of None, once. A path Lightning selected by
    itself (``"hpc"`` under SLURM, ``"last"`` with ``OnExceptionCheckpoint``) is left alone."""
    path = find_resume_path(d, storage_options=io.storage_options) if trainer.is_global_zero else None
    path = trainer.strategy.broadcast(path, src=0)  # every rank loads, or none does
    connector = trainer._checkpoint_connector
    original = connector.resume_start

    def resume_start(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
        _disarm(trainer)
        if checkpoint_path is not None:
            original(checkpoint_path, weights_only=weights_only)
            return
        original(path, weights_only=weights_only)
        if trainer.is_global_zero:
            step = connector._loaded_checkpoint.get("global_step") if path is not None else None
            source = io.last_load[0] if io.last_load is not None else "storage"
            # find_resume_path named the newest checkpoint there is: none newer is lost.
            resume_line(log, type(io).__name__, source=source, step=step, path=path, lost=0, automatic=True)

    resume_start._flashckpt = True  # type: ignore[attr-defined]
    connector.resume_start = resume_start


class _AutoResumeImpl:
    """The body of the callback Lightning adds to every Trainer of a restarted worker through its
    ``callbacks_factory`` entry point (pyproject.toml): a ``fit`` that saves through a ``FlashCheckpointIO``
    and has no ``FlashMemorySnapshot`` (which does the same itself) resumes as ``FlashMemorySnapshot``'s
    ``setup`` makes it, from the plugin's ``checkpoint_dir``, else the first ``ModelCheckpoint``'s dirpath,
    else ``<default_root_dir>/checkpoints``. Any other Trainer is left alone."""

    _tree = "lightning"

    def __init_subclass__(cls, *, tree: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._tree = tree

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if (stage != "fit" or not isinstance(io, _FlashIOImpl) or io._tree != self._tree
                or any(isinstance(cb, _MemorySnapshotImpl) for cb in trainer.callbacks)):
            return
        _disarm(trainer)
        if resume_wanted(io.auto_resume, op="FlashCheckpointIO(auto_resume)") and not _ckpt_path_given(trainer, io):
            d = io.checkpoint_dir or getattr(trainer.checkpoint_callback, "dirpath", None) or os.path.join(
                trainer.default_root_dir, "checkpoints")
            _arm_resume(trainer, io, d)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        _disarm(trainer)


def restarted_worker_callbacks(cls: type) -> list[Any]:
    """What the ``callbacks_factory`` entry point gives a Lightning Trainer: an ``cls`` (an ``_AutoResumeImpl``
    of the Trainer's package) in a worker the launcher restarted, else nothing (a first start is untouched)."""
    return [cls()] if restart_count() > 0 else []


def _ckpt_path_given(trainer: Any, io: _FlashIOImpl) -> bool:
    """Whether the script chose a checkpoint for this ``fit``: ``trainer.ckpt_path = ...`` before it, or
    ``fit(ckpt_path=...)`` (read from ``Trainer.fit``'s frame: Lightning resolves it before any hook runs and
    hands no hook the caller's value)."""
    if getattr(trainer._checkpoint_connector, "_user_managed", False):
        return True
    fit = io._codes()["fit"]
    f: Any = sys._getframe(1)
    while f is not None:
        if f.f_code is fit and f.f_locals.get("self") is trainer:
            return f.f_locals.get("ckpt_path") is not None
        f = f.f_back
    return False  # fit runs in a process of its own (ddp_spawn's workers): resume_start decides


def _disarm(trainer: Any) -> None:
    """Removes the ``resume_start`` of ``_MemorySnapshotImpl._arm_resume`` from ``trainer``'s checkpoint
    connector (the class's method is back)."""
    connector = getattr(trainer, "_checkpoint_connector", None)
    if connector is not None and getattr(vars(connector).get("resume_start"), "_flashckpt", False):
        del connector.resume_start


# ---------------------------------------------------------------------------------------- class trees
_CB_DOC = """Callback that takes memory-only snapshots every ``every_n_train_steps`` optimizer steps.

Each snapshot is a complete Lightning checkpoint in the node's shared memory (no file is written).
When the training process dies, the saver persists the newest snapshot to ``<dir>/<filename>``
(``last-flash.ckpt`` by default, which ``ckpt_path="last"`` also finds); ``resume_path()`` and
``load_checkpoint`` resume from it in memory. In a worker that ``flashckpt-run`` (or torchrun) restarted,
``fit(model)`` without a ``ckpt_path`` resumes from the newest checkpoint by itself, with one WARNING line
(``FlashCheckpointIO(auto_resume=False)`` or ``FLASHCKPT_AUTO_RESUME=0`` turns that off).

Args:
    every_n_train_steps: snapshot interval in optimizer steps (use more often than ``ModelCheckpoint``).
    filename: the snapshot's file name.
    dirpath: its directory (default: the plugin's ``checkpoint_dir``, else the first ModelCheckpoint's): a
        local directory or a store's URL (``s3://bucket/run``).
"""

# Each package's classes are defined in a module of their own, imported on first use of their names.
_CLASS_MODULES = {"lightning": "._lightning_classes", "pytorch_lightning": "._pl_classes"}
_TREE_OF = {name: tree for tree, names in _NAMES.items() for name in names}


def _needs_package(name: str, e: ImportError) -> ImportError:
    tree = _TREE_OF[name]
    return ImportError(f"flashckpt.integrations.lightning.{name} needs the '{tree}' package (pip install "
                       f"{'lightning' if tree == 'lightning' else 'pytorch-lightning'}==2.6.6): {e}")


__getattr__, __dir__ = lazy_attributes(__name__, {name: _CLASS_MODULES[tree] for name, tree in _TREE_OF.items()},
                                       import_error=_needs_package)
