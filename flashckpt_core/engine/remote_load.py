"""``torch.load`` of a file in a store without a local path, with the bytes going from the socket straight
into the tensors' memory (or into the caller's own tensors with ``into``), fetched as parallel ranged reads
and verified against the file's xxh3 as a whole.

How: ``torch.load(map_location="meta")`` over ``RangeFile`` (a seekable view of the stored file that reads
ranges on demand, with read-ahead) reads only the archive's directory and pickle: it gives the state
dict's tree with meta tensors whose storages carry their data offsets in the file (``_checkpoint_offset``;
tied tensors share an offset). Each storage then gets its memory: the CPU tensor of ``into`` that the rule
of ``_into`` matches, where it owns exactly that storage's bytes, or a new one (``Into.fill`` then copies
the tensors that fill ``into`` another way: shared storages, views, CUDA tensors). The whole file is read once,
cut into segments in file order (the storages' bytes into their memory, the few bytes between them into a
small buffer), by ``CheckpointStorage.read_scatter`` (object stores: a few large ranged GETs at once,
each filling the segments it covers); the segments are hashed in order and compared with the manifest's
xxh3 before the tensors are made (``CheckpointCorruptError`` on a mismatch: the caller falls back).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import xxhash
from flashckpt import errors as E
from flashckpt.format.into import Into
from flashckpt.format.rawio import SeekableReader
from flashckpt.format.tensormeta import set_value_bits, value_bits
from flashckpt.format.tree import map_tree, tensors_by_path
from flashckpt.storage.base import CheckpointStorage

__all__ = ["RangeFile", "load_remote"]

log = logging.getLogger(__name__)

_BLOCK = 256 << 10  # read-ahead of RangeFile


class RangeFile(SeekableReader):
    """A read-only, seekable view of the stored file ``path`` (``size`` bytes): reads fetch the blocks they
    touch (``_BLOCK`` bytes, cached), so reading the directory and a small record costs a request or two."""

    def __init__(self, storage: CheckpointStorage, path: str, size: int) -> None:
        super().__init__(size)
        self.storage, self.path = storage, path
        self._blocks: dict[int, bytes] = {}
        self.requests = 0

    def _block(self, i: int) -> bytes:
        b = self._blocks.get(i)
        if b is None:
            start = i * _BLOCK
            buf = bytearray(min(_BLOCK, self._size - start))
            self.storage.read_into(self.path, start, memoryview(buf))
            self.requests += 1
            b = self._blocks[i] = bytes(buf)
        return b

    def readinto(self, out: Any) -> int:
        view = memoryview(out).cast("B")
        n = min(len(view), max(0, self._size - self._pos))
        got = 0
        while got < n:
            i, at = divmod(self._pos + got, _BLOCK)
            b = self._block(i)
            k = min(n - got, len(b) - at)
            view[got:got + k] = b[at:at + k]
            got += k
        self._pos += got
        return got


_Owners = dict[int, list[tuple[tuple[Any, ...], torch.Tensor]]]


def load_remote(storage: CheckpointStorage, path: str, *, size: int, xxh3: str | None, weights_only: bool,
                into: Any = None) -> Any:
    """The state dict in the stored ``torch.save`` file ``path`` (see the module docstring).

    Args:
        size / xxh3: the file's size and checksum from its manifest (``xxh3`` None: not verified).
        into: the caller's tensors to fill (``CheckpointEngine.load``; the rule: ``_into``), returned in
            place of new ones.

    Raises:
        CheckpointCorruptError: the file does not match ``size``/``xxh3``, or is not a ``torch.save`` zip.
    """
    meta_tree = _meta_tree(storage, path, size, weights_only)
    spans, owners = _storages(meta_tree, path)
    fill = Into(into)
    memory = {off: _memory_for(fill, owners[off], nbytes) for off, nbytes in spans.items()}
    segments = _segments(path, size, spans, memory)
    storage.read_scatter(path, segments)
    if xxh3 is not None:
        _verify(path, segments, xxh3)

    def real(t: torch.Tensor) -> torch.Tensor:
        off: int = getattr(t.untyped_storage(), "_checkpoint_offset")  # noqa: B009 - set by torch.load
        st = memory[off]
        dst = fill.targets.get(owners[off][0][0]) if len(owners[off]) == 1 else None
        if dst is not None and dst.untyped_storage().data_ptr() == st.data_ptr():
            return dst  # filled in place
        return _tensor_over(st, t)

    return fill.fill(map_tree(meta_tree, real), source=path)


def _meta_tree(storage: CheckpointStorage, path: str, size: int, weights_only: bool) -> Any:
    """The file's state dict with meta tensors (only the archive's directory and pickle are read)."""
    stored = storage.size(path)
    if stored != size:
        raise E.CheckpointCorruptError(f"{path}: {stored} bytes, {size} in the manifest")
    f = RangeFile(storage, path, size)
    try:
        return torch.load(f, map_location="meta", weights_only=weights_only)  # type: ignore[arg-type]
    except Exception as e:
        if weights_only and "weights_only" in str(e):
            raise
        raise E.CheckpointCorruptError(f"{path}: not a readable torch.save archive ({type(e).__name__}: {e})") from e


def _storages(meta_tree: Any, path: str) -> tuple[dict[int, int], _Owners]:
    """Every distinct storage, by its offset in the file (tied tensors share one): its size in bytes, and
    the tensors (with their key paths) over it."""
    spans: dict[int, int] = {}
    owners: _Owners = {}
    for p, t in tensors_by_path(meta_tree).items():
        st = t.untyped_storage()
        off = getattr(st, "_checkpoint_offset", None)
        if off is None:
            raise E.CheckpointCorruptError(f"{path}: torch gave no data offset for the storage of {p}")
        spans[off] = st.nbytes()
        owners.setdefault(off, []).append((p, t))
    return spans, owners


def _memory_for(fill: Into, uses: list[tuple[tuple[Any, ...], torch.Tensor]], nbytes: int) -> torch.UntypedStorage:
    """The memory one storage of ``nbytes`` is read into: the storage of the CPU tensor of ``into`` that is
    the whole storage (the ranged reads go straight into it), else a new one."""
    if len(uses) == 1:
        p, t = uses[0]
        d = fill.target(p, t.dtype, tuple(t.shape), value_bits(t))
        if (d is not None and d.device.type == "cpu" and d.storage_offset() == 0
                and t.storage_offset() == 0 and t.is_contiguous()
                and d.untyped_storage().nbytes() == nbytes == t.numel() * t.element_size()):
            return d.untyped_storage()
    return torch.UntypedStorage(nbytes)


def _segments(path: str, size: int, spans: dict[int, int],
              memory: dict[int, torch.UntypedStorage]) -> list[tuple[int, memoryview]]:
    """The whole file, in order: gaps into small buffers, storages into their memory."""
    segments: list[tuple[int, memoryview]] = []
    at = 0
    for off in sorted(spans):
        if off < at:
            raise E.CheckpointCorruptError(f"{path}: storages overlap at offset {off}")
        if off > at:
            segments.append((at, memoryview(bytearray(off - at))))
        n = spans[off]
        if n:
            segments.append((off, memoryview(torch.empty(0, dtype=torch.uint8).set_(memory[off]).numpy())))  # type: ignore[arg-type]
        at = off + n
    if at < size:
        segments.append((at, memoryview(bytearray(size - at))))
    return segments


def _verify(path: str, segments: list[tuple[int, memoryview]], xxh3: str) -> None:
    """Compares the xxh3 of the segments, in order, with the manifest's."""
    h = xxhash.xxh3_64()
    for _off, v in segments:
        h.update(v)
    if h.hexdigest() != xxh3:
        raise E.CheckpointCorruptError(f"{path}: checksum {h.hexdigest()} != {xxh3} in the manifest")


def _tensor_over(st: torch.UntypedStorage, t: torch.Tensor) -> torch.Tensor:
    """A tensor like the meta tensor ``t`` (dtype, view, value bits, grad, Parameter) over the storage ``st``."""
    out = torch.empty(0, dtype=t.dtype).set_(st, t.storage_offset(), t.shape, t.stride())
    conj, neg = value_bits(t)
    if conj or neg:
        set_value_bits(out, conj=conj, neg=neg)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad) if t.requires_grad else out
