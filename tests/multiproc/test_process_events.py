"""Process events against a live engine (issue #30, items 3, 6, 7 and 8, and its matrix of process events):
real threads, real forks, real signals, a runtime dir removed under a running saver, a process starved of
file descriptors. The rule they all check: what ``load()`` returns is exactly what was saved, for the step
it says, or an error says why not; and the engine goes on.

- Threads: calls of one engine from several threads run one at a time (a second caller waits); a call
  re-entering it from a signal handler on the thread inside it is refused. Never a snapshot or a commit
  mixing two saves.
- Fork: only the process that opened an engine may use or end it. A forked child's exit (or close, or
  `with` block) never reaches the parent's saver; a forked child's call gets a clear error.
- A wiped runtime dir (systemd-logind's RemoveIPC, a tmp cleaner): detected at the next call, logged once,
  a new saver and new shared memory are started and training goes on; committed steps stay.
- Starved of file descriptors: an open that fails for a reason other than "no such segment" is an error
  naming it (EMFILE), never a silent fall back to an older committed step.

``_events_trainer.py`` (beside this file) is the trainer of the matrix: one process per event.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from _events_trainer import in_threads
from flashckpt import FlashCheckpointError, PersistError, StorageType
from flashckpt.commit.layout import CommitLayout
from flashckpt.storage.posix import PosixDiskStorage
from helpers import hold_persist, release_persist, saver_pids, wait_for

DISK, MEMORY = StorageType.DISK, StorageType.MEMORY
TESTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")  # the support code's folder
TRAINER = os.path.join(TESTS_DIR, "_events_trainer.py")


def state(step: int, n: int = 16) -> dict:
    """``n`` tensors that each say their step (a torn snapshot mixes steps), 256 KiB each."""
    return {**{f"t{i}": torch.full((64, 1024), float(step)) for i in range(n)}, "step": step}


def assert_one_step(sd: dict, step: int, where: str) -> None:
    assert sd.get("step") == step, f"{where}: step {sd.get('step')!r}, not {step}"
    torn = sorted({float(t[0, 0]) for k, t in sd.items() if k != "step" and not torch.all(t == step)})
    assert not torn, f"{where}: step {step} holds tensors of step(s) {torn}: a torn snapshot"


def _saver_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")


def _inside(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is running ``function`` now (somewhere on its stack)."""
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


# ------------------------------------------------------------------------------------------ threads (item 3)
@pytest.mark.parametrize("overlap", [False, True], ids=["copy", "overlap"])
def test_threads_saving_on_one_engine_never_tear_a_snapshot_or_a_commit(make_engine, ckpt_dir, overlap):
    """Defect: two threads calling save() on one engine wrote into one slot at once; committed files mixed
    the tensors of several steps and verified (their checksums were of the torn data). Now the calls run
    one at a time: every snapshot and every committed file holds one step's tensors."""
    eng = make_engine(max_to_keep=0, overlap=overlap)

    def work(k: int) -> None:
        for s in range(k + 1, 25, 3):
            eng.save(s, state(s), storage_type=DISK if s % 4 == 0 else MEMORY)

    in_threads(3, work)
    eng.wait(120)
    layout = CommitLayout(ckpt_dir, PosixDiskStorage())
    committed = layout.committed_steps()
    assert sorted(committed) == list(range(4, 25, 4)), committed
    for s in committed:
        assert layout.verify(s) == [], f"step {s}: {layout.verify(s)}"
        assert_one_step(torch.load(eng.step_path(s), weights_only=True), s, f"committed step {s}")
    for s in eng.memory_steps():
        assert_one_step(eng.load_memory(s), s, f"the memory snapshot of step {s}")
    eng.close()


