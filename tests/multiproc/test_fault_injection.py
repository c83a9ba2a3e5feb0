"""Fault injection: kill -9 of trainers and savers at chosen points, a full disk, a corrupted file, a
too small /dev/shm.

Every test asserts that no torn or partial checkpoint is ever committed or loaded, that what is loaded is
bit-exact to the snapshot it claims to be, and waits only on conditions with bounded polls. Where the
moment of a kill matters it is pinned with SIGSTOP: the victim is stopped, the test checks (with the victim
frozen) that it is at the intended point, and only then sends SIGKILL; no timing is assumed.
"""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch
from _fault_helpers import (  # noqa: F401
    FaultEnv,
    assert_state_of,
    close_and_wait,
    committed,
    fault_env_fixture,
    files_named,
    kill9,
    make_state,
    run_cli,
    saver_pid,
    saver_pids,
    small_tmpfs,
    step_meta_dir,
    stop,
    tracker_step,
    wait_for,
)
from flashckpt import CheckpointEngine, PersistError, SharedMemoryError, StorageType
from flashckpt.commit.layout import CommitLayout
from flashckpt.format.segment import COMPLETE, FLAG_PINNED, WRITING, Segment, SlotHeader, segment_paths
from flashckpt.memory.writer import SharedMemoryHandler
from flashckpt.storage.posix import PosixDiskStorage

MB = 200  # big enough that copies and persists take a while; small enough for 2 cores and 4 minutes


def _segment(job_dir: str, local_rank: int = 0) -> Segment:
    """The newest segment of ``local_rank`` (polls until the saver created it)."""
    paths = wait_for(lambda: segment_paths(job_dir, local_rank), 60, f"a segment in {job_dir}")
    return Segment(paths[-1][1], populate=False)


def _slots(seg: Segment) -> list[SlotHeader]:
    return [seg.header(i) for i in range(seg.nslots)]


def _file_of(ckpt: str, step: int) -> str:
    return os.path.join(ckpt, f"step_{step}", "rank_00000.pt")


def _assert_committed_sound(ckpt: str, step: int, mb: float) -> None:
    """``step`` is committed, its files verify, and its file is exactly the state of ``step``."""
    layout = CommitLayout(ckpt, PosixDiskStorage())
    assert step in layout.committed_steps(), f"step {step} is not committed: {layout.committed_steps()}"
    assert layout.verify(step) == []
    assert_state_of(torch.load(_file_of(ckpt, step), weights_only=True), step, mb)


