"""Drop-in ``save_checkpoint`` / ``load_checkpoint`` for Megatron-LM's training loop.

Both call Megatron-LM's own functions (``megatron.training.checkpointing``, or ``megatron.checkpointing``
in older checkouts), so everything Megatron-LM puts into a checkpoint and restores from it stays its
business. Only the I/O is routed through flashckpt, while the call runs:

- save: the files Megatron-LM writes into ``<save>/iter_XXXXXXX/`` (``torch.save`` of the legacy
  ``mp_rank_XX/model_optim_rng.pt`` and ``distrib_optim.pt``; ``dist_checkpointing.save`` of the
  ``torch_dist`` format) and its tracker ``latest_checkpointed_iteration.txt`` are staged in shared
  memory instead of written; the node's saver persists them (DISK) and writes the tracker only once every
  rank's files are durable (the commit). Megatron-LM's ``async_save`` is turned off for the call: the save
  already returns as soon as the state is in memory.
- load: when memory holds an iteration at least as new as storage's, Megatron-LM's
  ``_load_base_checkpoint`` is answered from memory (each rank's own files in place; files only another
  rank holds, like replicas and ``common.pt``, exchanged once); otherwise Megatron-LM loads from storage
  as usual. With ``--save``/``--load`` a URL a storage backend serves (``s3://bucket/prefix``),
  ``_load_base_checkpoint`` is answered from the store instead: the newest committed iteration that
  verifies on every rank, read through the backend without a download (``torch_dist`` through
  ``MegatronCheckpointer.store_view``; legacy files with ``torch.load`` of the stored object), so
  Megatron-LM itself never opens a URL.

The swaps are module attributes of Megatron-LM (and ``megatron.core.optimizer.distrib_optimizer``) set
for the duration of the call and restored after it; one training thread.

One concept, so one module (~540 lines): Megatron-LM's save/load entry points with their swaps; the
megatron-core side is ``dist_ckpt`` (with ``_view`` and ``_stager``).
"""

from __future__ import annotations

import importlib
import inspect
import io
import logging
import os
import posixpath
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from flashckpt import FileSet, StorageType
from flashckpt.commit.retention import CheckpointDeletionStrategy
from flashckpt.engine.adapter import LOCAL, LoadAttempt, Opened
from flashckpt.engine.collective import exchange_files, rank, world
from flashckpt.engine.engine import Located
from flashckpt.engine.routing import rel_inside, swapped
from flashckpt.errors import FlashCheckpointError
from flashckpt.format.torchfile import load_parts, torch_save_parts
from flashckpt.patches.megatron.dist_ckpt import TRACKER_NAME, MegatronCheckpointer, iteration_dir
from flashckpt.storage import locations, registry

__all__ = ["save_checkpoint", "load_checkpoint", "configure", "get_checkpointer", "finalize", "megatron_lm"]

log = logging.getLogger(__name__)

_MODULES = ("megatron.training.checkpointing", "megatron.checkpointing")
_CHECKPOINTERS: dict[str, MegatronCheckpointer] = {}
_OPTIONS: dict[str, Any] = {"max_to_keep": 0, "deletion_strategy": None, "weights_only": True, "local_dir": None,
                             "local_max_to_keep": 2}


def megatron_lm() -> ModuleType:
    """Megatron-LM's checkpointing module.

    Raises:
        ImportError: Megatron-LM is not importable (it is not on PyPI: run from a checkout, or put it on
            ``PYTHONPATH``); megatron-core alone is served by ``flashckpt.patches.megatron.dist_ckpt``.
    """
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name not in (name, name.rsplit(".", 1)[0], "megatron"):
                raise
    raise ImportError("flashckpt.patches.megatron.save_checkpoint/load_checkpoint wrap Megatron-LM's checkpointing module "
                      f"({' or '.join(_MODULES)}), which is not importable. Megatron-LM is not on PyPI: run from a "
                      "Megatron-LM checkout (or add it to PYTHONPATH). With megatron-core alone, use "
                      "flashckpt.patches.megatron.dist_ckpt (save/load/FlashCkptSaveStrategy).")


