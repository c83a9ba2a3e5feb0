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

import os

import pytest
import torch
import xxhash
from flashckpt import InvalidStateDictError, StorageType
from flashckpt.remote_load import load_remote
from flashckpt.storage import PosixDiskStorage
from helpers import assert_same_tree

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


@pytest.mark.parametrize("kind", ["zero", "nested"])
def test_tensors_torch_save_cannot_write_are_refused_at_save_naming_the_key(make_engine, ckpt_dir, kind):
    if kind == "zero":
        t = torch._efficientzerotensor(3)
    else:
        with pytest.warns(UserWarning):
            t = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
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
