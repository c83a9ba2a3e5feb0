"""The commit records under attack, with real savers and the real CLI: manifests and markers of the wrong
structure are damaged steps (never a crash), paths taken from records are confined to the checkpoint
dir, ``save(path=...)`` never rewrites another step's committed files, and the tracker is derived from
the manifests (a failed or interrupted tracker write is reported exactly and repaired at start)."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import pytest
from _fault_helpers import (  # noqa: F401
    FaultEnv,
    close_and_wait,
    fault_env_fixture,
    kill9,
    make_state,
    run_cli,
    saver_pid,
    wait_for,
)
from flashckpt import CheckpointDirError, CheckpointEngine, FileSet, PersistError, StorageType
from flashckpt.commit.layout import CommitLayout
from flashckpt.storage.base import FileRecord
from flashckpt.storage.posix import PosixDiskStorage

MB = 0.05


def _layout(ckpt: str) -> CommitLayout:
    return CommitLayout(ckpt, PosixDiskStorage())


def _save_steps(ckpt: str, steps: list[int], **kw: object) -> None:
    engine = CheckpointEngine(ckpt, max_to_keep=0, **kw)  # type: ignore[arg-type]
    try:
        for s in steps:
            engine.save(s, make_state(s, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=60)
    finally:
        close_and_wait(engine)


def _write_json(path: str, obj: object) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f)


def _sentinel(path: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("not flashckpt's")
    return path


# ------------------------------------------------------------------------------ defect 6: structure
def test_manifest_and_markers_of_the_wrong_structure_are_damaged_steps(fault_env: FaultEnv) -> None:
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    _save_steps(ckpt, [1, 2])
    layout = _layout(ckpt)
    with open(layout.manifest_path(2)) as f:
        good = json.load(f)
    # Valid JSON, wrong structure: the manifest of step 2, an intent of a crashed step 3, the tracker.
    _write_json(layout.manifest_path(2), {**good, "files": [1, 2]})
    _write_json(os.path.join(layout.step_dir(3), "intent_rank_0.json"), {"rank": 0, "paths": 3})
    _write_json(layout.tracker_path, [2])

    r = run_cli(fault_env, "ls", ckpt, console=True)
    assert r.returncode == 0 and "Traceback" not in r.stderr and "damaged" in r.stdout, r.stdout + r.stderr
    r = run_cli(fault_env, "verify", ckpt, console=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "step 1: ok" in r.stdout and "step 2: DAMAGED" in r.stdout and "'files'" in r.stdout, r.stdout

    # Other shapes of the same damage are reported, not raised.
    for bad in ([], {**good, "files": {"0": [{"path": 5, "size": 1, "xxh3": "0"}]}},
                {**good, "files": {"0": [{"path": "a", "size": "big", "xxh3": "0"}]}},
                {**good, "extra": {"bases": ["x"]}}, {**good, "step": "2"}):
        _write_json(layout.manifest_path(2), bad)
        assert layout.verify(2) and "damaged" in layout.verify(2)[0], bad
        r = run_cli(fault_env, "ls", ckpt, "--json")
        assert r.returncode == 0 and {row["step"]: row["state"] for row in json.loads(r.stdout)}[2] == "damaged"
    _write_json(layout.manifest_path(2), {**good, "files": [1, 2]})

    # A new saver starts (clean-up of step 3 included), and load() falls back to step 1.
    engine = CheckpointEngine(ckpt, max_to_keep=0)
    try:
        sd = engine.load()
        assert engine.last_load is not None and (engine.last_load.step, engine.last_load.source) == (1, "storage")
        assert sd["step"] == 1
        assert not os.path.exists(layout.step_dir(3)), fault_env.saver_logs()  # the crashed step is cleaned up
    finally:
        close_and_wait(engine)


# ------------------------------------------------------------------------------ defect 7: confinement
def test_paths_from_records_never_reach_outside_the_checkpoint_dir(fault_env: FaultEnv) -> None:
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    outside = os.path.join(fault_env.tmp, "outside")
    _save_steps(ckpt, [1, 2])
    layout = _layout(ckpt)
    os.symlink(outside, os.path.join(ckpt, "link"))
    sentinels = [_sentinel(os.path.join(outside, f"s{i}")) for i in range(6)]
    # Start-up clean-up: intents of crashed steps naming an absolute path, '..' and a symlinked dir.
    _write_json(os.path.join(layout.step_dir(3), "intent_rank_0.json"),
                {"rank": 0, "paths": [sentinels[0], "../outside/s1", "link/s2"]})
    # Retention: committed steps whose manifests list files outside (through a symlink, with '..').
    for step, path in ((1, "link/s3"), (2, "../outside/s4")):
        with open(layout.manifest_path(step)) as f:
            m = json.load(f)
        m["files"]["0"] = [{**m["files"]["0"][0], "path": path}, *m["files"]["0"]]
        _write_json(layout.manifest_path(step), m)
    _write_json(os.path.join(layout.step_dir(1), "intent_rank_0.json"), {"rank": 0, "paths": ["link/s5"]})

    r = run_cli(fault_env, "verify", ckpt, console=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert "step 1: DAMAGED" in r.stdout and "step 2: DAMAGED" in r.stdout, r.stdout

    engine = CheckpointEngine(ckpt, max_to_keep=1)  # start-up clean-up runs in its new saver
    try:
        assert not os.path.exists(layout.step_dir(3))
        engine.save(10, make_state(10, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=60)  # retention deletes steps 1 and 2
        wait_for(lambda: engine.committed_steps() == [10], 30, "retention to delete steps 1 and 2")
    finally:
        close_and_wait(engine)
    survivors = [p for p in sentinels if os.path.exists(p)]
    assert survivors == sentinels, f"deleted outside the checkpoint dir: {sorted(set(sentinels) - set(survivors))}"
    assert os.path.islink(os.path.join(ckpt, "link"))


# ------------------------------------------------------------------------------ defect 8: save targets
def test_save_refuses_paths_over_other_steps_committed_files(fault_env: FaultEnv) -> None:
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    engine = CheckpointEngine(ckpt, max_to_keep=0)
    try:
        engine.save(1, make_state(1, MB), storage_type=StorageType.DISK)  # step_1/rank_00000.pt
        fs = FileSet().add_raw("a.bin", b"a" * 100).add_torch("b.pt", {"x": 1})
        engine.save(2, fs, path="set2", storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        refused = {
            os.path.join(engine.layout.meta, "tracker.json"): "commit records",  # beside the checkpoint dir
            ".flashckpt/tracker.json": "reserves for its commit records",  # the inside layout's name
            ".flashckpt/steps/000000000001/manifest.json": "commit records",
            "set2/b.pt": "directory of committed step 2",
            "set2/new.pt": "directory of committed step 2",
            "step_1": "committed step 1 keeps",
        }
        for path, why in refused.items():
            with pytest.raises(CheckpointDirError, match=why):
                engine.save(3, make_state(3, MB), path=path, storage_type=StorageType.DISK)
        with pytest.raises(CheckpointDirError, match="directory of committed step 2"):
            engine.save(3, FileSet().add_raw("a.bin", b"b" * 100), path="set2", storage_type=StorageType.DISK)
        with pytest.raises(CheckpointDirError, match="committed step 1 keeps"):  # a set's file over step 1's dir
            engine.save(3, FileSet().add_raw("step_1", b"c"), path=ckpt, storage_type=StorageType.DISK)
        # One fixed path reused across steps: the newer save supersedes the older step at its commit.
        engine.save(4, make_state(4, MB), path="fixed.pt", storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        engine.save(5, make_state(5, MB), path="fixed.pt", storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        assert engine.committed_steps() == [1, 2, 5]
    finally:
        close_and_wait(engine)
    r = run_cli(fault_env, "verify", ckpt, console=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step 1: ok" in r.stdout and "step 2: ok" in r.stdout and "step 5: ok" in r.stdout


# ------------------------------------------------------------------------------ defect 9: the tracker
class _GatedTracker(PosixDiskStorage):
    """The POSIX backend, with writes of ``tracker.json`` held at a gate (a storage that stalls)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.held = threading.Event()
        self.tracker_writes: list[int | None] = []

    def write_bytes(self, path: str, data: bytes):  # type: ignore[no-untyped-def]
        if os.path.basename(path) == "tracker.json":
            self.held.set()
            assert self.gate.wait(60)
            self.tracker_writes.append(json.loads(data)["step"])
        return super().write_bytes(path, data)


