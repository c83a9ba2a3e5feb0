"""One writer per segment, one job per step: leases, job locks and clean-up, with real processes.

- A second writer of a local rank's segment (another engine in the process, another process of the same
  job key) is refused with an error naming the holder; the first writer's commits hold only its data.
- The writer lease dies with its process (not with the process's forked children): a restarted trainer
  takes it over.
- A saver starting on a checkpoint dir leaves alone the in-flight step of another live job.
- A failed persist gives its space back at once; concurrent allocations of one local rank both succeed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading

import pytest
import torch
from _fault_helpers import (  # noqa: F401
    FaultEnv,
    alive,
    assert_state_of,
    close_and_wait,
    committed,
    fault_env_fixture,
    kill9,
    make_state,
    saver_pids,
    small_tmpfs,
    step_meta_dir,
    wait_for,
)
from flashckpt import CheckpointEngine, FileSet, PersistError, SharedMemoryError, StorageType
from flashckpt.commit.layout import CommitLayout, Manifest
from flashckpt.storage.posix import PosixDiskStorage
from flashckpt.transport.spawn import SOCKET_NAME
from flashckpt.transport.wire import Client

DISK, MEMORY = StorageType.DISK, StorageType.MEMORY


def _file_of(ckpt: str, step: int, rank: int = 0) -> str:
    return os.path.join(ckpt, f"step_{step}", f"rank_{rank:05d}.pt")


def _assert_committed_sound(ckpt: str, step: int, mb: float, job: str) -> None:
    """``step`` is committed by ``job``, verifies, and its file is exactly the state of ``step``."""
    layout = CommitLayout(ckpt, PosixDiskStorage())
    assert step in layout.committed_steps(), f"step {step} is not committed: {layout.committed_steps()}"
    assert layout.verify(step) == []
    assert layout.read_manifest(step).job == job
    assert_state_of(torch.load(_file_of(ckpt, step), weights_only=True), step, mb)


def _wait_line(fe: FaultEnv, log_name: str, proc: subprocess.Popen[bytes], line: str, timeout: float = 120) -> str:
    def seen() -> str | None:
        text = fe.log(log_name)
        if line in text:
            return text
        assert proc.poll() is None, f"the trainer exited before {line!r}:\n{text}"
        return None
    return wait_for(seen, timeout, f"{line!r} in {log_name}")


# ---------------------------------------------------------------------------------------------- one process
def test_second_engine_on_one_dir_in_one_process_is_refused(fault_env: FaultEnv) -> None:
    """Two engines of one process on one dir would write the same slots: the second one's save is refused,
    naming this process, and writes nothing (it may still load); the first goes on; once it closed, a new
    engine gets the segment."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    mb = 1
    first = CheckpointEngine(ckpt, max_to_keep=0)
    second = None
    try:
        first.save(1, make_state(1, mb), storage_type=DISK)
        second = CheckpointEngine(ckpt, max_to_keep=0)
        with pytest.raises(SharedMemoryError) as info:
            second.save(5, make_state(5, mb), storage_type=DISK)
        msg = str(info.value)
        assert f"this process (pid {os.getpid()})" in msg, msg
        assert "Close the other CheckpointEngine" in msg and "FLASHCKPT_JOB_ID" in msg, msg
        assert_state_of(second.load(), 1, mb)  # reading takes no lease
        second.close()
        first.save(2, make_state(2, mb), storage_type=DISK)
        first.wait(60)
        for step in (1, 2):
            _assert_committed_sound(ckpt, step, mb, first.job_dir.rsplit("/", 1)[1])
    finally:
        if second is not None:
            second.close()
        close_and_wait(first)
    again = CheckpointEngine(ckpt, max_to_keep=0)
    try:
        assert again.load()["step"] == 2
    finally:
        close_and_wait(again)


