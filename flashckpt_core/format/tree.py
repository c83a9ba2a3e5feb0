"""State-dict trees without pickle: a JSON skeleton, a list of tensors and a list of opaque leaves.

The skeleton is plain JSON. Containers are lists tagged by their first element; None, int and str
appear as themselves; bools and floats are tagged so that equal skeletons are equal leaf for leaf
(in Python ``1 == 1.0 == True`` and ``0.0 == -0.0``), which lets an unchanged tree reuse its JSON. Tensors and opaque leaves are referenced by index:

    ["d", [[key, value], ...]]   dict          ["od", [[key, value], ...]]   OrderedDict
    ["l", [v, ...]]              list          ["t", [v, ...]]               tuple
    ["T", i]                     tensors[i]    ["o", i]                      opaque[i]
    ["b", base64]  bytes   ["c", re, im]  complex   ["dt", name]  torch.dtype   ["sz", [...]]  torch.Size
    ["dev", "cuda:0"] torch.device   ["B", true] bool   ["f", "0x1.0p-10"] float   ["I", "-1f"] int (hex)

Floats are exact: ``float.hex``, and a NaN as ``"nan:"`` and its 8 bytes (``float.hex`` drops a NaN's sign and
payload); complex numbers hold two such strings. Ints outside int64 are tagged, in hex (JSON readers and
Python's int-to-decimal limit stop at large ints; hex has no limit). Older snapshots held complex parts and
big ints as JSON numbers; they still decode.

Opaque leaves (anything else) are pickled by the trainer into a blob that only a trainer decodes; the
saver never unpickles them (its persist worker splices each pickle, unread, into the file it writes:
``torchfile``).

One concept, both ways: this module is the skeleton format (encode: ``flatten``, ``flatten_like``; decode:
``unflatten``), its opaque leaves, the key paths of a tree's leaves (``map_tree_paths``, ``tensor_paths``)
and the messages that name the key of a leaf that cannot be stored; a tensor's own metadata lives in
``format.tensormeta``. Pure functions of their arguments: any thread may call them.
"""

from __future__ import annotations

import base64
import gc
import pickle
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from flashckpt.errors import InvalidStateDictError
from flashckpt.format.tensormeta import dtype_from_name, dtype_name

__all__ = ["Flat", "flatten", "flatten_like", "unflatten", "encode_opaque", "decode_opaque", "map_tree",
           "map_tree_paths", "gc_paused", "check_tensor"]

_PLAIN = (str, int, float, bool, type(None))
_RAW = (str, int, type(None))  # appear in the skeleton as themselves (ints only inside int64)
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_LONG1_BYTES = 256  # pickle writes longer ints as LONG4, which torch.load(weights_only=True) refuses


class gc_paused:  # noqa: N801 (used like a function: ``with gc_paused():``)
    """Holds off Python's cyclic garbage collector for a ``with`` block. Walking or decoding a tree
    allocates a few containers per tensor; with torch imported (~200k tracked objects) that can trigger a
    full collection of 60-80 ms in the middle of a pause or a restore. Nothing in these walks makes cycles.
    The collection the block's allocations would have started runs at the next allocation after it (a
    class, not a generator: leaving the block allocates nothing that could start it right there)."""

    __slots__ = ("_was_enabled",)

    def __enter__(self) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._was_enabled:
            gc.enable()


def map_tree(tree: Any, fn: Callable[[Any], Any], leaves: tuple[type, ...] = (torch.Tensor,)) -> Any:
    """``tree`` with every instance of ``leaves`` in its dicts, lists and tuples (named tuples too) replaced by
    ``fn`` of it. Dicts keep their class and attributes (a state dict's ``_metadata``); a dict subclass that
    cannot be made empty becomes a plain dict."""
    return _map(tree, lambda _path, x: fn(x), leaves, None)


def map_tree_paths(tree: Any, fn: Callable[[tuple[Any, ...], Any], Any],
                   leaves: tuple[type, ...] = (torch.Tensor,)) -> Any:
    """``map_tree`` with ``fn(key path, leaf)``: the key path as ``tensors_by_path`` names it (dict keys and
    list or tuple indices from the root)."""
    return _map(tree, fn, leaves, ())