def _done(layout: CommitLayout, step: int) -> None:
    """Rank 0's file of ``step`` and its done marker, as a persist leaves them."""
    path = os.path.join(layout.root, f"s{step}.bin")
    rec = layout.storage.write_bytes(path, bytes([step]) * 64)
    layout.write_done(step, 0, [FileRecord(path, rec.size, rec.xxh3, fmt="raw")])


def _commit_later(saver: Any, job: Any) -> None:
    """Queues a commit as the saver's persist thread does once a rank's files are written."""
    from flashckpt.saver.state import StepState

    with saver.state.cv:
        saver.state.inflight += 1
        saver.state.steps.setdefault(job.step, StepState()).commits_here = True
    saver.state.commit_q.put(job)


def test_a_deletion_waits_for_the_commit_in_flight_and_the_tracker_names_the_newest(tmp_path) -> None:
    """A framework deletes its previous checkpoint while the next one commits (Lightning's top-k, the HF
    Trainer's rotation: ``delete_steps(newest=True)``). The saver runs every change to the commit records on
    its commit thread, in order: the deletion waits for the commit in flight, the two never write the
    tracker at once (CI once failed on the two writers' shared temporary name), and the tracker ends up
    naming the newest committed step. The real saver, in this process, over a storage whose tracker
    writes stall at a gate."""
    from flashckpt.saver.server import CheckpointSaver
    from flashckpt.saver.state import CommitJob
    from flashckpt.transport.messages import DeleteSteps

    storage = _GatedTracker()
    saver = CheckpointSaver(str(tmp_path / "job"), str(tmp_path / "ckpt"), storage=storage)
    saver.start()
    try:
        saver.records.await_ready("the test's persists", 30)  # as a persist request does: start-up clean-up first
        layout = saver.layout
        spec = {"ranks": [0], "world_size": 1}
        _done(layout, 1)
        _commit_later(saver, CommitJob(1, spec))
        wait_for(lambda: saver.state.committed == [1], 30, "step 1 to commit")
        storage.gate.clear()
        storage.held.clear()
        _done(layout, 2)
        _commit_later(saver, CommitJob(2, spec))
        assert storage.held.wait(30)  # step 2's manifest is written; its tracker write stalls
        deleted: list[Any] = []

        def delete() -> None:
            try:
                deleted.append(saver.control._on_delete_steps(DeleteSteps(steps=[1], newest=True), None).deleted)
            except BaseException as e:
                deleted.append(e)

        t = threading.Thread(target=delete)
        t.start()
        wait_for(lambda: not t.is_alive() or saver.state.commit_q.qsize() > 0, 30, "the deletion to run or queue")
        assert t.is_alive(), f"the deletion ran beside the commit in flight: {deleted}"
        storage.gate.set()
        t.join(60)
        assert deleted == [[1]]
        assert storage.tracker_writes == [1, 2]  # step 1's deletion never pointed the tracker elsewhere
        assert layout.committed_steps() == [2] and layout.tracker_step() == 2 and saver.state.committed == [2]
    finally:
        storage.gate.set()
        saver.request_stop()
        saver.shutdown(drain_timeout=30)


