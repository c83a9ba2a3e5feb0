"""The local tier's pieces in one process (``commit.tiers``): where a local dir may be, which locally
committed steps the durable tier lacks, and an upload that writes a durable step equal to the local one
(a file reused by a later step is staged until its commit; a damaged local copy is refused, not uploaded)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.protocol import commit_step
from flashckpt.commit.tiers import (
    DURABLE_ROOT,
    check_local_dir,
    durable_spec_of,
    local_layout,
    pending_uploads,
    upload_step,
)
from flashckpt.storage.posix import PosixDiskStorage


def _commit_locally(local: CommitLayout, step: int, files: dict[str, bytes], spec: dict[str, Any] | None,
                    durable: CommitLayout) -> None:
    recs = [local.storage.write_bytes(os.path.join(local.root, name), data) for name, data in files.items()]
    local.write_done(step, 0, recs, saved_at=float(step))
    commit_step(local, step, [0], 1, replicated=False, timeout=5,
                extra={"tier_ranks": [0], "durable_spec": spec, DURABLE_ROOT: durable.root})


def _upload_and_commit(local: CommitLayout, durable: CommitLayout, step: int) -> None:
    spec = durable_spec_of(upload_step(local, durable, step))
    assert spec is not None
    commit_step(durable, step, spec["ranks"], spec["world_size"], replicated=False, extra={}, timeout=5)


def test_check_local_dir(tmp_path: Any) -> None:
    st = PosixDiskStorage()
    durable = str(tmp_path / "d")
    assert check_local_dir(str(tmp_path / "n"), durable, st) == str(tmp_path / "n")
    for bad in (os.path.join(durable, "x"), durable, str(tmp_path)):
        with pytest.raises(E.InvalidArgumentError, match="overlaps"):
            check_local_dir(bad, durable, st)
    with pytest.raises(E.InvalidArgumentError, match="not a URL"):
        check_local_dir("s3://b/x", durable, st)


def test_upload_makes_the_durable_step_equal_to_the_local_one(tmp_path: Any) -> None:
    local = local_layout(str(tmp_path / "n"), "job")
    durable = CommitLayout(str(tmp_path / "d"), PosixDiskStorage(), job="job")
    os.makedirs(local.root)
    os.makedirs(durable.root)
    spec = {"ranks": [0], "world_size": 1, "replicated": False, "extra": {}}
    _commit_locally(local, 1, {"step_1/a.pt": b"one", "last.pt": b"L1"}, spec, durable)
    assert pending_uploads(local, durable) == [1]
    _upload_and_commit(local, durable, 1)
    assert durable.committed_steps() == [1] and durable.verify(1) == []
    assert pending_uploads(local, durable) == []
    _commit_locally(local, 2, {"step_2/a.pt": b"two", "last.pt": b"L2"}, None, durable)  # another node's step: no spec
    assert pending_uploads(local, durable) == [2]
    m = upload_step(local, durable, 2)  # markers only: this node does not commit step 2
    assert durable_spec_of(m) is None and durable.markers_complete(2, [0])
    # last.pt of committed step 1 is not overwritten before step 2's commit: it waits staged
    with open(os.path.join(durable.root, "last.pt"), "rb") as f:
        assert f.read() == b"L1"
    commit_step(durable, 2, [0], 1, replicated=False, extra={}, timeout=5)
    with open(os.path.join(durable.root, "last.pt"), "rb") as f:
        assert f.read() == b"L2"
    assert durable.committed_steps() == [2] and durable.verify(2) == []  # step 2 superseded step 1 (last.pt)


def test_a_damaged_local_copy_is_not_uploaded(tmp_path: Any) -> None:
    local = local_layout(str(tmp_path / "n"), "job")
    durable = CommitLayout(str(tmp_path / "d"), PosixDiskStorage(), job="job")
    os.makedirs(local.root)
    os.makedirs(durable.root)
    _commit_locally(local, 1, {"step_1/a.pt": b"one"}, {"ranks": [0], "world_size": 1, "replicated": False}, durable)
    with open(os.path.join(local.root, "step_1", "a.pt"), "wb") as f:
        f.write(b"ONE")
    with pytest.raises(E.CheckpointCorruptError, match="damaged"):
        upload_step(local, durable, 1)
    assert not durable.markers_complete(1, [0])
    os.unlink(os.path.join(local.root, "step_1", "a.pt"))  # emptied under the saver: said, never retried as a store error
    with pytest.raises(E.CheckpointCorruptError, match="is gone"):
        upload_step(local, durable, 1)
    assert not durable.markers_complete(1, [0])


def test_flashckpt_upload_commits_what_the_local_tier_holds(tmp_path: Any, capsys: Any) -> None:
    from flashckpt.cli import main

    local = local_layout(str(tmp_path / "n"), "job")
    os.makedirs(local.root)
    os.makedirs(tmp_path / "d")
    durable = CommitLayout(str(tmp_path / "d"), PosixDiskStorage())
    _commit_locally(local, 3, {"step_3/a.pt": b"three"}, {"ranks": [0], "world_size": 1, "replicated": False}, durable)
    assert main(["upload", str(tmp_path / "d"), "--local-dir", local.root]) == 0
    assert "step 3: uploaded and committed" in capsys.readouterr().out
    assert durable.committed_steps() == [3] and durable.verify(3) == []
    assert main(["upload", str(tmp_path / "d"), "--local-dir", local.root]) == 0
    assert "nothing to upload" in capsys.readouterr().out
    assert main(["ls", str(tmp_path / "d"), "--local-dir", local.root]) == 0
    assert "local, durable" in capsys.readouterr().out


def test_a_local_dir_never_gives_one_checkpoint_dirs_steps_to_another(tmp_path: Any) -> None:
    """The local tier of checkpoint dir A, given as the local dir of checkpoint dir B: nothing of A is
    uploaded to B (nor loaded as B's; the engine refuses the pair: tests/multiproc/test_tiers.py)."""
    local = local_layout(str(tmp_path / "n"), "job")
    a = CommitLayout(str(tmp_path / "a"), PosixDiskStorage(), job="job")
    b = CommitLayout(str(tmp_path / "b"), PosixDiskStorage(), job="job")
    for d in (local.root, a.root, b.root):
        os.makedirs(d)
    _commit_locally(local, 1, {"step_1/a.pt": b"A's"}, {"ranks": [0], "world_size": 1, "replicated": False}, a)
    assert pending_uploads(local, a) == [1]
    assert pending_uploads(local, b) == []
