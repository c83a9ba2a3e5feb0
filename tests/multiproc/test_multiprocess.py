"""Several ranks as real processes on one node, joined by a gloo process group: the commit barrier,
agreement on the step to load, storage loads with all ranks verifying, and replicated (DDP) mode.

The workers below run in the rank processes (see helpers.run_ranks); they return JSON."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import run_ranks, wait_for

pytestmark = pytest.mark.multiproc


def rank_sd(step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"w": torch.randn(32, generator=g), "rank": rank, "step": step}


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and a["rank"] == b["rank"] and a["step"] == b["step"]


def _layout(ckpt_dir: str):
    from flashckpt.commit.layout import CommitLayout
    from flashckpt.storage.posix import PosixDiskStorage

    return CommitLayout(ckpt_dir, PosixDiskStorage())


def _wait_job_dir_gone(eng) -> None:
    wait_for(lambda: not os.path.exists(eng.job_dir), 60, "the saver to release its runtime dir")


# ------------------------------------------------------------------------------------------ workers
def commit_barrier_worker(ckpt_dir: str) -> dict:
    """Rank 0 persists step 5 first; the step must not commit until rank 1 has persisted too. Then the
    ranks hold different memory steps and must agree on the newest one they all have."""
    import torch.distributed as dist
    from flashckpt import CheckpointEngine, CheckpointTimeoutError, StorageType

    rank = dist.get_rank()
    layout = _layout(ckpt_dir)
    eng = CheckpointEngine(ckpt_dir, max_to_keep=0)
    out: dict = {}
    try:
        if rank == 0:
            eng.save(5, rank_sd(5, 0), storage_type=StorageType.DISK)
            mine = os.path.join(ckpt_dir, "step_5", "rank_00000.pt")
            wait_for(lambda: os.path.exists(mine), 60, "rank 0's file")
            out["committed_with_one_rank"] = layout.committed_steps()
            try:  # the saver must still be waiting for rank 1's file: wait() cannot finish
                eng.wait(timeout=1.0)
                out["wait_returned_early"] = True
            except CheckpointTimeoutError:
                out["wait_returned_early"] = False
        dist.barrier()
        if rank == 1:
            eng.save(5, rank_sd(5, 1), storage_type=StorageType.DISK)
        eng.wait(60)
        dist.barrier()
        m = layout.read_manifest(5)
        out["manifest_ranks"] = sorted(m.files)
        out["manifest_world_size"] = m.world_size
        out["verify"] = layout.verify(5)
        out["tracker"] = layout.tracker_step()
        out["my_file_ok"] = _same(torch.load(os.path.join(ckpt_dir, m.files[rank][0].path), weights_only=True),
                                  rank_sd(5, rank))

        # Different memory steps: rank 0 holds 6 and 7, rank 1 holds 5 and 6. Both must pick 6.
        for step in ((6, 7) if rank == 0 else (6,)):
            eng.save(step, rank_sd(step, rank), storage_type=StorageType.MEMORY)
        dist.barrier()
        out["memory_steps"] = eng.memory_steps()
        sd = eng.load()
        out["agreed"] = [eng.last_load.source, eng.last_load.step]
        out["agreed_ok"] = _same(sd, rank_sd(6, rank))
    finally:
        eng.close()
    return out


def four_rank_worker(ckpt_dir: str) -> dict:
    """All four ranks persist step 2; ranks 0-2 also snapshot step 3. They agree on step 2 from memory;
    after a final close, fresh engines load step 2 from storage."""
    import torch.distributed as dist
    from flashckpt import CheckpointEngine, StorageType

    rank = dist.get_rank()
    layout = _layout(ckpt_dir)
    out: dict = {}
    eng = CheckpointEngine(ckpt_dir, max_to_keep=1)
    try:
        eng.save(1, rank_sd(1, rank), storage_type=StorageType.DISK)
        eng.save(2, rank_sd(2, rank), storage_type=StorageType.DISK)
        eng.wait(60)
        dist.barrier()
        if rank != 3:
            eng.save(3, rank_sd(3, rank), storage_type=StorageType.MEMORY)
        dist.barrier()
        sd = eng.load()
        out["memory_load"] = [eng.last_load.source, eng.last_load.step, _same(sd, rank_sd(2, rank))]
        m = layout.read_manifest(2)
        out["manifest_ranks"] = sorted(m.files)
        out["verify"] = layout.verify(2)
        dist.barrier()
    finally:
        eng.close()
    if rank == 0:
        _wait_job_dir_gone(eng)
    dist.barrier()
    eng = CheckpointEngine(ckpt_dir, max_to_keep=1)
    try:
        out["memory_after_restart"] = eng.memory_steps()
        sd = eng.load()
        out["storage_load"] = [eng.last_load.source, eng.last_load.step, _same(sd, rank_sd(2, rank))]
        out["committed"] = layout.committed_steps()  # max_to_keep=1 removed step 1
    finally:
        eng.close()
    return out


def replicated_worker(ckpt_dir: str) -> dict:
    """DDP mode: only rank 0 snapshots and persists; every rank loads rank 0's copy."""
    import torch.distributed as dist
    from flashckpt import CheckpointEngine, StorageType
    from flashckpt.format.segment import segment_paths

    rank = dist.get_rank()
    layout = _layout(ckpt_dir)
    out: dict = {}
    eng = CheckpointEngine(ckpt_dir, replicated=True)
    try:
        out["roles"] = [eng.snapshots, eng.persists]
        # Give rank 1 different values: whatever it loads must be rank 0's copy.
        eng.save(4, rank_sd(4, rank), storage_type=StorageType.DISK)
        eng.wait(60)
        dist.barrier()
        out["rank1_segments"] = len(segment_paths(eng.job_dir, 1))
        sd = eng.load()
        out["memory_load"] = [eng.last_load.source, eng.last_load.step, _same(sd, rank_sd(4, 0))]
        m = layout.read_manifest(4)
        out["manifest"] = [sorted(m.files), m.replicated, [f.path for f in m.files[0]]]
        dist.barrier()
    finally:
        eng.close()
    if rank == 0:
        _wait_job_dir_gone(eng)
    dist.barrier()
    eng = CheckpointEngine(ckpt_dir, replicated=True)
    try:
        sd = eng.load()
        out["storage_load"] = [eng.last_load.source, eng.last_load.step, _same(sd, rank_sd(4, 0))]
    finally:
        eng.close()
    return out