def test_failed_tracker_write_is_reported_exactly_and_repaired_at_start(fault_env: FaultEnv) -> None:
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    layout = _layout(ckpt)
    engine = CheckpointEngine(ckpt, max_to_keep=0)
    try:
        engine.save(1, make_state(1, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        os.unlink(layout.tracker_path)
        os.mkdir(layout.tracker_path)  # the tracker's rename now fails (EISDIR), after the manifest
        engine.save(2, make_state(2, MB), storage_type=StorageType.DISK)
        with pytest.raises(PersistError) as ei:
            engine.wait(timeout=60)
        msg = str(ei.value)
        assert msg.startswith(f"step 2 is committed and loadable, but updating {layout.tracker_path} failed: "
                              "[Errno 21] Is a directory"), msg
        assert "a saver repairs this at its next start" in msg and "persist(s) failed" not in msg, msg
        assert engine.committed_steps() == [1, 2] and layout.verify(2) == []
        engine.wait(timeout=60)  # reported once
    finally:
        close_and_wait(engine)
    os.rmdir(layout.tracker_path)
    _write_json(layout.tracker_path, {"step": 1})  # what the failed write left (the old tracker)
    engine = CheckpointEngine(ckpt, max_to_keep=0)  # its new saver repairs the tracker at start
    try:
        assert layout.tracker_step() == 2
        assert engine.load()["step"] == 2
    finally:
        close_and_wait(engine)


def test_saver_killed_between_manifest_and_tracker_is_repaired(fault_env: FaultEnv) -> None:
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    layout = _layout(ckpt)
    engine = CheckpointEngine(ckpt, max_to_keep=0)
    pid = saver_pid(fault_env.runtime_dir, engine.job_dir)
    fifo = layout.tracker_path + ".flashckpt-tmp"
    try:
        engine.save(1, make_state(1, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        # The tracker's temporary file is a FIFO: the commit of step 2 blocks opening it, right after
        # its manifest was written; the saver is killed there.
        os.mkfifo(fifo)
        engine.save(2, make_state(2, MB), storage_type=StorageType.DISK)
        wait_for(lambda: os.path.exists(layout.manifest_path(2)), 60, "the manifest of step 2")
        kill9(pid)
    finally:
        engine.close(release=False)
    os.unlink(fifo)
    assert layout.tracker_step() == 1
    engine = CheckpointEngine(ckpt, max_to_keep=0)
    try:
        assert layout.tracker_step() == 2
        r = run_cli(fault_env, "ls", ckpt, "--json")
        states = {row["step"]: (row["state"], row["latest"]) for row in json.loads(r.stdout)}
        assert states == {1: ("committed", False), 2: ("committed", True)}, states  # the tracker names step 2
    finally:
        close_and_wait(engine)


def test_fixed_path_reused_keeps_the_older_step_until_the_newer_commits(fault_env: FaultEnv) -> None:
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    layout = _layout(ckpt)
    engine = CheckpointEngine(ckpt, max_to_keep=0)
    try:
        engine.save(4, make_state(4, MB), path="fixed.pt", storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        # Step 5's persist to the same path fails after its data is written (its done marker cannot be
        # written): step 4, committed, must stay intact.
        os.makedirs(os.path.join(layout.step_dir(5), "done_rank_0.json"))
        engine.save(5, make_state(5, MB), path="fixed.pt", storage_type=StorageType.DISK)
        with pytest.raises(PersistError, match="persisting step 5"):
            engine.wait(timeout=60)
        assert engine.committed_steps() == [4] and layout.verify(4) == []
        assert engine.load(resume_path="fixed.pt")["step"] == 4
        os.rmdir(os.path.join(layout.step_dir(5), "done_rank_0.json"))
        engine.save(6, make_state(6, MB), path="fixed.pt", storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        assert engine.committed_steps() == [6] and layout.verify(6) == []  # step 4 superseded
    finally:
        close_and_wait(engine)
    r = run_cli(fault_env, "verify", ckpt, console=True)
    assert r.returncode == 0 and "step 6: ok" in r.stdout, r.stdout + r.stderr
