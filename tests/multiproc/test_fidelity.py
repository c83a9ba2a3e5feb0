"""Issue #30, items 1 and 5: what ``load()`` returns is what was saved, bit for bit, from memory and from the
committed file (read by flashckpt and by a plain ``torch.load(weights_only=True)``), or ``save()`` refuses it
naming its key, before anything is written.

Item 1: conjugate and negative views (``z.conj()``, ``z.conj().imag``, ``torch._neg_view``) keep the bits that
make their values, as ``torch.save`` keeps them; tensors ``torch.save`` cannot write (two views of one storage
as different types, zero tensors, nested tensors) are refused at save. Item 5: every plain value and Python
object that passes the save-time check loads back from the committed file under the same rules as from
memory (sets, bytearrays, ``b""``, big ints, NaN payloads), and a committed file that cannot be read is a
damaged step (the previous one loads), while one the loader's own rules refuse is a clear error.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import pickle
import struct
import warnings

import pytest
import torch
import xxhash
from flashckpt import FlashCheckpointError, InvalidStateDictError, StorageType
from flashckpt.commit.layout import CommitLayout
from flashckpt.engine.remote_load import load_remote
from flashckpt.memory.plan import _grad_loads
from flashckpt.storage.posix import PosixDiskStorage
from flashckpt.util import native as _native
from helpers import assert_same_tree, wait_savers_gone

DISK, MEMORY = StorageType.DISK, StorageType.MEMORY


class RunConfig:
    """A training script's own config object, which torch.load(weights_only=True) refuses unless allowed
    (argparse.Namespace is one too, but importing megatron-core, as other tests do, allows it everywhere)."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunConfig) and other.lr == self.lr


def rank_file(ckpt: str, step: int, rank: int = 0) -> str:
    return os.path.join(ckpt, f"step_{step}", f"rank_{rank:05d}.pt")


def saved_and_loaded_everywhere(make_engine, ckpt_dir: str, sd: dict, *, weights_only: bool = True,
                                step: int = 1) -> None:
    """Saves ``sd`` for ``step`` (DISK) and checks it bit for bit from memory, from the committed file with a
    plain ``torch.load`` and from storage through a new engine once the memory is gone."""
    eng = make_engine(max_to_keep=0, weights_only=weights_only)
    assert eng.save(step, sd, storage_type=DISK)
    assert_same_tree(sd, eng.load(), "memory")
    assert eng.last_load.source == "memory"
    eng.wait(60)
    assert_same_tree(sd, torch.load(rank_file(ckpt_dir, step), weights_only=weights_only), "torch.load of the file")
    eng.close()  # the saver exits and frees the memory: the next engine loads from storage
    wait_savers_gone(os.environ["FLASHCKPT_RUNTIME_DIR"])
    eng2 = make_engine(max_to_keep=0, weights_only=weights_only)
    assert_same_tree(sd, eng2.load(), "storage")
    assert eng2.last_load.source == "storage" and eng2.last_load.step == step
    eng2.close()


def refused_naming(make_engine, ckpt_dir: str, sd: dict, key: str, *, weights_only: bool = True,
                   also: str = "") -> InvalidStateDictError:
    """``save`` refuses ``sd`` with an InvalidStateDictError naming ``key``, and writes nothing: no snapshot in
    memory, no file; the engine saves a good state dict right after."""
    eng = make_engine(max_to_keep=0, weights_only=weights_only)
    with pytest.raises(InvalidStateDictError) as info:
        eng.save(7, sd, storage_type=DISK)
    msg = str(info.value)
    assert f"[{key!r}]" in msg, msg
    assert also in msg, msg
    assert 7 not in eng.memory_steps() and not os.path.exists(os.path.join(ckpt_dir, "step_7"))
    eng.save(8, {"ok": torch.ones(2)}, storage_type=DISK)
    eng.wait(60)
    assert 8 in eng.committed_steps() and 7 not in eng.committed_steps()
    eng.close()
    return info.value