def test_close_from_another_thread_waits_for_a_running_save_and_refuses_the_next(make_engine, ckpt_dir, monkeypatch):
    """Defect: close() from another thread ran in the middle of a save: it unmapped the segment the save was
    using (the save failed with 'mmap closed', or worse, wrote into memory no longer mapped). Now close()
    waits for the running save, and the next save is refused with the closed-engine error. (One spare slot,
    so that two held persists make the fourth save wait for a slot, surely inside the save.)"""
    monkeypatch.setenv("FLASHCKPT_SPARE_SLOTS", "1")
    eng = make_engine(max_to_keep=0)
    holds = [hold_persist(eng.default_path(s)) for s in (1, 2)]  # their persists block, their slots held
    saved: list[int] = []
    failures: list[BaseException] = []

    def loop() -> None:
        step = 0
        while True:
            step += 1
            try:
                eng.save(step, state(step), storage_type=DISK if step <= 2 else MEMORY)
            except PersistError:  # the held persists fail once let go; the snapshot was taken
                pass
            except BaseException as e:
                failures.append(e)
                return
            saved.append(step)

    trainer = threading.Thread(target=loop, name="trainer")
    trainer.start()
    # Steps 1 and 2 are held by their persists and 3 is the newest snapshot: the save of step 4 waits for a
    # slot, and close() comes from another thread meanwhile.
    wait_for(lambda: failures or (saved == [1, 2, 3] and _inside(trainer, "_acquire_slot")), 120,
             "the save of step 4 to wait for a slot")
    closer = threading.Thread(target=eng.close, name="closer")
    closer.start()
    for fifo in holds:
        release_persist(fifo)
    closer.join(120)
    trainer.join(120)
    assert not closer.is_alive() and not trainer.is_alive()
    assert len(failures) == 1 and isinstance(failures[0], FlashCheckpointError), failures
    assert "closed" in str(failures[0]), failures[0]
    assert saved[:4] == [1, 2, 3, 4], saved
    eng2 = make_engine(max_to_keep=0)  # close() left nothing torn behind
    for s in eng2.committed_steps():
        assert_one_step(torch.load(eng2.step_path(s), weights_only=True), s, f"committed step {s}")
    eng2.close()