# ---------------------------------------------------------------------------------------------- trainer -9
@pytest.mark.multiproc
def test_kill9_trainer_during_copy_into_shared_memory(fault_env: FaultEnv) -> None:
    """A trainer killed mid-copy leaves a WRITING slot; the previous complete snapshot is what loads."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    job_dir = fault_env.job_dir(ckpt)
    trainer = fault_env.trainer(ckpt, "--mb", str(MB), "--plan", "1:memory", "--loop", "300", "--hold")
    seg = _segment(job_dir)

    def caught_mid_copy() -> tuple[int, int] | None:
        """(slot being written, step held by the other, complete slot) once the trainer is frozen mid-copy."""
        assert trainer.poll() is None, f"the trainer exited early:\n{fault_env.log('trainer.log')}"
        hs = _slots(seg)
        torn = [i for i, h in enumerate(hs) if h.state == WRITING]
        done = [h.step for h in hs if h.state == COMPLETE]
        if not torn or not done:
            return None
        stop(trainer.pid)  # freeze it, then check it is still mid-copy
        hs = _slots(seg)
        torn = [i for i, h in enumerate(hs) if h.state == WRITING]
        done = [h.step for h in hs if h.state == COMPLETE]
        if torn and done:
            return torn[0], done[0]
        os.kill(trainer.pid, signal.SIGCONT)  # the copy finished just before the stop: try the next one
        return None

    torn_slot, previous = wait_for(caught_mid_copy, 120, "the trainer to be caught in the middle of a copy")
    torn_gen = seg.header(torn_slot).generation
    kill9(trainer.pid)
    assert seg.header(torn_slot).state == WRITING and seg.header(torn_slot).generation == torn_gen

    # A reader never sees the torn slot.
    reader = SharedMemoryHandler(0, job_dir)
    try:
        assert reader.memory_steps() == [previous]
        assert reader.load_snapshot().step == previous
    finally:
        reader.close()

    engine = CheckpointEngine(ckpt, max_to_keep=0)  # the restarted trainer
    try:
        sd = engine.load()
        assert engine.last_load.source == "memory" and engine.last_load.step == previous
        assert_state_of(sd, previous, MB)
        # The saver's last words for the dead trainer commit the complete snapshot, never the torn one.
        wait_for(lambda: committed(ckpt, previous), 120, f"the last words to commit step {previous}")
        engine.wait(timeout=120)
        assert tracker_step(ckpt) == previous
        _assert_committed_sound(ckpt, previous, MB)
    finally:
        close_and_wait(engine)
    del sd
    seg.close()


@pytest.mark.multiproc
def test_kill9_trainer_right_after_a_snapshot_completes(fault_env: FaultEnv) -> None:
    """Killed right after its step-3 snapshot completed: a new process loads step 3 (newer than the
    committed step 1) from memory, and the saver's last words commit step 3 too."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    job_dir = fault_env.job_dir(ckpt)
    mb = MB
    trainer = fault_env.trainer(ckpt, "--mb", str(mb), "--plan", "1:disk,2:memory,3:memory", "--hold")
    seg = _segment(job_dir)

    def step3_complete() -> bool:
        assert trainer.poll() is None, f"the trainer exited early:\n{fault_env.log('trainer.log')}"
        return any(h.state == COMPLETE and h.step == 3 for h in _slots(seg))

    wait_for(step3_complete, 120, "the snapshot of step 3 to complete")
    kill9(trainer.pid)
    seg.close()

    engine = CheckpointEngine(ckpt, max_to_keep=0)
    try:
        sd = engine.load()
        assert (engine.last_load.source, engine.last_load.step) == ("memory", 3)
        assert_state_of(sd, 3, mb)
        wait_for(lambda: committed(ckpt, 3), 120, "the last words to commit step 3")
        engine.wait(timeout=120)
        assert tracker_step(ckpt) == 3
        for step in (1, 3):
            _assert_committed_sound(ckpt, step, mb)
        assert not committed(ckpt, 2)  # a memory-only snapshot older than the newest is not persisted
    finally:
        close_and_wait(engine)