def _map(tree: Any, fn: Callable[[Any, Any], Any], leaves: tuple[type, ...], path: tuple[Any, ...] | None) -> Any:
    """``map_tree``'s walk; ``path`` None: no key paths are built (``fn`` gets None)."""
    if isinstance(tree, leaves):
        return fn(path, tree)
    if isinstance(tree, dict):
        try:
            out = type(tree)()
        except TypeError:
            out = {}
        for k, v in tree.items():
            out[k] = _map(v, fn, leaves, None if path is None else path + (k,))
        if hasattr(tree, "__dict__") and hasattr(out, "__dict__"):
            out.__dict__.update(tree.__dict__)
        return out
    if isinstance(tree, (list, tuple)):
        vals = [_map(v, fn, leaves, None if path is None else path + (i,)) for i, v in enumerate(tree)]
        if isinstance(tree, list):
            return vals
        return type(tree)(*vals) if hasattr(tree, "_fields") else type(tree)(vals)
    return tree


@dataclass
class Flat:
    """A flattened state dict: skeleton, tensors in traversal order and opaque leaves."""

    skeleton: Any
    tensors: list[torch.Tensor]
    opaque: list[Any]


def _key_str(path: list[Any]) -> str:
    return "".join(f"[{_key_repr(p)}]" for p in path) or "<root>"


def _key_repr(k: Any) -> str:
    """``repr(k)``, or a short name for an int too long for Python to print (``sys.set_int_max_str_digits``)."""
    try:
        return repr(k)
    except ValueError:
        return f"<int of {k.bit_length()} bits: {format(k, 'x')[:16]}...>" if type(k) is int else f"<{type(k).__name__}>"


def flatten(obj: Any, *, check_tensors: bool = True, weights_only: bool = False) -> Flat:
    """Split a state dict into a JSON skeleton, its tensors and its opaque leaves.

    Hot path (once per save): no per-item bookkeeping; where a leaf cannot be stored the walk stops and
    ``_path_to`` finds its key for the message. ``check_tensors=False`` leaves the per-tensor checks
    (layout, meta, quantized) to the caller (the native scan does them in C++); tensor subclasses are
    refused either way. Nested and zero tensors are left to the caller (``check_tensor``): they fail the
    first read of their shape or storage. ``weights_only``: refuse the plain values that
    ``torch.load(weights_only=True)`` cannot read back from the persisted file (ints over 255 bytes).

    Raises:
        InvalidStateDictError: a sparse, meta, quantized or otherwise unstorable tensor, or (with
            ``weights_only``) an int too large to load, naming its key.
    """
    tensors: list[torch.Tensor] = []
    leaves = _Leaves(obj, weights_only)
    skeleton = _encoder(obj, tensors, leaves, check_tensors)(obj)
    return Flat(skeleton, tensors, leaves.opaque)


def _encoder(root: Any, tensors: list[torch.Tensor], leaves: _Leaves, check_tensors: bool) -> Callable[[Any], Any]:
    """``flatten``'s walk over the tree ``root``: tensors, strs, ints, dicts and sequences here (the bulk of a
    state dict), any other leaf and dict keys that are not strs or ints by ``leaves``."""
    add_tensor = tensors.append
    tensor_t, param_t, strided = torch.Tensor, torch.nn.Parameter, torch.strided
    str_t, int_t, lo, hi = str, int, _I64_MIN, _I64_MAX
    big_int, enc_key, enc_leaf = leaves.big_int, leaves.key, leaves.value

    def enc(x: Any) -> Any:
        tx = type(x)
        if tx is tensor_t or tx is param_t:
            if check_tensors and not (x.layout is strided and not x.is_meta and not x.is_quantized):
                _check_tensor(x, _path_to(root, x))
            add_tensor(x)
            return ["T", len(tensors) - 1]
        if tx is str_t or x is None:
            return x
        if tx is int_t:
            return x if lo <= x <= hi else big_int(x)
        if tx is dict or tx is OrderedDict:
            items = [[k if type(k) is str_t or (type(k) is int_t and lo <= k <= hi) else enc_key(k), enc(v)]
                     for k, v in x.items()]
            if tx is dict:
                return ["d", items]
            # nn.Module.state_dict() attaches per-module versions as ``_metadata``; torch.save keeps it.
            md = getattr(x, "_metadata", None)
            return ["od", items] if md is None else ["od", items, enc(md)]
        if tx is list or tx is tuple:
            return ["l" if tx is list else "t", [enc(v) for v in x]]
        return enc_leaf(x)

    return enc


