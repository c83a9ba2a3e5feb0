"""One tensor of a snapshot: its metadata (``TensorMeta``) and how a tensor is rebuilt from it.

A snapshot's slot holds each distinct tensor storage once; ``TensorMeta`` says where a tensor's storage
region lies in the slot and how the tensor views it (dtype, shape, strides, offset, device, grad, the
Parameter class and the conjugate/negative bits). ``build_tensor`` makes the tensor over a storage without
a copy. Pure functions and frozen data: safe on any thread. Imports torch and ``errors`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from flashckpt.errors import InvalidStateDictError

__all__ = ["TensorMeta", "dtype_name", "dtype_from_name", "value_bits", "set_value_bits", "contiguous_strides",
           "build_tensor"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise InvalidStateDictError(f"unknown dtype {name!r} in snapshot metadata (torch {torch.__version__})")
    return dt


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in a slot and how to rebuild it.

    Attributes:
        shape: the tensor's shape.
        dtype: dtype name without the ``torch.`` prefix (``"bfloat16"``).
        offset: byte offset of the tensor's storage region inside the slot's data area (64-aligned).
        nbytes: size in bytes of that storage region; tensors that share storage share offset and nbytes.
        stride: the tensor's strides, in elements.
        storage_offset: the tensor's offset into its storage, in elements.
        device: the device the tensor came from (``"cpu"``, ``"cuda:0"``).
        requires_grad: whether the tensor required grad.
        parameter: whether the tensor was an ``nn.Parameter``.
        conj: the tensor's conjugate bit (``z.conj()``: a lazy conjugate of the bytes it views).
        neg: the tensor's negative bit (``z.conj().imag``: a lazy negation of the bytes it views).
            Both change its values as ``torch.save`` keeps them (``torch._utils.get_tensor_metadata``).
    """

    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int
    stride: tuple[int, ...] = ()
    storage_offset: int = 0
    device: str = "cpu"
    requires_grad: bool = False
    parameter: bool = False
    conj: bool = False
    neg: bool = False

    def to_json(self) -> list[Any]:
        out = [list(self.shape), self.dtype, self.offset, self.nbytes, list(self.stride),
               self.storage_offset, self.device, self.requires_grad, self.parameter]
        return out + [self.conj, self.neg] if self.conj or self.neg else out

    @staticmethod
    def from_json(v: list[Any]) -> TensorMeta:
        bits = (bool(v[9]), bool(v[10])) if len(v) > 10 else (False, False)  # older snapshots: no bits
        return TensorMeta(tuple(v[0]), v[1], v[2], v[3], tuple(v[4]), v[5], v[6], v[7], v[8], *bits)


def value_bits(t: torch.Tensor) -> tuple[bool, bool]:
    """``t``'s conjugate and negative bits: lazy operations on the bytes it views, part of its values."""
    return t.is_conj(), t.is_neg()


def set_value_bits(t: torch.Tensor, *, conj: bool, neg: bool) -> None:
    """Sets those of ``t``'s conjugate and negative bits that are True, as ``torch.load`` does
    (``torch._utils.set_tensor_metadata``; it takes only the bits that are set, as ``get_tensor_metadata``
    gives them: a False bit in the dict is not a clear)."""
    bits = {k: True for k, on in (("conj", conj), ("neg", neg)) if on}
    if bits:
        torch._utils.set_tensor_metadata(t, bits)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def build_tensor(storage: torch.UntypedStorage, meta: TensorMeta) -> torch.Tensor:
    """A tensor of ``meta``'s dtype, shape, strides and conjugate/negative bits over ``storage`` (no copy)."""
    t = torch.empty(0, dtype=dtype_from_name(meta.dtype), device=storage.device)
    t.set_(storage, meta.storage_offset, meta.shape, meta.stride)
    if meta.conj or meta.neg:
        set_value_bits(t, conj=meta.conj, neg=meta.neg)
    if meta.parameter:
        return torch.nn.Parameter(t, requires_grad=meta.requires_grad)
    if meta.requires_grad:
        t.requires_grad_(True)
    return t
