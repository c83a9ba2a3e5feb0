"""The public SnapshotReader against a real engine and its real saver: what memory holds (steps, the path
each snapshot goes to, save times), loads of state dicts and FileSets, the weights_only rules, and a reader
of a job this node does not hold, which sees nothing and starts nothing."""

from __future__ import annotations

import argparse
import os
import time

import pytest
import torch
from flashckpt import FileSet, FlashCheckpointError, InvalidStateDictError, StorageType
from flashckpt.memory.reader import SnapshotInfo, SnapshotReader, job_in_memory
from helpers import assert_same_tree, saver_pids

DISK, MEMORY = StorageType.DISK, StorageType.MEMORY


class Hyper(argparse.Namespace):
    """An opaque leaf that no other test or framework registers with torch.serialization.add_safe_globals
    (megatron-core registers argparse.Namespace when imported)."""


def model_sd(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(32, 16, generator=g), "b": torch.randn(16, generator=g).to(torch.bfloat16)},
            "step": seed, "lr": 0.5 / seed, "nested": [torch.arange(seed + 1), (seed, "x")]}


def test_a_reader_of_a_checkpoint_dir_lists_and_loads_what_memory_holds(make_engine, ckpt_dir):
    eng = make_engine(max_to_keep=0)
    t0 = time.time()
    eng.save(1, model_sd(1), path="first.pt", storage_type=MEMORY)
    eng.save(2, model_sd(2), storage_type=DISK)
    eng.wait(60)
    assert job_in_memory(ckpt_dir) and job_in_memory("file://" + ckpt_dir)
    with SnapshotReader(ckpt_dir) as reader:
        assert reader.exists() and reader.local_rank == 0 and reader.weights_only
        assert reader.memory_steps() == [2, 1]
        infos = reader.snapshots()
        assert [(i.step, i.name) for i in infos] == [(2, eng.default_path(2)), (1, os.path.join(ckpt_dir, "first.pt"))]
        assert all(isinstance(i, SnapshotInfo) and t0 <= i.wall_time <= time.time() for i in infos)
        assert infos[0].wall_time >= infos[1].wall_time
        assert reader.snapshot_name(1) == os.path.join(ckpt_dir, "first.pt") and reader.snapshot_name(7) is None
        assert_same_tree(reader.load(), model_sd(2))
        assert_same_tree(reader.load(1), model_sd(1))
        # ``into``: matching tensors are filled in place and returned
        w = torch.zeros(32, 16)
        got = reader.load(1, into={"model": {"w": w}})
        assert got["model"]["w"] is w and torch.equal(w, model_sd(1)["model"]["w"])
        with pytest.raises(FlashCheckpointError, match="step 7.*memory_steps"):
            reader.load(7)
        # Reading takes no lease: the engine goes on writing, and the reader sees the new snapshot (and
        # step 1's where its slot was not the one overwritten).
        eng.save(3, model_sd(3), storage_type=MEMORY)
        assert reader.memory_steps()[:2] == [3, 2]
        assert_same_tree(reader.load(), model_sd(3))
    # The same job through a file:// URL; a rollback to step 2 supersedes step 3 for every reader.
    eng.save(2, model_sd(20), storage_type=MEMORY)
    with SnapshotReader("file://" + ckpt_dir, local_rank=0) as reader:
        steps = reader.memory_steps()
        assert steps[0] == 2 and 3 not in steps
        assert_same_tree(reader.load(), model_sd(20))
    assert eng.memory_steps() == steps
    eng.close()


def test_a_reader_of_an_engine_follows_its_weights_only(make_engine, ckpt_dir):
    eng = make_engine(max_to_keep=0, weights_only=False)
    sd = {"w": torch.ones(3), "args": Hyper(lr=0.1)}
    eng.save(4, sd, storage_type=MEMORY)
    with SnapshotReader(eng) as reader:  # the engine's job and its weights_only=False
        assert not reader.weights_only and reader.job_dir == eng.job_dir
        assert reader.load()["args"] == Hyper(lr=0.1)
    with SnapshotReader(ckpt_dir) as reader:  # from the dir: weights_only=True, as a load from storage
        assert reader.memory_steps() == [4]
        with pytest.raises(InvalidStateDictError, match="weights_only"):
            reader.load()
    with SnapshotReader(eng, weights_only=True) as reader:
        with pytest.raises(InvalidStateDictError, match="weights_only"):
            reader.load(4)
    with SnapshotReader(ckpt_dir, weights_only=False) as reader:
        assert reader.load(4)["args"] == Hyper(lr=0.1)
    eng.close()