# ---------------------------------------------------------------------------------------------- two processes
@pytest.mark.multiproc
def test_second_process_without_job_id_is_refused_and_first_commits_only_its_data(fault_env: FaultEnv) -> None:
    """Two trainers with no job id on one dir share a job key (so a saver and its segments): the second is
    refused naming the first's pid, and every step the first commits (last words included) is its own."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    one = fault_env.trainer(ckpt, "--mb", "2", "--plan", "1:disk,2:memory", "--wait", "--hold",
                            log_name="one.log", FLASHCKPT_JOB_ID="")
    _wait_line(fault_env, "one.log", one, "holding")
    two = fault_env.trainer(ckpt, "--mb", "3", "--plan", "1:disk,2:disk", "--wait", log_name="two.log",
                            FLASHCKPT_JOB_ID="")
    rc = two.wait(timeout=120)
    out = fault_env.log("two.log")
    assert rc != 0, f"the second writer was not refused:\n{out}"
    assert "SharedMemoryError" in out and f"written by pid {one.pid}" in out, out
    key = hashlib.sha256(ckpt.encode()).hexdigest()[:10]  # no job id: the dir's hash alone, the same for both
    _assert_committed_sound(ckpt, 1, 2, key)
    # The first trainer dies: its saver's last words commit its step 2, still its own data.
    kill9(one.pid)
    wait_for(lambda: committed(ckpt, 2), 120, "the last words to commit step 2")
    _assert_committed_sound(ckpt, 2, 2, key)


@pytest.mark.multiproc
def test_restarted_trainer_takes_over_the_lease_of_a_crashed_one(fault_env: FaultEnv) -> None:
    """A trainer SIGKILLed while a forked child of it lives on: its lease died with it, so the restarted
    trainer writes the segment (and loads the snapshot), and is then the one writer a third one's save is
    refused by."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    mb = 1
    crashed = fault_env.trainer(ckpt, "--mb", str(mb), "--plan", "1:memory", "--fork", "--hold")
    text = _wait_line(fault_env, "trainer.log", crashed, "holding")
    child = int(text.split("child ", 1)[1].split()[0])
    restarted = None
    try:
        kill9(crashed.pid)
        assert alive(child)
        restarted = CheckpointEngine(ckpt, max_to_keep=0)
        assert_state_of(restarted.load(), 1, mb)
        assert restarted.last_load is not None and restarted.last_load.source == "memory"
        restarted.save(2, make_state(2, mb), storage_type=DISK)
        restarted.wait(60)
        third = CheckpointEngine(ckpt, max_to_keep=0)
        try:
            with pytest.raises(SharedMemoryError, match=f"this process \\(pid {os.getpid()}\\)"):
                third.save(3, make_state(3, mb), storage_type=MEMORY)
        finally:
            third.close()
    finally:
        kill9(child)  # it holds the crashed trainer's connection to the saver too
        if restarted is not None:
            close_and_wait(restarted)
    _assert_committed_sound(ckpt, 2, mb, fault_env.job_dir(ckpt).rsplit("/", 1)[1])


# ---------------------------------------------------------------------------------------------- two jobs
def _as_job(monkeypatch: pytest.MonkeyPatch, job: str, rank: int | None = None, world: int = 1) -> None:
    monkeypatch.setenv("FLASHCKPT_JOB_ID", job)
    for var in ("RANK", "LOCAL_RANK"):
        if rank is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, str(rank))
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        if rank is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, str(world))


