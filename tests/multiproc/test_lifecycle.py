"""A saver's life: it starts cleanly or not at all, and it does not outlive its use.

- A full runtime file system at start gives a clear ENOSPC error and leaves no process behind.
- A trainer that ends without ``close()`` (an uncaught exception, a ``with`` block left by one, or a
  plain exit) has its saver persist what is newer than the last commit and exit at once; the grace
  period is kept for crashes and for failures a restart follows.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import sys
import tempfile
import termios

import pytest
import torch
from _fault_helpers import (  # noqa: F401
    FaultEnv,
    alive,
    fault_env_fixture,
    kill9,
    saver_pid,
    saver_pids,
    small_tmpfs,
    tracker_step,
    wait_for,
)
from flashckpt import CheckpointEngine, PersistError, SaverError, SharedMemoryError, StorageType
from helpers import child_pids, leftovers


@pytest.fixture
def short_mnt():
    """A mount point with a short path (under /tmp): a runtime dir on it keeps its saver's socket path far
    below the 107 characters of AF_UNIX, whatever the test's tmp_path (longer under pytest-xdist)."""
    d = tempfile.mkdtemp(prefix="fcm-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)

def _fill(directory: str) -> None:
    """Fills the file system of ``directory``: its blocks, then its inodes."""
    with contextlib.suppress(OSError), open(os.path.join(directory, "fill"), "wb") as f:
        while True:
            f.write(b"\0" * (1 << 16))
    with contextlib.suppress(OSError):
        for i in range(100000):
            open(os.path.join(directory, f"inode{i}"), "wb").close()


def _no_saver_left(rt: str) -> None:
    wait_for(lambda: not saver_pids(rt), 10, f"no saver left under {rt}")


def test_full_runtime_fs_at_start_says_enospc_and_leaves_no_process(short_mnt, tmp_path, monkeypatch, ckpt_dir) -> None:
    """/dev/shm full of data: the engine starts (a load needs no space), a snapshot fails with ENOSPC and
    the bytes it needs, and no saver stays behind. Before the fix the saver's start failed writing its pid
    file ("see <empty log>") while the forked daemon kept serving."""
    mnt = short_mnt
    with small_tmpfs(mnt, "1m"):
        rt = os.path.join(mnt, "rt")
        os.mkdir(rt, 0o700)
        with open(os.path.join(mnt, "fill"), "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (1 << 16))
        monkeypatch.setenv("FLASHCKPT_RUNTIME_DIR", rt)
        try:
            eng = CheckpointEngine(ckpt_dir)
            try:
                with pytest.raises(SharedMemoryError, match=r"ENOSPC.*") as ei:
                    eng.save(1, {"w": torch.zeros(1 << 20)}, storage_type=StorageType.MEMORY)
                assert "needs" in str(ei.value) and "bytes" in str(ei.value)
            finally:
                eng.close()
        finally:
            _no_saver_left(rt)
        wait_for(lambda: leftovers(rt) == [], 10, "the saver to remove its runtime dir")


def test_runtime_fs_out_of_inodes_at_start_is_a_clear_error(short_mnt, tmp_path, monkeypatch, ckpt_dir) -> None:
    """No inode left for the saver's socket, locks or log: a SaverError that says ENOSPC and where, not
    an OSError or a pointer to a log that could not be written; no process left."""
    mnt = short_mnt
    with small_tmpfs(mnt, "1m,nr_inodes=16"):
        rt = os.path.join(mnt, "rt")
        os.mkdir(rt, 0o700)
        _fill(rt)
        monkeypatch.setenv("FLASHCKPT_RUNTIME_DIR", rt)
        try:
            with pytest.raises(SaverError) as ei:
                CheckpointEngine(ckpt_dir)
            msg = str(ei.value)
            assert "no space left in" in msg and "ENOSPC" in msg and rt in msg, msg
        finally:
            _no_saver_left(rt)


def test_saver_that_cannot_bind_reports_why_and_exits(short_mnt, tmp_path, monkeypatch, ckpt_dir) -> None:
    """Inodes for the job dir, its lock and log, but none for the socket: the daemon's own start fails.
    Its reason reaches the trainer over the start-up pipe, and it exits, removing its runtime dir."""
    mnt = short_mnt
    with small_tmpfs(mnt, "1m,nr_inodes=16"):
        rt = os.path.join(mnt, "rt")
        os.mkdir(rt, 0o700)
        _fill(rt)
        from flashckpt.config import job_key

        # Free exactly the inodes the spawner needs: the job dir, its spawn lock and its log.
        for i in range(3):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(rt, f"inode{i}"))
        monkeypatch.setenv("FLASHCKPT_RUNTIME_DIR", rt)
        try:
            with pytest.raises(SaverError) as ei:
                CheckpointEngine(ckpt_dir)
            msg = str(ei.value)
            assert "could not start" in msg and "ENOSPC" in msg, msg
        finally:
            _no_saver_left(rt)
        wait_for(lambda: not os.path.exists(os.path.join(rt, job_key(ckpt_dir))), 10,
                 "the failed saver to remove its runtime dir")


# ------------------------------------------------------------------------------------------ exit paths
_TRAINER = """
import signal, sys, torch
from flashckpt import CheckpointEngine, StorageType
ckpt, mode = sys.argv[1], sys.argv[2]
def sd(step):
    return {"w": torch.full((4096,), float(step)), "step": step}
def train(e):
    e.save(1, sd(1), storage_type=StorageType.DISK)
    e.wait(60)
    e.save(2, sd(2), storage_type=StorageType.MEMORY)
    print("saved", flush=True)
if mode == "with":
    with CheckpointEngine(ckpt) as e:
        train(e)
        raise RuntimeError("the trainer failed")
e = CheckpointEngine(ckpt)
train(e)
if mode == "raise":
    raise RuntimeError("the trainer failed")
if mode == "hold":
    signal.pause()
"""
_LONG_GRACE = "120"  # far longer than any test waits: a saver that exits did not wait out its grace


def _trainer(fe: FaultEnv, ckpt: str, mode: str, **env: str):
    script = os.path.join(fe.tmp, "trainer.py")
    with open(script, "w") as f:
        f.write(_TRAINER)
    return fe.popen([sys.executable, script, ckpt, mode], f"{mode}.log",
                    env=fe.env(FLASHCKPT_SAVER_GRACE_S=_LONG_GRACE, **env))


def _persisted_step(ckpt: str, step: int) -> float:
    sd = torch.load(os.path.join(ckpt, f"step_{step}", "rank_00000.pt"), weights_only=True)
    return float(sd["w"][0])


@pytest.mark.parametrize("mode, rc", [("raise", 1), ("with", 1), ("exit", 0)])
def test_trainer_ending_without_close_has_its_saver_persist_and_exit(fault_env: FaultEnv, mode: str, rc: int) -> None:
    """An uncaught exception (also out of a ``with`` block) or a normal exit without ``close()``, after a
    memory snapshot newer than the last commit: the saver persists it and exits within seconds, not
    after its grace period (the old saver held ~170 MB and the snapshots for 600 s)."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    p = _trainer(fault_env, ckpt, mode)
    assert p.wait(timeout=120) == rc, fault_env.log(f"{mode}.log")
    wait_for(lambda: not saver_pids(fault_env.runtime_dir), 20,
             f"the saver to exit after its trainer ended ({mode}), well within its {_LONG_GRACE} s grace")
    assert tracker_step(ckpt) == 2, fault_env.log(f"{mode}.log")
    assert _persisted_step(ckpt, 2) == 2.0


def _load_from_memory(ckpt: str) -> tuple[str, int | None]:
    from flashckpt import CheckpointEngine

    eng = CheckpointEngine(ckpt)
    try:
        sd = eng.load()
        assert eng.last_load is not None
        return eng.last_load.source, sd.get("step")
    finally:
        eng.close()


def test_crashed_trainer_keeps_its_snapshot_for_the_grace(fault_env: FaultEnv) -> None:
    """SIGKILL (a crash): no goodbye, so the saver keeps the newest snapshot for a restarted trainer."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    p = _trainer(fault_env, ckpt, "hold")
    wait_for(lambda: "saved" in fault_env.log("hold.log") or p.poll() is not None, 120, "the trainer to save")
    saver = saver_pid(fault_env.runtime_dir, fault_env.job_dir(ckpt))
    kill9(p.pid)
    p.wait(timeout=30)
    wait_for(lambda: tracker_step(ckpt) == 2, 30, "the last-words commit of step 2")
    assert alive(saver)
    assert _load_from_memory(ckpt) == ("memory", 2)  # its final goodbye then ends the saver


def test_failure_before_an_elastic_restart_keeps_the_snapshot(fault_env: FaultEnv) -> None:
    """Under torchrun with restarts left, an uncaught exception keeps the snapshots for the restarted
    worker (it loads step 2 from memory)."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    p = _trainer(fault_env, ckpt, "raise", TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="1")
    assert p.wait(timeout=120) == 1, fault_env.log("raise.log")
    assert saver_pids(fault_env.runtime_dir), "the saver exited although a restart is coming"
    assert _load_from_memory(ckpt) == ("memory", 2)


# ------------------------------------------------------------------------------------------ give way
def test_idle_saver_of_another_job_gives_way_when_shm_runs_short(short_mnt, fault_env: FaultEnv, tmp_path, monkeypatch) -> None:
    """A crashed job's saver holds 2 x 12 MiB of a 40 MiB /dev/shm for its grace period. A new job's
    snapshot needs 24 MiB: instead of failing with SharedMemoryError, the idle saver persists its newest
    snapshot (step 2, newer than its commit) and exits, and the new job's allocation succeeds."""
    from _fault_helpers import TRAINER, make_state

    mnt = short_mnt
    with small_tmpfs(mnt, "40m"):
        rt = os.path.join(mnt, "rt")
        os.mkdir(rt, 0o700)
        monkeypatch.setenv("FLASHCKPT_RUNTIME_DIR", rt)
        old_ckpt = os.path.join(fault_env.tmp, "old")
        old = fault_env.popen([sys.executable, TRAINER, "--ckpt", old_ckpt, "--mb", "12", "--plan",
                               "1:disk,2:memory", "--wait", "--hold"], "old.log",
                              env=fault_env.env(FLASHCKPT_RUNTIME_DIR=rt, FLASHCKPT_SAVER_GRACE_S=_LONG_GRACE,
                                                FLASHCKPT_JOB_ID="old-job"))
        eng = None
        try:
            wait_for(lambda: "holding" in fault_env.log("old.log") or old.poll() is not None, 120, "the old job")
            assert old.poll() is None, fault_env.log("old.log")
            kill9(old.pid)  # a crash: its saver keeps step 2 for its grace period
            (old_saver,) = saver_pids(rt)
            eng = CheckpointEngine(os.path.join(fault_env.tmp, "new"))
            eng.save(1, make_state(1, 12), storage_type=StorageType.MEMORY)  # fails without giving way
            assert eng.memory_steps() == [1]
            wait_for(lambda: not alive(old_saver), 30, "the idle saver to give way")
            assert tracker_step(old_ckpt) == 2  # it persisted its newest snapshot first
        finally:
            if eng is not None:
                eng.close()
            with contextlib.suppress(ProcessLookupError):
                os.kill(old.pid, 9)
            try:
                _no_saver_left(rt)
            finally:
                for pid in saver_pids(rt):
                    kill9(pid)


# ------------------------------------------------------------------------------------------ footprint
def _vm_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def _persist_workers(saver: int) -> list[int]:
    """The saver's live persist workers (its children running flashckpt.saver.persist_worker)."""
    out = []
    for kid in child_pids(saver):
        with contextlib.suppress(OSError), open(f"/proc/{kid}/cmdline", "rb") as f:
            if b"flashckpt.saver.persist_worker" in f.read():
                out.append(kid)
    return out


def _unread_requests(pid: int) -> int:
    """Bytes waiting in the pipes process ``pid`` reads from (its requests not read yet)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith("pipe:"):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
            if flags & os.O_ACCMODE != os.O_RDONLY:
                continue
            mine = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK)
            try:
                n += int.from_bytes(fcntl.ioctl(mine, termios.FIONREAD, b"\0\0\0\0"), "little")
            finally:
                os.close(mine)
    return n


def test_saver_never_loads_torch_its_persist_worker_does_and_exits_when_idle(make_engine, ckpt_dir,
                                                                              monkeypatch) -> None:
    """The saver stays under 60 MB of RSS and never maps libtorch, idle or persisting (it was ~273 MB
    from its first persist on, for the rest of its life, grace period included). Its first persist
    starts a persist worker that loads torch and writes the files; the worker exits once idle for
    FLASHCKPT_PERSIST_WORKER_IDLE_S, and the next persist starts a new one."""
    monkeypatch.setenv("FLASHCKPT_PERSIST_WORKER_IDLE_S", "1")
    eng = make_engine()
    pid = eng._link.saver_pid  # the saver's pid as its hello reported it
    eng.save(1, {"w": torch.arange(1 << 16, dtype=torch.float32)}, storage_type=StorageType.MEMORY)
    rss = _vm_rss_mb(pid)
    assert rss < 60 and not _maps_torch(pid), f"idle saver: {rss:.0f} MB, torch loaded: {_maps_torch(pid)}"
    assert _persist_workers(pid) == []  # none before the first persist
    workers = []
    for step in (2, 3):
        eng.save(step, {"w": torch.arange(1 << 16, dtype=torch.float32) * step}, storage_type=StorageType.DISK)
        eng.wait(60)
        rss = _vm_rss_mb(pid)
        assert rss < 60 and not _maps_torch(pid), f"saver after a persist: {rss:.0f} MB, torch: {_maps_torch(pid)}"
        (worker,) = _persist_workers(pid)
        workers.append(worker)
        assert _maps_torch(worker)
        sd = torch.load(os.path.join(ckpt_dir, f"step_{step}", "rank_00000.pt"), weights_only=True)
        assert torch.equal(sd["w"], torch.arange(1 << 16, dtype=torch.float32) * step)
        wait_for(lambda w=worker: not alive(w), 20, "the idle persist worker to exit")
    assert workers[0] != workers[1]  # the second persist started a new worker
    assert _vm_rss_mb(pid) < 60 and not _maps_torch(pid)
    eng.close()


def test_a_killed_persist_worker_fails_its_persist_clearly_and_the_next_one_works(make_engine, ckpt_dir,
                                                                                  monkeypatch) -> None:
    """SIGKILL of the persist worker while it holds a persist: that persist fails with a PersistError
    saying the worker was killed, its files are removed, and the next persist starts a new worker."""
    monkeypatch.setenv("FLASHCKPT_PERSIST_WORKER_IDLE_S", "60")
    eng = make_engine()
    pid = eng._link.saver_pid
    sd = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    eng.save(1, sd, storage_type=StorageType.DISK)
    eng.wait(60)
    (worker,) = _persist_workers(pid)
    os.kill(worker, signal.SIGSTOP)  # the next persist's request waits in its pipe: in flight, unwritten
    eng.save(2, sd, storage_type=StorageType.DISK)
    wait_for(lambda: _unread_requests(worker), 20, "the persist request in the stopped worker's pipe")
    kill9(worker)
    with pytest.raises(PersistError, match=rf"persist worker \(pid {worker}\) was killed by SIGKILL"):
        eng.wait(60)
    assert not os.path.exists(os.path.join(ckpt_dir, "step_2", "rank_00000.pt"))
    eng.save(3, sd, storage_type=StorageType.DISK)
    eng.wait(60)
    (again,) = _persist_workers(pid)
    assert again != worker
    assert torch.equal(torch.load(os.path.join(ckpt_dir, "step_3", "rank_00000.pt"), weights_only=True)["w"], sd["w"])
    assert tracker_step(ckpt_dir) == 3
    eng.close()
