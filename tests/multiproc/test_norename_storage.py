"""Nothing in flashckpt assumes POSIX: the whole life of a checkpoint dir on a backend without rename,
directories, locks or local paths (``lobj://``, tests/support/plugins/flashckpt_lobj: a local object store that
registers through the ``flashckpt.storage`` entry-point group, as a third-party backend would).

Snapshots, persists (single files and file sets with commit-time and tracker files, which a commit
moves into place without rename), commits, retention, loads from memory and from storage, last words
after a crash, a fixed name reused across steps, the job's lease and ``flashckpt ls/verify/gc`` all run
through the backend, with real savers, persist workers and trainers. A part that used ``os.path`` or
``open`` on a checkpoint location would fail, or leave a ``lobj:`` directory behind: each test looks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _fault_helpers import (  # noqa: F401
    FaultEnv,
    assert_bit_equal,
    assert_state_of,
    close_and_wait,
    fault_env_fixture,
    make_state,
    wait_for,
)
from flashckpt import CheckpointEngine, FileSet, StorageType
from flashckpt.commit.layout import CommitLayout
from flashckpt.storage.registry import storage_for

PLUGINS = os.path.join(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"), "plugins")
MB = 0.25


class Store:
    """The ``lobj://`` store of one test: its URL root and a view of its objects."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.url = "lobj://bucket/run"

    def storage(self) -> Any:
        return storage_for(self.url)

    def layout(self) -> CommitLayout:
        return CommitLayout(self.url, self.storage())

    def keys(self) -> list[str]:
        import urllib.parse

        return sorted(urllib.parse.unquote(n) for n in os.listdir(os.path.join(self.root, "bucket"))
                      if not n.startswith(".tmp-"))


def _strays(*dirs: str) -> list[str]:
    """Entries named like a lobj:// URL taken for a local path (``lobj:``), in ``dirs``."""
    return [os.path.join(d, n) for d in dirs if os.path.isdir(d) for n in os.listdir(d) if n.startswith("lobj:")]


