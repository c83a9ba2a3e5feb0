"""State-dict trees and metadata: pure flatten/plan logic, and bit-exact round trips of every dtype, layout and
leaf type through shared memory and through the persisted file.

The round-trip fixture saves two state dicts once per module with one real engine (one saver daemon):
step 1 holds only plain types (every dtype, every tensor layout, every plain leaf) and step 2 holds opaque
leaves (a dataclass defined here, a numpy array, a set). Each is read back three ways: from shared memory
(``engine.load()``), with vanilla ``torch.load`` of the persisted file, and through the engine's storage path
(``load(resume_path=...)``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections import OrderedDict

import numpy as np
import pytest
import torch
from flashckpt import CheckpointEngine, FlashCheckpointError, InvalidStateDictError, StorageType
from flashckpt.format.tree import Flat, flatten, flatten_like, unflatten
from flashckpt.memory.plan import ALIGN, plan_snapshot, signature_of
from helpers import assert_bit_identical, assert_same_tree, leftovers, wait_savers_gone

DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "float64": torch.float64, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2, "int8": torch.int8,
    "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8,
    "uint16": torch.uint16, "uint32": torch.uint32, "uint64": torch.uint64, "bool": torch.bool,
    "complex64": torch.complex64, "complex128": torch.complex128,
}
_NAN_FREE = {"int8", "int16", "int32", "int64", "uint8", "bool"}  # torch.equal is meaningful on these

SOURCES = ["memory", "file", "engine_storage"]


@dataclasses.dataclass
class Point:
    """An opaque leaf: a user class the saver cannot import (it runs with cwd=/ and no tests dir on its path)."""

    x: int
    y: float


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (floats include NaNs, infinities and subnormals)."""
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    t = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen).view(dtype).reshape(shape)
    if dtype.is_floating_point:
        t.view(-1)[0] = float("nan")  # make sure NaN is there: only a bitwise comparison passes
    return t


def make_layouts(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "transposed": torch.randn(4, 6, generator=gen).t(),
        "sliced_with_stride": torch.randn(40, generator=gen)[3::4],
        "sliced_2d": torch.randn(8, 10, generator=gen).bfloat16()[1:7:2, ::3],
        "expanded_stride0": torch.randn(3, 1, generator=gen).expand(3, 4),
        "channels_last": torch.randn(2, 3, 4, 5, generator=gen).to(memory_format=torch.channels_last),
        "zero_size": torch.empty(0),
        "zero_size_2d_fp16": torch.empty(0, 3, dtype=torch.float16),
        "zero_size_view": torch.arange(10.0)[5:5],
        "scalar_0dim": torch.tensor(2.5),
        "scalar_0dim_int": torch.tensor(-7, dtype=torch.int64),
        "scalar_view_0dim": torch.arange(5.0)[2],
        "requires_grad": torch.randn(3, generator=gen).requires_grad_(True),
        "parameter": torch.nn.Parameter(torch.randn(2, 2, generator=gen)),
        "parameter_frozen": torch.nn.Parameter(torch.randn(2, generator=gen), requires_grad=False),
    }


def make_plain_leaves() -> dict:
    return {
        "none": None, "true": True, "false": False, "zero": 0, "neg": -7, "big": 2**70, "float": 3.25,
        "nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"), "negzero": -0.0,
        "str": "hello", "empty_str": "", "unicode": "ünïcödé ✓", "bytes": b"\x00\xffab",
        "complex": complex(1.5, -2.0), "dtype": torch.bfloat16, "dtype_f8": torch.float8_e5m2,
        "size": torch.Size([2, 3]), "device": torch.device("cpu"),
        "list": [1, [2, [3, ()]], (4, 5)], "tuple": (1, "a", None, (2.0,)), "empty_dict": {}, "empty_list": [],
        "ordered": OrderedDict([("z", 1), ("a", OrderedDict([("k", [1.5])]))]),
        "int_keys": {0: "a", 1: "b", -5: "c"},
        "tuple_keys": {(1, "a"): 1, (2, ("n", 3)): 2, (): 3},
        "mixed_keys": {None: 1, 2.5: 2, b"k": 3, "s": 4, True: 5},
        # Values that look like the skeleton's own tags must stay what they are.
        "lookalikes": [["T", 0], ["o", 0], ("d", []), {"T": 1, "l": 2}],
    }


def make_plain_sd() -> dict:
    gen = torch.Generator().manual_seed(1234)
    return {
        "dtypes": {name: random_bits(dt, (3, 5), gen) for name, dt in DTYPES.items()},
        "layouts": make_layouts(gen),
        "leaves": make_plain_leaves(),
        "model": OrderedDict([("layer.0.weight", torch.randn(4, 4, generator=gen)), ("step", 7)]),
    }


