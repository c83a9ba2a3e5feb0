"""Bad input and failing resources: clear errors, raised before anything is written, and never at the cost
of an earlier snapshot or committed checkpoint."""

from __future__ import annotations

import os
import re
import threading

import pytest
import torch
from flashckpt import (
    CheckpointDirError,
    CheckpointEngine,
    FlashCheckpointError,
    InvalidStateDictError,
    PersistError,
    SharedMemoryError,
    StorageType,
)
from flashckpt.commit.layout import CommitLayout
from flashckpt.config import job_key
from flashckpt.format.tree import encode_opaque, flatten
from flashckpt.storage.posix import PosixDiskStorage
from helpers import assert_same_tree, leftovers, saver_pids, wait_savers_gone

DISK, MEMORY = StorageType.DISK, StorageType.MEMORY


def good_sd(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(8, 8, generator=g)}, "step": seed}


def _bad_values():
    return {
        "sparse_coo": torch.eye(4).to_sparse(),
        "sparse_csr": torch.eye(4).to_sparse_csr(),
        "meta": torch.empty(3, 3, device="meta"),
        "lambda": lambda x: x,
        "lock": threading.Lock(),
    }


BAD = ["sparse_coo", "sparse_csr", "meta", "lambda", "lock"]
pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")


def bad_sd(kind: str) -> dict:
    sd = good_sd(9)
    sd["optimizer"] = {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"lr": 0.1}]}
    sd["optimizer"]["state"][0]["culprit"] = _bad_values()[kind]
    return sd


