"""The adapter kit (flashckpt.engine.routing, engine.collective, integrations._kit_files): where the adapters' copies disagreed, the
kit's one answer, and the cross-rank exchange with real gloo ranks."""

from __future__ import annotations

import os
import re

import pytest
import torch
from flashckpt.engine.collective import exchange_files, rank, world
from flashckpt.engine.routing import path_inside, rel_inside, step_of, swapped
from flashckpt.errors import FlashCheckpointError
from flashckpt.format.files import FileSet
from flashckpt.integrations._kit_files import Capture, SnapshotDir, all_ranks_files
from helpers import run_ranks


def test_path_inside_resolves_dotdot_and_links_and_is_no_prefix_test(tmp_path):
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "ckpt2").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", root / "out")  # a link inside root to a directory outside it
    os.symlink(root, tmp_path / "alias")  # another name of root
    assert path_inside(root, root) and not path_inside(root, root, strict=True)
    assert path_inside(root / "sub" / "x.pt", root)
    # The lexical prefix test (Lightning's old _inside) said yes to these three:
    assert not path_inside(f"{root}/sub/../../ckpt2/x.pt", root)
    assert not path_inside(tmp_path / "ckpt2" / "x.pt", root)  # "ckpt2" merely starts with "ckpt"
    assert not path_inside(root / "out" / "x.pt", root)  # leaves root through a link (DeepSpeed's said yes too)
    assert path_inside(tmp_path / "alias" / "x.pt", root)  # enters root through a link (both said no)
    assert path_inside("x.pt", os.getcwd()) and not path_inside("../x.pt", os.getcwd())


def test_rel_inside_names_only_what_lies_strictly_inside(tmp_path):
    root = tmp_path / "tag"
    root.mkdir()
    assert rel_inside(root / "a" / "b.pt", root) == "a/b.pt"
    assert rel_inside(f"{root}/a/../c.pt", root) == "c.pt"
    assert rel_inside(root, root) is None
    assert rel_inside(tmp_path / "x.pt", root) is None
    assert rel_inside(object(), root) is None  # a file object is not a path


def test_step_of_ignores_a_trailing_separator():
    pat = re.compile(r"^checkpoint-(\d+)$")
    assert step_of("/out/checkpoint-40", pat) == 40
    assert step_of("/out/checkpoint-40/", pat) == 40
    assert step_of("checkpoint-40", pat) == 40
    assert step_of("/out/checkpoint-x", pat) is None
    assert step_of("/out/iter_0000100", re.compile(r"^iter_(\d+)$")) == 100


def test_rank_without_torch_distributed_is_the_only_rank(monkeypatch):
    """Collectives see one rank when torch.distributed is not initialized, whatever RANK says (DeepSpeed's
    copy read RANK, Megatron's did not): rank and world agree."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (rank(), world()) == (0, 1)


def test_swapped_restores_and_removes_what_was_not_there():
    import types

    mod = types.ModuleType("m")
    mod.f = len
    with pytest.raises(RuntimeError), swapped([(mod, "f", abs), (mod, "g", abs)]):
        assert mod.f is abs and mod.g is abs
        raise RuntimeError
    assert mod.f is len and not hasattr(mod, "g")


def test_exchange_alone_raises_for_what_nobody_holds():
    assert exchange_files({"a": b"x"}, ["a"], []) == {}
    with pytest.raises(FlashCheckpointError, match="'b'"):
        exchange_files({"a": b"x"}, ["a"], ["b"])


def test_capture_routes_writes_inside_root_only(tmp_path):
    root = tmp_path / "scratch"
    root.mkdir()
    t = torch.arange(1 << 15, dtype=torch.float32)  # 128 KiB: captured as a tree
    with Capture(str(root)) as cap:
        torch.save({"t": t}, os.path.join(root, "big.pt"))
        torch.save({"n": 1}, os.path.join(root, "small.pt"))  # small: its exact bytes
        torch.save({"n": 2}, os.path.join(tmp_path, "outside.pt"))
    (root / "state.json").write_text("{}")
    cap.collect()
    assert cap.files["big.pt"].format == "torch" and cap.files["big.pt"].data["t"] is t
    assert cap.files["small.pt"].format == "raw"
    assert cap.files.raw_bytes("state.json") == b"{}"
    assert not (root / "big.pt").exists() and (tmp_path / "outside.pt").exists()
    assert torch.save.__module__ == "torch.serialization"  # restored


def test_snapshot_dir_is_removed_on_close(tmp_path):
    fs = FileSet().add_raw("a/b.bin", [b"12", torch.tensor([1], dtype=torch.uint8)])
    with SnapshotDir(str(tmp_path), "checkpoint-1") as d:
        d.write("a/b.bin", fs["a/b.bin"])
        d.touch("c/d.pt")
        with open(os.path.join(d.dir, "a", "b.bin"), "rb") as f:
            assert f.read() == b"12\x01"
        assert os.path.getsize(os.path.join(d.dir, "c", "d.pt")) == 0
    assert os.listdir(tmp_path) == []


def exchange_worker() -> dict:
    """3 ranks: rank 0 holds a and b, rank 1 holds b and c, rank 2 nothing; each wants what it lacks."""
    import torch.distributed as dist

    r = dist.get_rank()
    t = torch.arange(6, dtype=torch.float64).reshape(2, 3) + r
    held = [{"a": {"t": t, "raw": b"A0", "n": 7}, "b": [b"B0", t]}, {"b": [b"B1"], "c": (t, "c1")}, {}][r]
    got = exchange_files(held, sorted(held), [n for n in ("a", "b", "c") if n not in held])
    out = {"names": sorted(got)}
    if "a" in got:
        out["a"] = [got["a"]["t"].tolist(), got["a"]["raw"].decode(), got["a"]["n"]]
    if "b" in got:
        out["b0"] = got["b"][0].decode()  # from the lowest rank that holds it
    if "c" in got:
        out["c"] = [got["c"][0].tolist(), got["c"][1], type(got["c"]).__name__]
    union = all_ranks_files(FileSet().add_raw(f"r{r}", [bytes([r])]) if r < 2 else FileSet())
    out["union"] = sorted(union)
    try:
        exchange_files(held, sorted(held), ["nobody"] if r == 2 else [])
    except FlashCheckpointError as e:
        out["error"] = str(e)

    def failing(name: str) -> object:
        raise OSError(f"cannot read {name}")

    try:
        exchange_files(failing if r == 1 else held, sorted(held), ["c"] if r == 0 else [])
    except FlashCheckpointError as e:
        out["serve_error"] = str(e)
    return out


@pytest.mark.multiproc
def test_exchange_between_ranks_and_errors_on_every_rank(tmp_path):
    r0, r1, r2 = run_ranks(exchange_worker, 3, str(tmp_path / "ranks"), timeout=240)
    assert r0["names"] == ["c"] and r0["c"] == [[[1, 2, 3], [4, 5, 6]], "c1", "tuple"]  # from rank 1
    assert r1["names"] == ["a"] and r1["a"] == [[[0, 1, 2], [3, 4, 5]], "A0", 7]
    assert r2["names"] == ["a", "b", "c"] and r2["b0"] == "B0"
    assert r0["union"] == r1["union"] == ["r0", "r1"] and r2["union"] == ["r0", "r1"]
    for r in (r0, r1, r2):  # the same error on every rank, not only on the one that asked
        assert "rank 2 needs nobody" in r["error"]
        assert "OSError: cannot read c" in r["serve_error"] and "ranks {1:" in r["serve_error"]