def test_a_starting_saver_leaves_another_live_jobs_in_flight_step_alone(fault_env: FaultEnv,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Job A (two ranks) has rank 0's files of step 1 on disk, waiting for rank 1 to commit. Job B starts
    a saver on the same checkpoint dir: its start-up clean-up must not touch A's step; B's commits and
    A's commit each hold their own job's files only."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    mb = 1
    _as_job(monkeypatch, "job-a", rank=0, world=2)
    a0 = CheckpointEngine(ckpt, max_to_keep=0)
    engines = [a0]
    try:
        a0.save(1, make_state(1, mb), storage_type=DISK)
        meta = step_meta_dir(ckpt, 1)
        wait_for(lambda: os.path.exists(os.path.join(meta, "done_rank_0.json")), 60, "rank 0's done marker")
        before = sorted(os.listdir(meta))

        _as_job(monkeypatch, "job-b")
        b = CheckpointEngine(ckpt, max_to_keep=0)  # its saver started (and cleaned up) before this returns
        engines.append(b)
        assert sorted(os.listdir(meta)) == before, "job B's start-up removed job A's in-flight step"
        assert os.path.exists(_file_of(ckpt, 1)) and not committed(ckpt, 1)
        b.save(7, make_state(7, mb), storage_type=DISK)
        b.wait(60)
        _assert_committed_sound(ckpt, 7, mb, b.job_dir.rsplit("/", 1)[1])

        _as_job(monkeypatch, "job-a", rank=1, world=2)
        a1 = CheckpointEngine(ckpt, max_to_keep=0)
        engines.append(a1)
        a1.save(1, make_state(1, mb), storage_type=DISK)
        a1.wait(60)
        a0.wait(60)
        _assert_committed_sound(ckpt, 1, mb, a0.job_dir.rsplit("/", 1)[1])
        manifest = CommitLayout(ckpt, PosixDiskStorage()).read_manifest(1)
        assert sorted(manifest.files) == [0, 1]
        with open(os.path.join(meta, "manifest.json")) as f:
            assert json.load(f)["job"] == a0.job_dir.rsplit("/", 1)[1]
    finally:
        for e in reversed(engines):
            e.close()
        wait_for(lambda: not saver_pids(fault_env.runtime_dir), 60, "the savers to exit after the goodbyes")


def test_a_commit_never_mixes_two_live_jobs_markers(fault_env: FaultEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """Job A's rank 0 and job B's rank 1 save step 3 into one dir: A's commit must not take B's done
    marker for rank 1 (a manifest mixing two jobs would verify); it fails with a clear error instead."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    mb = 1
    _as_job(monkeypatch, "job-a", rank=0, world=2)
    a0 = CheckpointEngine(ckpt, max_to_keep=0)
    engines = [a0]
    try:
        _as_job(monkeypatch, "job-b", rank=1, world=2)
        b1 = CheckpointEngine(ckpt, max_to_keep=0)
        engines.append(b1)
        b1.save(3, make_state(3, mb), storage_type=DISK)
        b1.wait(60)
        a0.save(3, make_state(3, mb), storage_type=DISK)
        with pytest.raises(PersistError, match="two live jobs save into the checkpoint dir"):
            a0.wait(60)
        assert not committed(ckpt, 3)
    finally:
        for e in reversed(engines):
            e.close()
        wait_for(lambda: not saver_pids(fault_env.runtime_dir), 60, "the savers to exit after the goodbyes")


def test_manifests_without_a_job_still_load(tmp_path: str) -> None:
    """Manifests written before the ``job`` field load (job ""); new ones round-trip it."""
    m = Manifest(1, 1, {}, False, 0.0, {}, "job-x")
    d = json.loads(m.to_json())
    assert d["job"] == "job-x" and Manifest.from_json(m.to_json()) == m
    del d["job"]
    assert Manifest.from_json(json.dumps(d).encode()).job == ""


# ---------------------------------------------------------------------------------------------- defect 14
def test_failed_persist_gives_its_space_back_at_once(fault_env: FaultEnv) -> None:
    """A file set whose second file does not fit: the first (complete) file is removed with the failure,
    not at the next start, so the disk is usable at once; committed files stay."""
    ckpt = os.path.join(fault_env.tmp, "small-disk")
    with small_tmpfs(ckpt, "4m"):
        engine = CheckpointEngine(ckpt, max_to_keep=0)
        try:
            engine.save(1, FileSet().add_raw("small", b"s" * 4096), storage_type=DISK)
            engine.wait(60)
            big = FileSet().add_raw("a", b"a" * (5 << 19)).add_raw("b", b"b" * (5 << 19))  # 2.5 + 2.5 MiB
            engine.save(2, big, storage_type=DISK)
            with pytest.raises(PersistError, match="No space left on device"):
                engine.wait(60)
            assert not os.path.exists(os.path.join(ckpt, "step_2", "a")), "the failed persist's file stayed"
            assert not os.path.exists(os.path.join(ckpt, "step_2", "a.flashckpt-tmp"))
            # The space is back: a file as big as the one removed fits now.
            engine.save(3, FileSet().add_raw("a", b"c" * (5 << 19)), storage_type=DISK)
            engine.wait(60)
            layout = CommitLayout(ckpt, PosixDiskStorage())
            assert layout.committed_steps() == [1, 3]
            assert layout.verify(1) == [] and layout.verify(3) == []
        finally:
            close_and_wait(engine)


def test_concurrent_allocations_of_one_local_rank_both_succeed(fault_env: FaultEnv) -> None:
    """Two allocations racing in the saver used to meet on one temporary file (PersistError: File
    exists); they are serialized now and each gets its own segment."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    engine = CheckpointEngine(ckpt, max_to_keep=0)
    try:
        sock = os.path.join(engine.job_dir, SOCKET_NAME)
        for _round in range(3):
            clients = [Client(sock, timeout=60) for _ in range(2)]
            barrier = threading.Barrier(len(clients))
            results: list[object] = [None] * len(clients)

            def alloc(i: int, clients: list[Client] = clients, barrier: threading.Barrier = barrier,
                      results: list[object] = results) -> None:
                barrier.wait()
                try:
                    results[i] = clients[i].call("alloc", local_rank=7, meta_cap=1 << 16, data_cap=48 << 20,
                                                 nslots=1)["path"]
                except Exception as e:  # reported below
                    results[i] = e

            threads = [threading.Thread(target=alloc, args=(i,)) for i in range(len(clients))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            for c in clients:
                c.close()
            errors = [r for r in results if isinstance(r, Exception)]
            assert not errors, errors
            assert len(set(results)) == len(results), results
        assert not [n for n in os.listdir(engine.job_dir) if n.endswith(".tmp")]
    finally:
        close_and_wait(engine)
