"""``load(into=...)``: the one rule by which a load fills the caller's own tensors, whatever the source.

A tensor of ``into`` is filled in place, and returned in place of the loaded one, when the checkpoint holds a
tensor at the same key path with the same dtype and shape, and the tensor of ``into`` is a plain tensor
(``torch.Tensor`` or ``nn.Parameter``; not a subclass such as a DTensor, whose shape is not its local shard's),
dense and contiguous, on the CPU or a CUDA device. The saved tensor's device, strides and storage sharing do
not matter. Everything else is as without ``into``: a saved tensor that fills nothing comes back in new memory,
and a tensor of ``into`` that the rule leaves alone keeps its values; one warning per load names each of
those (its key path holds another dtype or shape, or no tensor at all), so a resume never trains on
unloaded weights without a word.

Each source fills what it can straight from where the bytes are, choosing with ``Into.target`` (memory:
``snapshot_reader``, from the slot; an object store: ``remote_load``, ranged reads into the tensors' memory);
``Into.fill`` then copies every other match (all of a file system's ``torch.load``; transposed, shared or
device-crossing tensors), returns the filled tensors in place and warns. So the outcome is the same for every
source; only the number of copies differs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from flashckpt.format.tensormeta import dtype_name, value_bits
from flashckpt.format.tree import _key_str, map_tree_paths, tensors_by_path

__all__ = ["Into", "fits"]

log = logging.getLogger(__name__)

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not a subclass (a DTensor's shape is not its local shard's)
_LISTED = 8  # key paths named in the warning


def fits(target: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> bool:
    """Whether ``target`` (a tensor of ``into``) takes a saved tensor of ``dtype`` and ``shape`` (the module's rule)."""
    return (type(target) in _PLAIN and target.layout == torch.strided and target.device.type in ("cpu", "cuda")
            and target.dtype == dtype and tuple(target.shape) == tuple(shape) and target.is_contiguous())


def _fillable_from(t: torch.Tensor) -> bool:
    """Whether a loaded tensor's values can be copied out as they are (dense, not quantized)."""
    return t.layout == torch.strided and not t.is_quantized and t.device.type != "meta"


def _desc(t: torch.Tensor) -> str:
    kind = "" if type(t) in _PLAIN else f"{type(t).__name__} "
    dense = "" if t.layout == torch.strided and t.is_contiguous() else ", not contiguous" \
        if t.layout == torch.strided else f", {t.layout}"
    return f"{kind}{dtype_name(t.dtype)}{list(t.shape)} on {t.device}{dense}"


class Into:
    """The tensors of a ``load(into=...)`` tree by key path, and the rule that fills them.

    Args:
        into: the caller's tree (``None``: nothing to fill).

    Not thread-safe; one per load.
    """

    def __init__(self, into: Any) -> None:
        self.targets: dict[tuple[Any, ...], torch.Tensor] = tensors_by_path(into) if into is not None else {}

    def __bool__(self) -> bool:
        return bool(self.targets)

    def target(self, path: tuple[Any, ...], dtype: torch.dtype, shape: tuple[int, ...],
               bits: tuple[bool, bool] = (False, False)) -> torch.Tensor | None:
        """The tensor of ``into`` that a saved tensor at ``path`` of ``dtype`` and ``shape`` fills straight
        from the saved bytes, or None. ``bits``: the saved tensor's conjugate and negative bits
        (``_tree.value_bits``): bytes go straight only into a tensor with the same bits (``fill`` copies the
        others by value)."""
        t = self.targets.get(path)
        return t if t is not None and fits(t, dtype, shape) and value_bits(t) == bits else None

    def fill(self, tree: Any, *, source: str) -> Any:
        """``tree`` (a loaded state dict, new memory or already filled in part) with every tensor that
        fills a tensor of ``into`` copied into it and replaced by it; warns once about the tensors of
        ``into`` left alone. ``source`` names what was loaded, for the warning."""
        if not self.targets:
            return tree
        seen: set[tuple[Any, ...]] = set()
        left: list[str] = []

        def put(path: tuple[Any, ...], t: torch.Tensor) -> torch.Tensor:
            d = self.targets.get(path)
            if d is None:
                return t
            seen.add(path)
            if d is t:  # filled in place by the source
                return t
            if not (_fillable_from(t) and fits(d, t.dtype, t.shape)):
                left.append(f"{_key_str(list(path))} (saved {_desc(t)}; given {_desc(d)})")
                return t
            with torch.no_grad():  # a Parameter that requires grad is filled as load_state_dict fills it
                d.copy_(t)
            return d

        out = map_tree_paths(tree, put)
        left += [f"{_key_str(list(p))} (no tensor there in the checkpoint)" for p in self.targets if p not in seen]
        if left:
            more = f" and {len(left) - _LISTED} more" if len(left) > _LISTED else ""
            log.warning("load(into=...) from %s: %d tensor(s) of `into` were not filled and keep their values: %s%s. "
                        "A tensor is filled when the checkpoint holds one at the same key path with the same dtype "
                        "and shape (and it is a plain, contiguous CPU or CUDA tensor); the returned state dict "
                        "holds what the checkpoint has at those keys", source, len(left), "; ".join(left[:_LISTED]),
                        more)
        return out
