"""The round-trip rule over generated state dicts (issue #30, "Beyond these cases"): every state dict is
either saved and loaded back bit for bit, from memory and from the committed file (read by flashckpt and by
a plain ``torch.load`` under the engine's ``weights_only``), or refused by ``save()`` with an
``InvalidStateDictError`` that names a key of it, before anything is written.

The state dicts (``hypothesis``) hold tensors of every dtype ``torch.save`` writes (bool, the int and
unsigned types, float16/bfloat16/32/64, the float8 and float4 types, complex32/64/128, the bits and
quantized-integer types), as contiguous tensors and views: conjugate and negative views, ``.real``/``.imag``,
transposed, strided and offset slices, expanded (stride 0), zero-size, 0-dim, views as another dtype,
``nn.Parameter`` with and without ``requires_grad``; tied and aliased (the same tensor twice, several views of
one storage); and the leaves ``torch.save`` takes: ints (to 10**5000), floats (NaN payloads, -0.0, inf), bools,
None, str (unicode, lone surrogates), bytes (empty too), bytearray, complex, torch.dtype/Size/device, sets,
frozensets, Counters, argparse.Namespace, OrderedDicts with ``_metadata``, nested lists/tuples/dicts with
keys of every plain type. "Bit for bit": the bytes of every storage, dtype, shape, strides, storage offset,
conjugate/negative bits, requires_grad, Parameter-ness, storage sharing exactly where it was shared, float
bits, container and key types and order.

One engine serves every example of a test (a saver per example would take most of the time). CI runs a
bounded number (``PROFILE_EXAMPLES``, derandomized); ``--hypothesis-examples N`` (or
``FLASHCKPT_PROPERTY_EXAMPLES=N``) runs N random ones per test.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import struct
import sys
import warnings
from collections import OrderedDict
from typing import Any

import pytest
import torch
from flashckpt import InvalidStateDictError, StorageType
from flashckpt.format.tree import _key_str
from flashckpt.util import native as _native
from helpers import assert_same_tree, short_repr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PROFILE_EXAMPLES = 25  # per test in CI (each example persists and commits one step)


def _examples(config: pytest.Config) -> tuple[int, bool]:
    """(examples per test, derandomize): the flag or environment asks for a random soak."""
    n = config.getoption("--hypothesis-examples", 0) or int(os.environ.get("FLASHCKPT_PROPERTY_EXAMPLES", "0") or 0)
    return (n, False) if n > 0 else (PROFILE_EXAMPLES, True)


# ---------------------------------------------------------------------------------------------- tensors
def _round_trips_in_torch(t: torch.Tensor) -> bool:
    buf = io.BytesIO()
    try:
        torch.save({"t": t}, buf)
        buf.seek(0)
        got = torch.load(buf, weights_only=True)["t"]
    except Exception:
        return False
    return got.dtype == t.dtype and (got.is_conj(), got.is_neg()) == (t.is_conj(), t.is_neg())


def _savable_dtypes() -> list[torch.dtype]:
    """The dtypes of this torch whose tensors ``torch.save`` writes and ``torch.load(weights_only=True)`` reads."""
    names = ["bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16", "bfloat16",
             "float32", "float64", "complex32", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
             "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8",
             "bits2x4", "bits4x2", "qint8", "quint8", "qint32"]
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            dt = getattr(torch, name, None)
            if not isinstance(dt, torch.dtype):
                continue
            try:
                t = torch.zeros(4 * torch.empty(0, dtype=dt).element_size(), dtype=torch.uint8).view(dt)
            except Exception:
                continue
            if _round_trips_in_torch(t):
                out.append(dt)
    return out


DTYPES = _savable_dtypes()
FLOATING = {d for d in DTYPES if d.is_floating_point or d.is_complex}


def _base(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """A contiguous tensor of ``numel`` elements of random bit patterns (NaN payloads included; bools 0/1)."""
    size = torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype)


def _view(t: torch.Tensor, kind: str, a: int, b: int) -> torch.Tensor | None:
    """A view of ``t`` of ``kind`` (None where it does not apply, or torch does not make it for this dtype)."""
    try:
        return _make_view(t, kind, a, b)
    except (RuntimeError, TypeError, ValueError, IndexError):
        return None


def _make_view(t: torch.Tensor, kind: str, a: int, b: int) -> torch.Tensor | None:
    n = t.numel()
    if kind == "whole":
        return t
    if kind == "slice":
        return t[a % (n + 1):: 1 + b % 3] if t.dim() == 1 else t[a % (t.shape[0] + 1):]
    if kind == "zero_size":
        return t[0:0]
    if kind == "scalar":
        return t.reshape(-1)[a % n] if n else None
    if kind == "transpose":
        if n < 2:
            return None
        rows = 1 + a % (n - 1)
        return t.reshape(-1)[: rows * (n // rows)].reshape(rows, n // rows).t()
    if kind == "expand":
        return t.reshape(-1)[a % n: a % n + 1].expand(1 + b % 4, 1 + a % 3) if n else None
    if kind == "conj":
        return t.conj() if t.is_complex() else None
    if kind == "neg":
        return torch._neg_view(t)
    if kind in ("real", "imag"):
        return getattr(t, kind) if t.is_complex() and t.dtype != torch.complex32 else None
    if kind == "as_dtype":
        return t.view(DTYPES[a % len(DTYPES)]) if t.dim() == 1 and t.stride(0) == 1 else None
    raise AssertionError(kind)


VIEW_KINDS = ["whole", "slice", "zero_size", "scalar", "transpose", "expand", "conj", "neg", "real", "imag", "as_dtype"]


@st.composite
def tensor_lists(draw: Any) -> list[torch.Tensor]:
    """A few tensors, some of them the same object (tied) or views of one storage (aliased)."""
    bases = [_base(draw(st.sampled_from(DTYPES)), draw(st.integers(0, 24)), draw(st.integers(0, 2**31)))
             for _ in range(draw(st.integers(1, 3)))]
    out: list[torch.Tensor] = []
    for _ in range(draw(st.integers(1, 6))):
        if out and draw(st.integers(0, 5)) == 0:
            out.append(out[draw(st.integers(0, len(out) - 1))])  # the same tensor again
            continue
        t = bases[draw(st.integers(0, len(bases) - 1))]
        for _ in range(draw(st.integers(0, 2))):
            v = _view(t, draw(st.sampled_from(VIEW_KINDS)), draw(st.integers(0, 1000)), draw(st.integers(0, 1000)))
            if v is not None:
                t = v
        wrap = draw(st.sampled_from(["tensor", "parameter", "requires_grad"]))
        try:
            if wrap == "parameter":
                t = torch.nn.Parameter(t, requires_grad=t.dtype in FLOATING and draw(st.booleans()))
            elif wrap == "requires_grad" and t.dtype in FLOATING:
                t = t.detach().requires_grad_()
        except RuntimeError:
            pass  # a view torch does not let require grad
        out.append(t)
    return out


# ------------------------------------------------------------------------------------------------ leaves
def _float_of_bits(u: int) -> float:
    return float(struct.unpack("<d", struct.pack("<Q", u))[0])


INTS = st.one_of(st.integers(), st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64]),
                 st.sampled_from([(2, 2039, -1), (-2, 2039, 0), (2, 2040, 0), (10, 700, 0), (-10, 700, 0), (10, 5000, 0)])
                 .map(lambda p: p[0] ** p[1] + p[2]))  # over 255 bytes (pickle's LONG4), over 4300 digits
FLOATS = st.one_of(st.floats(), st.integers(0, 2**64 - 1).map(_float_of_bits), st.sampled_from([-0.0, 0.0]))
TEXT = st.text(st.characters(exclude_categories=()), max_size=8)  # lone surrogates too
HASHABLE = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), TEXT, st.binary(max_size=4))
KEYS = st.one_of(TEXT, INTS, FLOATS, st.booleans(), st.none(), st.binary(max_size=4),
                 st.tuples(TEXT, st.integers()), st.frozensets(st.integers(), max_size=2))
PLAIN = st.one_of(
    st.none(), st.booleans(), INTS, FLOATS, TEXT, st.binary(max_size=8),
    st.builds(complex, FLOATS, FLOATS),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.complex64, torch.bool]),
    st.lists(st.integers(0, 2**40), max_size=3).map(torch.Size),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")]),
)
OBJECTS = st.one_of(
    st.sets(HASHABLE, max_size=3), st.frozensets(HASHABLE, max_size=3), st.binary(max_size=6).map(bytearray),
    st.dictionaries(TEXT, st.integers(), max_size=2).map(collections.Counter),
    st.dictionaries(st.sampled_from(["lr", "name", "tags"]), HASHABLE, max_size=2).map(lambda d: argparse.Namespace(**d)),
)


class _Slot:
    """Where the i-th generated tensor goes in a tree."""

    def __init__(self, i: int) -> None:
        self.i = i


def _with_metadata(items: list[tuple[Any, Any]], md: Any) -> OrderedDict:
    od: OrderedDict = OrderedDict(items)
    if md is not None:
        od._metadata = md  # type: ignore[attr-defined]  # as nn.Module.state_dict() attaches it
    return od


def _trees(leaves: Any) -> Any:
    return st.recursive(leaves, lambda kids: st.one_of(
        st.lists(kids, max_size=3), st.lists(kids, max_size=3).map(tuple),
        st.dictionaries(KEYS, kids, max_size=3),
        st.builds(_with_metadata, st.lists(st.tuples(TEXT, kids), max_size=3),
                  st.none() | st.just(OrderedDict([("", {"version": 1})]))),
    ), max_leaves=12)


class _Example:
    """A generated state dict, printed (in hypothesis' reports) with ints of any length."""

    def __init__(self, sd: dict[str, Any]) -> None:
        self.sd = sd

    def __repr__(self) -> str:
        limit = sys.get_int_max_str_digits()
        sys.set_int_max_str_digits(0)  # for this repr only: the library runs under the default limit
        try:
            return repr(self.sd)
        finally:
            sys.set_int_max_str_digits(limit)


@st.composite
def state_dicts(draw: Any) -> _Example:
    tensors = draw(tensor_lists())
    leaves = st.one_of(st.integers(0, len(tensors) - 1).map(_Slot), PLAIN, OBJECTS)
    sd = {f"part{i}": draw(_trees(leaves)) for i in range(draw(st.integers(1, 3)))}
    sd["tensors"] = [_Slot(i) for i in range(len(tensors))]  # every tensor at least once

    def fill(x: Any) -> Any:
        if isinstance(x, _Slot):
            return tensors[x.i]
        if type(x) is OrderedDict:
            out = OrderedDict((k, fill(v)) for k, v in x.items())
            if hasattr(x, "_metadata"):
                out._metadata = x._metadata  # type: ignore[attr-defined]
            return out
        if type(x) is dict:
            return {k: fill(v) for k, v in x.items()}
        if type(x) in (list, tuple):
            return type(x)(fill(v) for v in x)
        return x

    return _Example(fill(sd))


# ------------------------------------------------------------------------------------------------ checks
def _paths(x: Any, path: list[Any], out: set[str]) -> set[str]:
    """The key of every node of the tree ``x``, as flashckpt's messages write them."""
    out.add(_key_str(path))
    if type(x) in (dict, OrderedDict):
        for k, v in x.items():
            _paths(v, [*path, k], out)
    elif type(x) in (list, tuple):
        for i, v in enumerate(x):
            _paths(v, [*path, i], out)
    return out


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if type(x) in (list, tuple):
        return [t for v in x for t in _tensors(v)]
    return []


def _sharing(tensors: list[torch.Tensor]) -> list[int]:
    """For each tensor, the index of the first tensor sharing its storage (empty storages share nothing)."""
    first: dict[int, int] = {}
    out = []
    for i, t in enumerate(tensors):
        st_ = t.untyped_storage()
        out.append(first.setdefault(st_.data_ptr(), i) if st_.nbytes() else i)
    return out


def _metadata_of(a: Any, b: Any, where: str = "<root>") -> None:
    """The ``_metadata`` of every OrderedDict of ``a`` is on the same one of ``b`` (assert_same_tree does
    not look at attributes)."""
    if type(a) is OrderedDict:
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), f"{where}: _metadata differs"
    if type(a) in (dict, OrderedDict):
        for (k, v), w in zip(a.items(), b.values()):
            _metadata_of(v, w, f"{where}[{short_repr(k):.40}]")
    elif type(a) in (list, tuple):
        for i, (v, w) in enumerate(zip(a, b)):
            _metadata_of(v, w, f"{where}[{i}]")