def configure(*, max_to_keep: int = 0, deletion_strategy: CheckpointDeletionStrategy | None = None,
              weights_only: bool = True, local_dir: str | os.PathLike[str] | None = None,
              local_max_to_keep: int = 2) -> None:
    """Options of the checkpointers ``save_checkpoint``/``load_checkpoint`` create (call before the first).

    Args:
        max_to_keep: committed iterations to keep (0 keeps all, as Megatron-LM does).
        deletion_strategy: which committed iterations to delete after each commit.
        weights_only: ``torch.load(weights_only=...)`` for legacy files served from memory.
        local_dir: a node-local directory as the fast tier of ``--save`` (see ``MegatronCheckpointer``):
            iterations commit there first and are uploaded in the background; a load reads Megatron-LM's
            files there (``args.load`` pointed at it for the call, with ``args.ckpt_step``) when this node
            holds every rank's files of the newest iteration. None: FLASHCKPT_LOCAL_DIR.
        local_max_to_keep: iterations the local tier keeps (0 keeps all).
    """
    if _CHECKPOINTERS:
        raise FlashCheckpointError("flashckpt.patches.megatron.configure(): call it before the first save_checkpoint/"
                                   "load_checkpoint (checkpointers already exist)")
    _OPTIONS.update(max_to_keep=max_to_keep, deletion_strategy=deletion_strategy, weights_only=weights_only,
                    local_dir=local_dir, local_max_to_keep=local_max_to_keep)


def get_checkpointer(checkpoint_dir: str) -> MegatronCheckpointer:
    """The checkpointer of ``checkpoint_dir`` (Megatron-LM's ``--save`` / ``--load``: a local directory, a
    ``file://`` URL, or the URL of a storage backend such as ``s3://bucket/prefix``), created on first use.

    Raises:
        CheckpointDirError: a URL no storage backend serves, or a directory that cannot be used."""
    # file:// mapped to its path; a URL of a scheme no backend serves refused (before anything is made)
    key = locations.normpath(registry.checkpoint_location(checkpoint_dir, "get_checkpointer"))
    ck = _CHECKPOINTERS.get(key)
    if ck is None:
        ck = MegatronCheckpointer(key, **_OPTIONS)
        _CHECKPOINTERS[key] = ck
    return ck


def finalize(*, release: bool = True, timeout: float | None = None) -> None:
    """Waits for the scheduled persists (raising the first error) and closes every checkpointer. Call it
    at the end of training; ``release=False`` keeps the snapshots for a restart that follows at once."""
    try:
        for ck in _CHECKPOINTERS.values():
            ck.wait(timeout)
    finally:
        while _CHECKPOINTERS:
            _, ck = _CHECKPOINTERS.popitem()
            ck.close(release)


# ------------------------------------------------------------------------------------------ swapping
class _Proxy:
    """A module with some attributes replaced."""

    def __init__(self, module: Any, **overrides: Any) -> None:
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _distrib_optimizer() -> ModuleType | None:
    try:
        return importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    except ImportError:
        return None


# ------------------------------------------------------------------------------------------ save
class _TrackerFile(io.StringIO):
    """What Megatron-LM writes to its tracker; staged as a commit-time tracker entry on close."""

    def __init__(self, fileset: FileSet) -> None:
        super().__init__()
        self._fileset = fileset

    def close(self) -> None:
        if not self.closed:
            self._fileset.add_raw(TRACKER_NAME, self.getvalue().encode(), kind="tracker")
        super().close()