class _Leaves:
    """``flatten``'s encoding of the leaves other than tensors, strs and small ints, and of dict keys
    other than strs and small ints; collects the opaque leaves (of the tree ``root``, for messages)."""

    __slots__ = ("root", "weights_only", "opaque")

    def __init__(self, root: Any, weights_only: bool) -> None:
        self.root, self.weights_only = root, weights_only
        self.opaque: list[Any] = []

    def value(self, x: Any) -> Any:
        tx = type(x)
        if tx is float:
            return ["f", x.hex() if x == x else _nan_code(x)]
        if tx is bool:
            return ["B", x]
        if isinstance(x, torch.Tensor):
            _check_tensor(x, _path_to(self.root, x))
        if tx is bytes:
            return ["b", base64.b64encode(x).decode("ascii")]
        if tx is complex:
            return ["c", _float_code(x.real), _float_code(x.imag)]
        if tx is torch.dtype:
            return ["dt", dtype_name(x)]
        if tx is torch.Size:
            return ["sz", list(x)]
        if tx is torch.device:
            return ["dev", str(x)]
        return self._opaque(x)  # pickled by encode_opaque, which refuses what cannot be

    def key(self, k: Any) -> Any:
        if type(k) in _RAW:
            return k if type(k) is not int or _I64_MIN <= k <= _I64_MAX else self.big_int(k)
        if type(k) is float:
            return ["f", _float_code(k)]
        if type(k) is bool:
            return ["B", k]
        if type(k) is tuple:
            return ["t", [self.key(v) for v in k]]
        if type(k) is bytes:
            return ["b", base64.b64encode(k).decode("ascii")]
        return self._opaque(k)

    def big_int(self, x: int) -> list[Any]:
        if self.weights_only and len(pickle.encode_long(x)) >= _LONG1_BYTES:
            raise InvalidStateDictError(
                f"save(): the int at {_key_str(_path_to(self.root, x))} ({x.bit_length()} bits) would not load back: "
                "torch.load(weights_only=True), the default, reads ints of up to 255 bytes. Nothing was saved. "
                "Store it another way (for example hex(x), read back with int(s, 16)), or, for checkpoints you "
                "trust, construct the engine / checkpointer with weights_only=False.")
        return ["I", format(x, "x")]

    def _opaque(self, x: Any) -> list[Any]:
        self.opaque.append(x)
        return ["o", len(self.opaque) - 1]


def _nan_code(x: float) -> str:
    """A NaN in a skeleton: ``float.hex`` gives "nan" whatever its sign and payload; its bytes keep them."""
    return "nan:" + struct.pack(">d", x).hex()


def _float_code(x: float) -> str:
    return x.hex() if x == x else _nan_code(x)


def _float_of(code: Any) -> float:
    """A float from its skeleton code (older snapshots held complex parts as JSON numbers)."""
    if type(code) is not str:
        return float(code)
    if code.startswith("nan:"):
        return float(struct.unpack(">d", bytes.fromhex(code[4:]))[0])
    return float.fromhex(code)


def flatten_like(obj: Any, skeleton: Any, *, check_tensors: bool = True) -> Flat | None:
    """``flatten(obj)`` when ``obj`` has exactly the structure and plain leaves of ``skeleton`` (a
    skeleton ``flatten`` made): the tensors in order, with ``skeleton`` itself reused; None as soon as
    anything differs or ``obj`` holds opaque leaves (then call ``flatten``).

    The common case of a training loop (the same keys every step, new tensor objects) without building
    a new skeleton: no allocation per item, and nothing to free after the save."""
    tensors: list[torch.Tensor] = []
    if not _matcher(tensors, check_tensors)(obj, skeleton):
        return None
    return Flat(skeleton, tensors, [])