def _same(want: Any, got: Any, where: str) -> None:
    assert_same_tree(want, got, where)
    _metadata_of(want, got, where)
    wt, gt = _tensors(want), _tensors(got)
    assert _sharing(wt) == _sharing(gt), f"{where}: storage sharing {_sharing(gt)} instead of {_sharing(wt)}"


def _check_rule(eng: Any, ckpt_dir: str, step: int, sd: dict[str, Any]) -> str:
    """Saves ``sd`` as ``step`` and asserts the rule; returns "refused" or "round-trip"."""
    before = eng.memory_steps()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about some of these dtypes and views
            eng.save(step, sd, storage_type=StorageType.DISK)
    except InvalidStateDictError as e:
        msg = str(e)
        assert msg.startswith("save(): ") and any(p in msg for p in _paths(sd, [], set()) if p != "<root>"), \
            f"the refusal names no key of the state dict: {msg}"
        assert eng.memory_steps() == before, "a refused save changed what memory holds"
        assert not os.path.exists(os.path.join(ckpt_dir, f"step_{step}")), "a refused save wrote a file"
        return "refused"
    _same(sd, eng.load_memory(step), "memory")
    eng.wait(120)
    path = os.path.join(ckpt_dir, f"step_{step}", "rank_00000.pt")
    _same(sd, torch.load(path, weights_only=eng.weights_only, map_location="cpu"), "torch.load of the file")
    _same(sd, eng.load(resume_path=path), "flashckpt's load of the file")
    return "round-trip"