# ------------------------------------------------------------------------ item 1: conjugate and negative views
def test_conjugate_and_negative_views_round_trip_bit_exact(make_engine, ckpt_dir):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(4, dtype=torch.complex64, generator=g)
    w = torch.randn(3, 2, dtype=torch.complex128, generator=g)
    sd = {
        "z": z,
        "conj": z.conj(),  # the same storage and dtype as "z": stored once, restored shared
        "conj_imag": w.conj().imag,  # a float view of a complex storage with the negative bit
        "neg": torch._neg_view(torch.randn(5, generator=g)),
        "neg_int": torch._neg_view(torch.arange(4)),
        "conj_neg": torch._neg_view(torch.randn(2, dtype=torch.complex64, generator=g).conj()),
        "param": torch.nn.Parameter(torch.randn(2, dtype=torch.complex64, generator=g).conj()),
        "strided": torch.randn(4, 3, dtype=torch.complex64, generator=g).conj().t()[::2],
        "plain": torch.randn(3, generator=g),
    }
    assert sd["conj"].is_conj() and sd["conj_imag"].is_neg() and sd["neg"].is_neg()
    saved_and_loaded_everywhere(make_engine, ckpt_dir, sd)


def test_a_conjugate_snapshot_loaded_into_plain_tensors_keeps_its_values(make_engine):
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    x = torch.tensor([1.0, -2.0])
    eng = make_engine(max_to_keep=0)
    eng.save(1, {"c": z.conj(), "n": torch._neg_view(x)}, storage_type=MEMORY)
    into = {"c": torch.zeros(2, dtype=torch.complex64), "n": torch.zeros(2)}
    out = eng.load(into=into)
    assert torch.equal(out["c"].resolve_conj(), z.conj().resolve_conj())
    assert torch.equal(out["n"].resolve_neg(), -x)
    eng.close()


def test_two_views_of_one_storage_as_different_types_are_refused_at_save(make_engine, ckpt_dir):
    # torch.save refuses these ("Cannot save multiple tensors or storages that view the same data as
    # different types"): flashckpt used to snapshot them and fail later, in the persist.
    z = torch.randn(4, dtype=torch.complex64)
    refused_naming(make_engine, ckpt_dir, {"c": z.conj(), "ci": z.conj().imag}, "ci", also="['c']")
    refused_naming(make_engine, ckpt_dir, {"z": z, "re": {"part": z.real}}, "part", also="['z']")
    f = torch.randn(4)
    refused_naming(make_engine, ckpt_dir, {"f": f, "u8": f.view(torch.uint8)}, "u8", also="clone()")


def test_views_torch_save_writes_as_bytes_may_share_a_storage(make_engine, ckpt_dir):
    # float8 and the unsigned 16-64 bit types are written as untyped bytes: torch.save keeps them shared
    # with a uint8 view of the same storage, and so does flashckpt.
    raw = torch.arange(16, dtype=torch.uint8)
    sd = {"u8": raw, "f8": raw.view(torch.float8_e4m3fn), "u16": raw.view(torch.uint16)[1:]}
    saved_and_loaded_everywhere(make_engine, ckpt_dir, sd)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("kind", ["zero", "nested", "quantized_dtype", "float8_requires_grad"])
def test_tensors_torch_save_cannot_write_are_refused_at_save_naming_the_key(make_engine, ckpt_dir, monkeypatch,
                                                                            kind, native):
    if not native:
        monkeypatch.setattr(_native, "get", lambda: None)  # the Python walk and signature
    if kind == "zero":
        t = torch._efficientzerotensor(3)
    elif kind == "nested":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (nested tensors are a prototype, torch warns once)
            t = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    elif kind == "quantized_dtype":
        t = torch.arange(4, dtype=torch.uint8).view(torch.quint8)  # no quantizer: torch.save cannot write it
    else:
        # torch.save writes it, but torch.load (2.13) cannot rebuild a float8 tensor that requires grad; a
        # torch that can gets it back.
        t = torch.zeros(4, dtype=torch.float8_e4m3fn).requires_grad_()
        if _grad_loads(torch.float8_e4m3fn):  # (asks this torch)
            saved_and_loaded_everywhere(make_engine, ckpt_dir, {"model": {"t": t}})
            return
    refused_naming(make_engine, ckpt_dir, {"model": {"t": t}}, "t")


