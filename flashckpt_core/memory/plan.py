"""The snapshot plan: where each tensor storage of a state dict goes in a slot, and what a snapshot copies.

``signature_of`` is a tensor list's structure (dtypes, shapes, strides, storage sharing, value bits);
``plan_snapshot`` lays out every distinct storage once, 64-byte aligned, and refuses (before anything is
written) tensors whose persisted file would not load back. The writer (``memory.writer``) reuses a plan
while the signature (or the native scan's) is unchanged. Pure functions of their arguments: they may run
on any thread. Imports only ``format`` and ``util`` (and torch).
"""

from __future__ import annotations

import array
import functools
import io
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from flashckpt import errors as E
from flashckpt.format.tensormeta import TensorMeta, dtype_name, value_bits
from flashckpt.util.copy import SMALL_COPY

__all__ = ["ALIGN", "SnapshotPlan", "signature_of", "plan_snapshot"]

ALIGN = 64


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class SnapshotPlan:
    """The slot layout of a state dict's tensors, reused while its structure is unchanged.

    Attributes:
        signature: what must match for the plan to be reused (dtypes, shapes, strides, storage sharing).
        regions: (offset, nbytes) per distinct storage, offsets relative to the data area, 64-aligned.
        tensor_region: for each tensor, the index of its storage region.
        metas: the TensorMeta of each tensor.
        tensor_bytes: bytes of the data area taken by tensor storages.
        metas_json: the metas, JSON-encoded once.
        copies: (tensor index, region offset, nbytes) of the first tensor of every non-empty CPU region;
            what a snapshot copies.
        device_copies: the same for regions on an accelerator; device_copies_packed: as packed int64
            triples, which the native fast path queues in one call.
        native_signature: the native scan's signature of the tensors (b"" without the extension).
        small_copies_packed: ``copies`` below ``SMALL_COPY`` bytes as packed int64 triples, which the
            native fast path copies in one call; large_copies: the others, which copy on threads;
            small_copy_work: what the small copies cost, in bytes of large memmove (each copy counts
            4 KiB more than its size: scattered small copies run far below memmove speed).
    """

    signature: tuple[Any, ...]
    regions: tuple[tuple[int, int], ...]
    tensor_region: tuple[int, ...]
    metas: tuple[TensorMeta, ...]
    tensor_bytes: int
    metas_json: str
    copies: tuple[tuple[int, int, int], ...] = ()
    device_copies: tuple[tuple[int, int, int], ...] = ()
    native_signature: bytes = b""
    small_copies_packed: bytes = b""
    large_copies: tuple[tuple[int, int, int], ...] = ()
    small_copy_work: int = 0
    device_copies_packed: bytes = b""


def signature_of(tensors: list[torch.Tensor]) -> tuple[tuple[Any, ...], list[int]]:
    """The structure of a tensor list (equal signatures reuse one plan) and each tensor's storage address.
    The conjugate and negative bits are part of it (they change the values the bytes stand for).

    Hot path: about ten cheap attribute reads per tensor, nothing that formats strings.

    Raises:
        RuntimeError: a tensor without the storage or sizes of a strided tensor (nested, zero tensors):
            the caller names it (``check_tensor``)."""
    seen: dict[tuple[int, int], int] = {}
    sig: list[Any] = []
    ptrs: list[int] = []
    param = torch.nn.Parameter
    for t in tensors:
        st = t.untyped_storage()
        n = st.nbytes()
        ptr = st.data_ptr()
        dev = t.get_device() if t.is_cuda else -1
        if n:
            group = seen.setdefault((dev, ptr), len(seen))
        else:
            group = -1
        ptrs.append(ptr)
        sig.append((t.dtype, t.shape, t.stride(), t.storage_offset(), n, group, dev,
                    t.requires_grad, type(t) is param, t.is_conj(), t.is_neg()))
    return tuple(sig), ptrs


def plan_snapshot(tensors: list[torch.Tensor], signature: tuple[Any, ...], *,
                  native_signature: bytes = b"", key_of: Callable[[int], str] = str) -> SnapshotPlan:
    """Lay out every distinct storage once, 64-byte aligned, in traversal order.

    Raises:
        InvalidStateDictError: a tensor whose file would not load back (``key_of(i)`` names tensor ``i``;
            the plan is made before anything is written): two tensors view one storage as types
            ``torch.save`` cannot write together, a quantized dtype without a quantizer, or a tensor that
            requires grad of a dtype this torch's ``torch.load`` cannot rebuild so (``_grad_loads``).
    """
    regions, tensor_region, metas, off = _lay_out(tensors, signature, key_of)
    metas_json = json.dumps([m.to_json() for m in metas], separators=(",", ":"))
    copies, device_copies = _first_copies(regions, tensor_region, signature)
    small, large, work = _split_small(copies)
    return SnapshotPlan(signature, tuple(regions), tuple(tensor_region), tuple(metas), off, metas_json,
                        tuple(copies), tuple(device_copies), native_signature, small, large, work,
                        array.array("q", [v for c in device_copies for v in c]).tobytes())


