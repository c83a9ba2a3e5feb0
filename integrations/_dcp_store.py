"""A DCP ``StorageReader`` that reads a persisted DCP checkpoint through a flashckpt storage backend, so a
checkpoint in an object store (``s3://...``) loads with ``torch.distributed.checkpoint.load`` without a
download to local files.

``FileSystemReader`` opens each data file and seeks to every record, which over a store would be one
request per small read. ``BackendStorageReader`` reads what the rank's plan needs instead: per data file,
the records it asks for, sorted by offset and merged into a few large byte ranges (``read_into``: ranged
GETs, several at once, straight into one buffer), then parses each record from memory exactly as
``FileSystemReader.read_data`` does (stream transforms, ``torch.load`` of tensor records, narrowing to the
requested chunk). ``.metadata`` is read once per reader and kept.

Used by ``FsdpShardCheckpointer`` and by megatron-core's ``torch_dist`` loads (``patches.megatron``) when
the checkpoint dir is a URL; on a local dir they keep DCP's own ``FileSystemReader``.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from collections.abc import Iterator
from typing import Any, cast

import torch
from flashckpt.errors import CheckpointCorruptError
from flashckpt.storage import locations
from flashckpt.storage.base import CheckpointStorage
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemReader, _generate_uuid, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

__all__ = ["BackendStorageReader"]

log = logging.getLogger(__name__)

METADATA_NAME = ".metadata"
#: records closer than this in a data file are read with one request (the bytes between come along)
MERGE_GAP = 4 << 20
#: at most this many bytes in one merged range (bounds the buffer a load holds at once)
MAX_RANGE = 256 << 20


def fill_target(planner: LoadPlanner, req: ReadItem, tensor: torch.Tensor, reader: str) -> None:
    """Copies the stored chunk ``tensor`` (narrowed to ``req``) into the planner's target for ``req``; a chunk
    that does not fit the target is a damaged checkpoint."""
    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise CheckpointCorruptError(f"{reader}: {req.storage_index.fqn}: stored chunk {tuple(tensor.size())} "
                                     f"does not fit the target {tuple(target.size())}")
    target.copy_(tensor)
    planner.commit_tensor(req, target)


class BackendStorageReader(FileSystemReader):
    """A DCP ``StorageReader`` over the checkpoint directory ``path`` (a location of ``storage``: a URL of an
    object store, or a local path), read through ``storage``.

    Call order (DCP's): ``reset``, ``read_metadata``, ``set_up_storage_reader``, ``prepare_local_plan``,
    ``prepare_global_plan`` (coordinator), ``read_data`` (every rank, its own plan). Reusable for several
    ``dcp.load`` calls (the metadata is read once). ``storage`` must stay usable while loads run; the reader
    never closes it.

    Args:
        storage: the backend that serves ``path`` (``CheckpointEngine.storage``).
        path: the DCP checkpoint directory (the one holding ``.metadata``).
    """

    def __init__(self, storage: CheckpointStorage, path: str) -> None:
        super().__init__(path)  # DCP's own file system is never used: every read goes through ``storage``
        self.storage = storage
        self.path = storage.normpath(path)
        self._metadata: Metadata | None = None
        self.source = "storage"

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id and self.storage.normpath(os.fspath(checkpoint_id)) != self.path:
            self.path = self.storage.normpath(os.fspath(checkpoint_id))
            self._metadata = None
        self.load_id = _generate_uuid()

    @property
    def checkpoint_id(self) -> str:
        return str(self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return locations.is_url(os.fspath(checkpoint_id))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's ``.metadata`` (read from the store once, then kept).

        Raises:
            CheckpointCorruptError: it is missing or cannot be unpickled.
        """
        if kwargs.get("rank") is not None:
            raise CheckpointCorruptError(f"BackendStorageReader({self.path}): the checkpoint has global metadata, "
                                         "not per-rank")
        if self._metadata is None:
            where = locations.join(str(self.path), METADATA_NAME)
            try:
                raw = self.storage.read_bytes(where)
            except FileNotFoundError as e:
                raise CheckpointCorruptError(f"{where} does not exist: {self.path} is not a committed DCP "
                                             "checkpoint") from e
            try:
                # DCP's own format: FileSystemReader unpickles it the same way (the checkpoint dir is trusted)
                self._metadata = cast(Metadata, pickle.loads(raw))
            except Exception as e:
                raise CheckpointCorruptError(f"{where} cannot be read: {type(e).__name__}: {e}") from e
        md = self._metadata
        meta = getattr(md, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        md.storage_meta = meta
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self._info(req).relative_path, []).append(req)
        for rel, reqs in per_file.items():
            where = locations.join(str(self.path), rel)
            for start, buf, group in self._ranges(where, reqs):
                for req in group:
                    info = self._info(req)
                    view = memoryview(buf)[info.offset - start: info.offset - start + info.length]
                    self._load_item(req, info, view, planner)
                del buf
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # ------------------------------------------------------------------ helpers
    def _info(self, req: ReadItem) -> _StorageInfo:
        try:
            return cast(_StorageInfo, self.storage_data[req.storage_index])
        except KeyError:
            raise CheckpointCorruptError(f"BackendStorageReader({self.path}): the metadata has no storage entry for "
                                         f"{req.storage_index}") from None

    def _ranges(self, where: str, reqs: list[ReadItem]) -> Iterator[tuple[int, bytearray, list[ReadItem]]]:
        """Yields (start, bytes, items) for the merged byte ranges of ``reqs`` in the file ``where``: each
        range read with one ``read_into`` (the backend splits a large one into parallel ranged reads)."""
        reqs = sorted(reqs, key=lambda r: self._info(r).offset)
        groups: list[tuple[int, int, list[ReadItem]]] = []
        for req in reqs:
            info = self._info(req)
            if info.offset < 0 or info.length < 0:
                raise CheckpointCorruptError(f"{where}: record {req.storage_index.fqn} has a bad range "
                                             f"{info.offset}+{info.length}")
            end = info.offset + info.length
            if groups:
                start, stop, items = groups[-1]
                if info.offset - stop <= MERGE_GAP and max(stop, end) - start <= MAX_RANGE:
                    groups[-1] = (start, max(stop, end), items + [req])
                    continue
            groups.append((info.offset, end, [req]))
        for start, stop, items in groups:
            buf = bytearray(stop - start)
            try:
                self.storage.read_into(where, start, memoryview(buf))
            except FileNotFoundError as e:
                raise CheckpointCorruptError(f"{where} is missing; the checkpoint {self.path} is damaged") from e
            yield start, buf, items

    def _load_item(self, req: ReadItem, info: _StorageInfo, view: memoryview, planner: LoadPlanner) -> None:
        """One record, as ``FileSystemReader.read_data`` loads it (transforms, then bytes or a tensor)."""
        raw = self.transforms.transform_load_stream(req, info.transform_descriptors or (), io.BytesIO(view))
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(raw.read(-1)))
            return
        seekable = raw if raw.seekable() else io.BytesIO(raw.read(-1))
        tensor = cast(torch.Tensor, torch.load(seekable, map_location="cpu", weights_only=True))
        fill_target(planner, req, tensor, f"BackendStorageReader({self.path})")