_Match = Callable[[Any, Any], bool]


def _matcher(tensors: list[torch.Tensor], check_tensors: bool) -> _Match:
    """``flatten_like``'s walk: whether a value matches its skeleton, appending its tensors to ``tensors``.
    Dicts are matched by ``_dict_matcher`` (the tensors of a dict's values without a call each)."""
    add_tensor = tensors.append
    tensor_t, param_t, strided = torch.Tensor, torch.nn.Parameter, torch.strided
    raw = _RAW

    def ok_tensor(t: Any) -> bool:
        if check_tensors and not (t.layout is strided and not t.is_meta and not t.is_quantized):
            return False  # flatten raises, naming the key
        add_tensor(t)
        return True

    def match(x: Any, sk: Any) -> bool:
        tx = type(x)
        if tx is tensor_t or tx is param_t:
            return type(sk) is list and sk[0] == "T" and sk[1] == len(tensors) and ok_tensor(x)
        if tx in raw:
            return type(sk) is tx and sk == x
        if type(sk) is not list:
            return False
        if tx is dict or tx is OrderedDict:
            return match_dict(x, sk, tx)
        if tx is list or tx is tuple:
            vals = sk[1]
            if sk[0] != ("l" if tx is list else "t") or len(vals) != len(x):
                return False
            return all(map(match, x, vals))
        return _plain_matches(x, sk, tx)

    match_dict = _dict_matcher(match, ok_tensor, tensors)
    return match


def _dict_matcher(match: _Match, ok_tensor: Callable[[Any], bool],
                  tensors: list[torch.Tensor]) -> Callable[[Any, Any, type], bool]:
    """``flatten_like``'s match of a dict (of type ``tx``: dict or OrderedDict) and its skeleton ``sk``."""
    tensor_t, param_t = torch.Tensor, torch.nn.Parameter
    raw = _RAW

    def match_dict(x: Any, sk: Any, tx: type) -> bool:
        items = sk[1]
        if sk[0] != ("d" if tx is dict else "od") or len(items) != len(x):
            return False
        for (k, v), pair in zip(x.items(), items):
            if type(k) not in raw or type(pair[0]) is not type(k) or pair[0] != k:
                return False
            sv = pair[1]
            tv = type(v)
            if tv is tensor_t or tv is param_t:
                if type(sv) is not list or sv[0] != "T" or sv[1] != len(tensors) or not ok_tensor(v):
                    return False
            elif not match(v, sv):
                return False
        if tx is OrderedDict:
            md = getattr(x, "_metadata", None)
            return (md is None) == (len(sk) == 2) and (md is None or match(md, sk[2]))
        return True

    return match_dict


def _plain_matches(x: Any, sk: list[Any], tx: type) -> bool:
    """Whether a leaf other than a tensor, str, int or None matches its skeleton ``sk`` (a list): floats
    and bools; anything else (bytes, dtypes, opaque leaves, ...) is left to the full walk."""
    if tx is float:
        return sk[0] == "f" and sk[1] == (x.hex() if x == x else _nan_code(x))
    if tx is bool:
        return sk[0] == "B" and sk[1] is x
    return False


def _path_to(root: Any, target: Any) -> list[Any]:
    """The keys leading from ``root`` to the object ``target`` (or to the dict key that is ``target``),
    for error messages; [] when it is not found."""
    stack: list[tuple[Any, list[Any]]] = [(root, [])]
    while stack:
        x, path = stack.pop()
        if x is target:
            return path
        tx = type(x)
        if tx is dict or tx is OrderedDict:
            for k, v in x.items():
                if k is target:
                    return path + [k]
                stack.append((v, path + [k]))
            md = getattr(x, "_metadata", None) if tx is OrderedDict else None
            if md is not None:
                stack.append((md, path + ["_metadata"]))
        elif tx is list or tx is tuple:
            stack.extend((v, path + [i]) for i, v in enumerate(x))
    return []