@pytest.mark.multiproc
def test_kill9_trainer_while_its_snapshot_is_persisted(fault_env: FaultEnv) -> None:
    """The saver keeps persisting after the trainer died: the step gets committed and verifies."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    job_dir = fault_env.job_dir(ckpt)
    trainer = fault_env.trainer(ckpt, "--mb", str(MB), "--plan", "1:memory,2:disk", "--hold")
    seg = _segment(job_dir)

    def persisting() -> bool:
        assert trainer.poll() is None, f"the trainer exited early:\n{fault_env.log('trainer.log')}"
        return any(h.step == 2 and h.flags & FLAG_PINNED for h in _slots(seg))

    wait_for(persisting, 120, "the saver to start persisting step 2")
    saver = saver_pid(fault_env.runtime_dir, job_dir)
    stop(saver)  # hold the persist while the trainer dies
    try:
        assert any(h.step == 2 and h.flags & FLAG_PINNED for h in _slots(seg)) and not committed(ckpt, 2)
        kill9(trainer.pid)
    finally:
        os.kill(saver, signal.SIGCONT)
    wait_for(lambda: committed(ckpt, 2), 120, "step 2 to be committed after the trainer died")
    _assert_committed_sound(ckpt, 2, MB)
    assert run_cli(fault_env, "verify", ckpt).returncode == 0
    seg.close()

    engine = CheckpointEngine(ckpt, max_to_keep=0)
    try:
        sd = engine.load()
        assert (engine.last_load.source, engine.last_load.step) == ("memory", 2)
        assert_state_of(sd, 2, MB)
        del sd
        sd = engine.load(resume_path=os.path.join("step_2", "rank_00000.pt"))  # from storage, verified
        assert_state_of(sd, 2, MB)
    finally:
        close_and_wait(engine)


# ---------------------------------------------------------------------------------------------- saver -9
@pytest.mark.multiproc
def test_kill9_saver_during_persist(fault_env: FaultEnv) -> None:
    """A saver killed mid-persist: the half-written step never becomes visible and is cleaned up by the
    next saver, the last committed step loads, and the memory snapshots it adopted still load."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    job_dir = fault_env.job_dir(ckpt)
    sd = make_state(1, MB)
    first = CheckpointEngine(ckpt, max_to_keep=0)
    try:
        first.save(1, sd, storage_type=StorageType.DISK)
        first.wait(timeout=120)
        assert tracker_step(ckpt) == 1
        saver = saver_pid(fault_env.runtime_dir, job_dir)
        sd = make_state(2, MB)
        first.save(2, sd, storage_type=StorageType.DISK)
        tmp_file = _file_of(ckpt, 2) + ".flashckpt-tmp"
        wait_for(lambda: os.path.exists(tmp_file), 120, "the saver to start writing step 2")
        stop(saver)
        try:
            assert os.path.exists(tmp_file) and not committed(ckpt, 2)  # frozen mid-write
        finally:
            kill9(saver)
    finally:
        first.close()  # its goodbye fails (the saver is gone): logged, not raised
    del sd

    # The half-written step is not visible.
    layout = CommitLayout(ckpt, PosixDiskStorage())
    assert layout.committed_steps() == [1] and tracker_step(ckpt) == 1
    assert os.path.isdir(step_meta_dir(ckpt, 2)) and os.path.exists(tmp_file)
    assert os.path.exists(os.path.join(job_dir, "saver.sock"))  # stale runtime state of the dead saver

    second = CheckpointEngine(ckpt, max_to_keep=0)  # a new run: starts a new saver
    try:
        assert saver_pid(fault_env.runtime_dir, job_dir) != saver
        # Cleaned up by the new saver before it served us.
        assert not os.path.exists(step_meta_dir(ckpt, 2))
        assert files_named(ckpt, ".flashckpt-tmp") == []
        assert not os.path.exists(os.path.join(ckpt, "step_2"))
        assert layout.committed_steps() == [1] and tracker_step(ckpt) == 1
        # The memory snapshots survived the saver and were adopted: the newest loads from memory.
        got = second.load()
        assert (second.last_load.source, second.last_load.step) == ("memory", 2)
        assert_state_of(got, 2, MB)
        del got
        # The last committed checkpoint loads (checked against its manifest).
        got = second.load(resume_path=os.path.join("step_1", "rank_00000.pt"))
        assert_state_of(got, 1, MB)
        del got
        assert run_cli(fault_env, "verify", ckpt).returncode == 0
    finally:
        close_and_wait(second)


# ---------------------------------------------------------------------------------------------- disk full
def test_disk_full_during_persist(fault_env: FaultEnv) -> None:
    """A save that does not fit: a clear PersistError at wait(), memory snapshots go on, the previous
    commit stays intact and verifies, and no partial file is left."""
    ckpt = os.path.join(fault_env.tmp, "small-disk")
    mb = 5  # one checkpoint fits in the 8 MiB file system, two do not
    with small_tmpfs(ckpt, "8m"):
        engine = CheckpointEngine(ckpt, max_to_keep=1)
        try:
            sd = make_state(1, mb)
            engine.save(1, sd, storage_type=StorageType.DISK)
            engine.wait(timeout=60)
            _assert_committed_sound(ckpt, 1, mb)

            engine.save(2, make_state(2, mb), storage_type=StorageType.DISK)
            with pytest.raises(PersistError) as info:
                engine.wait(timeout=60)
            msg = str(info.value)
            assert "step 2" in msg and _file_of(ckpt, 2) in msg
            assert "No space left on device" in msg, msg

            # Training continues with memory snapshots; the error was reported once.
            for step in (3, 4):
                engine.save(step, make_state(step, mb), storage_type=StorageType.MEMORY)
            engine.wait(timeout=60)
            got = engine.load()
            assert (engine.last_load.source, engine.last_load.step) == ("memory", 4)
            assert_state_of(got, 4, mb)

            # The previous commit is intact; nothing of step 2 was committed or left half-written.
            assert tracker_step(ckpt) == 1 and not committed(ckpt, 2)
            _assert_committed_sound(ckpt, 1, mb)
            assert files_named(ckpt, ".flashckpt-tmp") == []
            assert not os.path.exists(_file_of(ckpt, 2))
            assert run_cli(fault_env, "verify", ckpt).returncode == 0
        finally:
            close_and_wait(engine)


