"""The C++ fast path (signature scan and small-storage copies) against the Python code it replaces: the
same snapshots, the same re-planning, the same errors; and its build: in the background on first use,
a failed build remembered instead of retried."""

from __future__ import annotations

import array
import ctypes
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from flashckpt import InvalidStateDictError, StorageType
from flashckpt.format.tree import flatten
from flashckpt.memory.plan import signature_of
from flashckpt.util import native as _native
from helpers import assert_same_tree


@pytest.fixture
def native():
    """The extension (built by the session fixture in conftest); skips under FLASHCKPT_NATIVE=0."""
    m = _native.get()
    if m is None:
        pytest.skip("the native fast path is disabled (FLASHCKPT_NATIVE=0)")
    return m


def _tree() -> dict:
    base = torch.randn(40, 30)
    emb = torch.nn.Parameter(torch.randn(50, 8))
    return {
        "emb": emb, "tied": emb,  # the same Parameter twice: stored once, restored tied
        "view": base[3:9, ::2], "t": base.t(), "base": base,  # views of one storage, non-contiguous
        "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5, dtype=torch.float64),
        "bf16": torch.randn(7).to(torch.bfloat16), "ints": torch.arange(1000, dtype=torch.int32),
        "grad": torch.randn(3, requires_grad=True).detach().requires_grad_(),
        "big": torch.randn(300_000),  # over SMALL_COPY: copied on the copier's threads
        "nested": [{"a": torch.ones(2, 2)}, (torch.zeros(3, dtype=torch.bool), 7, "s")],
    }


def test_scan_signature_tracks_the_python_signature(native) -> None:
    """Equal native signatures exactly where the Python signatures are equal."""
    tree = _tree()
    ts = flatten(tree).tensors
    sig, ptrs, bad = native.scan(ts, torch.nn.Parameter)
    assert bad == -1
    py_sig, py_ptrs = signature_of(ts)
    assert list(memoryview(ptrs).cast("q")) == py_ptrs
    variants = {
        "same tensors again": (lambda t: t, True),
        "a shape": (lambda t: {**t, "ints": torch.arange(999, dtype=torch.int32)}, False),
        "a dtype": (lambda t: {**t, "ints": torch.arange(1000, dtype=torch.int64)}, False),
        "a stride": (lambda t: {**t, "t": t["base"].t().contiguous().t()}, False),
        "storage sharing": (lambda t: {**t, "tied": t["emb"].detach().clone()}, False),
        "requires_grad": (lambda t: {**t, "grad": t["grad"].detach()}, False),
        "Parameter-ness": (lambda t: {**t, "emb": t["emb"].detach(), "tied": t["emb"].detach()}, False),
        "new storages of the same structure": (lambda t: {k: (v.clone() if k == "ints" else v) for k, v in t.items()},
                                               True),
    }
    for what, (change, same) in variants.items():
        ts2 = flatten(change(tree)).tensors
        sig2, _, _ = native.scan(ts2, torch.nn.Parameter)
        assert (sig2 == sig) == same, what
        assert (signature_of(ts2)[0] == py_sig) == same, what


@pytest.mark.parametrize("bad", ["sparse", "meta", "quantized", "subclass"])
def test_unstorable_tensors_are_refused_with_their_key(native, make_engine, monkeypatch, bad: str) -> None:
    """Both paths refuse the same tensors and name the key; nothing is written."""
    t = {"sparse": lambda: torch.eye(3).to_sparse(), "meta": lambda: torch.empty(3, device="meta"),
         "quantized": lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
         "subclass": lambda: torch.Tensor._make_subclass(type("MyTensor", (torch.Tensor,), {}), torch.ones(3)),
         }[bad]()
    engine = make_engine()
    tree = {"ok": torch.ones(2), "layer": {"w": t}}
    messages = []
    for use_native in (True, False):
        if not use_native:
            monkeypatch.setattr(_native, "get", lambda: None)
        with pytest.raises(InvalidStateDictError) as info:
            engine.save(1, tree, storage_type=StorageType.MEMORY)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "['layer']['w']" in messages[0], messages
    engine.save(2, {"ok": torch.ones(2)}, storage_type=StorageType.MEMORY)
    assert engine.load()["ok"].sum() == 2
    engine.close()


