"""Kill points: a process killed at any point of the save / persist / commit / retention path never costs
the newest complete snapshot or the newest committed step, and never leaves torn or unverifiable data.

A training loop (``_killpoint_trainer.py``) saves the state of ``_fault_helpers.make_state(step)`` (every
tensor a deterministic function of the step, so the checker recomputes it) to memory at every step and
to disk every k steps with ``max_to_keep=2``, journaling each save. The test freezes the trainer and the
saver (SIGSTOP), records which point of the path they are at (``observe``: a slot being copied, a persist
running, done markers without a manifest, a manifest newer than the tracker, a step being deleted), then
SIGKILLs the trainer, the saver or both, in some order. A fresh engine in the test process (the restarted
trainer) and a read-only reader of the segments then check these invariants:

- **memory**: the newest COMPLETE snapshot in shared memory is the newest step whose ``save()`` returned
  (journal ``D``), or the step whose save was running at the kill (journal ``B``) when its copy completed;
  nothing else, in particular not an older one. ``load()`` returns it, and every COMPLETE slot's content is
  bit-exact the state of the step it claims (no torn snapshot, no snapshot claiming another step).
- **storage**: every committed step (one with a manifest) verifies against its manifest, both at the kill
  moment and after the restart (``CommitLayout.verify == []``; ``flashckpt verify`` exits 0, or 2 when nothing is committed), and its file
  is bit-exact the state of its step; the newest committed step is never older than the newest committed
  at the kill moment; when only the trainer died, its saver commits the newest snapshot (last words); the
  tracker names the newest committed step once a saver started; no half-written step, temp file or
  unlisted step directory is left once the saver is idle; a storage-only ``locate`` finds the newest
  committed step; memory never holds a step older than storage.

Two ways to reach the points: seeded random delays (``test_random_kill``: a few seeds in CI, ``--soak N``
or ``FLASHCKPT_SOAK=N`` runs N of them), and deterministic points pinned by observation only (slot
headers, marker files) or by a FIFO placed where the saver is about to write a temp file: its ``open``
blocks there until the test kills it, without any hook in the code.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from _fault_helpers import (  # noqa: F401
    FaultEnv,
    alive,
    assert_state_of,
    close_and_wait,
    fault_env_fixture,
    files_named,
    kill9,
    run_cli,
    saver_pids,
    stop,
    wait_for,
)
from flashckpt import CheckpointEngine
from flashckpt.commit.layout import CommitLayout
from flashckpt.format.segment import (
    COMPLETE,
    EMPTY,
    FLAG_PENDING,
    FLAG_PINNED,
    WRITING,
    Segment,
    SlotHeader,
    segment_paths,
)
from flashckpt.memory.writer import SharedMemoryHandler
from flashckpt.storage.posix import PosixDiskStorage

TRAINER = os.path.join(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"), "_killpoint_trainer.py")
VICTIMS = ("trainer", "saver", "both", "saver_then_trainer", "trainer_then_saver")
DEFAULT_SEEDS = len(VICTIMS)  # random iterations in CI: each victim once (a trainer, a saver, a restart: ~10 s)
SETTLE_S = 60.0  # bound on the saver's work after the kill (last words, commits)


def _soak_seeds(config: pytest.Config) -> int:
    n = config.getoption("soak", default=0) or 0
    return int(n) or int(os.environ.get("FLASHCKPT_SOAK", "0") or 0) or DEFAULT_SEEDS


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "seed" in metafunc.fixturenames:
        first = int(os.environ.get("FLASHCKPT_SOAK_FIRST_SEED", "0") or 0)
        seeds = list(range(first, first + _soak_seeds(metafunc.config)))
        metafunc.parametrize("seed", seeds, ids=[f"seed{s}" for s in seeds])


# ------------------------------------------------------------------------------------------ journal
@dataclass
class Journal:
    """What the trainer said before it died (see ``_killpoint_trainer.py``)."""

    ready: bool = False
    begun: list[int] = field(default_factory=list)
    done: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def newest_done(self) -> int | None:
        return self.done[-1] if self.done else None

    @property
    def last_begun(self) -> int | None:
        return self.begun[-1] if self.begun else None

    def allowed_newest(self) -> set[int | None]:
        """The newest snapshot memory may hold: the last save that returned, or the one running at the
        kill if its copy completed (None: no snapshot, only before the first save returned)."""
        out: set[int | None] = {self.newest_done}
        if self.last_begun is not None:
            out.add(self.last_begun)
        return out

    def summary(self) -> str:
        return f"begun up to {self.last_begun}, returned up to {self.newest_done}" + \
            (f", error {self.error!r}" if self.error else "")


def read_journal(path: str) -> Journal:
    j = Journal()
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return j
    for line in lines:
        parts = line.split(" ", 2)
        if parts[0] == "R":
            j.ready = True
        elif parts[0] == "B" and len(parts) >= 2:
            j.begun.append(int(parts[1]))
        elif parts[0] == "D" and len(parts) == 2:
            j.done.append(int(parts[1]))
        elif parts[0] == "E":
            j.error = line
    return j


# ------------------------------------------------------------------------------------------ observing
@dataclass
class Frozen:
    """The state at the kill moment (both processes stopped)."""

    points: list[str]
    committed: list[int]
    tracker: int | None
    slots: list[tuple[int, int, int]]  # (state, flags, step) of every slot
    uncommitted: list[int]
    damaged: dict[int, list[str]]

    def describe(self) -> str:
        names = {EMPTY: "EMPTY", WRITING: "WRITING", COMPLETE: "COMPLETE"}
        slots = ", ".join(f"{names.get(s, s)}{'/pinned' if fl & FLAG_PINNED else ''}"
                          f"{'/pending' if fl & FLAG_PENDING else ''}:{st}" for s, fl, st in self.slots)
        return (f"kill point {'+'.join(self.points) or 'idle'}; slots [{slots}]; committed {self.committed}; "
                f"tracker {self.tracker}; uncommitted step dirs {self.uncommitted}")



def slot_headers(job_dir: str) -> list[SlotHeader]:
    """Every slot header of local rank 0's segments (read without locking: a racy view is fine here)."""
    out = []
    for _epoch, path in segment_paths(job_dir, 0):
        try:
            seg = Segment(path, populate=False)
        except Exception:  # removed, or not yet complete, under our feet
            continue
        try:
            out += [seg.header(i) for i in range(seg.nslots)]
        finally:
            seg.close()
    return out