def snapshot_tree(root: str) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime_ns) of every file under ``root``."""
    out = {}
    for d, _dirs, files in os.walk(root):
        for n in files:
            st = os.stat(os.path.join(d, n))
            out[os.path.join(d, n)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("kind", BAD)
def test_flatten_rejects_unstorable_values_naming_their_key(kind):
    """Tensors flatten cannot store are refused by the walk itself; other leaves it cannot store natively
    become opaque leaves, refused when they are pickled (what save does next, before anything is written)."""
    sd = bad_sd(kind)
    with pytest.raises(InvalidStateDictError) as ei:
        encode_opaque(flatten(sd).opaque, sd)
    assert "['optimizer']['state'][0]['culprit']" in str(ei.value)


def test_invalid_state_dict_writes_nothing(make_engine, ckpt_dir):
    eng = make_engine(max_to_keep=0)
    eng.save(1, good_sd(1), storage_type=DISK)
    eng.wait(60)
    files_before = snapshot_tree(ckpt_dir)
    runtime_before = snapshot_tree(eng.job_dir)
    for kind in BAD:
        for st in (MEMORY, DISK):
            with pytest.raises(InvalidStateDictError, match=re.escape("['optimizer']['state'][0]['culprit']")):
                eng.save(2, bad_sd(kind), storage_type=st)
        assert snapshot_tree(ckpt_dir) == files_before, f"{kind}: files were written"
        assert sorted(snapshot_tree(eng.job_dir)) == sorted(runtime_before), f"{kind}: segments changed"
    # A persist path outside the checkpoint dir is refused before anything is copied, too.
    with pytest.raises(CheckpointDirError, match="outside the checkpoint dir"):
        eng.save(2, good_sd(2), path="/tmp/elsewhere.pt", storage_type=DISK)
    assert eng.memory_steps() == [1]
    assert_same_tree(good_sd(1), eng.load())
    assert (eng.last_load.source, eng.last_load.step) == ("memory", 1)
    eng.wait(60)  # no error was queued by the refused saves
    assert CommitLayout(ckpt_dir, PosixDiskStorage()).committed_steps() == [1]
    eng.close()


def test_unwritable_checkpoint_dir_fails_at_construction(tmp_path, runtime_dir):
    blocker = tmp_path / "a_file"
    blocker.write_bytes(b"not a directory")  # root ignores permissions, so block with a file instead
    target = str(blocker / "ckpt")
    with pytest.raises(CheckpointDirError) as ei:
        CheckpointEngine(target)
    assert target in str(ei.value)
    assert not saver_pids(runtime_dir) and leftovers(runtime_dir) == [], "a saver started for an unusable dir"


def test_too_little_shared_memory_names_the_bytes_needed(make_engine, monkeypatch):
    monkeypatch.setenv("FLASHCKPT_SHM_LIMIT_BYTES", str(2 << 20))  # pretend /dev/shm has 2 MiB
    eng = make_engine()
    big = {"w": torch.zeros(4 << 20, dtype=torch.uint8)}  # 4 MiB, twice (two slots)
    with pytest.raises(SharedMemoryError) as ei:
        eng.save(1, big, storage_type=MEMORY)
    m = re.search(r"needs (\d+) bytes", str(ei.value))
    assert m, str(ei.value)
    assert int(m.group(1)) >= 2 * (4 << 20)
    assert "FLASHCKPT_SLOTS=1" in str(ei.value) or "/dev/shm" in str(ei.value)
    assert eng.memory_steps() == [] and eng.load() == {}
    small = good_sd(2)  # the engine stays usable for what fits
    eng.save(2, small, storage_type=MEMORY)
    assert_same_tree(small, eng.load())
    eng.close()


def test_persist_error_reaches_wait_and_previous_checkpoint_stays(make_engine, ckpt_dir, runtime_dir):
    eng = make_engine(max_to_keep=1)
    eng.save(5, good_sd(5), storage_type=DISK)
    eng.wait(60)
    layout = CommitLayout(ckpt_dir, PosixDiskStorage())
    good_file = os.path.join(ckpt_dir, "step_5", "rank_00000.pt")
    before = open(good_file, "rb").read()
    # A regular file where the step directory must be created: the persist fails even for root.
    with open(os.path.join(ckpt_dir, "step_7"), "w") as f:
        f.write("in the way")
    try:
        eng.save(7, good_sd(7), storage_type=DISK)  # the error surfaces at the next save or wait
        with pytest.raises(PersistError) as ei:
            eng.wait(60)
        err = ei.value
    except PersistError as e:  # the persist failed before save()'s own reply was built
        err = e
    assert "step 7" in str(err) and "step_7" in str(err)
    eng.wait(60)  # reported once
    assert layout.committed_steps() == [5] and layout.tracker_step() == 5
    assert layout.verify(5) == []
    assert open(good_file, "rb").read() == before
    assert_same_tree(good_sd(5), eng.load(resume_path="step_5/rank_00000.pt"))
    assert_same_tree(good_sd(7), eng.load())  # the snapshot itself is still in memory
    eng.close()
    wait_savers_gone(runtime_dir)

    # A new saver (clean-up of the half-written step 7 included) and a load from storage.
    again = make_engine(max_to_keep=1)
    assert_same_tree(good_sd(5), again.load())
    assert (again.last_load.source, again.last_load.step) == ("storage", 5)
    assert layout.committed_steps() == [5]
    again.close()


def test_two_engines_with_different_dirs_are_isolated(make_engine, tmp_path, runtime_dir, monkeypatch):
    monkeypatch.setenv("FLASHCKPT_JOB_ID", "same-job")  # even within one job
    a = make_engine(str(tmp_path / "a"))
    b = make_engine(str(tmp_path / "b"))
    assert a.job_dir != b.job_dir
    assert a._link.client.path != b._link.client.path  # their control sockets
    a.save(1, {"x": torch.ones(4)}, storage_type=MEMORY)
    b.save(1, {"x": torch.full((4,), 2.0)}, storage_type=MEMORY)
    assert torch.equal(a.load()["x"], torch.ones(4)) and torch.equal(b.load()["x"], torch.full((4,), 2.0))
    segs_a, segs_b = set(os.listdir(a.job_dir)), set(os.listdir(b.job_dir))
    assert any(n.endswith(".shm") for n in segs_a) and any(n.endswith(".shm") for n in segs_b)
    savers = saver_pids(runtime_dir)
    assert len(savers) == 2
    assert {argv[argv.index("--job-dir") + 1] for argv in savers.values()} == {a.job_dir, b.job_dir}
    a.close()
    assert torch.equal(b.load()["x"], torch.full((4,), 2.0))  # b is unaffected by a's saver leaving
    b.close()


def test_job_key_separates_dirs_and_jobs(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHCKPT_JOB_ID", "job/1 with spaces")
    k1, k2 = job_key(str(tmp_path / "a")), job_key(str(tmp_path / "b"))
    assert k1 != k2 and k1.startswith("job_1_with_spaces-") and "/" not in k1
    monkeypatch.setenv("FLASHCKPT_JOB_ID", "job2")
    assert job_key(str(tmp_path / "a")) != k1
    monkeypatch.delenv("FLASHCKPT_JOB_ID")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert job_key(str(tmp_path / "a")) == job_key(str(tmp_path / "a") + "/")


def test_error_hierarchy():
    for cls in (InvalidStateDictError, CheckpointDirError, SharedMemoryError, PersistError):
        assert issubclass(cls, FlashCheckpointError)
    assert issubclass(InvalidStateDictError, ValueError) and issubclass(PersistError, OSError)


# ------------------------------------------------------------------------------------------ one hierarchy
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROTOCOL_BUILTINS = {"KeyError", "NotImplementedError", "AttributeError", "StopIteration", "ImportError", "AssertionError"}


def _raised_builtins(root: str) -> list[str]:
    """``raise <builtin exception>(...)`` statements in the library's source under ``root``."""
    import ast
    import builtins

    found = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Raise) or node.exc is None:
                    continue
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and isinstance(getattr(builtins, exc.id, None), type) \
                        and issubclass(getattr(builtins, exc.id), BaseException) and exc.id not in _PROTOCOL_BUILTINS:
                    found.append(f"{os.path.relpath(path, _REPO)}:{node.lineno}: raise {exc.id}")
    return found


def test_the_library_raises_only_its_own_hierarchy():
    """Every error flashckpt raises derives from FlashCheckpointError (and from the builtin a user would
    catch); builtins are raised only where a Python protocol requires them (a mapping's KeyError, ...)."""
    found = [hit for folder in ("flashckpt_core", "integrations", "patches") for hit in _raised_builtins(os.path.join(_REPO, folder))]
    assert not found, "raise FlashCheckpointError subclasses (flashckpt.errors) instead of:\n" + "\n".join(found)


def test_every_public_error_is_a_flashcheckpointerror_and_a_builtin():
    import flashckpt.errors as errors

    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.FlashCheckpointError), name
    assert issubclass(errors.InvalidArgumentError, ValueError) and issubclass(errors.CheckpointNotFoundError, FileNotFoundError)
