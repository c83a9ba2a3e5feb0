"""The staging half of ``FlashCkptSaveStrategy``: the storage writer megatron-core's save planning drives,
which lays each rank's shards out as megatron-core's ``FileSystemWriterAsync`` would (``__<rank>_<i>.distcp``
files, ``thread_count`` buckets by size, BYTE_IO items first) and stages them in a ``FileSet`` instead of
writing them.

Imports megatron-core and torch.distributed.checkpoint. One save at a time per stager (one per save).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import uuid
from typing import Any

import torch
from flashckpt import FileSet
from flashckpt import errors as E
from flashckpt.engine.collective import rank
from flashckpt.integrations.dcp import torch_save_frame
from megatron.core.dist_checkpointing.strategies.filesystem_async import (
    _split_by_separation_hint,
    _split_by_size_and_type,
)
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

__all__ = ["DistcpStager", "saveable"]


log = logging.getLogger(__name__)


class DistcpStager:
    """The storage writer megatron-core's planning (``save_state_dict_async_plan``) drives: instead of
    writing, it lays each rank's items out as ``FileSystemWriterAsync`` would (``thread_count`` buckets by
    size, BYTE_IO items first in each, files ``__<rank>_<i>.distcp``) and stages them in a ``FileSet``.
    Errors while staging are kept and reported to every rank by the finalize step."""

    can_run_decentralized_global_plan = True

    def __init__(self, checkpoint_dir: str, thread_count: int, separation_hint: str | None) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.thread_count = thread_count
        self.separation_hint = separation_hint
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = False
        self.fileset = FileSet()
        self.results: list[WriteResult] = []
        self.error: str | None = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(plans)]

    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        return dataclasses.replace(local_plan, storage_data=_StoragePrefix(f"__{rank()}_"))

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        try:
            self._stage(plan, planner)
        except Exception as e:  # reported on every rank by _finalize
            log.exception("staging the rank's shards failed")
            self.error = f"{type(e).__name__}: {e}"

    def _stage(self, plan: SavePlan, planner: SavePlanner) -> None:
        prefix = plan.storage_data.prefix
        bins = self.thread_count // 2 if self.separation_hint is not None else self.thread_count
        if bins < 1:
            raise E.InvalidArgumentError(f"thread_count={self.thread_count}: at least 1 (2 with a separation_hint)")
        buckets = _split_by_size_and_type(bins, plan.items)
        count = 0
        for group, group_buckets in _split_by_separation_hint(buckets, self.separation_hint).items():
            for bucket in group_buckets:
                if not bucket:
                    continue
                name = f"{group}{prefix}{count}{DEFAULT_SUFFIX}"
                count += 1
                self.fileset.add_raw(name, self._file(name, bucket, planner))

    def _file(self, name: str, bucket: list[Any], planner: SavePlanner) -> list[Any]:
        parts: list[Any] = []
        pending = bytearray()
        offset = 0

        def add(index: Any, length: int) -> None:
            nonlocal offset
            self.results.append(WriteResult(index=index, size_in_bytes=length,
                                            storage_data=_StorageInfo(name, offset, length)))
            offset += length

        for item in bucket:
            if item.type == WriteItemType.BYTE_IO:
                data: Any = planner.resolve_data(item)
                buf = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
                pending += buf
                add(item.index, len(buf))
        for item in bucket:
            if item.type == WriteItemType.BYTE_IO:
                continue
            resolved: Any = planner.resolve_data(item)
            t = saveable(resolved)
            head, tail = torch_save_frame(t.dtype, tuple(t.shape))
            pending += head
            parts.append(bytes(pending))
            parts.append(t)
            pending = bytearray(tail)
            add(item.index, len(head) + t.numel() * t.element_size() + len(tail))
        if pending:
            parts.append(bytes(pending))
        return parts

    def metadata_bytes(self, metadata: Metadata, results: list[list[WriteResult]]) -> bytes:
        """``.metadata`` as ``FileSystemWriter.finish`` writes it."""
        import pickle

        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rl in results for wr in rl}
        metadata.storage_meta = StorageMeta(checkpoint_id=str(self.checkpoint_dir), save_id=self.save_id)
        return pickle.dumps(metadata)


def saveable(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose ``torch.save`` the data file holds: detached, and a contiguous copy of views (as
    megatron-core clones them), so the record's data is exactly the tensor's bytes in C order."""
    t = t.detach()
    if not (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()):
        t = t.clone(memory_format=torch.contiguous_format)
    return t
