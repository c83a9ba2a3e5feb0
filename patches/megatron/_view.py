"""Megatron-core's loading functions pointed at a checkpoint that lives in memory or in a store: ``View``
swaps megatron-core's strategy lookup and DCP reader factory for one directory, with ``common.pt`` and
``metadata.json`` held in memory (``from_rank0``: rank 0's copies for every rank).

Imports megatron-core and torch.distributed.checkpoint. ``View`` swaps module functions while entered:
one training thread; ``from_rank0`` is collective.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from flashckpt import FileSet
from flashckpt.engine.collective import rank
from flashckpt.engine.routing import swapped
from flashckpt.storage import locations
from megatron.core.dist_checkpointing import serialization as _ser
from megatron.core.dist_checkpointing.core import CheckpointingConfig
from megatron.core.dist_checkpointing.strategies import torch as _mtorch
from megatron.core.dist_checkpointing.strategies.base import (
    LoadCommonStrategy,
    StrategyAction,
    get_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
from torch.distributed.checkpoint.filesystem import (
    FileSystemReader,
)

__all__ = ["View", "HeldCommonLoadStrategy", "from_rank0", "raw_entry"]


def raw_entry(fs: Any, name: str) -> bytes | None:
    return fs.raw_bytes(name) if isinstance(fs, FileSet) and name in fs and fs[name].format == "raw" else None


def from_rank0(common: bytes | None, config: bytes | None) -> tuple[bytes, CheckpointingConfig] | None:
    """Rank 0's ``common.pt`` and ``metadata.json`` for every rank (one broadcast), or None."""
    obj: list[Any] = [(common, config) if rank() == 0 else None]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(obj, src=0)
    common, config = obj[0]
    if common is None or config is None:
        return None
    return common, CheckpointingConfig(**json.loads(config))


class HeldCommonLoadStrategy(TorchCommonLoadStrategy):
    """megatron-core's common load strategy over ``common.pt`` held in memory (from a snapshot, or read
    from a store)."""

    def __init__(self, common: bytes, weights_only: bool) -> None:
        super().__init__()
        self.common = common
        self.weights_only = weights_only

    def load_common(self, checkpoint_dir: str | Path) -> Any:
        return torch.load(io.BytesIO(self.common), map_location="cpu", weights_only=self.weights_only)

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> Any:
        # The legacy per-object files (``<key>/shard_*.pt``) this scans a local directory for do not exist in
        # a torch_dist checkpoint of ours: its sharded objects live in the DCP files (the sharded strategy's).
        return {}


class View:
    """While entered, megatron-core reads the checkpoint at ``path`` from memory (a ``FileSetStorageReader``)
    or from a store (a ``BackendStorageReader``): its strategy lookup (``verify_checkpoint_and_load_strategy``)
    and its DCP reader factory (``_get_filesystem_reader``) answer for that one directory, with
    ``common.pt`` and ``metadata.json`` held here. Other directories are read as usual. Not thread-safe:
    megatron-core's module functions are swapped while inside (one training thread)."""

    def __init__(self, path: str, step: int | None, reader: FileSystemReader, common: bytes,
                 config: CheckpointingConfig, weights_only: bool) -> None:
        self.path = locations.normpath(path)
        self.step = step
        self.reader = reader
        self.config = config
        self.common_strategy = HeldCommonLoadStrategy(common, weights_only)
        self._swaps: Any = None

    def _mine(self, checkpoint_dir: Any) -> bool:
        if checkpoint_dir is None:
            return False
        # megatron-core passes the directory as given, or as a pathlib.Path (which folds a URL's "//")
        return locations.normpath(str(checkpoint_dir)) == self.path or str(checkpoint_dir) == str(Path(self.path))

    def __enter__(self) -> View:
        orig_verify = _ser.verify_checkpoint_and_load_strategy
        orig_reader = _mtorch._get_filesystem_reader

        def verify(checkpoint_dir: Any, sharded_strategy: Any = None, common_strategy: Any = None) -> Any:
            if not self._mine(checkpoint_dir):
                return orig_verify(checkpoint_dir, sharded_strategy, common_strategy)
            if sharded_strategy is None:
                sharded_strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, self.config.sharded_backend,
                                                        self.config.sharded_backend_version)
            elif isinstance(sharded_strategy, tuple):
                sharded_strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, *sharded_strategy)
            if not isinstance(common_strategy, LoadCommonStrategy):
                common_strategy = self.common_strategy
            return sharded_strategy, common_strategy

        def reader(checkpoint_dir: Any, cache_metadata: bool = False) -> Any:
            return self.reader if self._mine(checkpoint_dir) else orig_reader(checkpoint_dir, cache_metadata)

        swaps = swapped([(_ser, "verify_checkpoint_and_load_strategy", verify),
                         (_mtorch, "_get_filesystem_reader", reader)])
        swaps.__enter__()
        self._swaps = swaps
        return self

    def __exit__(self, *exc: Any) -> None:
        swaps, self._swaps = self._swaps, None
        if swaps is not None:
            swaps.__exit__(None, None, None)
