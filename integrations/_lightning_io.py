"""The body of ``FlashCheckpointIO`` (``lightning``) and ``PLFlashCheckpointIO`` (``pytorch_lightning``): the
``CheckpointIO`` plugin that snapshots every checkpoint Lightning saves and has the node's saver persist it
to its ``.ckpt`` path, local or in a store (``s3://...``) (see ``flashckpt.integrations.lightning`` and
docs/lightning.md).

One concept, hence one module past 500 lines: Lightning's ``CheckpointIO`` contract (``save_checkpoint``,
``load_checkpoint``, ``remove_checkpoint``, ``teardown``) over one bookkeeping that all four share and
change together: the saves still being persisted (``_pending``), the committed steps of each path
(``_live``), the removals that wait for a persist (``_doomed``) and the empty files that stand for pending
saves. The path helpers and the reads from a store are in ``_lightning_paths``; the load protocol is the
adapter base's (``flashckpt.engine.adapter.resolve_load``).

Imports Lightning lazily (the classes are built per package in ``_lightning_classes`` / ``_pl_classes``).
Lightning calls the plugin from the training thread only; ``_wait_at_exit`` runs at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import os
import sys
import time
import weakref
from collections.abc import Iterator
from typing import Any

from flashckpt import CheckpointEngine, FlashCheckpointError, PersistError, StorageType
from flashckpt import errors as E
from flashckpt.engine.adapter import LOCAL, LoadAttempt, Opened, resolve_load
from flashckpt.engine.engine import Located
from flashckpt.engine.routing import path_inside
from flashckpt.integrations._kit_resume import auto_resume as resume_wanted
from flashckpt.integrations._lightning_paths import (
    dir_of,
    find_resume_path,
    link_target,
    local_path,
    map_tensors,
    read_stored,
    remove_path,
    single_file_steps,
    storage_type_of,
)
from flashckpt.integrations.telemetry import report_lightning
from flashckpt.memory.reader import SnapshotReader, job_in_memory
from flashckpt.storage import locations

log = logging.getLogger("flashckpt.integrations.lightning")


# The exported name of each class, by Lightning package.
_NAMES = {"lightning": ("FlashCheckpointIO", "FlashMemorySnapshot"),
          "pytorch_lightning": ("PLFlashCheckpointIO", "PLFlashMemorySnapshot")}

# The public module of the classes built on this body (their __module__).
_PUBLIC = __name__.rsplit(".", 1)[0] + ".lightning"

_IO_DOC = """Lightning ``CheckpointIO`` that snapshots checkpoints to shared memory and persists them in the
background (see the module docstring of ``flashckpt.integrations.lightning``).

Args:
    checkpoint_dir: the directory that contains every ``.ckpt`` path Lightning saves (default: the
        directory of the first checkpoint saved; saves outside it then go to ``TorchCheckpointIO``): a
        local directory, or the URL of a store (``s3://bucket/run``, with ``ModelCheckpoint(dirpath=
        "s3://bucket/run")``; see docs/lightning.md). flashckpt keeps its bookkeeping beside a local one, in
        ``<parent>/.flashckpt/<name>/`` (in a store: inside, in ``.flashckpt/``); the job's saver and shared
        memory are keyed by it.
    weights_only: how Python objects in memory snapshots are decoded (torch's weights-only rules).
    teardown_timeout_s: how long ``teardown`` waits for the persists (None: no bound).
    load_wait_s: how long a rank that does not hold a checkpoint in memory waits for it on storage.
    storage_options: options of the store's backend (``s3://``: ``flashckpt.storage.s3.options.S3Options`` fields
        such as ``endpoint_url``); the node's saver gets them too.
    scratch_dir: where a checkpoint loaded from a store is downloaded for Lightning's reader (default
        ``/dev/shm`` when writable, else the system temp dir); removed after the load.
    local_dir: a node-local directory (NVMe, a local disk) as the fast tier: a DISK save commits there first
        (the ``.ckpt`` at the same relative path) and the node's saver uploads it to the checkpoint dir in the
        background; a load of a path reads this node's copy there when the local tier holds its newest save
        whole (``last_load`` ``("local", <its path there>)``), else the checkpoint dir. None:
        FLASHCKPT_LOCAL_DIR (unset: no local tier).
    local_max_to_keep: saves the local tier keeps (0 keeps all; one not yet uploaded is never deleted).
    auto_resume: a worker that ``flashckpt-run`` (or torchrun) restarted after a failure runs ``fit(model)``
        without a ``ckpt_path`` as ``fit(model, ckpt_path=<the newest checkpoint, memory first>)``, and logs
        one WARNING line about it; done by ``FlashMemorySnapshot`` (it needs the Trainer: see docs/lightning.md,
        **Resume without a script change**). None: ``FLASHCKPT_AUTO_RESUME`` (on by default).

