"""A trainer that meets one process event with a live engine, then checks the rule of the product: what
``load()`` returns is exactly what was saved, for the step it says, or an error says why not; and the
engine goes on (tests/multiproc/test_process_events.py runs it once per event, as a process of its own).

    python _events_trainer.py CHECKPOINT_DIR EVENT

Before the event the engine has committed step 1 and holds step 2 in memory. The event returns what a
load right after it must find: (step, source), or None for "the newest snapshot in memory". Then the
trainer persists and commits step 10, snapshots step 11, and checks every committed step and the load
again. It exits 0 and prints ``OK EVENT`` when every check held; an AssertionError (or any error) fails it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from _starve import starved_fds
from flashckpt import CheckpointEngine, FlashCheckpointError, StorageType
from flashckpt.commit.layout import CommitLayout
from flashckpt.storage.posix import PosixDiskStorage
from helpers import _proc_state, saver_pids, wait_for  # this file's folder, sys.path[0] when run

DISK, MEMORY = StorageType.DISK, StorageType.MEMORY
Expect = tuple[int, str] | None


def sd(step: int) -> dict[str, Any]:
    """A state whose every tensor says its step: a snapshot mixing two steps is seen at once."""
    return {"w": torch.full((64, 1024), float(step)), "b": torch.arange(4096, dtype=torch.int64) + step,
            "nested": {"m": torch.full((8,), float(step), dtype=torch.float64)}, "step": step}


def same(got: Any, step: int, where: str) -> None:
    want = sd(step)
    assert isinstance(got, dict) and got.get("step") == step, f"{where}: step {got.get('step')!r}, not {step}"
    for key in ("w", "b"):
        assert torch.equal(got[key], want[key]), f"{where}: tensor {key!r} is not step {step}'s"
    assert torch.equal(got["nested"]["m"], want["nested"]["m"]), f"{where}: tensor 'nested.m' is not step {step}'s"


def alive(pid: int) -> bool:
    return _proc_state(pid) not in (None, "Z", "X")


def saver_of(eng: CheckpointEngine) -> int:
    return eng._link.saver_pid


def savers_of(eng: CheckpointEngine) -> list[int]:
    """Live saver daemons serving the engine's job dir."""
    found = saver_pids(eng.knobs.runtime_dir)
    return sorted(pid for pid, argv in found.items() if argv[argv.index("--job-dir") + 1] == eng.job_dir)


def in_threads(n: int, work: Callable[[int], None]) -> None:
    """Runs ``work(k)`` for k in range(n) on n threads released together; raises with what any of them
    raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run(k: int) -> None:
        try:
            start.wait(30)
            work(k)
        except BaseException as e:
            errors.append(e)

    ts = [threading.Thread(target=run, args=(k,), name=f"worker{k}") for k in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    assert not errors, f"concurrent calls failed: {errors!r}"


# ------------------------------------------------------------------------------------------ events
EVENTS: dict[str, Callable[[CheckpointEngine, str], Expect]] = {}


def event(fn: Callable[[CheckpointEngine, str], Expect]) -> Callable[[CheckpointEngine, str], Expect]:
    EVENTS[fn.__name__] = fn
    return fn


def _fork(eng: CheckpointEngine, child: Callable[[], None]) -> None:
    """Forks; the child runs ``child`` and exits through the interpreter's normal exit (its exit
    handlers run); the parent checks that its saver, its connection and its memory are untouched."""
    saver = saver_of(eng)
    pid = os.fork()
    if pid == 0:
        try:
            child()
        except SystemExit:
            raise
        except BaseException as e:  # the child's own failure shows in its exit code
            print(f"child failed: {type(e).__name__}: {e}", flush=True)
            sys.exit(3)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the forked child exited {os.waitstatus_to_exitcode(status)}"
    eng.wait(60)  # a round trip on the parent's own connection, after anything the child may have said
    assert saver_of(eng) == saver and alive(saver), "the forked child's exit ended the parent's saver"
    assert os.path.isdir(eng.job_dir), "the forked child's exit removed the parent's runtime dir"
    assert eng.memory_steps()[:2] == [2, 1], f"memory holds {eng.memory_steps()} after the child's exit"


@event
def fork_exit(eng: CheckpointEngine, ckpt: str) -> Expect:
    """A forked child (a DataLoader worker, a multiprocessing 'fork' child) exits normally."""
    _fork(eng, lambda: None)
    return 2, "memory"


@event
def fork_close(eng: CheckpointEngine, ckpt: str) -> Expect:
    """A forked child closes its copy of the engine (a `with` block ending in the child)."""
    def child() -> None:
        eng.__exit__(SystemExit, SystemExit(0), None)
        eng.close()

    _fork(eng, child)
    return 2, "memory"


@event
def fork_use(eng: CheckpointEngine, ckpt: str) -> Expect:
    """A forked child calls the inherited engine: each call is refused, saying why; nothing it does
    reaches the parent's saver or memory."""
    state = sd(7)  # made before the fork: torch's thread pools may hang in a forked child (a torch matter)

    def child() -> None:
        calls = {"save": lambda: eng.save(7, state, storage_type=DISK), "load": eng.load, "wait": eng.wait,
                 "memory_steps": eng.memory_steps, "delete_steps": lambda: eng.delete_steps([1])}
        for name, call in calls.items():
            try:
                call()
            except FlashCheckpointError as e:
                msg = str(e)
                assert "fork" in msg and str(os.getppid()) in msg and str(os.getpid()) in msg, f"{name}(): {msg}"
            else:
                raise AssertionError(f"{name}() in a forked child was not refused")

    _fork(eng, child)
    assert eng.committed_steps() == [1], "a forked child's call reached the saver"
    return 2, "memory"