# ---------------------------------------------------------------------------------------------- corruption
def test_corrupted_file_in_newest_step(fault_env: FaultEnv, caplog: pytest.LogCaptureFixture) -> None:
    """`flashckpt verify` names the damaged file; load() falls back to the previous committed step."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    mb = 2
    engine = CheckpointEngine(ckpt, max_to_keep=0)
    try:
        for step in (1, 2):
            engine.save(step, make_state(step, mb), storage_type=StorageType.DISK)
            engine.wait(timeout=60)
    finally:
        close_and_wait(engine)  # the saver exits and frees the memory snapshots

    bad = _file_of(ckpt, 2)
    with open(bad, "r+b") as f:
        f.seek(os.path.getsize(bad) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))

    r = run_cli(fault_env, "verify", ckpt, console=True)  # the installed `flashckpt` command
    assert r.returncode != 0 and bad in r.stdout and "step 2" in r.stdout, r.stdout + r.stderr
    r = run_cli(fault_env, "verify", ckpt, "--step", "1")
    assert r.returncode == 0 and "step 1: ok" in r.stdout, r.stdout + r.stderr
    r = run_cli(fault_env, "verify", ckpt, "--step", "2")
    assert r.returncode != 0 and bad in r.stdout

    engine = CheckpointEngine(ckpt, max_to_keep=0)
    try:
        with caplog.at_level(logging.WARNING, logger="flashckpt.engine"):
            sd = engine.load()
        assert (engine.last_load.source, engine.last_load.step) == ("storage", 1)
        assert_state_of(sd, 1, mb)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("step 2" in w and bad in w for w in warnings), warnings
    finally:
        close_and_wait(engine)


# ---------------------------------------------------------------------------------------------- /dev/shm
def test_shared_memory_too_small(fault_env: FaultEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """Too little /dev/shm: a clear SharedMemoryError at the first save, naming the size needed."""
    monkeypatch.setenv("FLASHCKPT_SHM_LIMIT_BYTES", str(1 << 20))  # read by the saver the engine starts
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    job_dir = fault_env.job_dir(ckpt)
    engine = CheckpointEngine(ckpt)
    try:
        with pytest.raises(SharedMemoryError) as info:
            engine.save(1, make_state(1, 4), storage_type=StorageType.MEMORY)
        msg = str(info.value)
        assert "needs" in msg and "bytes" in msg and "/dev/shm" in msg, msg
        assert engine.memory_steps() == [] and segment_paths(job_dir, 0) == []
        assert engine.load() == {} and engine.last_load.source == "none"
    finally:
        close_and_wait(engine)


# ---------------------------------------------------------------------------------------------- saver SIGTERM
@pytest.mark.multiproc
def test_sigterm_to_the_saver_commits_the_newest_snapshot_and_exits(fault_env: FaultEnv) -> None:
    """SIGTERM to a saver whose trainer is still attached: last words (the newest snapshot is committed),
    then a clean exit that removes the job's runtime state."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    mb = 4
    engine = CheckpointEngine(ckpt, max_to_keep=0)
    try:
        engine.save(1, make_state(1, mb), storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        for step in (2, 3):
            engine.save(step, make_state(step, mb), storage_type=StorageType.MEMORY)
        saver = saver_pid(fault_env.runtime_dir, engine.job_dir)
        os.kill(saver, signal.SIGTERM)
        wait_for(lambda: not saver_pids(fault_env.runtime_dir), 60, "the saver to exit on SIGTERM")
        assert not os.path.exists(engine.job_dir)
    finally:
        engine.close()  # its goodbye fails (the saver is gone): logged, not raised
    assert tracker_step(ckpt) == 3 and not committed(ckpt, 2)
    for step in (1, 3):
        _assert_committed_sound(ckpt, step, mb)