def make_opaque_sd() -> dict:
    return {
        "point": Point(1, 2.5),
        "np": np.arange(6, dtype=np.int32).reshape(2, 3),
        "set": {1, 2, 3},
        "frozen_key": {frozenset({1, 2}): "fk"},
        "nested": [Point(3, 4.0), {"deep": Point(5, 6.0)}],
        "w": torch.arange(4.0),
        # Plain for flashckpt, but vanilla torch.save pickles b"" as a call to `bytes`, which
        # torch.load(weights_only=True) refuses, so it lives in the weights_only=False state dict.
        "empty_bytes": b"",
    }


def _file(ckpt: str, step: int) -> str:
    return os.path.join(ckpt, f"step_{step}", "rank_00000.pt")


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory):
    """Saves both state dicts once (own runtime dir and saver) and returns what every path read back.

    The engine and its saver live only inside this fixture's setup; it checks their clean-up itself, so
    no state crosses into the tests."""
    ckpt = str(tmp_path_factory.mktemp("tree") / "ckpt")
    rt = tempfile.mkdtemp(prefix="fct-", dir="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    out: dict = {"plain_src": make_plain_sd(), "opaque_src": make_opaque_sd(), "plain": {}, "opaque": {}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHCKPT_RUNTIME_DIR", rt)
        mp.setenv("FLASHCKPT_SAVER_GRACE_S", "20")
        eng = CheckpointEngine(ckpt, max_to_keep=0, weights_only=False)
        try:
            eng.save(1, out["plain_src"], storage_type=StorageType.DISK)
            out["plain"]["memory"] = eng.load()
            out["plain_load"] = eng.last_load
            eng.save(2, out["opaque_src"], storage_type=StorageType.DISK)
            out["opaque"]["memory"] = eng.load()
            out["opaque_load"] = eng.last_load
            eng.wait(60)
            out["files"] = [_file(ckpt, 1), _file(ckpt, 2)]
            out["plain"]["file"] = torch.load(_file(ckpt, 1), weights_only=True)
            out["opaque"]["file"] = torch.load(_file(ckpt, 2), weights_only=False)
            out["plain"]["engine_storage"] = eng.load(resume_path="step_1/rank_00000.pt")
            out["opaque"]["engine_storage"] = eng.load(resume_path="step_2/rank_00000.pt")
            out["resume_load"] = eng.last_load
            # A second engine of this process (same saver) with the default weights_only=True.
            strict = CheckpointEngine(ckpt, max_to_keep=0)
            try:
                try:
                    strict.load(resume_path="step_2/rank_00000.pt")
                    out["strict_error"] = None
                except FlashCheckpointError as e:
                    out["strict_error"] = e
                out["strict_plain"] = strict.load(resume_path="step_1/rank_00000.pt")
            finally:
                strict.close()
        finally:
            eng.close()
        wait_savers_gone(rt)
        left = leftovers(rt)
        shutil.rmtree(rt, ignore_errors=True)
    assert not left, f"the round-trip savers left {left}"
    return out


# ------------------------------------------------------------------------------------------ pure
def test_flatten_gives_a_json_skeleton_and_unflatten_restores_the_tree():
    sd = {**make_plain_sd(), "opaque": make_opaque_sd()}
    flat = flatten(sd)
    skeleton = json.loads(json.dumps(flat.skeleton))  # plain JSON, no pickle
    # Only the non-plain leaves become opaque: Point x3, ndarray, set, and the frozenset key.
    assert sorted(type(o).__name__ for o in flat.opaque) == ["Point", "Point", "Point", "frozenset", "ndarray", "set"]
    assert len(flat.tensors) == len(DTYPES) + len(make_layouts(torch.Generator())) + 1 + 1
    assert_same_tree(sd, unflatten(skeleton, flat.tensors, flat.opaque))