@event
def threads(eng: CheckpointEngine, ckpt: str) -> Expect:
    """Three threads save, persist, wait and load on the one engine at once."""
    def work(k: int) -> None:
        for s in range(3 + k, 9, 3):
            eng.save(s, sd(s), storage_type=DISK if s % 3 == 0 else MEMORY)
            got = eng.load()
            assert eng.last_load is not None
            same(got, eng.last_load.step, f"a load in thread {threading.current_thread().name}")
        eng.wait(120)

    in_threads(3, work)
    return None


@event
def signal_handler_calls(eng: CheckpointEngine, ckpt: str) -> Expect:
    """A signal handler calls the engine while the main thread is inside its save: refused, and the save
    it interrupted completes intact."""
    refused: list[str] = []

    def handler(signum: int, frame: Any) -> None:
        if refused:
            return
        for name, call in (("save", lambda: eng.save(99, sd(99), storage_type=MEMORY)), ("load", eng.load)):
            try:
                call()
            except FlashCheckpointError as e:
                refused.append(f"{name}: {e}")

    class Interrupting:  # pickled by the save: the signal arrives in the middle of the save
        def __reduce__(self) -> tuple[Any, ...]:
            os.kill(os.getpid(), signal.SIGUSR1)
            return (str, ("interrupted",))

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        state = sd(3)
        state["leaf"] = Interrupting()
        eng.save(3, state, storage_type=MEMORY)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert len(refused) == 2 and all("signal handler" in r for r in refused), f"not refused: {refused}"
    assert 99 not in eng.memory_steps()
    return 3, "memory"


@event
def keyboard_interrupt(eng: CheckpointEngine, ckpt: str) -> Expect:
    """SIGINT in the middle of a save: KeyboardInterrupt out of it; the snapshots before stay, the engine
    goes on (its call lock is free again)."""
    class Interrupting:
        def __reduce__(self) -> tuple[Any, ...]:
            os.kill(os.getpid(), signal.SIGINT)
            return (str, ("interrupted",))

    state = sd(3)
    state["leaf"] = Interrupting()
    # Python's own SIGINT handler, whatever this process inherited: a process started in the background by a
    # shell without job control inherits SIGINT ignored, and Python then installs no handler for it.
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        eng.save(3, state, storage_type=MEMORY)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("SIGINT did not interrupt the save")
    finally:
        signal.signal(signal.SIGINT, old)
    return 2, "memory"


@event
def saver_sigterm(eng: CheckpointEngine, ckpt: str) -> Expect:
    """The saver gets SIGTERM (a node shutting down): its last words commit the snapshot in memory, it
    exits and removes the runtime dir; the engine starts a new saver at its next call."""
    saver = saver_of(eng)
    os.kill(saver, signal.SIGTERM)
    wait_for(lambda: not alive(saver), 60, "the saver to exit after SIGTERM")
    return 2, "storage"


def _wait_old_saver(saver: int) -> None:
    wait_for(lambda: not alive(saver), 60, f"the old saver (pid {saver}) to exit")


@event
def runtime_dir_wiped(eng: CheckpointEngine, ckpt: str) -> Expect:
    """The runtime dir removed with everything in it, as systemd-logind's RemoveIPC removes a user's files
    and dirs in /dev/shm: the memory snapshots are lost, the committed step is what a load finds, and the
    engine goes on."""
    shutil.rmtree(eng.knobs.runtime_dir)
    return 1, "storage"


@event
def runtime_dir_files_wiped(eng: CheckpointEngine, ckpt: str) -> Expect:
    """The files in the job's runtime dir removed, the dir itself left (a cleaner that keeps dirs)."""
    for name in os.listdir(eng.job_dir):
        os.unlink(os.path.join(eng.job_dir, name))
    return 1, "storage"


