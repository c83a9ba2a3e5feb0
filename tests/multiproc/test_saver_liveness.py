"""The trainer against a saver that stalls, freezes or dies (real saver daemons, real signals).

- A request that timed out leaves its late reply on the socket: the next call must not take it for its
  own (replies carry the request's id).
- A frozen saver (SIGSTOP) never delays a memory snapshot; a persist or wait() reports it, naming its
  pid, within a bound far below the RPC timeout.
- A killed saver (SIGKILL) is replaced: the engine attaches to a new saver that adopts the snapshots in
  shared memory, reports the persists lost with the old one once, and goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

import pytest
import torch
from _fault_helpers import kill9, stop
from flashckpt import CheckpointTimeoutError, PersistError, StorageType
from flashckpt.commit.layout import CommitLayout
from flashckpt.format.segment import lock_path
from flashckpt.storage.posix import PosixDiskStorage
from flashckpt.transport.ipc import SharedDict, SharedLock
from helpers import flock_waiters, saver_pids, wait_for

DISK, MEMORY = StorageType.DISK, StorageType.MEMORY


def state(step: int) -> dict:
    return {"w": torch.full((64, 64), float(step)), "step": step}


def _cont(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


@pytest.mark.multiproc
def test_a_late_reply_is_never_taken_for_a_later_calls(make_engine, runtime_dir, monkeypatch):
    """Defect: after one timed-out request, the late reply stayed on the socket and wait() read it as
    its own: it returned at once, before the persist it was to wait for was committed."""
    monkeypatch.setenv("FLASHCKPT_RPC_TIMEOUT_S", "5")
    eng = make_engine(max_to_keep=0)
    eng.save(1, state(1), storage_type=MEMORY)
    (pid,) = saver_pids(runtime_dir)
    seg_lock = SharedLock(lock_path(eng.job_dir, 0))  # the saver's persist of step 2 waits on it
    try:
        stop(pid)
        with pytest.raises(CheckpointTimeoutError):
            eng.save(2, state(2), storage_type=DISK)  # the snapshot is taken; the persist goes unanswered
        seg_lock.acquire()
        _cont(pid)  # the saver now answers the persist request, late, and its persist blocks on the lock
        wait_for(lambda: pid in flock_waiters(lock_path(eng.job_dir, 0)), 30, "the saver's persist to wait")
        with pytest.raises(CheckpointTimeoutError, match="still running"):
            eng.wait(timeout=1)  # the saver's answer to this wait, not the late answer to the persist
    finally:
        _cont(pid)
        if seg_lock.locked():
            seg_lock.release()
    eng.wait(60)
    assert eng.committed_steps() == [2]
    d = SharedDict("d", eng._link.client)
    d["k"] = 1
    assert d.to_dict() == {"k": 1}  # every later call reads its own reply
    eng.close()


@pytest.mark.multiproc
def test_a_stopped_saver_never_blocks_memory_snapshots(make_engine, runtime_dir, monkeypatch):
    """Defect: memory snapshots polled a SIGSTOPped saver with a blocking round trip and hung for the
    RPC timeout. Now they go on without it, and a persist or wait() says the saver is stopped, within a
    bound far below the RPC timeout."""
    rpc_timeout = 20.0
    monkeypatch.setenv("FLASHCKPT_RPC_TIMEOUT_S", str(rpc_timeout))
    eng = make_engine(max_to_keep=0)
    eng.save(1, state(1), storage_type=DISK)
    eng.wait(60)
    (pid,) = saver_pids(runtime_dir)
    step = 1
    try:
        stop(pid)
        t_start = time.monotonic()
        while time.monotonic() - t_start < 2.0 or step < 6:  # several status polls fall due meanwhile
            step += 1
            t0 = time.monotonic()
            assert eng.save(step, state(step), storage_type=MEMORY)
            assert time.monotonic() - t0 < 2.0, "a memory snapshot waited on the stopped saver"
            time.sleep(0.1)  # the training step between snapshots
        assert eng.memory_steps()[0] == step
        for call in (lambda: eng.save(step + 1, state(step + 1), storage_type=DISK), lambda: eng.wait(60)):
            t0 = time.monotonic()
            with pytest.raises(CheckpointTimeoutError, match=rf"pid {pid}\).*not responding.*stopped"):
                call()
            assert time.monotonic() - t0 < rpc_timeout / 2
        step += 1
    finally:
        _cont(pid)
    eng.wait(60)  # the persist asked for while the saver was stopped completes once it runs again
    assert eng.committed_steps() == [1, step]
    assert torch.equal(eng.load()["w"], state(step)["w"])
    eng.close()


@pytest.mark.multiproc
def test_the_engine_recovers_from_a_killed_saver(make_engine, runtime_dir, ckpt_dir, monkeypatch, caplog):
    """Defect: after the saver was SIGKILLed every call raised SaverError although the snapshots in
    memory were intact. Now a new saver adopts them; the persist that died with the old one is
    reported once; later persists commit; load() returns the newest snapshot."""
    monkeypatch.setenv("FLASHCKPT_RPC_TIMEOUT_S", "5")
    eng = make_engine(max_to_keep=0)
    eng.save(1, state(1), storage_type=DISK)
    eng.wait(60)
    (old,) = saver_pids(runtime_dir)
    seg_lock = SharedLock(lock_path(eng.job_dir, 0))
    try:
        # A persist of step 2 in flight in the saver when it is killed: it waits on the segment lock.
        stop(old)
        with pytest.raises(CheckpointTimeoutError):
            eng.save(2, state(2), storage_type=DISK)
        seg_lock.acquire()
        _cont(old)
        wait_for(lambda: old in flock_waiters(lock_path(eng.job_dir, 0)), 30, "the saver's persist to wait")
        kill9(old)
    finally:
        _cont(old)
        if seg_lock.locked():
            seg_lock.release()

    with caplog.at_level(logging.WARNING, logger="flashckpt.engine"):
        assert eng.save(3, state(3), storage_type=MEMORY)  # no saver needed
        with pytest.raises(PersistError, match=rf"step\(s\) \[2\] were lost.*pid {old}"):
            eng.save(4, state(4), storage_type=DISK)  # attaches a new saver; step 4's persist is scheduled
        eng.wait(60)  # reported once
        eng.save(5, state(5), storage_type=DISK)
        eng.wait(60)
    (new,) = saver_pids(runtime_dir)
    assert new != old
    assert sum("attached to a new saver" in r.getMessage() for r in caplog.records) == 1
    layout = CommitLayout(ckpt_dir, PosixDiskStorage())
    assert layout.committed_steps() == [1, 4, 5]
    for s in (1, 4, 5):
        assert layout.verify(s) == []
    assert torch.equal(torch.load(eng.step_path(4))["w"], state(4)["w"])
    assert eng.memory_steps()[:2] == [5, 4]  # (the spare slot, kept after a persist, may hold step 3 too)
    got = eng.load()
    assert (eng.last_load.source, eng.last_load.step) == ("memory", 5)
    assert torch.equal(got["w"], state(5)["w"])
    eng.close()