def test_flatten_like_reuses_the_skeleton_exactly_when_nothing_but_tensors_changed():
    """The per-step fast walk: same structure and plain leaves -> the cached skeleton and the new
    tensors in flatten's order; any other difference -> None (the caller runs the full flatten)."""
    def tree(**over):
        md = OrderedDict(layer=OrderedDict(w=torch.randn(2)))
        md._metadata = {"": {"version": 1}}  # as nn.Module.state_dict() sets it
        t = {"model": md, "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2)}},
                                        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "amsgrad": False,
                                                          "params": [0], "name": None}]},
             "step": 7, "tag": "run"}
        t.update(over)
        return t

    base = flatten(tree())
    same = tree()
    got = flatten_like(same, base.skeleton)
    assert got is not None and got.skeleton is base.skeleton and got.opaque == []
    assert [id(t) for t in got.tensors] == [id(t) for t in flatten(same).tensors]
    p = torch.nn.Parameter(torch.randn(2))
    assert flatten_like(tree(model=OrderedDict(layer=OrderedDict(w=p))), base.skeleton) is None  # _metadata gone
    changed = {
        "an int leaf": tree(step=8), "a str leaf": tree(tag="other"), "a key": {**tree(), "extra": 1},
        "a float": tree(optimizer={**tree()["optimizer"], "param_groups": [{**tree()["optimizer"]["param_groups"][0],
                                                                             "lr": 0.2}]}),
        "-0.0 for 0.0": flatten_like(tree(x=-0.0), flatten(tree(x=0.0)).skeleton),
        "True for 1": flatten_like(tree(step=True), flatten(tree(step=1)).skeleton),
        "a tuple for a list": flatten_like(tree(step=(1,)), flatten(tree(step=[1])).skeleton),
        "a dict for an OrderedDict": flatten_like(tree(model={"layer": {"w": torch.ones(2)}}),
                                                  flatten(tree(model=OrderedDict(layer={"w": torch.ones(2)}))).skeleton),
        "a tensor for an int": tree(step=torch.tensor(7)),
        "an int for a tensor": tree(model=OrderedDict(layer=OrderedDict(w=3))),
        "an opaque leaf": flatten_like(tree(tag={1, 2}), flatten(tree(tag={1, 2})).skeleton),
        "a meta tensor": tree(model=OrderedDict(layer=OrderedDict(w=torch.empty(2, device="meta")))),
    }
    for what, t in changed.items():
        res = t if t is None or isinstance(t, Flat) else flatten_like(t, base.skeleton)
        assert res is None, what
    # An int key that equals a str key's value in another type never matches.
    assert flatten_like({0: torch.ones(1)}, flatten({"0": torch.ones(1)}).skeleton) is None


