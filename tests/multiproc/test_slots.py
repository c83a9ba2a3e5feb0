"""The slot state machine and the save order: a kill at any point of a snapshot, while a persist holds a
slot, leaves the newest complete snapshot; the newest save of a step wins and a lower step starts a new
timeline, in memory and on storage.

Real processes: the trainer is ``_fault_trainer.py`` (a subprocess), the saver its real daemon. The
moment of a kill is pinned with SIGSTOP: the trainer is frozen, the test checks (with it frozen) that it
is mid-copy while the saver persists another slot, and only then sends SIGKILL.
"""

from __future__ import annotations

import os
import re
import signal

import pytest
import torch
from _fault_helpers import (  # noqa: F401
    FaultEnv,
    assert_state_of,
    close_and_wait,
    committed,
    fault_env_fixture,
    kill9,
    make_state,
    stop,
    tracker_step,
    wait_for,
)
from flashckpt import CheckpointEngine, PersistError, StorageType
from flashckpt.format.segment import FLAG_PINNED, FLAG_UNRESERVED, PAGE, WRITING, Segment, segment_paths
from helpers import hold_persist, release_persist

MB = 64


def _segment(job_dir: str) -> Segment:
    paths = wait_for(lambda: segment_paths(job_dir, 0), 60, f"a segment in {job_dir}")
    return Segment(paths[-1][1], populate=False)


def _hold_persist(ckpt: str, step: int) -> str:
    """Makes the persist of ``step`` (rank 0, default path) block, its slot pinned, until ``release_persist``."""
    return hold_persist(os.path.join(ckpt, f"step_{step}", "rank_00000.pt"))


def _last_saved(log: str) -> int:
    steps = re.findall(r"^saved (\d+) ", log, re.M)
    assert steps, f"the trainer saved nothing:\n{log}"
    return int(steps[-1])