def check_tensor(t: torch.Tensor, path: list[Any]) -> None:
    """Raises InvalidStateDictError, naming ``path``, when ``t`` is a tensor flashckpt cannot store as
    ``torch.save`` would: not dense and strided, on the meta device, quantized, nested, a zero tensor, or
    a tensor subclass. Not the hot path: the snapshot makes the cheap checks itself and calls this for
    the message (``_check_tensor`` makes the common ones)."""
    _check_tensor(t, path)
    where = _key_str(path)
    if t.is_nested:
        raise InvalidStateDictError(
            f"save(): tensor at {where} is a nested tensor; store its components (t.unbind()) as a list of tensors.")
    if t._is_zerotensor():
        raise InvalidStateDictError(
            f"save(): tensor at {where} is a zero tensor without storage (torch.save cannot write it either); "
            "store torch.zeros(t.shape, dtype=t.dtype) instead.")


def _check_tensor(t: torch.Tensor, path: list[Any]) -> None:
    # Hot path (once per tensor per save): cheap attribute checks; messages are built only on error.
    # (torch is looked up here, not at import: the saver daemon imports this module without torch.)
    if (t.layout is torch.strided and not t.is_meta and not t.is_quantized
            and (type(t) is torch.Tensor or type(t) is torch.nn.Parameter)):
        return
    where = _key_str(path)
    if t.layout != torch.strided:
        raise InvalidStateDictError(
            f"save(): tensor at {where} has layout {t.layout}; flashckpt stores dense tensors only. "
            "Convert it with .to_dense() (or keep its indices and values as separate dense tensors).")
    if t.is_meta:
        raise InvalidStateDictError(
            f"save(): tensor at {where} is on the meta device and has no data; materialize it "
            "(for example with model.to_empty(device=...) and an init) before checkpointing.")
    if t.is_quantized:
        raise InvalidStateDictError(
            f"save(): tensor at {where} is quantized; store its int_repr() and quantization parameters instead.")
    raise InvalidStateDictError(
        f"save(): tensor at {where} is a {type(t).__name__}, a tensor subclass; pass its local data "
        "(DTensor.to_local()) or use the sharded checkpointer (flashckpt.integrations.fsdp.FsdpShardCheckpointer).")


def encode_opaque(opaque: list[Any], root: Any = None) -> tuple[bytes, list[int]]:
    """Pickle each opaque leaf separately (of the tree ``root``, for messages); returns the concatenation
    and the lengths. These pickles are what a persisted file holds (``_rawpickle``): protocol 2, as
    ``torch.save`` uses (torch's weights-only unpickler, which decodes them on a load with
    ``weights_only=True``, does not take the framing opcodes of protocols 4 and 5).

    Raises:
        InvalidStateDictError: a leaf cannot be pickled, naming its key.
    """
    parts = []
    for x in opaque:
        try:
            parts.append(pickle.dumps(x, protocol=2))
        except Exception as e:
            raise InvalidStateDictError(
                f"save(): the value at {_key_str(_path_to(root, x))} of type {type(x).__qualname__} can be neither "
                f"stored natively nor pickled ({e}); replace it with plain types or tensors.") from e
    return b"".join(parts), [len(p) for p in parts]


def decode_opaque(raw: bytes, *, weights_only: bool) -> Any:
    """Unpickles an opaque leaf written by a trainer. With ``weights_only`` only the types that
    ``torch.load(weights_only=True)`` accepts are allowed, as for a load from storage.

    Raises:
        InvalidStateDictError: ``weights_only`` and the leaf holds another type.
    """
    if not weights_only:
        return pickle.loads(raw)
    import io

    from torch import _weights_only_unpickler

    try:
        return _weights_only_unpickler.load(io.BytesIO(raw), encoding="utf-8")
    except pickle.UnpicklingError as e:
        raise InvalidStateDictError(
            f"load(): the snapshot holds a Python object that weights_only loading refuses ({e}). If the "
            "snapshot is trusted, construct the engine with weights_only=False.") from e