def test_a_reader_loads_a_fileset(make_engine, ckpt_dir):
    fs = FileSet()
    fs.add_torch("optimizer.pt", {"exp_avg": torch.arange(6.0), "lr": 0.1})
    fs.add_raw("state.json", b'{"step": 5}')
    fs.add_raw("latest", b"checkpoint-5", kind="tracker")
    eng = make_engine(max_to_keep=0)
    eng.save(5, fs, path="checkpoint-5", storage_type=MEMORY)
    with SnapshotReader(eng) as reader:
        assert reader.snapshots() == [SnapshotInfo(5, os.path.join(ckpt_dir, "checkpoint-5"),
                                                   reader.snapshots()[0].wall_time, rank=0, world_size=1)]
        got = reader.load(5)
    assert isinstance(got, FileSet) and sorted(got) == ["latest", "optimizer.pt", "state.json"]
    assert_same_tree(got["optimizer.pt"].data, {"exp_avg": torch.arange(6.0), "lr": 0.1})
    assert got.raw_bytes("state.json") == b'{"step": 5}' and got["latest"].kind == "tracker"
    eng.close()


def test_a_reader_of_a_job_this_node_does_not_hold_sees_nothing_and_starts_nothing(runtime_dir, tmp_path):
    other = str(tmp_path / "never_saved")
    assert not job_in_memory(other)
    with SnapshotReader(other) as reader:
        assert not reader.exists()
        assert reader.memory_steps() == [] and reader.snapshots() == [] and reader.memory_snapshots() == []
        with pytest.raises(FlashCheckpointError, match="holds no"):
            reader.load()
    assert not saver_pids(runtime_dir) and os.listdir(runtime_dir) == []
    assert not os.path.exists(other)


def test_a_reader_refuses_a_url_it_cannot_read(runtime_dir):
    """A URL no backend serves is refused; a served one (s3://) names a job like a local dir does (this
    node holds no snapshot of it)."""
    from flashckpt import CheckpointDirError

    with pytest.raises(CheckpointDirError, match="gs://"):
        SnapshotReader("gs://bucket/ckpt")
    with SnapshotReader("s3://bucket/ckpt") as reader:
        assert reader.memory_steps() == []


def _big_sd(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    # several MiB per tensor, so the copier splits them across threads; a view and an odd size too
    base = torch.randn(3 << 20, generator=g)
    return {"a": torch.randn(1 << 21, generator=g), "view": base[1000:2000001], "odd": torch.randn(12345, generator=g),
            "half": torch.randn(1 << 20, generator=g).half(), "n": seed}


def _check_loads(eng) -> None:
    """``load()`` into new memory and ``load(into=)`` into existing tensors, by preadv or from the mapping,
    give back exactly what was saved."""
    want = _big_sd(7)
    with SnapshotReader(eng) as reader:
        assert_same_tree(reader.load(), want)
        into = {k: torch.full_like(v, -1) if isinstance(v, torch.Tensor) and k != "view" else v for k, v in want.items()}
        got = reader.load(into=into)
        assert got["a"] is into["a"] and got["odd"] is into["odd"]
        assert_same_tree(got, want)


def test_a_restore_reads_through_the_segment_file_and_its_mapping_alike(make_engine, monkeypatch):
    from flashckpt.format import segment

    eng = make_engine(max_to_keep=0)
    eng.save(1, _big_sd(7), storage_type=MEMORY)
    eng.wait_snapshot()
    _check_loads(eng)  # preadv from the segment file
    # no descriptor of the mapped file (gone or replaced under its path; stood in for here: replacing a
    # live segment's file would break its saver): the mapping is the source
    import contextlib

    monkeypatch.setattr(segment.Segment, "read_fd", lambda self: contextlib.nullcontext(None))
    calls = []
    orig = segment.Segment.populate
    monkeypatch.setattr(segment.Segment, "populate", lambda self, i, n: (calls.append(n), orig(self, i, n)))
    _check_loads(eng)
    assert calls, "the mapping was not the source"
    eng.close(release=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs with huge pages: needs root")
def test_a_runtime_dir_on_a_huge_page_tmpfs_is_found_and_restores_from_its_mapping(tmp_path, monkeypatch, make_engine):
    import subprocess

    from flashckpt.format import segment

    mnt = tmp_path / "huge"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m,huge=always", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        segment.huge_page_tmpfs.cache_clear()
        assert segment.huge_page_tmpfs(str(mnt)) and segment.huge_page_tmpfs(str(mnt / "a" / "b"))
        assert not segment.huge_page_tmpfs(str(tmp_path))
        rt = mnt / "rt"
        rt.mkdir(mode=0o700)
        monkeypatch.setenv("FLASHCKPT_RUNTIME_DIR", str(rt))
        eng = make_engine(max_to_keep=0)
        eng.save(1, _big_sd(7), storage_type=MEMORY)
        eng.wait_snapshot()
        calls = []
        orig = segment.Segment.populate
        monkeypatch.setattr(segment.Segment, "populate", lambda self, i, n: (calls.append(n), orig(self, i, n)))
        _check_loads(eng)
        assert len(calls) == 1, "only the load into existing tensors reads from the mapping"
        eng.close(release=True)
    finally:
        segment.huge_page_tmpfs.cache_clear()
        subprocess.run(["umount", "-l", str(mnt)])
