"""Retention: the strategies as pure functions, and applied by the engine after commits, never to the newest
committed step, with their state derived from storage (so they carry over a restart)."""

from __future__ import annotations

import os

import pytest
import torch
from flashckpt import CheckpointDeletionStrategy, KeepLatestStepStrategy, KeepStepIntervalStrategy, StorageType
from flashckpt.commit.layout import CommitLayout
from flashckpt.storage.posix import PosixDiskStorage
from helpers import assert_same_tree, wait_savers_gone

DISK = StorageType.DISK
MEMORY = StorageType.MEMORY


def sd(step: int) -> dict:
    return {"w": torch.full((16,), float(step)), "step": step}


def layout(ckpt: str) -> CommitLayout:
    return CommitLayout(ckpt, PosixDiskStorage())


def step_dirs(ckpt: str) -> list[str]:
    return sorted(n for n in os.listdir(ckpt) if n.startswith("step_"))


class DeleteEverything(CheckpointDeletionStrategy):
    """A careless custom strategy: asks to delete every committed step."""

    def steps_to_delete(self, committed_steps):
        return list(committed_steps)


# ------------------------------------------------------------------------------------------ pure
@pytest.mark.parametrize("keep, steps, doomed", [
    (2, [1, 2, 3, 4], [1, 2]),
    (2, [4, 1, 3, 2], [4, 1]),  # commit order, not step order: the two committed last stay
    (3, [5, 9], []),
    (1, [7], []),
    (1, [], []),
])
def test_keep_latest_step_strategy(keep, steps, doomed):
    assert KeepLatestStepStrategy(keep, "/ckpt").steps_to_delete(steps) == doomed


@pytest.mark.parametrize("interval, steps, doomed", [
    (3, [1, 2, 3, 4, 5, 6, 7], [1, 2, 4, 5]),  # keeps 3 and 6, and 7 as the newest
    (5, [1, 2], [1]),
    (10, [10, 20, 25], []),
    (2, [3], []),
])
def test_keep_step_interval_strategy(interval, steps, doomed):
    assert KeepStepIntervalStrategy(interval, "/ckpt").steps_to_delete(steps) == doomed


def test_strategies_refuse_nonsense_arguments():
    with pytest.raises(ValueError):
        KeepLatestStepStrategy(0)
    with pytest.raises(ValueError):
        KeepStepIntervalStrategy(0)
    with pytest.raises(TypeError):
        CheckpointDeletionStrategy()  # abstract


def test_clean_up_never_deletes_the_newest_step():
    deleted = []
    DeleteEverything().clean_up(9, deleted.append, committed_steps=[3, 5, 7])
    assert deleted == [3, 5, 7]
    deleted.clear()
    KeepLatestStepStrategy(2).clean_up(4, deleted.append, committed_steps=[1, 2, 3])
    assert deleted == [1, 2]


# ------------------------------------------------------------------------------------------ applied
def test_interval_strategy_applied_after_commits(make_engine, ckpt_dir):
    eng = make_engine(deletion_strategy=KeepStepIntervalStrategy(3, ckpt_dir))
    for step in range(1, 8):
        eng.save(step, sd(step), storage_type=DISK)
    eng.wait(60)
    assert layout(ckpt_dir).committed_steps() == [3, 6, 7]
    assert step_dirs(ckpt_dir) == ["step_3", "step_6", "step_7"]
    assert sorted(os.listdir(os.path.join(layout(ckpt_dir).meta, "steps"))) == [f"{s:012d}" for s in (3, 6, 7)]
    for step in (3, 6, 7):
        assert layout(ckpt_dir).verify(step) == []
        assert_same_tree(sd(step), eng.load(resume_path=f"step_{step}/rank_00000.pt"))
    eng.close()


def test_newest_committed_step_is_never_deleted(make_engine, ckpt_dir):
    eng = make_engine(deletion_strategy=DeleteEverything())
    for step in (1, 2, 3):
        eng.save(step, sd(step), storage_type=DISK)
        eng.wait(60)
        assert layout(ckpt_dir).committed_steps() == [step]
    # The saver enforces it too, whoever asks.
    assert eng._link.client.call("delete_steps", steps=[3])["deleted"] == []
    assert eng._link.client.call("delete_steps", steps=[99])["deleted"] == []  # not a committed step
    assert layout(ckpt_dir).committed_steps() == [3] and layout(ckpt_dir).tracker_step() == 3
    assert_same_tree(sd(3), eng.load(resume_path="step_3/rank_00000.pt"))
    eng.close()