# ------------------------------------------------------------------------------------------ tests
def test_two_ranks_commit_only_when_every_rank_persisted_and_agree_on_load(ckpt_dir, tmp_path):
    r0, r1 = run_ranks(commit_barrier_worker, 2, str(tmp_path / "ranks"), args={"ckpt_dir": ckpt_dir})
    assert r0["committed_with_one_rank"] == [], "step 5 was committed before rank 1 persisted"
    assert r0["wait_returned_early"] is False
    for r in (r0, r1):
        assert r["manifest_ranks"] == [0, 1] and r["manifest_world_size"] == 2
        assert r["verify"] == [] and r["tracker"] == 5 and r["my_file_ok"]
        assert r["agreed"] == ["memory", 6] and r["agreed_ok"]
    # The newest two; the spare slot, kept reserved for a while after a persist, may hold an older third.
    assert r0["memory_steps"][:2] == [7, 6] and r1["memory_steps"][:2] == [6, 5]


def test_four_ranks_persist_commit_and_load_from_memory_then_storage(ckpt_dir, tmp_path):
    results = run_ranks(four_rank_worker, 4, str(tmp_path / "ranks"), args={"ckpt_dir": ckpt_dir})
    for rank, r in enumerate(results):
        assert r["manifest_ranks"] == [0, 1, 2, 3] and r["verify"] == [], rank
        assert r["memory_load"] == ["memory", 2, True], rank  # rank 3 never snapshotted step 3
        assert r["memory_after_restart"] == [], rank
        assert r["storage_load"] == ["storage", 2, True], rank
        assert r["committed"] == [2], rank
    assert sorted(os.listdir(os.path.join(ckpt_dir, "step_2"))) == [f"rank_{r:05d}.pt" for r in range(4)]


def test_replicated_mode_rank0_persists_and_every_rank_loads_its_copy(ckpt_dir, tmp_path):
    r0, r1 = run_ranks(replicated_worker, 2, str(tmp_path / "ranks"), args={"ckpt_dir": ckpt_dir})
    assert r0["roles"] == [True, True] and r1["roles"] == [False, False]
    assert r0["rank1_segments"] == 0, "rank 1 wrote a snapshot in replicated mode"
    for r in (r0, r1):
        assert r["memory_load"] == ["memory", 4, True]
        assert r["manifest"] == [[0], True, ["step_4/checkpoint.pt"]]
        assert r["storage_load"] == ["storage", 4, True]
    assert os.listdir(os.path.join(ckpt_dir, "step_4")) == ["checkpoint.pt"]