def test_native_and_python_snapshots_are_the_same(native, make_engine, monkeypatch) -> None:
    """Snapshots taken with the fast path and without it restore the tree bit for bit, with its ties,
    views, Parameters and grad flags; the plan is reused while the structure holds."""
    engine = make_engine()
    tree = _tree()
    engine.save(1, tree, storage_type=StorageType.MEMORY)
    fast = engine.load()
    assert_same_tree(tree, fast)
    plan = engine._handler._plan  # the plan the save used: there is no public accessor
    assert plan is not None and plan.native_signature and plan.small_copies_packed and plan.large_copies
    tree["big"].add_(1)
    tree["ints"].mul_(3)
    engine.save(2, tree, storage_type=StorageType.MEMORY)
    assert engine._handler._plan is plan  # same structure: reused
    assert_same_tree(tree, engine.load())
    monkeypatch.setattr(_native, "get", lambda: None)
    tree["emb"].data.mul_(-1)
    engine.save(3, tree, storage_type=StorageType.MEMORY)
    slow = engine.load()
    assert_same_tree(tree, slow)
    for got in (fast, slow):
        assert got["tied"].data_ptr() == got["emb"].data_ptr()
        assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    engine.close()


def _run(code: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=timeout)


_BACKGROUND_BUILD = """
    import os, signal, time, torch, flashckpt.util.native as n
    t = time.monotonic(); m = n.get(); waited = time.monotonic() - t
    assert m is None and waited < 5, (m, waited)
    b = n._builder
    assert b is not None
    nice = os.getpriority(os.PRIO_PROCESS, b.pid)
    while nice != 19 and b.poll() is None and time.monotonic() < t + 30:  # the builder lowers itself first
        time.sleep(0.05)
        nice = os.getpriority(os.PRIO_PROCESS, b.pid)
    print("nice", nice if b.poll() is None else "exited")
    if os.environ.get("WAIT_FOR_BUILD"):
        rc = b.wait(timeout=600)
        print("rc", rc, "status", n.status())
        m = n.get()
        print("loaded", m is not None)
        if m is not None:
            print("scan", m.scan([torch.ones(2)], torch.nn.Parameter)[2])
    else:
        os.killpg(b.pid, signal.SIGKILL)
        b.wait()
"""


@pytest.mark.multiproc
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler on this machine")
def test_first_use_starts_a_build_in_the_background_and_a_failed_build_is_remembered(tmp_path) -> None:
    """In a fresh cache dir, get() does not wait: it starts a build at the lowest priority and the Python path
    runs meanwhile (here the build is stopped at once: the session built the same extension before any test,
    and ``test_a_background_build_is_loaded_once_done``, in --extended, waits for a background build). A build
    that fails (no working compiler here) leaves a marker, so later processes use Python at once instead of
    compiling again."""
    r = _run(_BACKGROUND_BUILD, dict(os.environ, FLASHCKPT_EXT_DIR=str(tmp_path / "ok"), FLASHCKPT_NATIVE="auto"), 120)
    assert r.returncode == 0, r.stderr
    assert "nice 19" in r.stdout or "nice exited" in r.stdout, r.stdout

    bad_env = dict(os.environ, FLASHCKPT_EXT_DIR=str(tmp_path / "bad"), FLASHCKPT_NATIVE="auto", CXX="false",
                   WAIT_FOR_BUILD="1")
    r = _run(_BACKGROUND_BUILD, bad_env, 300)
    assert r.returncode == 0, r.stderr
    assert "loaded False" in r.stdout and "build failed" in r.stdout, r.stdout
    again = _run("""
        import flashckpt.util.native as n
        assert n.get() is None and n._builder is None, "a failed build must not be retried"
        print(n.status())
    """, bad_env, 60)
    assert again.returncode == 0 and "build failed" in again.stdout, again.stderr + again.stdout


@pytest.mark.multiproc
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler on this machine")
def test_a_background_build_is_loaded_once_done(tmp_path) -> None:
    """In a fresh cache dir, the build get() started in the background compiles the extension (a minute of
    a core), and a later get() loads it."""
    env = dict(os.environ, FLASHCKPT_EXT_DIR=str(tmp_path / "ok"), FLASHCKPT_NATIVE="auto", WAIT_FOR_BUILD="1")
    r = _run(_BACKGROUND_BUILD, env, 700)
    assert r.returncode == 0, r.stderr
    assert "rc 0" in r.stdout and "loaded True" in r.stdout and "scan -1" in r.stdout, r.stdout