def test_delete_steps_lets_a_framework_delete_its_newest_checkpoint_through_the_saver(make_engine, ckpt_dir):
    """What the HF Trainer (save_total_limit=1 keeps only the best) and Lightning (removing a checkpoint)
    need: the newest committed step goes only when asked for by name, and the tracker follows."""
    eng = make_engine(max_to_keep=0)
    for step in (1, 2, 3):
        eng.save(step, sd(step), storage_type=DISK)
    eng.wait(60)
    assert eng.delete_steps([3]) == []  # the newest is kept unless newest=True
    assert eng.delete_steps([3, 2, 99], newest=True) == [3, 2]  # 99: not committed, left alone
    assert layout(ckpt_dir).committed_steps() == [1] == eng.committed_steps()
    assert layout(ckpt_dir).tracker_step() == 1 and step_dirs(ckpt_dir) == ["step_1"]
    assert_same_tree(sd(1), eng.load(resume_path="step_1/rank_00000.pt"))
    eng.save(4, sd(4), storage_type=DISK)  # the saver's own record of what is committed followed
    eng.wait(60)
    assert layout(ckpt_dir).committed_steps() == [1, 4] and layout(ckpt_dir).tracker_step() == 4
    eng.close()


def test_retention_state_comes_from_storage_across_a_restart(make_engine, ckpt_dir, runtime_dir):
    first = make_engine(max_to_keep=3)
    for step in (1, 2, 3):
        first.save(step, sd(step), storage_type=DISK)
    first.wait(60)
    first.close()
    wait_savers_gone(runtime_dir)
    assert layout(ckpt_dir).committed_steps() == [1, 2, 3]

    # A new engine knows nothing in memory about steps 1-3: after its first commit, retention still
    # counts them, because it reads the committed steps from storage.
    second = make_engine(max_to_keep=2)
    second.save(4, sd(4), storage_type=DISK)
    second.wait(60)
    assert layout(ckpt_dir).committed_steps() == [3, 4]
    assert step_dirs(ckpt_dir) == ["step_3", "step_4"]
    second.save(5, sd(5), storage_type=DISK)
    second.wait(60)
    assert layout(ckpt_dir).committed_steps() == [4, 5]
    second.close()


def test_an_engine_that_only_loads_deletes_nothing(make_engine, ckpt_dir, runtime_dir):
    first = make_engine(max_to_keep=0)
    for step in (1, 2, 3):
        first.save(step, sd(step), storage_type=DISK)
    first.wait(60)
    first.close()
    wait_savers_gone(runtime_dir)

    # The default max_to_keep=1 must not cost the user the checkpoints that were there before: an
    # engine constructed to load (and one that only snapshots to memory) deletes nothing.
    reader = make_engine()
    assert_same_tree(sd(3), reader.load())
    reader.save(4, sd(4), storage_type=MEMORY)
    reader.wait(60)
    assert layout(ckpt_dir).committed_steps() == [1, 2, 3]
    # Its first own commit applies retention over everything on storage.
    reader.save(5, sd(5), storage_type=DISK)
    reader.wait(60)
    assert layout(ckpt_dir).committed_steps() == [5]
    reader.close()


def test_retention_keeps_the_step_just_committed_after_a_rollback(make_engine, ckpt_dir, runtime_dir):
    """max_to_keep=1: 100 committed, then 50 (the job rolled back): 50 is kept and loads, 100 goes."""
    eng = make_engine(max_to_keep=1)
    eng.save(100, sd(100), storage_type=DISK)
    eng.wait(timeout=60)
    eng.save(50, sd(50), storage_type=DISK)
    eng.wait(timeout=60)
    assert layout(ckpt_dir).committed_steps() == [50]
    assert step_dirs(ckpt_dir) == ["step_50"]
    eng.close()
    wait_savers_gone(runtime_dir)
    eng2 = make_engine(max_to_keep=1)
    assert_same_tree(sd(50), eng2.load())
    assert eng2.last_load.source == "storage" and eng2.last_load.step == 50
    eng2.close()