def test_remote_loads_keep_the_conjugate_and_negative_bits(tmp_path):
    # The object-store loader (ranged reads straight into new or the caller's tensors) rebuilds each
    # tensor itself; a POSIX storage exercises the same code.
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    sd = {"c": z.conj(), "n": torch._neg_view(torch.tensor([1.0, -2.0])), "p": torch.ones(2)}
    path = str(tmp_path / "f.pt")
    torch.save(sd, path)
    with open(path, "rb") as f:
        data = f.read()
    storage = PosixDiskStorage()
    for into in (None, {"c": torch.zeros(2, dtype=torch.complex64), "n": torch.zeros(2), "p": torch.zeros(2)}):
        out = load_remote(storage, path, size=len(data), xxh3=xxhash.xxh3_64_hexdigest(data), weights_only=True,
                          into=into)
        for k in sd:
            assert torch.equal(out[k].resolve_conj().resolve_neg(), sd[k].resolve_conj().resolve_neg()), k
        if into is None:
            assert_same_tree(sd, out, "remote load")


# ------------------------------------------------------------------------ item 5: values the commit must load
def test_python_objects_load_from_the_committed_file_as_from_memory(make_engine, ckpt_dir):
    sd = {
        "w": torch.randn(3),
        "set": {1, 2, "a"},
        "bytearray": bytearray(b"ab\x00"),
        "empty_bytearray": bytearray(),
        "counter": collections.Counter(a=2, b=1),
        "nested": [{"s": {3}, "t": (bytearray(b"x"), {4, 5})}],
        "empty_bytes": b"",
        "key_types": {(1, b""): b"", -0.0: 1},
        "ns": argparse.Namespace(lr=0.1, name="x", tags={"a"}),
        "cfg": RunConfig(0.5),
    }
    with torch.serialization.safe_globals([argparse.Namespace, RunConfig]):
        saved_and_loaded_everywhere(make_engine, ckpt_dir, sd)
    with open(rank_file(ckpt_dir, 1), "rb") as f:
        assert b"pickle" not in f.read(), "the file embeds pickle.loads"


def test_python_objects_round_trip_without_weights_only(make_engine, ckpt_dir):
    class Config:  # a local class pickles by reference: this one cannot (refused below), a module one can
        pass

    sd = {"ns": argparse.Namespace(a=1), "frozen": frozenset({1}), "range": range(3), "slice": slice(1, 5, 2),
          "dd": collections.defaultdict(int, a=1), "empty": b""}
    saved_and_loaded_everywhere(make_engine, ckpt_dir, sd, weights_only=False)
    refused_naming(make_engine, ckpt_dir, {"c": {"cfg": Config()}}, "cfg", weights_only=False)


def test_python_objects_weights_only_loading_refuses_are_refused_at_save(make_engine, ckpt_dir):
    refused_naming(make_engine, ckpt_dir, {"a": {"cfg": RunConfig(0.1)}}, "cfg", also="add_safe_globals")
    refused_naming(make_engine, ckpt_dir, {"fs": frozenset({1})}, "fs", also="weights_only=False")
    refused_naming(make_engine, ckpt_dir, {"s": {b""}}, "s")  # pickled as builtins.bytes(): torch.load refuses it


def test_big_ints_round_trip_or_are_refused_naming_the_key(make_engine, ckpt_dir):
    # Pickle writes ints of up to 255 bytes as LONG1, which torch.load(weights_only=True) reads, and longer
    # ones as LONG4, which it refuses; 10**5000 has more digits than Python converts to a string (JSON).
    fits = {"i64_max": 2**63 - 1, "u64": 2**64, "below_i64": -2**63 - 1, "long1_max": 2**2039 - 1,
            "long1_min": -2**2039, "keys": {2**70: "a", -2**70: "b"}}
    saved_and_loaded_everywhere(make_engine, ckpt_dir, fits)
    refused_naming(make_engine, ckpt_dir, {"x": {"big": 10**700}}, "big", also="weights_only")
    refused_naming(make_engine, ckpt_dir, {"x": {"huge": 10**5000}}, "huge", also="weights_only")
    # A key too long for Python to print is named by its size (the message itself must not fail).
    refused_naming(make_engine, ckpt_dir, {"k": {10**5000: 1}}, "k", also=f"<int of {(10**5000).bit_length()} bits")


def test_huge_ints_round_trip_without_weights_only(make_engine, ckpt_dir):
    saved_and_loaded_everywhere(make_engine, ckpt_dir, {"big": 10**700, "huge": -(10**5000), "k": {10**5000: 1}},
                                weights_only=False)


def test_float_leaves_keep_their_bits(make_engine, ckpt_dir):
    def bits(u: int) -> float:
        return struct.unpack("<d", struct.pack("<Q", u))[0]

    sd = {"nan": float("nan"), "neg_nan": bits(0xFFF8000000000000), "payload_nan": bits(0x7FF0000000000123),
          "neg_zero": -0.0, "inf": float("-inf"), "tiny": 5e-324, "in_tuple": (bits(0x7FF8000000000042), 1.5),
          "c": complex(bits(0xFFF8000000000001), -0.0)}
    saved_and_loaded_everywhere(make_engine, ckpt_dir, sd)