# ------------------------------------------------------------------------------------------ a wiped runtime dir (item 7)
def test_a_wiped_runtime_dir_gets_a_new_saver_logged_once_and_training_goes_on(make_engine, runtime_dir, ckpt_dir,
                                                                                caplog):
    """Defect: after the job's runtime dir was removed (systemd-logind's RemoveIPC, a tmp cleaner), every
    later save raised a raw FileNotFoundError, for good. Now the next call sees it, logs one warning saying
    the memory snapshots were lost and why, starts a new saver with new shared memory, and goes on; the
    committed step stays and is what a load finds until a newer snapshot is taken."""
    eng = make_engine(max_to_keep=0)
    eng.save(1, state(1), storage_type=DISK)
    eng.wait(60)
    eng.save(2, state(2), storage_type=MEMORY)
    (old,) = saver_pids(runtime_dir)
    shutil.rmtree(eng.job_dir)
    # The saver sees its dir gone and leaves by itself (no trainer could reach it any more).
    wait_for(lambda: not _saver_alive(old), 30, f"the saver (pid {old}) to leave the removed runtime dir")
    with caplog.at_level(logging.WARNING):
        assert eng.save(3, state(3), storage_type=MEMORY)
        eng.save(4, state(4), storage_type=DISK)
        eng.wait(60)
        assert eng.save(5, state(5), storage_type=MEMORY)
    lost = [r for r in caplog.records if "runtime dir" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(lost) == 1, [r.getMessage() for r in caplog.records]
    msg = lost[0].getMessage()
    assert eng.job_dir in msg and "lost" in msg and "RemoveIPC" in msg and "new saver" in msg, msg
    (new,) = saver_pids(runtime_dir)
    assert new != old
    assert eng.committed_steps() == [1, 4]
    assert eng.memory_steps()[:2] == [5, 4]  # new shared memory: step 2 went with the old one
    got = eng.load()
    assert (eng.last_load.step, eng.last_load.source) == (5, "memory")
    assert_one_step(got, 5, "the load after the wipe")
    eng.close()


def test_a_load_right_after_the_wipe_finds_the_committed_step(make_engine, runtime_dir, ckpt_dir, caplog):
    """The first call after the wipe is a load, with an overlapped snapshot still in flight into the removed
    dir: it finds the committed step (memory is gone), says why once."""
    eng = make_engine(max_to_keep=0, overlap=True)
    eng.save(1, state(1), storage_type=DISK)
    eng.wait(60)
    eng.save(2, state(2), storage_type=MEMORY)  # returns before its copy is done
    shutil.rmtree(eng.job_dir)
    with caplog.at_level(logging.WARNING):
        assert eng.memory_steps() == []
        got = eng.load()
    assert (eng.last_load.step, eng.last_load.source) == (1, "storage")
    assert_one_step(got, 1, "the load after the wipe")
    assert sum("runtime dir" in r.getMessage() for r in caplog.records) == 1
    eng.close()


# ------------------------------------------------------------------------------------------ fd starvation (item 8)
_CRASHED_TRAINER = """
import os, sys, torch
from flashckpt import CheckpointEngine, StorageType
eng = CheckpointEngine(sys.argv[1], max_to_keep=0)
eng.save(1, {"w": torch.full((1024,), 1.0), "step": 1}, storage_type=StorageType.DISK)
eng.wait(60)
eng.save(2, {"w": torch.full((1024,), 2.0), "step": 2}, storage_type=StorageType.MEMORY)
os._exit(1)  # a crash: the saver keeps step 2 in memory for a restart
"""

_STARVED_RESTART = """
import contextlib, os, resource, sys
from flashckpt import CheckpointEngine, SnapshotReader
eng = CheckpointEngine(sys.argv[1], max_to_keep=0)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
held = []
with contextlib.suppress(OSError):
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
os.close(held.pop())  # one file descriptor left
for name, call in (("memory_steps", eng.memory_steps), ("load", eng.load),
                   ("reader", lambda: SnapshotReader(eng).memory_steps())):
    try:
        got = call()
        print(name, "returned", got if name != "load" else (eng.last_load.step, eng.last_load.source), flush=True)
    except Exception as e:
        print(name, "raised", type(e).__name__, str(e).replace(chr(10), " "), flush=True)
for fd in held:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
got = eng.load()
print("relieved", eng.last_load.step, eng.last_load.source, float(got["w"][0]), flush=True)
eng.close()
"""


def test_a_restart_starved_of_fds_gets_an_error_never_the_older_commit(tmp_path, ckpt_dir, runtime_dir):
    """Defect: a restarted trainer with one free file descriptor got [] from memory_steps() and the older
    committed step from load(), silently (the segment's open failed with EMFILE and was taken for "no
    segment"). Now both raise an error naming the segment and EMFILE; with descriptors again, load()
    returns the newer snapshot from memory."""
    # The crashed trainer's saver keeps step 2 in memory only, far longer than the restart takes to come.
    env = {**os.environ, "FLASHCKPT_LAST_WORDS": "0", "FLASHCKPT_SAVER_GRACE_S": "120"}
    scripts = {}
    for name, body in (("crash", _CRASHED_TRAINER), ("restart", _STARVED_RESTART)):
        scripts[name] = tmp_path / f"{name}.py"
        scripts[name].write_text(body)
    first = subprocess.run([sys.executable, str(scripts["crash"]), ckpt_dir], env=env, capture_output=True,
                           text=True, timeout=180)
    assert first.returncode == 1, first.stdout + first.stderr
    out = subprocess.run([sys.executable, str(scripts["restart"]), ckpt_dir], env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = {ln.split(" ", 1)[0]: ln for ln in out.stdout.splitlines()}
    for name in ("memory_steps", "load", "reader"):
        line = lines[name]
        assert " raised " in line and "EMFILE" in line and "seg-r000" in line, f"{line}\n{out.stderr}"
    assert lines["relieved"] == "relieved 2 memory 2.0", out.stdout + out.stderr


# ------------------------------------------------------------------------------------------ the matrix
EVENTS = ["fork_exit", "fork_close", "fork_use", "threads", "signal_handler_calls", "keyboard_interrupt",
          "saver_sigterm", "runtime_dir_wiped", "runtime_dir_files_wiped", "runtime_dir_renamed",
          "checkpoint_dir_renamed", "fds_one_free", "fds_none_free"]


@pytest.mark.parametrize("event", EVENTS)
def test_process_event_matrix(event, ckpt_dir, runtime_dir, tmp_path):
    """One process event against a live engine holding a committed step and a newer memory snapshot
    (``_events_trainer.py``): afterwards load() returns exactly the state of the step it says (the newest
    left), the engine persists, commits and snapshots again, every committed step verifies and holds one
    step's tensors, and one saver serves the job."""
    out = subprocess.run([sys.executable, TRAINER, ckpt_dir, event], capture_output=True, text=True, timeout=400,
                         cwd=str(tmp_path))
    assert out.returncode == 0 and f"OK {event}" in out.stdout, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