def split_opaque(blob: bytes | memoryview, lengths: list[int]) -> list[bytes]:
    out, pos = [], 0
    for n in lengths:
        out.append(bytes(blob[pos:pos + n]))
        pos += n
    return out


def unflatten(skeleton: Any, tensors: list[Any], opaque: list[Any], *, empty_bytes: Any = b"") -> Any:
    """Rebuild the tree from its skeleton; ``tensors`` and ``opaque`` are indexed by the skeleton.
    ``empty_bytes``: what stands for ``b""`` (the persist worker's stand-in pickles as a file must hold it)."""

    def dec(x: Any) -> Any:
        if type(x) is not list:
            return x
        tag = x[0]
        if tag == "T":
            return tensors[x[1]]
        if tag == "d":
            return {dec_key(k): dec(v) for k, v in x[1]}
        if tag == "od":
            od = OrderedDict((dec_key(k), dec(v)) for k, v in x[1])
            if len(x) > 2:
                od._metadata = dec(x[2])  # type: ignore[attr-defined]
            return od
        if tag == "l":
            return [dec(v) for v in x[1]]
        if tag == "t":
            return tuple(dec(v) for v in x[1])
        if tag == "o":
            return opaque[x[1]]
        return _decode_leaf(x, empty_bytes)

    def dec_key(k: Any) -> Any:
        if type(k) is not list:
            return k
        if k[0] == "t":
            return tuple(dec_key(v) for v in k[1])
        return dec(k)

    return dec(skeleton)


def _decode_leaf(x: list[Any], empty_bytes: Any) -> Any:
    """A tagged plain leaf of a skeleton (``unflatten``): float, big int, bool, bytes, complex, dtype,
    Size or device."""
    tag = x[0]
    if tag == "f":
        return _float_of(x[1])
    if tag == "I":
        return int(x[1], 16)
    if tag == "B":
        return bool(x[1])
    if tag == "b":
        return base64.b64decode(x[1]) if x[1] else empty_bytes
    if tag == "c":
        return complex(_float_of(x[1]), _float_of(x[2]))
    if tag == "dt":
        return dtype_from_name(x[1])
    if tag == "sz":
        return torch.Size(x[1])
    if tag == "dev":
        return torch.device(x[1])
    raise InvalidStateDictError(f"unknown tag {tag!r} in snapshot metadata")


def tensor_paths(skeleton: Any) -> list[tuple[Any, ...]]:
    """The key path of every tensor of a skeleton, in tensor-index order."""
    out: dict[int, tuple[Any, ...]] = {}

    def walk(x: Any, path: tuple[Any, ...]) -> None:
        if type(x) is not list:
            return
        tag = x[0]
        if tag == "T":
            out[x[1]] = path
        elif tag in ("d", "od"):
            for k, v in x[1]:
                walk(v, path + (_path_key(k) if type(k) is list else k,))
        elif tag in ("l", "t"):
            for i, v in enumerate(x[1]):
                walk(v, path + (i,))

    walk(skeleton, ())
    return [out[i] for i in range(len(out))]


_OPAQUE_KEY = object()  # in a path, a key that was pickled: equal to no key of any tree


def _path_key(k: list[Any]) -> Any:
    """A tagged key of a skeleton, decoded for a path (its pickled parts are not decoded here)."""
    try:
        return unflatten(k, [], [])
    except IndexError:
        return _OPAQUE_KEY


def tensors_by_path(tree: Any) -> dict[tuple[Any, ...], torch.Tensor]:
    """Every tensor of a state-dict tree by its key path (the paths ``tensor_paths`` gives)."""
    out: dict[tuple[Any, ...], torch.Tensor] = {}

    def walk(x: Any, path: tuple[Any, ...]) -> None:
        if isinstance(x, torch.Tensor):
            out[path] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, path + (k,))
        elif type(x) in (list, tuple):
            for i, v in enumerate(x):
                walk(v, path + (i,))

    walk(tree, ())
    return out
