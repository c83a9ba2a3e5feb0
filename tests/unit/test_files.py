"""Multi-file checkpoints (FileSet): native formats on storage, commit-time and tracker files, memory
round trips, last words after a crash, retention of whole sets, and bad names."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from flashckpt import CheckpointTimeoutError, FileSet, StorageType
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.protocol import commit_step
from flashckpt.storage.base import FileRecord
from flashckpt.storage.posix import PosixDiskStorage
from helpers import assert_same_tree, launch_ranks, run_ranks, saver_pids, wait_for, wait_savers_gone
from safetensors.torch import load_file

DISK, MEMORY = StorageType.DISK, StorageType.MEMORY


def committed(ckpt: str) -> list[int]:
    return CommitLayout(ckpt, PosixDiskStorage()).committed_steps()


def make_set(step: int) -> FileSet:
    g = torch.Generator().manual_seed(step)
    weights = {"emb.weight": torch.randn(16, 8, generator=g), "head.bias": torch.randn(8, generator=g).to(torch.bfloat16),
               "mask": torch.rand(5, generator=g) > 0.5, "count": torch.tensor(step, dtype=torch.int64)}
    fs = FileSet()
    fs.add_safetensors("model.safetensors", weights, metadata={"format": "pt"})
    fs.add_torch("optimizer.pt", {"state": {0: {"exp_avg": torch.randn(16, 8, generator=g)}}, "lr": 0.1 * step,
                                  "groups": [{"params": [0], "betas": (0.9, 0.99)}]})
    fs.add_raw("trainer_state.json", json.dumps({"global_step": step}).encode())
    fs.add_raw("sub/blob.bin", [b"HEAD", torch.arange(6, dtype=torch.int16), b"TAIL"])
    fs.add_raw(".metadata", f"meta-{step}".encode(), kind="commit")
    fs.add_raw("latest", f"checkpoint-{step}".encode(), kind="tracker")
    return fs


def check_on_storage(ckpt: str, step: int) -> None:
    want = make_set(step)
    d = os.path.join(ckpt, f"checkpoint-{step}")
    safetensors_equal(step, ckpt)
    assert_same_tree(want["optimizer.pt"].data, torch.load(os.path.join(d, "optimizer.pt"), weights_only=True))
    with open(os.path.join(d, "trainer_state.json"), "rb") as f:
        assert json.load(f) == {"global_step": step}
    with open(os.path.join(d, "sub", "blob.bin"), "rb") as f:
        assert f.read() == b"HEAD" + torch.arange(6, dtype=torch.int16).numpy().tobytes() + b"TAIL"
    with open(os.path.join(d, ".metadata"), "rb") as f:
        assert f.read() == f"meta-{step}".encode()


def safetensors_equal(step: int, ckpt: str) -> None:
    """The safetensors package itself reads our file back."""
    want = {"emb.weight", "head.bias", "mask", "count"}
    got = load_file(os.path.join(ckpt, f"checkpoint-{step}", "model.safetensors"))
    assert set(got) == want
    g = torch.Generator().manual_seed(step)
    ref = {"emb.weight": torch.randn(16, 8, generator=g), "head.bias": torch.randn(8, generator=g).to(torch.bfloat16),
           "mask": torch.rand(5, generator=g) > 0.5, "count": torch.tensor(step, dtype=torch.int64)}
    for k in want:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k


def test_fileset_persists_native_files_commit_and_tracker(make_engine, ckpt_dir):
    eng = make_engine(max_to_keep=0)
    assert eng.save(3, make_set(3), path="checkpoint-3", storage_type=DISK)
    eng.wait(60)
    check_on_storage(ckpt_dir, 3)
    with open(os.path.join(ckpt_dir, "latest"), "rb") as f:
        assert f.read() == b"checkpoint-3"
    assert eng.committed_steps() == [3]
    assert eng.step_path(3) == os.path.join(ckpt_dir, "checkpoint-3")
    m = CommitLayout(ckpt_dir, PosixDiskStorage()).read_manifest(3)
    assert sorted(f.name for f in m.files[0]) == [".metadata", "model.safetensors", "optimizer.pt",
                                                  "sub/blob.bin", "trainer_state.json"]
    assert not os.path.exists(CommitLayout(ckpt_dir, PosixDiskStorage()).staged_path(3, 0, 0))

    # From memory: the same set, and ``into`` fills existing tensors in place.
    loc = eng.locate()
    assert (loc.step, loc.source, loc.path) == (3, "memory", os.path.join(ckpt_dir, "checkpoint-3"))
    target = {"exp_avg": torch.zeros(16, 8)}
    fs = eng.load(into={"optimizer.pt": {"state": {0: target}}})
    assert isinstance(fs, FileSet) and eng.last_load.source == "memory"
    assert fs["optimizer.pt"].data["state"][0]["exp_avg"] is target["exp_avg"]
    assert_same_tree(fs["optimizer.pt"].data, make_set(3)["optimizer.pt"].data)
    assert fs.raw_bytes("model.safetensors") == make_set(3).raw_bytes("model.safetensors")
    assert fs.raw_bytes("latest") == b"checkpoint-3" and fs["latest"].kind == "tracker"
    eng.close()


def test_fileset_loads_from_storage_and_by_directory(make_engine, ckpt_dir, runtime_dir):
    eng = make_engine(max_to_keep=0)
    eng.save(5, make_set(5), path="checkpoint-5", storage_type=DISK)
    eng.close()
    wait_savers_gone(runtime_dir)
    eng = make_engine(max_to_keep=0)
    loc = eng.locate()
    assert (loc.step, loc.source, loc.path) == (5, "storage", os.path.join(ckpt_dir, "checkpoint-5"))
    fs = eng.load()
    assert eng.last_load.source == "storage"
    assert sorted(fs) == [".metadata", "model.safetensors", "optimizer.pt", "sub/blob.bin", "trainer_state.json"]
    assert fs.raw_bytes("model.safetensors") == make_set(5).raw_bytes("model.safetensors")
    assert_same_tree(fs["optimizer.pt"].data, make_set(5)["optimizer.pt"].data)
    by_dir = eng.load("checkpoint-5")
    assert by_dir.raw_bytes("trainer_state.json") == fs.raw_bytes("trainer_state.json")
    eng.close()


def test_retention_removes_whole_sets_but_never_the_tracker(make_engine, ckpt_dir):
    eng = make_engine(max_to_keep=2)
    for step in (1, 2, 3):
        eng.save(step, make_set(step), path=f"checkpoint-{step}", storage_type=DISK)
        eng.wait(60)
    eng.wait(60)
    assert committed(ckpt_dir) == [2, 3]
    assert not os.path.exists(os.path.join(ckpt_dir, "checkpoint-1"))  # the directory is gone too
    assert os.path.exists(os.path.join(ckpt_dir, "checkpoint-2", ".metadata"))
    with open(os.path.join(ckpt_dir, "latest"), "rb") as f:
        assert f.read() == b"checkpoint-3"
    eng.close()


def test_commit_time_file_waits_for_every_rank(ckpt_dir):
    """The staged commit file of rank 0 is moved into place only once every rank is done."""
    layout = CommitLayout(ckpt_dir, PosixDiskStorage())
    st = PosixDiskStorage()
    final = os.path.join(ckpt_dir, "ck", ".metadata")
    staged = layout.staged_path(7, 0, 0)
    data = st.write_bytes(os.path.join(ckpt_dir, "ck", "__0_0.distcp"), b"rank0")
    meta = st.write_bytes(staged, b"METADATA")
    layout.write_done(7, 0, [FileRecord(data.path, data.size, data.xxh3, "raw", "__0_0.distcp"),
                             FileRecord(final, meta.size, meta.xxh3, "raw", ".metadata", "commit", staged)],
                      base=os.path.join(ckpt_dir, "ck"))
    with pytest.raises(CheckpointTimeoutError):
        commit_step(layout, 7, [0, 1], 2, replicated=False, extra={}, timeout=0.3)
    assert not os.path.exists(final) and layout.committed_steps() == []
    rec = st.write_bytes(os.path.join(ckpt_dir, "ck", "__1_0.distcp"), b"rank1")
    layout.write_done(7, 1, [FileRecord(rec.path, rec.size, rec.xxh3, "raw", "__1_0.distcp")],
                      base=os.path.join(ckpt_dir, "ck"))
    commit_step(layout, 7, [0, 1], 2, replicated=False, extra={}, timeout=5)
    with open(final, "rb") as f:
        assert f.read() == b"METADATA"
    assert layout.committed_steps() == [7] and layout.verify(7) == []


def crashing_set_trainer(ckpt_dir: str, ready_file: str) -> None:
    import threading

    from flashckpt import CheckpointEngine

    eng = CheckpointEngine(ckpt_dir, max_to_keep=0)
    eng.save(1, make_set(1), path="checkpoint-1", storage_type=DISK)
    eng.wait(60)
    eng.save(2, make_set(2), path="checkpoint-2", storage_type=MEMORY)
    with open(ready_file, "w") as f:
        f.write("ready")
    threading.Event().wait(120)
    raise RuntimeError("not killed")


def restarted_set_trainer(ckpt_dir: str) -> dict:
    from flashckpt import CheckpointEngine

    eng = CheckpointEngine(ckpt_dir, max_to_keep=0)
    try:
        loc = eng.locate()
        fs = eng.load_memory(loc.step)
        return {"source": loc.source, "step": loc.step, "path": loc.path,
                "state": fs.raw_bytes("trainer_state.json").decode()}
    finally:
        eng.close(release=True)


@pytest.mark.multiproc
def test_last_words_persist_a_memory_only_set(runtime_dir, ckpt_dir, tmp_path):
    ready = str(tmp_path / "ready")
    crashed = launch_ranks(crashing_set_trainer, 1, str(tmp_path / "crash"), dist=False,
                           args={"ckpt_dir": ckpt_dir, "ready_file": ready})
    try:
        wait_for(lambda: os.path.exists(ready) or crashed.procs[0].poll() is not None, 120, "the trainer to save")
        assert os.path.exists(ready), crashed.logs()
    finally:
        crashed.kill()
    assert crashed.procs[0].returncode == -signal.SIGKILL
    assert saver_pids(runtime_dir)
    wait_for(lambda: committed(ckpt_dir) == [1, 2], 60, "the last-words commit of step 2")
    check_on_storage(ckpt_dir, 2)

    def latest() -> bytes:
        with open(os.path.join(ckpt_dir, "latest"), "rb") as f:
            return f.read()

    # The tracker follows the manifest (a reader of the tracker never sees an uncommitted step).
    wait_for(lambda: latest() == b"checkpoint-2", 30, "the tracker to name step 2")
    (res,) = run_ranks(restarted_set_trainer, 1, str(tmp_path / "restart"), args={"ckpt_dir": ckpt_dir}, dist=False)
    assert res == {"source": "memory", "step": 2, "path": os.path.join(ckpt_dir, "checkpoint-2"),
                   "state": json.dumps({"global_step": 2})}
    wait_savers_gone(runtime_dir)


@pytest.mark.parametrize("name", ["../x", "/abs/file", ".flashckpt/x", "", "a/../../b"])
def test_bad_entry_names_are_refused(name):
    with pytest.raises(ValueError, match="FileSet entry name"):
        FileSet().add_raw(name, b"x")


def test_bad_parts_and_kinds_are_refused():
    with pytest.raises(Exception, match="parts must be bytes or tensors"):
        FileSet().add_raw("a", [b"x", 3])
    with pytest.raises(ValueError, match="kind must be one of"):
        FileSet().add_raw("a", b"x", kind="later")