def _walk_tree() -> dict:
    sd = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4)).state_dict()  # OrderedDict + _metadata
    return {"model": sd, "opt": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4, 3)}},
                                 "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "amsgrad": False,
                                                   "params": [0, 1], "name": None}]},
            "step": 17, "tag": "run-a", "pair": (torch.ones(2), [torch.zeros(1), 2.5]), "flag": True}


def test_flatten_like_matches_the_python_walk(native) -> None:
    """The C++ walk against a cached skeleton finds the same tensors where the Python one does, and
    gives up (None) wherever the Python one does: any key, plain value, container type or order changed."""
    from collections import OrderedDict

    from flashckpt.format.tree import flatten_like

    skeleton = flatten(_walk_tree()).skeleton

    def both(tree: object) -> list | None:
        py = flatten_like(tree, skeleton, check_tensors=False)
        got = native.flatten_like(tree, skeleton, torch.nn.Parameter, OrderedDict)
        assert (py is None) == (got is None)
        if got is not None:
            assert [id(t) for t in got] == [id(t) for t in py.tensors]
        return got

    same = _walk_tree()
    got = both(same)
    assert got is not None and len(got) == len(flatten(same).tensors) == 8

    def changed(fn) -> dict:
        t = _walk_tree()
        fn(t)
        return t

    def reorder(t: dict) -> None:
        t["model"].move_to_end("0.weight")  # an OrderedDict's own order, not its dict's

    def drop_metadata(t: dict) -> None:
        del t["model"]._metadata

    def none_metadata(t: dict) -> None:
        t["model"]._metadata = None  # getattr(..., None) is None: as if absent

    cases = {
        "an int leaf": lambda t: t.update(step=18),
        "a str leaf": lambda t: t.update(tag="run-b"),
        "a float leaf": lambda t: t["opt"]["param_groups"][0].update(lr=2e-3),
        "a bool leaf": lambda t: t.update(flag=False),
        "an int key's type": lambda t: t["opt"].update(state={"0": t["opt"]["state"][0]}),
        "a new key": lambda t: t.update(extra=1),
        "a tuple turned list": lambda t: t["opt"]["param_groups"][0].update(betas=[0.9, 0.999]),
        "a tensor turned int": lambda t: t.update(pair=(1, t["pair"][1])),
        "an int turned tensor": lambda t: t.update(step=torch.tensor(17)),
        "a bytes leaf": lambda t: t.update(tag=b"run-a"),
        "a dict subclass": lambda t: t.update(opt=type("D", (dict,), {})(t["opt"])),
        "an OrderedDict reordered": reorder,
        "metadata removed": drop_metadata,
        "a list longer": lambda t: t["pair"][1].append(3),
    }
    for what, fn in cases.items():
        assert both(changed(fn)) is None, what
    assert both(changed(none_metadata)) is None  # the skeleton has _metadata: a difference either way
    param = changed(lambda t: t.update(pair=(torch.nn.Parameter(torch.ones(2)), t["pair"][1])))
    assert both(param) is not None  # a Parameter where a tensor was: the same leaf kind; scan tells them apart


# The CUDA runtime's cudaMemcpyAsync cannot run on a machine without a GPU: a ctypes function of the same
# C signature stands in for it (it records each call and copies with memmove), so that the C++ loop that
# queues a snapshot's device copies in one call is checked here: its arguments, order, kinds and its stop
# at a refused copy. On a GPU the same loop calls the runtime torch loaded (tests/gpu).
_MEMCPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                           ctypes.c_void_p)