def test_a_committed_file_that_does_not_load_is_a_damaged_step_and_the_previous_one_loads(make_engine, ckpt_dir):
    eng = make_engine(max_to_keep=0)
    for step in (1, 2):
        eng.save(step, {"w": torch.full((3,), float(step))}, storage_type=DISK)
        eng.wait(60)
    eng.close()
    wait_savers_gone(os.environ["FLASHCKPT_RUNTIME_DIR"])
    # Step 2's file replaced by one that matches its manifest but that torch.load cannot read.
    path = rank_file(ckpt_dir, 2)
    with open(path, "wb") as f:
        f.write(b"not a torch.save archive")
    layout = CommitLayout(ckpt_dir, PosixDiskStorage())
    with open(layout.manifest_path(2)) as f:
        m = json.load(f)
    for recs in m["files"].values():
        for r in recs:
            r.update(size=len(b"not a torch.save archive"), xxh3=xxhash.xxh3_64_hexdigest(b"not a torch.save archive"))
    with open(layout.manifest_path(2), "w") as f:
        json.dump(m, f)
    eng2 = make_engine(max_to_keep=0)
    sd = eng2.load()
    assert eng2.last_load.source == "storage" and eng2.last_load.step == 1
    assert torch.equal(sd["w"], torch.full((3,), 1.0))
    eng2.close()


def test_a_committed_file_the_loaders_rules_refuse_is_a_clear_error_not_an_older_step(make_engine, ckpt_dir):
    # Saved by an engine that loads any object; loaded by one that loads only weights: no older step is
    # handed back in its place (it would hold the same objects, or be a silent step back).
    eng = make_engine(max_to_keep=0, weights_only=False)
    eng.save(1, {"w": torch.ones(2)}, storage_type=DISK)
    eng.save(2, {"w": torch.ones(2), "args": RunConfig(0.1)}, storage_type=DISK)
    eng.wait(60)
    eng.close()
    wait_savers_gone(os.environ["FLASHCKPT_RUNTIME_DIR"])
    eng2 = make_engine(max_to_keep=0, weights_only=True)
    with pytest.raises(FlashCheckpointError, match="weights_only=False"):
        eng2.load()
    eng2.close()


def test_a_spliced_pickle_loads_as_the_object_itself_wherever_the_outer_memo_stands():
    # The persist worker writes an opaque leaf's pickle into torch.save's stream unread. Its memo indexes
    # move past the outer pickler's, which here holds over 256 entries (4-byte indexes), and objects pickled
    # after it are memoized past its own: what the file holds is what torch.save of the objects writes.
    from flashckpt.format.rawpickle import EMPTY_BYTES, RawPickle
    from flashckpt.format.torchfile import SPLICING_MODULE, load_parts, torch_save_parts

    shared = ["a", "b"]
    inner = {"cfg": RunConfig(0.25), "twice": [shared, shared], "s": {1, 2}, "ba": bytearray(b"\x00x")}
    keys = [f"key{i}" for i in range(300)]
    after = ["after"]
    tree = {**{k: (k, torch.full((1,), float(i))) for i, k in enumerate(keys)},
            "opaque": RawPickle(pickle.dumps(inner, 2)), "after": [after, after], "empty": EMPTY_BYTES,
            "w": torch.arange(3)}
    want = {**{k: (k, torch.full((1,), float(i))) for i, k in enumerate(keys)}, "opaque": inner,
            "after": [after, after], "empty": b"", "w": torch.arange(3)}
    with torch.serialization.safe_globals([RunConfig]):
        for got in (load_parts(torch_save_parts(tree, raw_pickles=True), weights_only=True),
                    torch.load(_saved(tree, SPLICING_MODULE), weights_only=True)):
            assert_same_tree(want, got, "spliced")
            assert got["opaque"]["twice"][0] is got["opaque"]["twice"][1]  # the inner pickle's own memo
            assert got["after"][0] is got["after"][1]  # the outer memo past the spliced entries


def _saved(tree, module):
    buf = io.BytesIO()
    torch.save(tree, buf, pickle_module=module)
    buf.seek(0)
    return buf