def _save_swaps(mlm: ModuleType, ck: MegatronCheckpointer, col: Any) -> list[tuple[Any, str, Any]]:
    from flashckpt.patches.megatron import dist_ckpt

    base = col.path
    tracker = locations.join(ck.checkpoint_dir, TRACKER_NAME)

    def routed(path: Any) -> str | None:
        return rel_inside(path, base)

    def torch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        rel = routed(f)
        if rel is None:
            torch.save(obj, f, *args, **kwargs)
        else:
            col.fileset.add_raw(rel, torch_save_parts(obj))

    real_dist_checkpointing = mlm.dist_checkpointing

    def dist_save(sharded_state_dict: Any, checkpoint_dir: Any, sharded_strategy: Any = None,
                  common_strategy: Any = None, *args: Any, **kwargs: Any) -> Any:
        if locations.normpath(os.fspath(checkpoint_dir)) != base:
            return real_dist_checkpointing.save(sharded_state_dict, checkpoint_dir, sharded_strategy,
                                               common_strategy, *args, **kwargs)
        known = inspect.signature(dist_ckpt.save).parameters
        unused = sorted(k for k in kwargs if k not in known)
        if unused:  # newer megatron-cores add options (async_strategy, ...) that a memory snapshot has no use for
            log.info("dist_checkpointing.save(%s=...): not used by flashckpt", ", ".join(unused))
        return dist_ckpt.save(sharded_state_dict, base, sharded_strategy, common_strategy, *args,
                              checkpointer=ck, step=col.step, storage_type=col.storage_type,
                              **{k: v for k, v in kwargs.items() if k in known})

    orig_ensure = getattr(mlm, "ensure_directory_exists", None)

    def ensure_directory_exists(filename: Any, check_parent: bool = True) -> None:
        if routed(locations.join(os.fspath(filename), "x")) is None and orig_ensure is not None:
            orig_ensure(filename, check_parent)

    def opener(orig: Callable[..., Any]) -> Callable[..., Any]:
        def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if isinstance(file, (str, os.PathLike)) and locations.normpath(os.fspath(file)) == tracker and "w" in mode:
                return _TrackerFile(col.fileset)
            return orig(file, mode, *args, **kwargs)
        return open_

    torch_proxy = _Proxy(torch, save=torch_save)
    swaps: list[tuple[Any, str, Any]] = [
        (mlm, "torch", torch_proxy),
        (mlm, "dist_checkpointing", _Proxy(real_dist_checkpointing, save=dist_save)),
        (mlm, "open", opener(open)),
    ]
    if orig_ensure is not None:
        swaps.append((mlm, "ensure_directory_exists", ensure_directory_exists))
    if hasattr(mlm, "open_file"):  # Megatron-LM up to core 0.18
        swaps.append((mlm, "open_file", opener(mlm.open_file)))
    msc = getattr(mlm, "maybe_msc", None)
    if msc is not None and hasattr(msc, "open"):  # core 0.19 and later: maybe_msc.open(tracker, "w")
        swaps.append((mlm, "maybe_msc", _Proxy(msc, open=opener(msc.open))))
    dopt = _distrib_optimizer()
    if dopt is not None:
        swaps.append((dopt, "torch", torch_proxy))
    return swaps


def _call(fn: Callable[..., Any], values: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    """Calls ``fn`` with those of ``values`` its signature has (older Megatron-LMs take fewer)."""
    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in values.items() if k in params}, **kwargs)


def save_checkpoint(iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any,
                    num_floating_point_operations_so_far: int = 0, checkpointing_context: dict[str, Any] | None = None,
                    *, storage_type: StorageType = StorageType.DISK, **kwargs: Any) -> None:
    """Megatron-LM's ``save_checkpoint`` with ``storage_type``: MEMORY takes a snapshot in shared memory
    only; DISK also persists it, in Megatron-LM's layout, in the background.

    Same arguments and return value (None) as Megatron-LM's; call it on every rank where Megatron-LM's is
    called. Returns once the state is in shared memory. ``latest_checkpointed_iteration.txt`` is written
    when the iteration is committed (every rank's files durable), never before. ``non_persistent_ckpt``
    saves are passed to Megatron-LM unchanged.

    Raises:
        ImportError: Megatron-LM is not importable.
        FlashCheckpointError: the state could not be staged (nothing was saved) or an earlier persist
            failed (``PersistError``; the snapshot was taken).
    """
    mlm = megatron_lm()
    values = {"iteration": iteration, "model": model, "optimizer": optimizer, "opt_param_scheduler": opt_param_scheduler,
              "num_floating_point_operations_so_far": num_floating_point_operations_so_far,
              "checkpointing_context": checkpointing_context}
    if kwargs.get("non_persistent_ckpt"):
        _call(mlm.save_checkpoint, values, kwargs)
        return
    args = mlm.get_args()
    ck = get_checkpointer(args.save)
    path = (locations.join(ck.checkpoint_dir, "release") if kwargs.get("release")
            else iteration_dir(ck.checkpoint_dir, iteration))
    async_save = getattr(args, "async_save", False)
    with ck.collecting(iteration, path, storage_type) as col, swapped(_save_swaps(mlm, ck, col)):
        args.async_save = False
        try:
            _call(mlm.save_checkpoint, values, kwargs)
        finally:
            args.async_save = async_save


# ------------------------------------------------------------------------------------------ load
def _read_tracker(ck: MegatronCheckpointer) -> int | None:
    """The iteration Megatron-LM's tracker names in the checkpointer's dir (read through its backend)."""
    try:
        text = ck.engine.storage.read_bytes(locations.join(ck.checkpoint_dir, TRACKER_NAME)).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else 0 if text == "release" else None