def _run(request: pytest.FixtureRequest, make_engine: Any, ckpt_dir: str, *, weights_only: bool) -> None:
    """Checks the rule over the examples with one engine (see the module docstring)."""
    n, derandomize = _examples(request.config)
    eng = make_engine(max_to_keep=2, weights_only=weights_only)
    step = 0
    outcomes: collections.Counter[str] = collections.Counter()

    @settings(max_examples=n, derandomize=derandomize, deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(state_dicts())
    def check(example: _Example) -> None:
        nonlocal step
        step += 1
        outcomes[_check_rule(eng, ckpt_dir, step, example.sd)] += 1

    try:
        check()
    finally:
        eng.close()
    assert outcomes["round-trip"], f"every generated state dict was refused: {outcomes}"


def test_generated_state_dicts_round_trip_bit_exact_or_are_refused_naming_a_key(request, make_engine, ckpt_dir):
    _run(request, make_engine, ckpt_dir, weights_only=True)


def test_generated_state_dicts_without_weights_only_and_without_the_native_fast_path(request, make_engine, ckpt_dir,
                                                                                    monkeypatch):
    monkeypatch.setattr(_native, "get", lambda: None)  # the Python walk and signature (test_native.py compares both)
    _run(request, make_engine, ckpt_dir, weights_only=False)