def test_plan_stores_shared_storage_once_and_aligns_regions():
    a = torch.randn(100)
    b = torch.randn(7, dtype=torch.float64)
    tensors = [a, a, a[10:20], b, a.view(4, 25)]
    plan = plan_snapshot(tensors, signature_of(tensors)[0])
    assert len(plan.regions) == 2
    assert plan.tensor_region == (0, 0, 0, 1, 0)
    assert all(off % ALIGN == 0 for off, _ in plan.regions)
    assert plan.regions[0][1] == a.untyped_storage().nbytes() and plan.regions[1][1] == b.nbytes
    assert plan.tensor_bytes == -(-400 // ALIGN) * ALIGN + -(-56 // ALIGN) * ALIGN
    assert plan.metas[2].storage_offset == 10 and plan.metas[2].offset == plan.metas[0].offset
    # A view of the same storage as another type is refused, as torch.save refuses it (test_fidelity.py).
    mixed = [a, a.view(torch.int32)]
    with pytest.raises(InvalidStateDictError, match="view one storage as different types"):
        plan_snapshot(mixed, signature_of(mixed)[0])


def test_plan_signature_changes_exactly_when_the_structure_does():
    def sig(sd):
        return signature_of(flatten(sd).tensors)[0]

    w = torch.randn(4, 4)
    base = sig({"w": w, "b": torch.zeros(4)})
    assert sig({"w": torch.randn(4, 4), "b": torch.ones(4)}) == base  # new values, same structure: reuse
    assert sig({"w": w, "b": torch.zeros(4), "exp_avg": torch.zeros(4, 4)}) != base  # a key added
    assert sig({"w": w.double(), "b": torch.zeros(4)}) != base  # a dtype changed
    assert sig({"w": w.t(), "b": torch.zeros(4)}) != base  # strides changed
    assert sig({"w": w, "b": w}) != sig({"w": w, "b": w.clone()})  # sharing changed


# ------------------------------------------------------------------------------------------ round trips
def test_memory_loads_report_their_source(roundtrip):
    assert (roundtrip["plain_load"].source, roundtrip["plain_load"].step) == ("memory", 1)
    assert (roundtrip["opaque_load"].source, roundtrip["opaque_load"].step) == ("memory", 2)
    assert roundtrip["resume_load"].source == "storage"


def test_default_persist_paths(roundtrip):
    for path in roundtrip["files"]:
        assert os.path.isfile(path), path


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("name", list(DTYPES))
def test_dtype_round_trip_is_bit_exact(roundtrip, name, source):
    src = roundtrip["plain_src"]["dtypes"][name]
    out = roundtrip["plain"][source]["dtypes"][name]
    assert_bit_identical(src, out, f"{source}:{name}")
    if name in _NAN_FREE:
        assert torch.equal(src, out)
    elif src.dim() and src.stride(-1) == 1:
        assert torch.equal(src.view(torch.uint8), out.view(torch.uint8))


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("name", list(make_layouts(torch.Generator())))
def test_tensor_layout_round_trip_is_bit_exact(roundtrip, name, source):
    src = roundtrip["plain_src"]["layouts"][name]
    out = roundtrip["plain"][source]["layouts"][name]
    assert_bit_identical(src, out, f"{source}:{name}")
    assert torch.equal(src.detach(), out.detach())  # same values through the same view


@pytest.mark.parametrize("source", SOURCES)
def test_containers_keys_and_plain_leaves_keep_their_types(roundtrip, source):
    assert_same_tree(roundtrip["plain_src"]["leaves"], roundtrip["plain"][source]["leaves"], source)
    assert_same_tree(roundtrip["plain_src"]["model"], roundtrip["plain"][source]["model"], source)


@pytest.mark.parametrize("source", SOURCES)
def test_opaque_leaves_are_restored(roundtrip, source):
    out = roundtrip["opaque"][source]
    assert_same_tree(roundtrip["opaque_src"], out, source)
    assert isinstance(out["point"], Point) and isinstance(out["nested"][1]["deep"], Point)


def test_plain_only_file_loads_with_vanilla_torch_load_weights_only(roundtrip):
    sd = torch.load(roundtrip["files"][0], weights_only=True, map_location="cpu")
    assert_same_tree(roundtrip["plain_src"], sd)


def test_weights_only_engine_refuses_opaque_file_with_a_hint(roundtrip):
    err = roundtrip["strict_error"]
    assert err is not None, "an engine with weights_only=True loaded a file holding pickled Python objects"
    assert "weights_only=False" in str(err)
    assert_same_tree(roundtrip["plain_src"], roundtrip["strict_plain"])


def test_memory_load_decodes_python_objects_under_weights_only(runtime_dir, tmp_path):
    """A snapshot's opaque leaves are pickles written by another process: weights_only engines decode
    only what torch.load(weights_only=True) accepts, exactly as for a load from storage."""
    from flashckpt import CheckpointEngine, InvalidStateDictError, StorageType

    ckpt = str(tmp_path / "wo")
    writer = CheckpointEngine(ckpt, max_to_keep=0, weights_only=False)
    writer.save(1, {"w": torch.ones(3), "safe": {1, 2}}, storage_type=StorageType.MEMORY)
    assert writer.load()["safe"] == {1, 2}
    # A class of this module: never on torch's safe-globals list (megatron-core, imported by other tests of
    # this process, adds argparse.Namespace to it).
    writer.save(2, {"w": torch.ones(3), "args": Point(1, 2)}, storage_type=StorageType.MEMORY)
    assert writer.load()["args"] == Point(1, 2)
    writer.close(release=False)

    strict = CheckpointEngine(ckpt, max_to_keep=0)  # weights_only=True by default
    with pytest.raises(InvalidStateDictError, match="weights_only=False"):
        strict.load()
    strict.close()


def test_module_state_dict_metadata_survives_like_torch_save(make_engine, ckpt_dir):
    """nn.Module.state_dict() carries per-module versions in ``_metadata``; torch.save keeps them, and so do
    memory snapshots and persisted files."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    sd = model.state_dict()
    assert sd._metadata  # what torch gives us
    flat = flatten({"model": sd})
    back = unflatten(json.loads(json.dumps(flat.skeleton)), flat.tensors, flat.opaque)
    assert back["model"]._metadata == sd._metadata
    eng = make_engine(max_to_keep=0)
    eng.save(1, {"model": sd}, storage_type=StorageType.DISK)
    eng.wait(60)
    assert eng.load()["model"]._metadata == sd._metadata
    on_disk = torch.load(os.path.join(ckpt_dir, "step_1", "rank_00000.pt"), weights_only=True)
    assert on_disk["model"]._metadata == sd._metadata
    eng.close()


def test_gc_paused_holds_the_collector_off_and_restores_its_state():
    import gc

    from flashckpt.format.tree import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block leaves it as the outer one set it
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller that disabled it keeps it disabled
    finally:
        gc.enable()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError
    assert gc.isenabled()