def _rel(path: str, base: str) -> str:
    """``path``'s name in the iteration directory ``base`` (a local path or a URL; ``/``-separated). A path
    outside it gets a ``..`` name, which no file of the iteration has (the caller reports it)."""
    rel = locations.relpath(path, base)
    return (rel if rel is not None else os.path.relpath(path, base)).replace(os.sep, "/")


def _fetch_files(held: dict[str, list[Any]], wanted: list[str]) -> dict[str, list[Any]]:
    """The files ``wanted``, from this rank's snapshot or from a rank that holds them (collective; see
    ``exchange_files``, whose errors are raised on every rank)."""
    got = exchange_files(held, sorted(held), [n for n in wanted if n not in held], what="load_checkpoint()")
    return {n: held[n] for n in wanted if n in held} | got


class _ServedLoad:
    """Serves one Megatron-LM ``load_checkpoint`` call from the snapshot of ``step`` in memory
    (``source="memory"``) or from the committed ``step`` in a store (``source="storage"``), so Megatron-LM
    never opens the files itself: ``torch_dist`` through a view (``memory_view`` / ``store_view``), legacy
    files by name (``files``: a snapshot's parts, or stored locations)."""

    def __init__(self, mlm: ModuleType, ck: MegatronCheckpointer, step: int, path: str, source: str) -> None:
        self.mlm = mlm
        self.ck = ck
        self.step = step
        self.path = path
        self.source = source
        self.files: dict[str, Any] = {}  # name in the iteration dir -> parts (memory) or location (storage)
        self.view: Any = None

    def prepare(self, args: Any, fs: Any) -> str:
        """Collective: fetches what this rank will read from memory, given its snapshot ``fs``. "" or why
        memory cannot serve (on every rank)."""
        held = {n: (e.data if isinstance(e.data, list) else [e.data]) for n, e in fs.items()
                if e.format == "raw" and e.kind == "file"} if isinstance(fs, FileSet) else {}
        flag: list[Any] = ["metadata.json" in held] if rank() == 0 else [None]
        if world() > 1:
            dist.broadcast_object_list(flag, src=0)
        if flag[0]:  # torch_dist
            view = self.ck.view_of(Located(self.step, "memory", self.path), fs)
            if isinstance(view, str):
                return view
            self.view = view
            return ""
        mlm = self.mlm
        own = _rel(mlm.get_checkpoint_name(self.ck.checkpoint_dir, self.step, False), self.path)
        wanted = [own]
        if getattr(args, "use_distributed_optimizer", False):
            wanted.append(posixpath.join(posixpath.dirname(own), "distrib_optim.pt"))
        if getattr(args, "auto_detect_ckpt_format", False) or getattr(args, "ckpt_format", "torch") == "torch_dist":
            wanted.append(self._rank0_name(held))
        wanted = [n for n in dict.fromkeys(wanted) if n]
        try:
            self.files = _fetch_files(held, wanted)
        except FlashCheckpointError as e:
            return str(e)
        return ""

    def prepare_store(self) -> None:
        """The committed iteration's files (every rank's, by name in the iteration dir), from its manifest;
        a ``torch_dist`` iteration is read through ``store_view``. Not collective."""
        layout = self.ck.engine.layout
        for f in layout.read_manifest(self.step).all_files():
            where = layout.abs(f.path)
            rel = locations.relpath(where, self.path)
            if rel is not None and rel != ".":
                self.files[rel.replace(os.sep, "/")] = where
        if "metadata.json" in self.files:
            self.view = self.ck.store_view(self.path, self.step)

    def _load_file(self, name: str, weights_only: bool) -> Any:
        """The ``torch.load`` of the iteration's file ``name``: from the snapshot's parts, or read through
        the backend."""
        if self.source == "memory":
            return load_parts(self.files[name], weights_only=weights_only)
        storage = self.ck.engine.storage
        local = storage.local_path(self.files[name])
        if local is not None:
            return torch.load(local, map_location="cpu", weights_only=weights_only)
        with storage.open_read(self.files[name]) as f:
            return torch.load(f, map_location="cpu", weights_only=weights_only)

    def _rank0_name(self, held: dict[str, list[Any]]) -> str:
        names: list[Any] = [sorted(n for n in held if _is_rank0_model(n)) if rank() == 0 else None]
        if world() > 1:
            dist.broadcast_object_list(names, src=0)
        return names[0][0] if names[0] else ""

    def _result(self, state_dict: Any, name: str, kind: str) -> Any:
        ckpt_type = getattr(self.mlm, "CheckpointType", None)
        return (state_dict, name, False) if ckpt_type is None else (state_dict, name, False, getattr(ckpt_type, kind))

    def load_base(self, orig: Callable[..., Any], load_dir: str, *a: Any, **kw: Any) -> Any:
        if locations.normpath(load_dir) != self.ck.checkpoint_dir:
            return orig(load_dir, *a, **kw)
        bound = inspect.signature(orig).bind(load_dir, *a, **kw)
        rank0 = bound.arguments.get("rank0", False)
        sharded_state_dict = bound.arguments.get("sharded_state_dict")
        context = bound.arguments.get("checkpointing_context")
        mlm = self.mlm
        args = mlm.get_args()
        if hasattr(mlm, "set_loaded_iteration"):
            mlm.set_loaded_iteration(self.step)
        if self.view is not None:
            from megatron.core import dist_checkpointing
            from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

            with self.view:
                if rank0:
                    return self._result(dist_checkpointing.load_common_state_dict(self.path), self.path, "GLOBAL")
                strategy = get_default_load_sharded_strategy(self.path)
                if getattr(args, "ckpt_fully_parallel_load", False):
                    from megatron.core import mpu
                    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
                        FullyParallelLoadStrategyWrapper,
                    )

                    strategy = FullyParallelLoadStrategyWrapper(
                        strategy, mpu.get_data_parallel_group(with_context_parallel=True))
                if context is not None:
                    context["load_strategy"] = strategy
                sd = dist_checkpointing.load(sharded_state_dict, self.path, strategy,
                                             strict=getattr(args, "dist_ckpt_strictness", "assume_ok_unexpected"))
                return self._result(sd, self.path, "GLOBAL")
        if rank0:
            name = min((n for n in self.files if _is_rank0_model(n)), default="")
        else:
            name = _rel(mlm.get_checkpoint_name(self.ck.checkpoint_dir, self.step, False), self.path)
        if name not in self.files:
            raise FlashCheckpointError(f"load_checkpoint(): {name} of iteration {self.step} is not in {self.source} "
                                       f"(it holds {sorted(self.files)[:8]})")
        sd = self._load_file(name, self.ck.weights_only)
        return self._result(sd, locations.join(self.path, name), "LEGACY")

    def swaps(self) -> list[tuple[Any, str, Any]]:
        mlm = self.mlm
        orig = mlm._load_base_checkpoint
        tracker = locations.join(self.ck.checkpoint_dir, TRACKER_NAME)
        orig_read = mlm.read_metadata
        step = self.step

        def load_base(load_dir: str, *a: Any, **kw: Any) -> Any:
            return self.load_base(orig, load_dir, *a, **kw)

        def read_metadata(tracker_filename: str) -> Any:
            if locations.normpath(tracker_filename) == tracker:
                return step, False
            return orig_read(tracker_filename)

        def torch_load(f: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(f, (str, os.PathLike)):
                rel = rel_inside(f, self.path)
                if rel in self.files:
                    return self._load_file(rel, kwargs.get("weights_only", self.ck.weights_only))
            return torch.load(f, *args, **kwargs)

        swaps: list[tuple[Any, str, Any]] = [(mlm, "_load_base_checkpoint", load_base),
                                             (mlm, "read_metadata", read_metadata)]
        dopt = _distrib_optimizer()
        if dopt is not None:
            swaps.append((dopt, "torch", _Proxy(torch, load=torch_load)))
        return swaps


def _is_rank0_model(name: str) -> bool:
    """Whether ``name`` is a legacy model file of tensor/pipeline rank 0 (``mp_rank_00*/model_optim_rng.pt``)."""
    return name.startswith("mp_rank_00") and name.endswith("model_optim_rng.pt")


def load_checkpoint(model: Any, optimizer: Any, opt_param_scheduler: Any, load_arg: str = "load", strict: bool = True,
                    **kwargs: Any) -> Any:
    """Megatron-LM's ``load_checkpoint``, served from memory when memory holds the newest iteration.

    Same arguments and return value as Megatron-LM's (the iteration, and in recent versions also
    ``num_floating_point_operations_so_far``). Collective: call it on every rank. Memory wins when every
    rank holds an iteration at least as new as the tracker's; otherwise Megatron-LM reads storage (when
    the tracker's iteration is a committed one that fails its checksums, the newest intact committed
    iteration is loaded instead, through ``args.ckpt_step``). With a checkpoint dir in a store
    (``s3://...``) the newest committed iteration that verifies on every rank is served from the store.
    """
    mlm = megatron_lm()
    args = mlm.get_args()
    load_dir = getattr(args, load_arg, None)
    values = {"model": model, "ddp_model": model, "optimizer": optimizer, "opt_param_scheduler": opt_param_scheduler,
              "load_arg": load_arg, "strict": strict}
    if not load_dir or getattr(args, "ckpt_step", None):
        return _call(mlm.load_checkpoint, values, kwargs)
    ck = get_checkpointer(load_dir)
    tracked = _read_tracker(ck)

    def refuse(loc: Located) -> str:
        if loc.path is None:
            return "its directory is not known"
        newer = tracked is not None and loc.step is not None and loc.step < tracked
        return f"the tracker names the newer iteration {tracked}" if newer else ""

    def from_memory(loc: Located, fs: Any) -> Opened | str:
        assert loc.step is not None and loc.path is not None  # refuse() passed it
        served = _ServedLoad(mlm, ck, loc.step, loc.path, "memory")
        why = served.prepare(args, fs)
        if why:
            return why
        with swapped(served.swaps()):
            return Opened(_call(mlm.load_checkpoint, values, kwargs), loc.step, loc.path)

    def from_storage(attempt: LoadAttempt) -> Opened:
        local = _load_local(mlm, ck, attempt, args, load_arg, values, kwargs)
        if local is not None:
            return local
        if locations.is_url(ck.checkpoint_dir):
            return _load_from_store(mlm, ck, attempt, args, values, kwargs)
        loc = attempt.located
        step = loc.step if loc.source == "storage" else None
        if (step is not None and tracked is not None and tracked != step and tracked in ck.engine.committed_steps()
                and hasattr(args, "ckpt_step")):
            log.warning("load_checkpoint(): iteration %d (the tracker's) is damaged; loading iteration %d", tracked, step)
            args.ckpt_step = step
            try:
                return Opened(_call(mlm.load_checkpoint, values, kwargs), step)
            finally:
                args.ckpt_step = None
        return Opened(_call(mlm.load_checkpoint, values, kwargs), step,
                      source="none" if loc.source == "none" else "storage")

    r = ck.resolve_load(op="load_checkpoint()", event="megatron_lm_load", logger=log, refuse=refuse,
                        from_memory=from_memory, from_storage=from_storage)
    ck.last_load = r.result()
    return r.value


def _load_local(mlm: ModuleType, ck: MegatronCheckpointer, attempt: LoadAttempt, args: Any, load_arg: str,
                values: dict[str, Any], kwargs: dict[str, Any]) -> Opened | None:
    """Megatron-LM's own load of the newest committed iteration from this node's local tier, when it holds
    every rank's files of it (``locate(local=True)``): ``args.<load_arg>`` names the local dir (which has
    the checkpoint dir's layout: ``iter_XXXXXXX`` and the tracker) and ``args.ckpt_step`` the iteration for
    the call. None when the local tier does not serve it (or Megatron-LM has no ``ckpt_step``)."""
    if ck.engine.local_dir is None or not hasattr(args, "ckpt_step"):
        return None
    loc = attempt.stored()
    root = ck.engine.local_path(ck.checkpoint_dir)
    if loc.source != LOCAL or loc.step is None or root is None:
        return None
    given = getattr(args, load_arg), args.ckpt_step
    setattr(args, load_arg, root)
    args.ckpt_step = loc.step
    try:
        return Opened(_call(mlm.load_checkpoint, values, kwargs), loc.step, loc.path, source=LOCAL)
    finally:
        setattr(args, load_arg, given[0])
        args.ckpt_step = given[1]


def _load_from_store(mlm: ModuleType, ck: MegatronCheckpointer, attempt: LoadAttempt, args: Any,
                     values: dict[str, Any], kwargs: dict[str, Any]) -> Opened:
    """Megatron-LM cannot open a URL: the newest committed step that verifies on every rank is served from
    the store; with nothing committed Megatron-LM finds no tracker (nothing loaded)."""
    loc = attempt.stored()
    if loc.source == "storage" and loc.step is not None and loc.path is not None:
        served = _ServedLoad(mlm, ck, loc.step, loc.path, "storage")
        served.prepare_store()
        with swapped(served.swaps()):
            return Opened(_call(mlm.load_checkpoint, values, kwargs), loc.step, loc.path)
    return Opened(_call(mlm.load_checkpoint, values, kwargs), None, source="none")