def observe(ckpt: str, job_dir: str) -> Frozen:
    """Classifies the point of the save / persist / commit / retention path the frozen processes are at."""
    layout = CommitLayout(ckpt, PosixDiskStorage())
    committed = layout.committed_steps()
    tracker = layout.tracker_step()
    uncommitted = layout.uncommitted_steps()
    hs = slot_headers(job_dir)
    points = []
    if any(h.state == WRITING for h in hs):
        points.append("copy")
    if any(h.flags & FLAG_PINNED for h in hs) or files_named(ckpt, ".flashckpt-tmp"):
        points.append("persist")
    newest = committed[-1] if committed else -1
    for s in uncommitted:
        names = set(os.listdir(layout.step_dir(s))) if os.path.isdir(layout.step_dir(s)) else set()
        has_done = any(n.startswith("done_rank_") for n in names)
        if s < newest:
            points.append(f"retention({s})")
        elif has_done:
            points.append(f"commit({s})")
    if committed and tracker != committed[-1]:
        points.append(f"tracker({tracker}<{committed[-1]})")
    damaged = {s: p for s in committed if (p := layout.verify(s))}
    return Frozen(points, committed, tracker, [(h.state, h.flags, h.step) for h in hs], uncommitted, damaged)


def _poll(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    """A tight poll (0.5 ms) for windows of a few milliseconds, such as a slot being copied."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.0005)


# ------------------------------------------------------------------------------------------ a run
@dataclass
class Run:
    fe: FaultEnv
    ckpt: str
    journal: str
    mb: float
    trainer: Any = None

    @property
    def job_dir(self) -> str:
        return self.fe.job_dir(self.ckpt)

    def start(self, every: int, max_to_keep: int = 2) -> None:
        self.trainer = self.fe.popen([sys.executable, TRAINER, "--ckpt", self.ckpt, "--journal", self.journal,
                                      "--mb", str(self.mb), "--every", str(every), "--max_to_keep", str(max_to_keep)],
                                     "trainer.log")

    def j(self) -> Journal:
        return read_journal(self.journal)

    def alive_or_fail(self) -> None:
        if self.trainer.poll() is not None:
            pytest.fail(f"the trainer exited early ({self.trainer.returncode}):\n{self.fe.log('trainer.log')}\n"
                        f"{self.fe.saver_logs()}")

    def wait_done(self, step: int, timeout: float = 120) -> None:
        def ok() -> bool:
            self.alive_or_fail()
            j = self.j()
            if j.error:
                pytest.fail(f"the trainer failed before the kill: {j.error}\n{self.fe.saver_logs()}")
            return (j.newest_done or 0) >= step

        wait_for(ok, timeout, f"the trainer's save of step {step} to return")

    def savers(self) -> list[int]:
        return saver_pids(self.fe.runtime_dir, self.job_dir)

    def freeze(self) -> list[int]:
        """SIGSTOPs the trainer, then the job's saver(s); returns the savers' pids."""
        stop(self.trainer.pid)
        savers = self.savers()
        for pid in savers:
            stop(pid)
        return savers

    def thaw(self, pids: list[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def kill(self, victim: str, savers: list[int], after: float) -> None:
        """With everything frozen: SIGKILLs ``victim`` (see VICTIMS) and lets the others go on."""
        t = self.trainer.pid
        if victim in ("trainer", "both", "trainer_then_saver"):
            kill9(t)
        if victim in ("saver", "both", "saver_then_trainer"):
            for pid in savers:
                kill9(pid)
        self.thaw([p for p in [t, *savers] if alive(p)])
        if victim in ("saver", "saver_then_trainer"):
            if victim == "saver_then_trainer":
                time.sleep(after)  # the trainer runs on without its saver for a while
            kill9(t)
        if victim == "trainer_then_saver":
            time.sleep(after)  # the saver runs its last words for a while
            for pid in self.savers():
                kill9(pid)
        self.trainer.wait(timeout=30)


# ------------------------------------------------------------------------------------------ checking
def check_recovery(run: Run, frozen: Frozen, victim: str) -> list[str]:
    """Checks every invariant of the module docstring after the kill; returns the violations."""
    problems: list[str] = []
    ckpt, mb, fe = run.ckpt, run.mb, run.fe
    layout = CommitLayout(ckpt, PosixDiskStorage())
    j = run.j()
    for s, p in frozen.damaged.items():
        problems.append(f"at the kill moment, committed step {s} did not verify: {p}")

    # Memory, read straight from the segments (no saver involved).
    newest_mem: int | None = None
    reader = SharedMemoryHandler(0, run.job_dir) if os.path.isdir(run.job_dir) else None
    try:
        mem = reader.memory_steps() if reader else []
        newest_mem = mem[0] if mem else None
        if newest_mem not in j.allowed_newest():
            problems.append(f"memory: the newest complete snapshot is step {newest_mem} (all: {mem}); expected "
                            f"one of {sorted(x for x in j.allowed_newest() if x is not None)} ({j.summary()})")
        for s in mem:
            snap = reader.load_snapshot(s) if reader else None
            if snap is None:
                problems.append(f"memory: the COMPLETE snapshot of step {s} did not read back")
                continue
            try:
                assert snap.step == s, f"asked for step {s}, got a snapshot claiming step {snap.step}"
                assert_state_of(snap.state_dict, s, mb)
            except AssertionError as e:
                problems.append(f"memory: torn or foreign snapshot in the slot of step {s}: {e}")
            del snap
    finally:
        if reader is not None:
            reader.close()

    # The saver that survived the trainer commits its newest snapshot (last words).
    if victim == "trainer" and newest_mem is not None:
        try:
            wait_for(lambda: (layout.committed_steps() or [-1])[-1] >= newest_mem, SETTLE_S,
                     f"the saver's last words to commit step {newest_mem}")
        except TimeoutError as e:
            problems.append(f"storage: {e}; committed {layout.committed_steps()}")

    engine = CheckpointEngine(ckpt, max_to_keep=0)  # the restarted trainer (applies no retention)
    try:
        try:
            sd = engine.load()
            ll = engine.last_load
            assert ll is not None
            if newest_mem is not None and (ll.source, ll.step) != ("memory", newest_mem):
                problems.append(f"load(): got step {ll.step} from {ll.source}; expected step {newest_mem} from memory")
            if ll.step is not None:
                assert_state_of(sd, ll.step, mb)
            del sd
        except AssertionError as e:
            problems.append(f"load(): the state it returned is not bit-exact that of the step it claims: {e}")
        except Exception as e:
            problems.append(f"load() raised {type(e).__name__}: {e}")
        try:
            engine.wait(timeout=SETTLE_S)
        except Exception as e:
            problems.append(f"wait() after the restart raised {type(e).__name__}: {e}")

        committed = layout.committed_steps()
        for s in committed:
            bad = layout.verify(s)
            if bad:
                problems.append(f"storage: committed step {s} does not verify: {bad}")
                continue
            try:
                path = engine.step_path(s)
                assert path is not None, f"step {s} has no file for rank 0"
                sd = engine.load(resume_path=path)
                assert_state_of(sd, s, mb)
                del sd
            except Exception as e:  # AssertionError included
                problems.append(f"storage: committed step {s} is not bit-exact the state of step {s}: {e}")
        newest = committed[-1] if committed else None
        if frozen.committed and (newest is None or newest < frozen.committed[-1]):
            problems.append(f"storage: step {frozen.committed[-1]} was committed at the kill, but the newest "
                            f"committed step is now {newest} ({committed})")
        if victim == "trainer" and newest_mem is not None and newest != newest_mem:
            problems.append(f"storage: only the trainer died, so its saver's last words should commit its newest "
                            f"snapshot {newest_mem}; the newest committed step is {newest}")
        if newest is not None and j.last_begun is not None and newest > j.last_begun:
            problems.append(f"storage: step {newest} is committed but was never saved ({j.summary()})")
        if newest is not None and newest_mem is not None and newest_mem < newest:
            problems.append(f"memory holds step {newest_mem}, older than the committed step {newest}")
        tracker = layout.tracker_step()
        if newest is not None and tracker != newest:
            problems.append(f"storage: the tracker says {tracker} after the restart; the newest committed step "
                            f"is {newest}")
        left = layout.uncommitted_steps()
        if left:
            problems.append(f"storage: uncommitted step dirs {left} left once the saver is idle")
        tmp = files_named(ckpt, ".flashckpt-tmp")
        if tmp:
            problems.append(f"storage: temp files left once the saver is idle: {tmp}")
        data_dirs = sorted(int(n[5:]) for n in os.listdir(ckpt) if n.startswith("step_") and n[5:].isdigit())
        if set(data_dirs) - set(committed):
            problems.append(f"storage: data dirs of steps {sorted(set(data_dirs) - set(committed))} that no "
                            f"manifest lists (committed {committed})")
        try:
            loc = engine.locate(memory=False)
            if loc.step != newest:
                problems.append(f"locate(memory=False) found step {loc.step}; the newest committed is {newest}")
        except Exception as e:
            problems.append(f"locate(memory=False) raised {type(e).__name__}: {e}")
    finally:
        close_and_wait(engine)
    r = run_cli(fe, "verify", ckpt)
    want = 0 if layout.committed_steps() else 2  # 2: nothing committed to verify
    if r.returncode != want:
        problems.append(f"`flashckpt verify` exited {r.returncode} (expected {want}): {r.stdout[-2000:]}{r.stderr[-2000:]}")
    return problems


def report(what: str, run: Run, frozen: Frozen, problems: list[str]) -> None:
    j = run.j()
    line = f"{what}: {frozen.describe()}; trainer {j.summary()}"
    print(line)
    if problems:
        pytest.fail(line + "\n  - " + "\n  - ".join(problems) + f"\n--- saver logs:\n{run.fe.saver_logs()[-6000:]}")


def new_run(fe: FaultEnv, mb: float) -> Run:
    ckpt = os.path.join(fe.tmp, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    return Run(fe, ckpt, os.path.join(fe.tmp, "journal.txt"), mb)


# ------------------------------------------------------------------------------------------ random kills
@pytest.mark.multiproc
def test_random_kill(fault_env: FaultEnv, seed: int) -> None:
    """SIGKILL of the trainer and/or the saver after a seeded random delay into a training loop."""
    rng = random.Random(seed)
    victim = VICTIMS[seed % len(VICTIMS)]  # the CI default runs each victim once
    every = rng.choice((1, 2, 3))
    mb = rng.choice((8, 32))
    delay = rng.uniform(0.0, 1.5)
    after = rng.uniform(0.0, 0.6)
    run = new_run(fault_env, mb)
    t0 = time.monotonic()
    run.start(every)
    run.wait_done(1)
    t1 = time.monotonic()
    time.sleep(delay)  # the random kill point (the seed fixes the plan; timing varies between runs)
    savers = run.freeze()
    frozen = observe(run.ckpt, run.job_dir)
    run.kill(victim, savers, after)
    t2 = time.monotonic()
    problems = check_recovery(run, frozen, victim)
    report(f"seed {seed}: kill {victim} (every {every}, {mb} MB, delay {delay:.2f} s, then {after:.2f} s; "
           f"start {t1 - t0:.1f} s, check {time.monotonic() - t2:.1f} s)", run, frozen, problems)


# ------------------------------------------------------------------------------------------ pinned points
@pytest.mark.multiproc
def test_kill_trainer_mid_copy_while_a_persist_runs(fault_env: FaultEnv) -> None:
    """Issue 15 defect 3: slot A holds step d being persisted, slot B the newer step d+1; the trainer is
    killed while it saves d+2. Memory must still hold d+1 (or d+2 had it completed)."""
    run = new_run(fault_env, 64)
    run.start(every=3)  # disk, memory, memory: the second memory save runs while the disk step persists
    run.wait_done(1)

    def at_point() -> bool:
        run.alive_or_fail()
        hs = slot_headers(run.job_dir)
        j = run.j()
        pinned = [h.step for h in hs if h.flags & FLAG_PINNED and h.state == COMPLETE]
        if not pinned or j.newest_done is None or j.last_begun is None:
            return False
        copying = j.last_begun > j.newest_done > pinned[0]
        return copying and not any(h.state == COMPLETE and h.step == j.last_begun for h in hs)

    def writing() -> bool:
        return any(h.state == WRITING for h in slot_headers(run.job_dir))

    for _ in range(200):
        _poll(at_point, 120, "a save to start while an older step persists and a newer one is complete")
        savers = run.savers()
        for pid in savers:  # hold the persist (and its pin) where it is
            stop(pid)
        if at_point():
            # Today's code copies into the newest snapshot's slot (WRITING); a fixed one may copy into
            # another slot, or wait for the persist: give it 2 s to start a copy, else it is waiting.
            with contextlib.suppress(TimeoutError):
                _poll(writing, 2.0, "the copy to start")
            copying = writing()
            stop(run.trainer.pid)
            if at_point() and (not copying or writing()):  # still there with both frozen
                break
        run.thaw([run.trainer.pid, *savers])
    else:
        pytest.fail("never caught the trainer mid-copy while a persist ran")
    frozen = observe(run.ckpt, run.job_dir)
    run.kill("trainer", savers, 0)
    report("kill trainer mid-copy while a persist runs", run, frozen, check_recovery(run, frozen, "trainer"))


def _block_with_fifo(path: str) -> None:
    """Puts a FIFO where the saver is about to create a temp file: its open() blocks until a reader comes."""
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def made() -> bool:
        try:
            os.mkfifo(path, 0o600)
        except FileExistsError:  # the saver is writing that temp file right now: the next write blocks
            return False
        return True

    _poll(made, 60, f"a FIFO in place at {path}")


def _fifo_blocked(path: str) -> bool:
    """True while the FIFO is still in place (the writer, if any, is blocked in open())."""
    with contextlib.suppress(FileNotFoundError):
        return os.path.exists(path) and os.stat(path).st_mode & 0o170000 == 0o010000
    return False


def _tear(path: str, head: bytes) -> None:
    """Replaces the FIFO with what a real kill leaves there: a partially written temp file."""
    os.unlink(path)
    with open(path, "wb") as f:
        f.write(head)


@pytest.mark.multiproc
def test_kill_saver_between_done_marker_and_manifest(fault_env: FaultEnv) -> None:
    """Trainer and saver killed while step 3 has its file and done marker but no manifest yet."""
    run = new_run(fault_env, 8)
    layout = CommitLayout(run.ckpt, PosixDiskStorage())
    fifo = layout.manifest_path(3) + ".flashckpt-tmp"
    run.start(every=1)
    wait_for(lambda: run.j().ready or run.alive_or_fail(), 120, "the trainer to attach")
    _block_with_fifo(fifo)  # after the saver's start-up clean-up, before step 3 commits
    done3 = os.path.join(layout.step_dir(3), "done_rank_0.json")
    wait_for(lambda: os.path.exists(done3) or run.alive_or_fail(), 120, "step 3's done marker")
    run.wait_done(5)  # the loop goes on while the commit hangs
    savers = run.freeze()
    frozen = observe(run.ckpt, run.job_dir)
    assert os.path.exists(done3) and not os.path.exists(layout.manifest_path(3)) and _fifo_blocked(fifo), \
        frozen.describe()
    run.kill("both", savers, 0)
    _tear(fifo, b'{"format": "flashckpt-manif')
    report("kill trainer+saver between step 3's done marker and its manifest", run, frozen,
           check_recovery(run, frozen, "both"))


@pytest.mark.multiproc
def test_kill_saver_between_manifest_and_tracker(fault_env: FaultEnv) -> None:
    """Issue 15 defect 9: trainer and saver killed when a step's manifest is written and the tracker still
    names the previous step. A new saver must repair the tracker."""
    run = new_run(fault_env, 8)
    layout = CommitLayout(run.ckpt, PosixDiskStorage())
    fifo = layout.tracker_path + ".flashckpt-tmp"
    run.start(every=1)
    wait_for(lambda: layout.tracker_step() is not None or run.alive_or_fail(), 120, "the first commit")
    _block_with_fifo(fifo)  # the next commit writes its manifest, then blocks on the tracker

    def manifest_ahead() -> bool:
        run.alive_or_fail()
        c = layout.committed_steps()
        return bool(c) and c[-1] != layout.tracker_step()

    wait_for(manifest_ahead, 120, "a manifest newer than the tracker")
    run.wait_done((run.j().newest_done or 0) + 2)
    savers = run.freeze()
    frozen = observe(run.ckpt, run.job_dir)
    assert frozen.committed and frozen.tracker is not None and frozen.tracker < frozen.committed[-1] \
        and _fifo_blocked(fifo), frozen.describe()
    run.kill("both", savers, 0)
    _tear(fifo, b'{"st')
    report("kill trainer+saver between a manifest and the tracker", run, frozen, check_recovery(run, frozen, "both"))



@pytest.mark.multiproc
def test_kill_saver_mid_retention(fault_env: FaultEnv) -> None:
    """Trainer and saver killed while retention deletes a step: its manifest is gone, the rest not yet.
    The step no longer counts as committed; the next saver removes what is left of it."""
    run = new_run(fault_env, 8)
    layout = CommitLayout(run.ckpt, PosixDiskStorage())
    run.start(every=1)  # with max_to_keep=2 every commit from the third on deletes a step

    def deleting() -> bool:
        run.alive_or_fail()
        c = layout.committed_steps()
        return bool(c) and any(s < c[-1] for s in layout.uncommitted_steps())

    for _ in range(500):
        _poll(deleting, 120, "retention to be deleting a step")
        savers = run.freeze()
        if deleting():  # still half deleted with both frozen
            break
        run.thaw([run.trainer.pid, *savers])
    else:
        pytest.fail("never caught retention in the middle of a deletion")
    frozen = observe(run.ckpt, run.job_dir)
    run.kill("both", savers, 0)
    report("kill trainer+saver mid-retention", run, frozen, check_recovery(run, frozen, "both"))