@event
def runtime_dir_renamed(eng: CheckpointEngine, ckpt: str) -> Expect:
    """The job's runtime dir moved away under the engine: as good as wiped for the engine."""
    moved = eng.job_dir + ".moved"
    saver = saver_of(eng)
    os.rename(eng.job_dir, moved)
    got = eng.load()
    assert eng.last_load is not None and (eng.last_load.step, eng.last_load.source) == (1, "storage")
    same(got, 1, "the load after the runtime dir moved")
    _wait_old_saver(saver)
    # The old saver removed its files through its own handle of the dir; the emptied dir is ours to remove.
    os.rmdir(moved)
    return 1, "storage"


@event
def checkpoint_dir_renamed(eng: CheckpointEngine, ckpt: str) -> Expect:
    """The checkpoint dir renamed under a live engine (what storage then says is another test's matter):
    the snapshots in memory are unaffected. Moved back before the trainer goes on persisting."""
    moved = ckpt.rstrip("/") + "-moved"
    os.rename(ckpt, moved)
    try:
        assert eng.save(3, sd(3), storage_type=MEMORY)
        assert eng.memory_steps()[0] == 3
        same(eng.load_memory(3), 3, "the memory snapshot after the checkpoint dir moved")
    finally:
        os.rename(moved, ckpt)
    return 3, "memory"


def _starved(eng: CheckpointEngine, free: int) -> dict[str, str]:
    """Calls memory_steps() and load() with ``free`` file descriptors left: each returns the right answer or
    raises an error naming what failed; returns call -> what happened."""
    out: dict[str, str] = {}
    with starved_fds(free, limit=512):
        for name, call in (("memory_steps", eng.memory_steps), ("load", eng.load)):
            try:
                got = call()
            except Exception as e:
                msg = f"{type(e).__name__}: {e}"
                assert "EMFILE" in msg or "Too many open files" in msg, f"{name}() failed without saying why: {msg}"
                out[name] = "error naming EMFILE"
                continue
            if name == "memory_steps":
                assert got[:2] == [2, 1], f"memory_steps() starved of fds: {got}, not [2, 1]"
            else:
                assert eng.last_load is not None and (eng.last_load.step, eng.last_load.source) == (2, "memory"), \
                    f"load() starved of fds returned {eng.last_load}, not step 2 from memory"
                same(got, 2, "the load starved of fds")
            out[name] = "right"
    return out


@event
def fds_one_free(eng: CheckpointEngine, ckpt: str) -> Expect:
    print("starved, one fd free:", json.dumps(_starved(eng, 1)), flush=True)
    return 2, "memory"


@event
def fds_none_free(eng: CheckpointEngine, ckpt: str) -> Expect:
    print("starved, no fd free:", json.dumps(_starved(eng, 0)), flush=True)
    return 2, "memory"


# ------------------------------------------------------------------------------------------ the run
def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(process)d %(name)s %(levelname)s %(message)s")
    ckpt, name = sys.argv[1], sys.argv[2]
    eng = CheckpointEngine(ckpt, max_to_keep=0, weights_only=False)
    eng.save(1, sd(1), storage_type=DISK)
    eng.wait(60)
    assert eng.save(2, sd(2), storage_type=MEMORY)
    first_saver = saver_of(eng)

    expect = EVENTS[name](eng, ckpt)
    got = eng.load()
    assert eng.last_load is not None
    found = (eng.last_load.step, eng.last_load.source)
    if expect is None:
        assert found == (eng.memory_steps()[0], "memory"), f"{name}: load() found {found}, not the newest snapshot"
    else:
        assert found == expect, f"{name}: load() found {found}, not {expect}"
    same(got, found[0], f"{name}: the load right after the event")

    # The engine goes on: a persist commits, a snapshot is taken, and both load back exactly.
    eng.save(10, sd(10), storage_type=DISK)
    eng.wait(120)
    assert eng.save(11, sd(11), storage_type=MEMORY)
    got = eng.load()
    assert eng.last_load is not None and (eng.last_load.step, eng.last_load.source) == (11, "memory"), eng.last_load
    same(got, 11, f"{name}: the load after the engine went on")
    layout = CommitLayout(ckpt, PosixDiskStorage())
    committed = layout.committed_steps()
    assert committed[0] == 1 and committed[-1] == 10, f"{name}: committed steps {committed}"
    for s in committed:
        assert layout.verify(s) == [], f"{name}: committed step {s} does not verify: {layout.verify(s)}"
        path = eng.step_path(s)
        assert path is not None
        same(torch.load(path, weights_only=False), s, f"{name}: committed step {s}'s file")
    savers = savers_of(eng)
    assert savers == [saver_of(eng)], f"{name}: savers {savers} serve the job, not only {saver_of(eng)}"
    if saver_of(eng) != first_saver:
        assert not alive(first_saver), f"{name}: the first saver (pid {first_saver}) still runs"
    eng.close()
    print(f"OK {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