@pytest.fixture
def store(fault_env: FaultEnv, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """A fresh store, the backend found through its entry point in this process and in every process the
    test starts (savers, persist workers, trainers, the CLI); no stray ``lobj:`` entry afterwards."""
    root = tmp_path / "objects"
    root.mkdir()
    monkeypatch.setenv("FLASHCKPT_LOBJ_ROOT", str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([PLUGINS, *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.syspath_prepend(PLUGINS)
    fault_env.base_env.update(FLASHCKPT_LOBJ_ROOT=str(root), PYTHONPATH=os.environ["PYTHONPATH"])
    monkeypatch.chdir(tmp_path)
    yield Store(str(root))
    assert not _strays(str(tmp_path), "/", os.path.expanduser("~")), "a checkpoint URL was used as a local path"


def _cli(fe: FaultEnv, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flashckpt.cli", *args], capture_output=True, text=True,
                          timeout=120, env=fe.env())


def test_the_backend_comes_from_its_entry_point_and_has_no_rename(store: Store) -> None:
    s = store.storage()
    assert type(s).__name__ == "LocalObjectStorage" and not s.supports_rename and s.local_path(store.url) is None


def test_save_commit_retention_and_load_through_a_store_without_rename(store: Store, fault_env: FaultEnv) -> None:
    engine = CheckpointEngine(store.url, max_to_keep=2)
    try:
        assert engine.checkpoint_dir == store.url
        states = {}
        for step in (1, 2, 3):
            states[step] = make_state(step, MB)
            engine.save(step, states[step], storage_type=StorageType.DISK)
            engine.wait(timeout=60)
        assert engine.committed_steps() == [2, 3]  # retention ran on the store
        lease = [k for k in store.keys() if k.startswith("run/.flashckpt/jobs/")]
        assert len(lease) == 1 and lease[0].endswith(".lease")  # the saver's hold on the records
        body = json.loads(store.storage().read_bytes(f"lobj://bucket/{lease[0]}"))
        assert body["pid"] > 0 and body["expires"] > 0
        states[4] = make_state(4, MB)
        engine.save(4, states[4], storage_type=StorageType.MEMORY)  # committed by close()'s last words
        assert_state_of(engine.load(), 4, MB)
        assert engine.last_load is not None and engine.last_load.source == "memory"
    finally:
        close_and_wait(engine)
    keys = store.keys()
    assert "run/step_3/rank_00000.pt" in keys and not any(k.startswith("run/step_1/") for k in keys)
    assert not any(k.startswith("run/.flashckpt/jobs/") for k in keys)  # the lease went with the saver
    layout = store.layout()
    assert layout.committed_steps() == [2, 3, 4] and layout.tracker_step() == 4 and layout.verify(4) == []
    again = CheckpointEngine(store.url)  # memory released: from storage, read through the backend
    try:
        assert_bit_equal(again.load(), states[4])
        assert again.last_load is not None and again.last_load.source == "storage"
        assert_bit_equal(again.load(resume_path="step_2/rank_00000.pt"), states[2])
        assert_bit_equal(again.load(resume_path=f"{store.url}/step_2/rank_00000.pt"), states[2])
    finally:
        close_and_wait(again)
    ls = _cli(fault_env, "ls", store.url)
    assert ls.returncode == 0 and "committed (latest)" in ls.stdout and "step_4/rank_00000.pt" in ls.stdout, ls
    ok = _cli(fault_env, "verify", store.url)
    assert ok.returncode == 0 and "step 4: ok" in ok.stdout, ok
    s = store.storage()
    s.write_bytes(f"{store.url}/step_4/rank_00000.pt", b"damaged")
    bad = _cli(fault_env, "verify", store.url)
    assert bad.returncode == 1 and "step 4: DAMAGED" in bad.stdout, bad
    fallback = CheckpointEngine(store.url)
    try:
        assert_bit_equal(fallback.load(), states[3])  # damage found by checksum: the previous step
    finally:
        close_and_wait(fallback)


def test_file_sets_with_staged_and_tracker_files_commit_without_rename(store: Store) -> None:
    """Commit-time and tracker files wait in the records and are moved into place by the commit (a copy
    and a delete on this backend); a fixed name reused by a later step supersedes the older one."""
    engine = CheckpointEngine(store.url, max_to_keep=0)
    try:
        for step in (1, 2):
            fs = FileSet()
            fs.add_torch("model.pt", {"w": torch.full((64,), float(step))})
            fs.add_raw("meta.json", json.dumps({"step": step}).encode(), kind="commit")
            fs.add_raw("latest", str(step).encode(), kind="tracker")  # a name in the checkpoint dir
            engine.save(step, fs, path=f"ckpt-{step}", storage_type=StorageType.DISK)
            engine.wait(timeout=60)
        engine.save(3, {"w": torch.ones(3)}, path="last.pt", storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        engine.save(4, {"w": torch.zeros(3)}, path="last.pt", storage_type=StorageType.DISK)
        engine.wait(timeout=60)
    finally:
        close_and_wait(engine)
    s = store.storage()
    assert s.read_bytes(f"{store.url}/latest") == b"2"  # the tracker file, written at commit
    assert json.loads(s.read_bytes(f"{store.url}/ckpt-2/meta.json")) == {"step": 2}
    assert not any("/staged/" in k for k in store.keys())  # every staged file was moved into place
    layout = store.layout()
    assert layout.committed_steps() == [1, 2, 4]  # step 4 rewrote last.pt: it superseded step 3
    assert all(layout.verify(st) == [] for st in (1, 2, 4))
    again = CheckpointEngine(store.url)
    try:
        got = again.load(resume_path="ckpt-1")
        assert isinstance(got, FileSet) and torch.equal(got["model.pt"].data["w"], torch.full((64,), 1.0))
        assert torch.equal(again.load()["w"], torch.zeros(3))
    finally:
        close_and_wait(again)


def test_last_words_persist_a_crashed_trainers_snapshot_to_the_store(store: Store, fault_env: FaultEnv) -> None:
    """A trainer killed after memory snapshots: its saver persists and commits the newest one to the store."""
    proc = fault_env.trainer(store.url, "--mb", str(MB), "--plan", "1:disk,2:memory,3:memory", "--wait", "--hold")
    wait_for(lambda: "holding" in fault_env.log("trainer.log") or proc.poll() is not None, 120,
             "the trainer to save")
    assert proc.poll() is None, fault_env.log("trainer.log")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    layout = store.layout()
    wait_for(lambda: 3 in layout.committed_steps(), 60, f"last words to commit step 3\n{fault_env.saver_logs()}")
    assert layout.verify(3) == [] and layout.tracker_step() == 3
    engine = CheckpointEngine(store.url)
    try:
        assert_state_of(engine.load(), 3, MB)
    finally:
        close_and_wait(engine)


def test_a_url_no_backend_serves_is_refused_before_anything_starts(store: Store, fault_env: FaultEnv) -> None:
    from flashckpt import CheckpointDirError

    with pytest.raises(CheckpointDirError, match="gs://.*installed: .*lobj://"):
        CheckpointEngine("gs://bucket/run")
    out = _cli(fault_env, "ls", "lobj://bucket/nothing-here")
    assert out.returncode == 2 and "holds nothing" in out.stderr, out