@pytest.mark.parametrize("kind", [2, 1])
def test_memcpy_async_queues_a_plans_copies_in_order_and_stops_at_a_refused_one(native, kind: int) -> None:
    calls: list[tuple[int, int, int, int, int]] = []
    refuse_at = {"n": -1}

    def fake(dst, src, n, k, stream):  # cudaMemcpyAsync(dst, src, bytes, kind, stream)
        calls.append((dst, src, n, k, stream))
        if len(calls) - 1 == refuse_at["n"]:
            return 700  # cudaErrorIllegalAddress
        ctypes.memmove(dst, src, n)
        return 0

    fn = _MEMCPY(fake)
    addr = ctypes.cast(fn, ctypes.c_void_p).value
    tensors = [torch.arange(n, dtype=torch.uint8) for n in (5, 100, 1, 64)]
    host = torch.zeros(512, dtype=torch.uint8)
    copies = [(2, 0, 1), (0, 64, 5), (3, 128, 64), (1, 256, 100)]  # (tensor index, offset, bytes), any order
    packed = array.array("q", [v for c in copies for v in c]).tobytes()
    ptrs = array.array("q", [t.data_ptr() for t in tensors]).tobytes()
    base = host.data_ptr()
    if kind == 2:  # device-to-host: tensors -> host
        assert native.memcpy_async(addr, 77, base, ptrs, packed, kind) == (-1, 0)
        for i, off, n in copies:
            assert torch.equal(host[off:off + n], tensors[i][:n])
        assert calls == [(base + off, tensors[i].data_ptr(), n, 2, 77) for i, off, n in copies]
    else:  # host-to-device: host -> tensors
        for i, off, n in copies:
            host[off:off + n] = 200 + i
        assert native.memcpy_async(addr, 5, base, ptrs, packed, kind) == (-1, 0)
        assert all(bool((tensors[i][:n] == 200 + i).all()) for i, _off, n in copies)
        assert calls[0] == (tensors[2].data_ptr(), base, 1, 1, 5)
    calls.clear()
    refuse_at["n"] = 2
    assert native.memcpy_async(addr, 0, base, ptrs, packed, kind) == (2, 700)
    assert len(calls) == 3  # nothing queued after the refused copy
    with pytest.raises(IndexError):
        native.memcpy_async(addr, 0, base, ptrs, array.array("q", [9, 0, 1]).tobytes(), kind)


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # cudaMemcpyAttributes of CUDA 13
    _fields_ = [("src_access_order", ctypes.c_int), ("src_hint", _MemLocation), ("dst_hint", _MemLocation),
                ("flags", ctypes.c_uint)]


# cudaMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream) of CUDA 13, stood in for as
# above: the batch's arrays and its one attribute (sources read in stream order) as the runtime would see them.
_BATCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
                          ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, ctypes.POINTER(_MemcpyAttributes),
                          ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, ctypes.c_void_p)


@pytest.mark.parametrize("kind", [2, 1])
def test_memcpy_batch_async_hands_the_runtime_one_batch_in_stream_order(native, kind: int) -> None:
    seen: list[tuple] = []
    answer = {"code": 0}

    def fake(dsts, srcs, sizes, count, attrs, idxs, nattrs, stream):
        a = attrs[0]
        seen.append(([dsts[k] for k in range(count)], [srcs[k] for k in range(count)],
                     [sizes[k] for k in range(count)], (a.src_access_order, a.src_hint.type, a.dst_hint.type, a.flags),
                     idxs[0], nattrs, stream))
        if answer["code"] == 0:
            for k in range(count):
                ctypes.memmove(dsts[k], srcs[k], sizes[k])
        return answer["code"]

    fn = _BATCH(fake)
    addr = ctypes.cast(fn, ctypes.c_void_p).value
    tensors = [torch.arange(n, dtype=torch.uint8) + 1 for n in (5, 100, 64)]
    host = torch.zeros(512, dtype=torch.uint8)
    copies = [(1, 0, 100), (0, 128, 5), (2, 256, 64)]
    packed = array.array("q", [v for c in copies for v in c]).tobytes()
    ptrs = array.array("q", [t.data_ptr() for t in tensors]).tobytes()
    base = host.data_ptr()
    if kind == 1:
        for i, off, n in copies:
            host[off:off + n] = 9 + i
    assert native.memcpy_batch_async(addr, 41, base, ptrs, packed, kind) == 0
    dsts, srcs, sizes, attr, first, nattrs, stream = seen[0]
    hosts = [base + off for _i, off, _n in copies]
    devs = [tensors[i].data_ptr() for i, _off, _n in copies]
    assert (dsts, srcs) == ((hosts, devs) if kind == 2 else (devs, hosts))
    assert sizes == [n for *_, n in copies] and attr == (1, 0, 0, 1) and (first, nattrs, stream) == (0, 1, 41)
    for i, off, n in copies:
        want = tensors[i][:n] if kind == 2 else torch.full((n,), 9 + i, dtype=torch.uint8)
        assert torch.equal(host[off:off + n] if kind == 2 else tensors[i][:n], want)
    answer["code"] = 1  # cudaErrorInvalidValue: returned as it is (the caller queues the copies one by one)
    assert native.memcpy_batch_async(addr, 41, base, ptrs, packed, kind) == 1
    assert native.memcpy_batch_async(addr, 41, base, ptrs, b"", kind) == 0 and len(seen) == 2  # nothing to queue