Thread safety: Lightning calls it from the training thread only; so must you.
"""


# ---------------------------------------------------------------------------------------- the plugin
class _FlashIOImpl:
    """The body of ``FlashCheckpointIO`` (mixed into each Lightning package's ``CheckpointIO``)."""

    _tree = "lightning"
    _torch_io_cls: Any = None
    _trainer_codes: Any = None  # set per class by _codes()

    def __init_subclass__(cls, *, tree: str, torch_io: Any, **kwargs: Any) -> None:
        """The ``FlashCheckpointIO`` of Lightning package ``tree`` (``class X(_FlashIOImpl, CheckpointIO,
        tree=..., torch_io=TorchCheckpointIO)``), documented and named as this module's."""
        super().__init_subclass__(**kwargs)
        cls._tree, cls._torch_io_cls, cls.__module__, cls.__doc__ = tree, torch_io, _PUBLIC, _IO_DOC

    def __init__(self, checkpoint_dir: str | None = None, *, weights_only: bool = True,
                 teardown_timeout_s: float | None = 1800.0, load_wait_s: float = 600.0,
                 storage_options: dict[str, Any] | None = None, scratch_dir: str | None = None,
                 local_dir: str | os.PathLike[str] | None = None, local_max_to_keep: int = 2,
                 auto_resume: bool | None = None) -> None:
        super().__init__()
        resume_wanted(auto_resume, op="FlashCheckpointIO(auto_resume)")  # refuses anything but a bool or None
        if teardown_timeout_s is not None and teardown_timeout_s <= 0:
            raise E.InvalidArgumentError(f"FlashCheckpointIO(teardown_timeout_s={teardown_timeout_s!r}): must be > 0 or None")
        self.checkpoint_dir = dir_of(checkpoint_dir, "FlashCheckpointIO")
        self.weights_only = weights_only
        self.teardown_timeout_s = teardown_timeout_s
        self.load_wait_s = load_wait_s
        self.storage_options = storage_options
        self.scratch_dir = scratch_dir
        self.local_dir = None if local_dir is None else os.fspath(local_dir)
        self.local_max_to_keep = local_max_to_keep
        self.auto_resume = auto_resume
        self.last_load: tuple[str, str] | None = None  # (source: "memory" | "local" | "storage", path)
        self.deferred_removals = 0  # removals that waited for a persist of their path
        self._warned_dir = False
        self._warned_url = False
        self._warned_outside = False
        self._memory_only = 0
        self._reset()
        _all_ios.add(self)  # fsspec's s3:// (_lightning_fs) asks the plugins for their dirs and pending saves

    def _reset(self) -> None:
        self._engine: CheckpointEngine | None = None
        self._names: SnapshotReader | None = None  # reads the names of local rank 0's snapshots
        self._seq = 0  # the engine step of the next save: one per save, increasing across restarts
        self._pending: dict[int, str] = {}  # engine step -> path of DISK saves not known finished
        self._live: dict[str, list[int]] = {}  # path -> committed engine steps that list it
        self._doomed: set[str] = set()  # removed paths whose removal waits for their persists
        self._removed_seqs: set[int] = set()  # engine steps of saves removed while they were persisted
        self._high = -1  # newest committed engine step seen
        self._placeholders: set[str] = set()  # empty files made at save for pending persists (_reserve)
        self._late_error: BaseException | None = None  # a save's error while fit fails, for teardown
        self._finalizer: weakref.finalize | None = None  # closes the engine when the plugin is dropped
        self._loaded_only = True  # the engine has only loaded so far (its directory is not yet the plugin's)
        self._on_local: tuple[str, tuple[int, str] | None] | None = None  # a load's (path, local_file of it)

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the Trainer: no engine crosses over
        state = dict(self.__dict__)
        for k in ("_engine", "_names", "_pending", "_live", "_doomed", "_removed_seqs", "_placeholders", "_late_error",
                  "_finalizer"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()
        _all_ios.add(self)

    def __repr__(self) -> str:
        other = _NAMES["pytorch_lightning" if self._tree == "lightning" else "lightning"][0]
        pkg = "pytorch_lightning" if self._tree == "lightning" else "lightning"
        return (f"{type(self).__name__}(checkpoint_dir={self.checkpoint_dir!r}) [a '{self._tree}' CheckpointIO; "
                f"with a {pkg}.Trainer use flashckpt.integrations.lightning.{other}]")

    # ------------------------------------------------------------------ CheckpointIO API
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Copies ``checkpoint`` into shared memory and schedules its persist to ``path``.

        Returns once the copy is in shared memory (the tensors may then change); ``path`` exists from
        then on (an empty file until the persist replaces it), so ``ModelCheckpoint`` sees it, as after
        ``torch.save``. The ``.ckpt`` is written in the background, atomically, as ``torch.save(checkpoint)``
        would write it, and is on storage when ``teardown`` returns (at the end of ``fit``, also when
        ``fit`` raises). ``Trainer.save_checkpoint`` outside ``fit``/``validate``/``test``/``predict``
        (no teardown follows) returns once the file is on storage. A direct call is on storage at
        ``teardown()`` or when the process exits.

        Args:
            checkpoint: the dict Lightning built (``Trainer.save_checkpoint``).
            path: the ``.ckpt`` to write, inside ``checkpoint_dir`` (default: the directory of the first
                checkpoint this plugin saves; without ``checkpoint_dir``, a path outside it is saved by
                ``TorchCheckpointIO``): a local path, or a URL in a store (``s3://``). A URL of a scheme no
                flashckpt backend serves (``memory://``, ...) is saved by Lightning's ``TorchCheckpointIO``
                instead (synchronously, no flash snapshot). In a store nothing appears before the persist
                (an object is created whole), but ``ModelCheckpoint`` sees the path at once through
                fsspec (see ``flashckpt.integrations._lightning_fs``).
            storage_options: None or ``StorageType.DISK`` to persist; ``StorageType.MEMORY`` for a
                memory-only snapshot (persisted only if the process dies before a newer one). Other
                options are Lightning's: the save goes to ``TorchCheckpointIO`` with them.

        Raises:
            FlashCheckpointError: ``path`` is outside ``checkpoint_dir``, or a memory-only snapshot of a
                URL no flashckpt backend serves (nothing written).
            PersistError: an earlier persist failed (raised after this snapshot was taken); outside
                ``fit``, this one failed.
        """
        storage = storage_type_of(storage_options, self._memory_only > 0)
        if storage is None:
            self._torch_save(checkpoint, path, storage_options)
            return
        target = self._flash_target(checkpoint, path, storage)
        if target is None:
            return
        context = self._caller()
        engine = self._ensure_engine(target, "save_checkpoint")
        self._reconcile()
        seq, self._seq = self._seq, self._seq + 1
        self._doomed.discard(target)  # saved again after a removal: the new file stays
        if storage == StorageType.DISK:
            self._pending[seq] = target
        disk = storage == StorageType.DISK and engine.persists  # this rank writes the file
        t0 = time.perf_counter()
        error: PersistError | None = None
        try:
            engine.save(seq, checkpoint, path=target, storage_type=storage)
        except PersistError as e:  # about an earlier persist; this one was scheduled
            error = self._unless_removed(e)
        except BaseException:
            self._pending.pop(seq, None)
            raise
        self._reserve(target, disk)
        log.info("event=lightning_save path=%s engine_step=%d global_step=%s storage=%s seconds=%.4f", target, seq,
                 checkpoint.get("global_step"), storage.value, time.perf_counter() - t0)
        trainer = self._saving_trainer()
        if trainer is not None:  # the pause, persist time and durable step to the module's loggers
            report_lightning(trainer, engine)
        if disk and context == "trainer":  # no teardown follows: durable on return, as torch.save is
            try:
                self._wait_persists()
            except PersistError as e:
                error = error or e
        if error is None:
            return
        if context != "interrupt":
            raise error
        # Saving on the way out of a failing fit (save_on_exception): the fit's exception goes on, and
        # teardown reports this error with it.
        log.error("FlashCheckpointIO.save_checkpoint(%s) while fit fails: %s", target, error)
        self._late_error = self._late_error or error

    def _flash_target(self, checkpoint: dict[str, Any], path: Any, storage: StorageType) -> str | None:
        """Where flashckpt saves ``path``; None when Lightning's ``TorchCheckpointIO`` saved it instead (a URL no
        flashckpt backend serves, a path outside the directory this plugin chose by itself).

        Raises:
            FlashCheckpointError: a memory-only snapshot of such a path (nothing written).
        """
        target = local_path(path, "save_checkpoint")
        if target is None:
            if storage == StorageType.MEMORY:
                raise FlashCheckpointError(
                    f"FlashCheckpointIO.save_checkpoint({os.fspath(path)!r}): a memory-only snapshot needs a path "
                    "flashckpt writes (its persist after a crash is written by flashckpt): a local path or a store it "
                    "serves (s3://); give FlashMemorySnapshot(dirpath=...) or FlashCheckpointIO(checkpoint_dir=...) one")
            self._torch_save(checkpoint, path, None)
            return None
        if self._elsewhere(target):
            engine = self._engine
            assert engine is not None  # _elsewhere says so
            if storage == StorageType.MEMORY:
                raise FlashCheckpointError(self._outside("save_checkpoint", target, engine.checkpoint_dir))
            if not self._warned_outside:
                self._warned_outside = True
                log.warning("FlashCheckpointIO: %s is outside %s, the directory this plugin took from its first save; "
                            "Lightning's TorchCheckpointIO saves it (synchronously, without a flash snapshot), as every "
                            "other path outside it. Construct FlashCheckpointIO(checkpoint_dir=...) with a directory "
                            "that contains every path you save, to flash them all.", target, engine.checkpoint_dir)
            self._torch_save(checkpoint, path, None)
            return None
        return target

    def _elsewhere(self, target: str) -> bool:
        """Whether a save to ``target`` falls outside the directory this plugin chose by itself (no
        ``checkpoint_dir`` given: the first save's directory); such saves go to ``TorchCheckpointIO``."""
        engine = self._engine
        return not (engine is None or self.checkpoint_dir or self._loaded_only or path_inside(target, engine.checkpoint_dir))

    def _torch_save(self, checkpoint: dict[str, Any], path: Any, storage_options: Any) -> None:
        """Saves with Lightning's ``TorchCheckpointIO``: URLs, paths outside the directory the plugin
        chose by itself, and ``storage_options`` that are not flashckpt's."""
        if storage_options is None and not self._warned_url and local_path(path, "save_checkpoint") is None:
            self._warned_url = True
            log.warning("FlashCheckpointIO: %s is a URL that no flashckpt storage backend serves, so Lightning's "
                        "TorchCheckpointIO saves it (synchronously, without a flash snapshot) and every other such URL "
                        "of this plugin. Use a local dirpath, or s3://, for flash checkpoints.", os.fspath(path))
        io = self._torch_io_cls()
        try:
            io.save_checkpoint(checkpoint, path, storage_options=storage_options)
        except TypeError as e:
            if storage_options is None:
                raise
            raise E.InvalidArgumentTypeError(f"FlashCheckpointIO.save_checkpoint(storage_options={storage_options!r}): flashckpt takes "
                            "None (persist), StorageType.MEMORY or StorageType.DISK (or 'memory' / 'disk'); other "
                            f"storage_options go to Lightning's TorchCheckpointIO, which refused them: {e}") from e

    def _caller(self) -> str:
        """Who saves: "run" (a Trainer's fit/validate/test/predict before its teardown), "interrupt"
        (its exception handling, which tears down next), "trainer" (``Trainer.save_checkpoint``
        elsewhere: no teardown follows) or "direct" (not a Trainer)."""
        codes = self._codes()
        via_trainer = False
        f: Any = sys._getframe(2)
        while f is not None:
            code = f.f_code
            if code is codes["run_stage"]:
                return "run"
            if code is codes["interrupt"]:
                return "interrupt"
            if code is codes["save"]:
                via_trainer = True
            f = f.f_back
        return "trainer" if via_trainer else "direct"

    def _saving_trainer(self) -> Any:
        """The Lightning ``Trainer`` whose ``save_checkpoint`` called us (None: a direct call)."""
        save = self._codes()["save"]
        f: Any = sys._getframe(2)
        while f is not None:
            if f.f_code is save:
                return f.f_locals.get("self")
            f = f.f_back
        return None

    def _failing(self) -> BaseException | None:
        """The exception Lightning tears down for, if it does: the one being handled when a Trainer's
        ``_teardown`` calls us for an interrupted run (not when ``fit`` merely runs inside some
        ``except`` block), or, called by something else, whatever exception is being handled."""
        exc = sys.exc_info()[1]
        if exc is None:
            return None
        teardown = self._codes()["teardown"]
        f: Any = sys._getframe(1)
        while f is not None:
            if f.f_code is teardown:
                trainer = f.f_locals.get("self")
                return exc if getattr(trainer, "interrupted", True) else None
            f = f.f_back
        return exc

    @classmethod
    def _codes(cls) -> dict[str, Any]:
        """The code objects of this class's Lightning package that tell where a call comes from:
        ``Trainer._run_stage``, ``Trainer._teardown``, ``Trainer.save_checkpoint``, the exception
        handler's ``_interrupt``, and ``Trainer.fit`` (whose ``ckpt_path`` is the caller's)."""
        codes = cls.__dict__.get("_trainer_codes")
        if codes is None:
            pkg = "lightning.pytorch" if cls._tree == "lightning" else "pytorch_lightning"
            trainer = importlib.import_module(f"{pkg}.trainer.trainer").Trainer
            call = importlib.import_module(f"{pkg}.trainer.call")
            codes = {"run_stage": trainer._run_stage.__code__, "teardown": trainer._teardown.__code__,
                     "save": trainer.save_checkpoint.__code__, "interrupt": call._interrupt.__code__,
                     "fit": trainer.fit.__code__}
            cls._trainer_codes = codes
        return codes

    def _reserve(self, target: str, disk: bool) -> None:
        """Creates ``target`` empty when it does not exist, so that it exists once ``save_checkpoint``
        returns, as after ``torch.save``: ``ModelCheckpoint`` picks ``-v1`` names by that. The persist
        replaces it atomically; a failed persist removes it again. In a store nothing is created (only the
        saver writes there): fsspec's ``s3://`` of ``_lightning_fs`` reports pending saves as existing."""
        if not disk or locations.is_url(target):
            return
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError:  # it exists (the usual case for a repeated name), or the persist will say why not
            return
        os.close(fd)
        self._placeholders.add(target)

    def _wait_persists(self) -> None:
        """Waits (up to ``teardown_timeout_s``) until every scheduled persist is on storage."""
        engine = self._engine
        if engine is None:
            return
        try:
            engine.wait(self.teardown_timeout_s)
        except PersistError as e:
            self._reconcile(all_done=True)  # wait() raises it only once no persist runs
            if self._unless_removed(e) is not None:
                raise
        self._reconcile(all_done=True)

    def _unless_removed(self, error: PersistError) -> PersistError | None:
        """``error``, or None where it is only about saves whose checkpoints were removed while they were
        persisted (``remove_checkpoint``: a commit finds the file it was about to list gone): nothing the
        Trainer still wants was lost."""
        if error.failed_steps and set(error.failed_steps) <= self._removed_seqs:
            log.info("FlashCheckpointIO: the persists of removed checkpoints did not commit (engine steps %s): %s",
                     list(error.failed_steps), error)
            return None
        return error

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads ``path``: from shared memory when memory holds its newest save, else from the file.

        With several processes (DDP) every rank must call it (Lightning does): global rank 0's choice
        of path and save is broadcast, and a rank whose node does not hold that save in memory waits
        (up to ``load_wait_s``) for it to be committed on storage. ``weights_only`` applies to file
        loads; Python objects in memory snapshots are decoded under the plugin's ``weights_only``.
        A file in a store (``s3://``) is downloaded into ``scratch_dir``, checked against the manifest
        that lists it (when flashckpt committed it) and read by Lightning's ``TorchCheckpointIO``.

        Raises:
            FileNotFoundError: neither memory nor storage has ``path``.
            CheckpointCorruptError: the file in the store does not match its manifest.
        """
        target = local_path(path, "load_checkpoint")
        seq = None
        if target is not None:
            target = link_target(target)
            root = self.checkpoint_dir or (self._engine.checkpoint_dir if self._engine else locations.parent(target))
            # An engine is made for a load only where a saver of this job may hold snapshots (its runtime
            # dir exists), or this plugin's local tier may hold the file: loading someone else's checkpoint
            # never starts a saver or writes into its dir.
            if path_inside(target, root) and (self._engine is not None or job_in_memory(root)
                                              or (self.local_dir is not None and os.path.isdir(self.local_dir))):
                self._ensure_engine(target, "load_checkpoint")
                seq = self._memory_choice(target)
        own = target
        target, seq = self._agree(target, seq)
        engine, names = self._engine, self._names
        in_memory = (target is not None and seq is not None and engine is not None and names is not None
                     and seq in engine.memory_steps() and names.snapshot_name(seq) == target)

        def from_storage(_attempt: LoadAttempt) -> Opened:
            io = self._torch_io_cls()
            kw: dict[str, Any] = {"weights_only": weights_only}
            if map_location is not None:
                kw["map_location"] = map_location
            local = self._local_copy(target, seq)  # this node's whole copy of that save on the local tier
            if local is not None:
                return Opened(io.load_checkpoint(local, **kw), seq, local, source=LOCAL)
            if target is not None and seq is not None and engine is not None:
                self._wait_committed(target, seq)
            if target is not None and locations.is_url(target):
                sd = read_stored(target, io, kw, engine=engine, checkpoint_dir=self.checkpoint_dir,
                                 storage_options=self.storage_options, scratch_dir=self.scratch_dir)
            else:
                # The caller's own path as given (Lightning's messages name it so); another rank's choice as chosen.
                sd = io.load_checkpoint(path if target == own else target, **kw)
            return Opened(sd, seq, str(target if target is not None else path))

        # Each rank loads on its own (replicated state): from its node's memory, else from storage.
        r = resolve_load(engine, op="FlashCheckpointIO.load_checkpoint()", event="lightning_load", logger=log,
                         locate=lambda: Located(seq, "memory" if in_memory else "storage", target), agree=False,
                         from_memory=lambda loc, sd: Opened(map_tensors(sd, map_location), seq, target),
                         from_storage=from_storage)
        self.last_load = (r.source, str(r.path))
        out: dict[str, Any] = r.value
        return out

    def remove_checkpoint(self, path: Any) -> None:
        """Removes ``path`` at once, and again once every persist of it scheduled so far is done.

        When a persist of ``path`` is pending, the file is gone on return (as with vanilla) and the
        persist's file is removed when it lands, at a later call (the next save, removal or
        ``teardown``), so a removed checkpoint never stays. A path saved again after its removal is kept.
        """
        target = local_path(path, "remove_checkpoint")
        local = None if target is None or locations.is_url(target) else target
        if local is not None and os.path.isdir(local) and not os.path.islink(local) and not self._warned_dir:
            self._warned_dir = True
            log.warning("FlashCheckpointIO.remove_checkpoint(%r): a directory, which this plugin never writes: the "
                        "Trainer's strategy saves without CheckpointIO (DeepSpeed, sharded FSDP), so its checkpoints "
                        "are not flash checkpoints; see flashckpt.integrations.lightning.check_strategy", target)
        if target is None or self._engine is None or not path_inside(target, self._engine.checkpoint_dir):
            if local is not None:
                remove_path(local)
            else:  # through fsspec (a store's objects outside this plugin's dir: only with s3fs)
                self._torch_io_cls().remove_checkpoint(path)
            return
        self._reconcile()
        if target in self._pending.values():
            self._doomed.add(target)
            self._removed_seqs.update(s for s, p in self._pending.items() if p == target)
            self.deferred_removals += 1
            self._placeholders.discard(target)
            remove_path(target)  # what is there now (the empty file of a pending save, an older save)
            log.debug("removal of %s waits for its persist", target)
            return
        self._delete(target)

    def teardown(self) -> None:
        """Waits for the scheduled persists, applies the removals that waited for them, and detaches.

        Called by Lightning at the end of ``fit``/``validate``/``test``/``predict``, also when they
        raise: a checkpoint saved on the way out (``ModelCheckpoint(save_on_exception=True)``) is on
        storage before the exception reaches the caller. An error while waiting then does not replace
        the exception: it is logged and added to it as a note. After an exception the saver keeps the
        snapshots in memory for a restart (its grace period); otherwise it exits once every rank detached.

        Raises:
            PersistError: a persist failed (earlier committed checkpoints are intact).
            CheckpointTimeoutError: persists still running after ``teardown_timeout_s``.
        """
        failing = self._failing()
        error, self._late_error = self._late_error, None
        if self._engine is not None:
            try:
                try:
                    self._wait_persists()
                except FlashCheckpointError as e:
                    error = error or e
                if self._doomed:
                    log.warning("FlashCheckpointIO.teardown: %d removal(s) still wait for their persists and are "
                                "skipped: %s", len(self._doomed), sorted(self._doomed))
            finally:
                self._close(release=failing is None)
        if error is None:
            return
        if failing is None:
            raise error
        log.error("FlashCheckpointIO.teardown while %s propagates: %s", type(failing).__name__, error)
        if hasattr(failing, "add_note"):  # Python 3.11+
            failing.add_note(f"FlashCheckpointIO.teardown: {type(error).__name__}: {error}")

    # ------------------------------------------------------------------ more API
    @contextlib.contextmanager
    def memory_only(self) -> Iterator[None]:
        """Inside this block, saves are memory-only snapshots (``FlashMemorySnapshot`` uses it, since
        some strategies refuse ``storage_options``)."""
        self._memory_only += 1
        try:
            yield
        finally:
            self._memory_only -= 1

    def resume_path(self, checkpoint_dir: str | None = None) -> str | None:
        """``find_resume_path`` of ``checkpoint_dir`` (default: the plugin's ``checkpoint_dir``), with the
        plugin's ``storage_options``."""
        d = checkpoint_dir or self.checkpoint_dir
        if not d:
            raise E.InvalidArgumentError("FlashCheckpointIO.resume_path(): pass the checkpoint dir, or construct the plugin "
                             "with FlashCheckpointIO(checkpoint_dir=...)")
        return find_resume_path(d, storage_options=self.storage_options)

    @property
    def engine(self) -> CheckpointEngine | None:
        """The engine of this process (None before the first save or load, and after ``teardown``)."""
        return self._engine

    # ------------------------------------------------------------------ internals
    def _ensure_engine(self, target: str, op: str) -> CheckpointEngine:
        engine = self._engine
        if engine is not None and self._loaded_only and op == "save_checkpoint" and not self.checkpoint_dir \
                and not path_inside(target, engine.checkpoint_dir):
            # Made to load a checkpoint of another directory (a resume from it): saves go elsewhere.
            self._close(release=True)
            engine = None
        if engine is None:
            root = self.checkpoint_dir or locations.parent(target)
            if not path_inside(target, root):
                raise FlashCheckpointError(self._outside(op, target, root))
            engine = CheckpointEngine(root, max_to_keep=0, replicated=True, weights_only=self.weights_only,
                                      storage_options=self.storage_options, local_dir=self.local_dir,
                                      local_max_to_keep=self.local_max_to_keep)
            self._engine = engine
            _open_ios.add(self)
            # A plugin dropped without teardown (a save outside fit) detaches when collected; at exit the
            # engine's own handler closes it, after _wait_at_exit.
            self._finalizer = weakref.finalize(self, engine.close)
            self._finalizer.atexit = False
            try:
                self._names = SnapshotReader(engine, local_rank=0, weights_only=self.weights_only)
                self._scan(engine)
            except BaseException:
                self._close(release=False)  # keeps what memory holds
                raise
        if not path_inside(target, engine.checkpoint_dir):
            raise FlashCheckpointError(self._outside(op, target, engine.checkpoint_dir))
        self._loaded_only = self._loaded_only and op != "save_checkpoint"
        return engine

    @staticmethod
    def _outside(op: str, target: str, root: str) -> str:
        return (f"FlashCheckpointIO.{op}({target!r}): the path is outside {root}, the directory this plugin "
                "checkpoints into (the first checkpoint's directory unless given). Construct "
                "FlashCheckpointIO(checkpoint_dir=...) with a directory that contains every ModelCheckpoint dirpath.")

    def _scan(self, engine: CheckpointEngine) -> None:
        """Learns the committed checkpoints on storage and the next engine step (after every step on
        storage or in memory, so a restarted run never reuses one)."""
        steps = single_file_steps(engine.layout)
        for step, path in sorted(steps.items()):
            self._live.setdefault(path, []).append(step)
        used = list(steps) + engine.layout.uncommitted_steps() + engine.memory_steps() + engine.committed_steps()
        self._seq = max(used, default=-1) + 1
        self._high = max(steps, default=-1)
        if engine.ranks.rank == 0:  # only the saving rank changes records (others only load)
            for path in list(self._live):
                self._supersede(path)
        else:
            self._live = {p: s[-1:] for p, s in self._live.items()}

    def _reconcile(self, *, all_done: bool = False) -> None:
        """Takes note of the persists that finished and applies the removals that waited for them.

        The saver persists and commits one rank's saves in order, so a save is finished (committed or
        failed) once a newer one is committed."""
        engine = self._engine
        if engine is None or not (self._pending or self._doomed):
            return
        committed = engine.committed_steps()
        if committed:
            self._high = max(self._high, committed[-1])
        done = set(committed)
        for seq in sorted(self._pending):
            if all_done or seq <= self._high:
                path = self._pending.pop(seq)
                if seq in done:
                    self._live.setdefault(path, []).append(seq)
                    self._supersede(path)
                    self._placeholders.discard(path)
                elif path in self._placeholders and path not in self._pending.values():
                    self._placeholders.discard(path)
                    with contextlib.suppress(OSError):
                        if os.path.getsize(path) == 0:  # still the empty file: its persist failed
                            os.remove(path)
        waiting = set(self._pending.values())
        for path in sorted(self._doomed - waiting):
            self._doomed.discard(path)
            self._delete(path)

    def _supersede(self, path: str) -> None:
        """Drops the bookkeeping of older saves of ``path`` (its file belongs to the newest one)."""
        steps = sorted(self._live.get(path, []))
        if len(steps) > 1:
            for s in steps[:-1]:
                self._drop_step(s)  # keeps the file: the newest committed step lists it
            self._live[path] = steps[-1:]

    def _drop_step(self, step: int) -> None:
        """Deletes committed ``step``'s bookkeeping and its files that no other committed step lists."""
        if self._engine is None:
            return
        try:
            self._engine.delete_steps([step], newest=True)  # through the saver, like every deletion
        except (OSError, E.FlashCheckpointError) as e:  # bookkeeping only: never fail a save over it
            log.warning("FlashCheckpointIO: could not delete the records of step %d in %s: %s", step,
                        self._engine.layout.meta, e)

    def _delete(self, path: str) -> None:
        """Removes ``path`` and the bookkeeping of its saves (no persist of it may be pending). In a store
        the saver removes it: with the steps that list it, else (not committed by this plugin) by path."""
        steps = sorted(self._live.pop(path, []))
        for s in steps:
            self._drop_step(s)
        if locations.is_url(path) and not steps and self._engine is not None:
            with contextlib.suppress(FileNotFoundError):  # nothing there: as a removal of a missing file
                self._engine.delete_checkpoint(path)
        remove_path(path)
        log.debug("removed checkpoint %s", path)

    def _memory_choice(self, target: str) -> int | None:
        """The engine step of the snapshot in memory to serve ``target`` from, if memory holds its newest save."""
        engine, names = self._engine, self._names
        if engine is None or names is None:
            return None
        self._reconcile()
        newest_on_storage = max(self._live.get(target, []), default=-1)
        on_local = engine.local_file(target)  # a newer save of it committed on the local tier, not yet uploaded
        self._on_local = (target, on_local)  # for _local_copy: the checksums are verified once per load
        if on_local is not None:
            newest_on_storage = max(newest_on_storage, on_local[0])
        for step in engine.memory_steps():
            if names.snapshot_name(step) == target and step >= newest_on_storage:
                return step
        return newest_on_storage if newest_on_storage >= 0 else None

    def _agree(self, target: str | None, seq: int | None) -> tuple[str | None, int | None]:
        """Global rank 0's (path, save) for every rank, so all ranks load the same checkpoint."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return target, seq
        obj: list[Any] = [(target, seq)]
        dist.broadcast_object_list(obj, src=0)
        return obj[0]

    def _local_copy(self, target: str | None, seq: int | None) -> str | None:
        """The local tier's file of save ``seq`` of ``target``, when this node's local tier holds that save
        whole and it is the newest save of ``target`` there (``CheckpointEngine.local_file``); else None."""
        engine, cached = self._engine, self._on_local
        self._on_local = None
        if engine is None or target is None or seq is None or engine.local_dir is None:
            return None
        found = cached[1] if cached is not None and cached[0] == target else engine.local_file(target)
        return found[1] if found is not None and found[0] == seq else None

    def _wait_committed(self, target: str, seq: int) -> None:
        """Waits until save ``seq`` of ``target`` is on storage (another node's saver may be writing it)."""
        engine = self._engine
        if engine is None or seq in self._live.get(target, []):
            return
        deadline = time.monotonic() + self.load_wait_s
        delay = 0.01
        while seq not in engine.committed_steps():
            if time.monotonic() >= deadline:
                raise FlashCheckpointError(
                    f"FlashCheckpointIO.load_checkpoint({target!r}): save {seq} of it is neither in this node's "
                    f"shared memory nor committed on storage after {self.load_wait_s:.0f} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _close(self, *, release: bool) -> None:
        engine, names = self._engine, self._names
        if self._finalizer is not None:
            self._finalizer.detach()
        _open_ios.discard(self)
        self._reset()
        try:
            if names is not None:
                names.close()
        finally:
            if engine is not None:
                engine.close(release=release)


_open_ios: weakref.WeakSet[_FlashIOImpl] = weakref.WeakSet()  # plugins with an engine
_all_ios: weakref.WeakSet[_FlashIOImpl] = weakref.WeakSet()  # every plugin of this process


def plugin_for(url: str) -> _FlashIOImpl | None:
    """The plugin of this process whose checkpoint dir (its engine's, else the one it was given) holds
    ``url``; one with an engine first. For fsspec's ``s3://`` of ``_lightning_fs``."""
    found = None
    for io in list(_all_ios):
        engine = io._engine
        if engine is not None and path_inside(url, engine.checkpoint_dir):
            return io
        if found is None and io.checkpoint_dir and path_inside(url, io.checkpoint_dir):
            found = io
    return found


def pending_saves(url: str) -> list[str]:
    """The paths at or below ``url`` that a plugin of this process saved and still persists (and that were
    not removed since): they exist for ``ModelCheckpoint`` as after ``torch.save``."""
    out = []
    for io in list(_all_ios):
        for path in list(io._pending.values()):
            if path not in io._doomed and path_inside(path, url):
                out.append(path)
    return sorted(set(out))


def pending_save(url: str) -> bool:
    """Whether ``url`` itself is a pending save (see ``pending_saves``)."""
    return url in pending_saves(url)


@atexit.register
def _wait_at_exit() -> None:
    """Saves still persisting when the interpreter exits (``save_checkpoint`` called directly, or by
    ``ddp_spawn``'s worker) are on storage before the process ends, as ``torch.save``'s files would
    be. Registered after the engine's own exit handler, so it runs first; that one then detaches."""
    for io in list(_open_ios):
        if io._engine is None or not (io._pending or io._doomed):
            continue
        try:
            io._wait_persists()
        except Exception as e:  # at exit: report, never raise
            log.error("FlashCheckpointIO at exit: %s", e)