@pytest.mark.multiproc
def test_kill_mid_copy_while_a_persist_holds_a_slot_keeps_the_newest_snapshot(fault_env: FaultEnv) -> None:
    """Step 2 is being persisted (its slot pinned), step 3 (or a later one) is the newest complete
    snapshot, and the trainer is SIGKILLed in the middle of the next copy: a new process loads that
    newest snapshot bit-exact (two slots alone would have had to overwrite it)."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    job_dir = fault_env.job_dir(ckpt)
    # The persist of step 2 is held with its slot pinned: its temp file is a FIFO with no reader, so the
    # saver's persist thread blocks opening it until the test opens the other end.
    hold = _hold_persist(ckpt, 2)
    # The saver keeps the spare reserved for FLASHCKPT_SPARE_HOLD_S after the last persist: 2 s here.
    trainer = fault_env.trainer(ckpt, "--mb", str(MB), "--plan", "2:disk,3:memory", "--loop", "1000", "--hold",
                                FLASHCKPT_SPARE_HOLD_S="2")
    seg = _segment(job_dir)

    def mid_copy_while_persisting() -> bool:
        assert trainer.poll() is None, f"the trainer exited early:\n{fault_env.log('trainer.log')}"
        hs = [seg.header(i) for i in range(seg.nslots)]
        if not (any(h.step == 2 and h.flags & FLAG_PINNED for h in hs) and any(h.state == WRITING for h in hs)):
            return False
        stop(trainer.pid)  # freeze it, then check it is still mid-copy while step 2 is persisted
        hs = [seg.header(i) for i in range(seg.nslots)]
        if (any(h.step == 2 and h.flags & FLAG_PINNED for h in hs) and any(h.state == WRITING for h in hs)
                and _last_saved(fault_env.log("trainer.log")) >= 3):
            return True
        os.kill(trainer.pid, signal.SIGCONT)  # the copy or the persist ended just before: try the next one
        return False

    wait_for(mid_copy_while_persisting, 120, "the trainer to be caught mid-copy while step 2 is persisted")
    newest = _last_saved(fault_env.log("trainer.log"))  # its snapshot completed before this copy began
    kill9(trainer.pid)
    release_persist(hold)  # the persist of step 2 fails (a broken pipe); the newest snapshot is what matters

    engine = CheckpointEngine(ckpt, max_to_keep=0)  # the restarted trainer
    try:
        sd = engine.load()
        assert (engine.last_load.source, engine.last_load.step) == ("memory", newest), \
            f"loaded step {engine.last_load.step} from {engine.last_load.source}; the newest snapshot was {newest}"
        assert_state_of(sd, newest, MB)
        del sd
        # The saver's last words commit the newest snapshot; then no persist holds a slot and, after the
        # hold period, the spares' memory is given back: two slots' worth stays reserved.
        wait_for(lambda: committed(ckpt, newest), 120, f"the last words to commit step {newest}")
        try:
            engine.wait(timeout=120)
        except PersistError as e:  # the held persist's failure, when it came after this engine attached
            assert "step 2 " in str(e) and "Broken pipe" in str(e), e
        assert tracker_step(ckpt) == newest
        spares = seg.nslots - 2
        wait_for(lambda: seg.reserved_bytes() == seg.size - spares * (seg.slot_size - PAGE), 60,
                 "the saver to give the spare slots' memory back")
        assert sum(bool(seg.header(i).flags & FLAG_UNRESERVED) for i in range(seg.nslots)) == spares
    finally:
        close_and_wait(engine)
    seg.close()


# ------------------------------------------------------------------------------- the newest save wins
def _sd(step: int, tag: float) -> dict:
    return {"w": torch.full((1024,), tag), "step": step, "tag": tag}


def test_memory_the_newest_save_of_a_step_wins_and_a_lower_step_starts_a_new_timeline(make_engine) -> None:
    """In memory: step 5 saved twice loads the second content; after 40, then 30 and 31 (a rollback),
    a restarted process loads 31, not 40 from the abandoned timeline."""
    eng = make_engine(max_to_keep=0)
    for step, tag in ((4, 4.0), (5, 5.0), (5, 5.5)):
        eng.save(step, _sd(step, tag), storage_type=StorageType.MEMORY)
    got = eng.load()
    assert (eng.last_load.source, eng.last_load.step, got["tag"]) == ("memory", 5, 5.5)
    assert eng.memory_steps()[0] == 5
    for step in (40, 30, 31):
        eng.save(step, _sd(step, float(step)), storage_type=StorageType.MEMORY)
    assert eng.memory_steps() == [31, 30]  # 40 and both 5s are superseded by the new timeline
    eng.close(release=False)  # a crash-like exit: the snapshots stay for the restarted process
    eng2 = make_engine(max_to_keep=0)
    got = eng2.load()
    assert (eng2.last_load.source, eng2.last_load.step, got["tag"]) == ("memory", 31, 31.0)
    eng2.close()


def test_storage_the_newest_commit_wins(make_engine, ckpt_dir, runtime_dir) -> None:
    """On storage: 40, then 30 and 31 (31 saved twice) committed in that order: a new process (memory
    gone) loads the second 31; the tracker names 31 and 40 is the oldest commit."""
    from helpers import wait_savers_gone

    eng = make_engine(max_to_keep=0)
    for step, tag in ((40, 40.0), (30, 30.0), (31, 31.0), (31, 31.5)):
        eng.save(step, _sd(step, tag), storage_type=StorageType.DISK)
        eng.wait(timeout=60)
    eng.close()
    wait_savers_gone(runtime_dir)
    eng2 = make_engine(max_to_keep=0)
    got = eng2.load()
    assert (eng2.last_load.source, eng2.last_load.step, got["tag"]) == ("storage", 31, 31.5)
    assert eng2.committed_steps() == [40, 30, 31]
    assert eng2.layout.tracker_step() == 31 and eng2.layout.verify(31) == []
    eng2.close()