def _lay_out(tensors: list[torch.Tensor], signature: tuple[Any, ...], key_of: Callable[[int], str],
             ) -> tuple[list[tuple[int, int]], list[int], list[TensorMeta], int]:
    """The regions (offset, nbytes) of the distinct storages, in traversal order and 64-aligned, each
    tensor's region index, each tensor's meta, and the bytes the regions take; refuses the tensors whose
    file would not load back (see ``plan_snapshot``)."""
    regions: list[tuple[int, int]] = []
    group_region: dict[int, int] = {}
    group_first: dict[int, int] = {}  # the first tensor of each storage, for the types check
    tensor_region: list[int] = []
    metas: list[TensorMeta] = []
    as_bytes = torch.storage._new_dtypes()
    off = 0
    for i, (t, s) in enumerate(zip(tensors, signature)):
        n, group = s[4], s[5]
        if group >= 0 and group in group_region:
            ri = group_region[group]
            _check_one_storage_type(tensors, group_first[group], i, as_bytes, key_of)
        else:
            ri = len(regions)
            regions.append((off, n))
            off = _align(off + n)
            if group >= 0:
                group_region[group] = ri
                group_first[group] = i
        if t.dtype in _QUANTIZED:
            raise E.InvalidStateDictError(
                f"save(): the tensor at {key_of(i)} has the quantized dtype {t.dtype} but no quantizer (a view of "
                "integer data); torch.save cannot write its rebuilt form. Nothing was saved. Save it as its integer "
                "type (t.view(torch.int8) / torch.uint8 / torch.int32), or as a quantized tensor.")
        if t.requires_grad and t.dtype in as_bytes and type(t) is not torch.nn.Parameter and not _grad_loads(t.dtype):
            raise E.InvalidStateDictError(
                f"save(): the tensor at {key_of(i)} ({t.dtype}, requires_grad=True) would not load back: torch.load "
                f"{torch.__version__} cannot rebuild a {t.dtype} tensor that requires grad (torch.save writes it). "
                "Nothing was saved. Save it as an nn.Parameter, or t.detach() (and set requires_grad after loading).")
        tensor_region.append(ri)
        r_off, r_n = regions[ri]
        metas.append(TensorMeta(tuple(t.shape), dtype_name(t.dtype), r_off, r_n, tuple(t.stride()),
                                int(t.storage_offset()), str(t.device), bool(t.requires_grad),
                                type(t) is torch.nn.Parameter, *value_bits(t)))
    return regions, tensor_region, metas, off


def _first_copies(regions: list[tuple[int, int]], tensor_region: list[int], signature: tuple[Any, ...],
                  ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """(tensor index, region offset, nbytes) of the first tensor of every non-empty region: those of CPU
    regions, then those of regions on an accelerator (``SnapshotPlan.copies`` / ``device_copies``)."""
    copies: list[tuple[int, int, int]] = []
    device_copies: list[tuple[int, int, int]] = []
    first: set[int] = set()
    for i, (ri, s) in enumerate(zip(tensor_region, signature)):
        if ri in first or not regions[ri][1]:
            continue
        first.add(ri)
        (device_copies if s[6] >= 0 else copies).append((i, regions[ri][0], regions[ri][1]))
    return copies, device_copies


def _split_small(copies: list[tuple[int, int, int]]) -> tuple[bytes, tuple[tuple[int, int, int], ...], int]:
    """``copies`` below ``SMALL_COPY`` bytes packed as int64 triples, the others, and the small copies'
    work (``SnapshotPlan.small_copies_packed`` / ``large_copies`` / ``small_copy_work``)."""
    small_list = [c for c in copies if c[2] < SMALL_COPY]
    small = array.array("q", [v for c in small_list for v in c])
    large = tuple(c for c in copies if c[2] >= SMALL_COPY)
    work = sum(c[2] + 4096 for c in small_list)
    return small.tobytes(), large, work


_QUANTIZED = {getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, n)}


@functools.cache
def _grad_loads(dtype: torch.dtype) -> bool:
    """Whether ``torch.load`` reads back a tensor of ``dtype`` (one ``torch.save`` writes untyped) that
    requires grad: torch 2.13's ``_rebuild_tensor_v3`` makes it requiring grad, then ``set_``s its storage,
    which autograd refuses. Asked of this torch once per dtype."""
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch warns that some of these dtypes are experimental)
        torch.save(torch.empty(1, dtype=dtype).requires_grad_(), buf)
        buf.seek(0)
        try:
            torch.load(buf, weights_only=True)
        except RuntimeError:
            return False
    return True


def _check_one_storage_type(tensors: list[torch.Tensor], first: int, i: int, as_bytes: set[torch.dtype],
                            key_of: Callable[[int], str]) -> None:
    """Refuses tensors ``first`` and ``i``, views of one storage, when ``torch.save`` would refuse them: it
    writes a storage once, as one type (the tensor's dtype, or bytes for the dtypes it writes untyped:
    float8, complex32, uint16-64), and refuses "multiple tensors or storages that view the same data as
    different types"."""
    a, b = tensors[first].dtype, tensors[i].dtype
    if a == b or (a in as_bytes or a == torch.uint8) and (b in as_bytes or b == torch.uint8):
        return
    raise E.InvalidStateDictError(
        f"save(): the tensors at {key_of(i)} ({b}) and {key_of(first)} ({a}) view one storage as different "
        "types, which torch.save cannot write (a persist would fail). Nothing was saved. Save a copy of one of "
        "them (.clone()), or both as one type.")
