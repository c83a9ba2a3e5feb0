"""A rank loads its own state, or a clear refusal (issue #30, items 2 and 4), with real processes: ranks of
gloo groups launched as separate Python processes (``helpers.launch_ranks``), trainers that stay alive.

- Two ranks saved, three restart: the new rank has no file in the committed step, and nobody hands it rank
  0's; every rank refuses the same way (the plain engine loads each rank's own state).
- Memory snapshots saved by another number of ranks are never used by the plain engine, not even by the
  ranks that exist in both (a logged reason; storage decides).
- Two ranks restarted on one node with their local ranks the other way round: each finds its own snapshot
  (in the other local rank's segment), never the other rank's.
- A second training on the same job key, while the first lives: its ``load()`` never returns the first
  one's snapshots (a logged reason naming the writer; storage instead); a tool's ``SnapshotReader`` still
  reads them, and once the first one let go of them (closed, or died) they are the restart's to load.

The workers below run in the rank processes; they return JSON.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch
from helpers import launch_ranks, run_ranks, wait_for

pytestmark = pytest.mark.multiproc

# The snapshots outlive the gap between two runs of ranks, and stay memory-only (no last words persist them).
_KEEP_ENV = {"FLASHCKPT_SAVER_GRACE_S": "180", "FLASHCKPT_LAST_WORDS": "0"}


def rank_sd(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"w": torch.randn(64, generator=g), "rank": rank, "step": step}


def _whose(sd: Any) -> list[Any]:
    """(rank, step) the loaded state says it is, and whether it is bit for bit that state."""
    if not isinstance(sd, dict) or "rank" not in sd:
        return [None, None, False]
    return [sd["rank"], sd["step"], torch.equal(sd["w"], rank_sd(sd["step"], sd["rank"])["w"])]


# ------------------------------------------------------------------------------------------ workers
def save_worker(ckpt_dir: str, plan: list[list[Any]], release: bool) -> dict[str, Any]:
    """Saves ``plan`` ([step, "disk" | "memory"], ...) of this rank's state, waits for the persists, closes
    (``release=False``: the snapshots stay for a restart)."""
    import torch.distributed as dist
    from flashckpt import CheckpointEngine, StorageType

    rank = dist.get_rank() if dist.is_initialized() else 0
    eng = CheckpointEngine(ckpt_dir, max_to_keep=0)
    try:
        for step, kind in plan:
            eng.save(step, rank_sd(step, rank), storage_type=StorageType(kind))
        eng.wait(120)
        steps = eng.memory_steps()
    finally:
        eng.close(release=release)
    return {"memory_steps": steps}


def load_worker(ckpt_dir: str, swap_local_ranks: bool = False) -> dict[str, Any]:
    """Loads as a restarted rank would (the local ranks the other way round with ``swap_local_ranks``):
    whose state it got and where from, or the error it got; then closes for good."""
    import torch.distributed as dist
    from flashckpt import CheckpointEngine, FlashCheckpointError

    rank = dist.get_rank() if dist.is_initialized() else 0
    if swap_local_ranks:  # as RANK/LOCAL_RANK set by hand, or a launcher that numbers a node's ranks otherwise
        os.environ["LOCAL_RANK"] = str(int(os.environ["LOCAL_WORLD_SIZE"]) - 1 - rank)
    eng = CheckpointEngine(ckpt_dir, max_to_keep=0)
    out: dict[str, Any] = {"rank": rank, "local_rank": eng.ranks.local_rank}
    try:
        out["memory_steps"] = eng.memory_steps()
        try:
            sd = eng.load()
            out["got"] = _whose(sd)
            out["source"] = [eng.last_load.source, eng.last_load.step] if eng.last_load else None
        except FlashCheckpointError as e:
            out["error"] = [type(e).__name__, str(e)]
    finally:
        eng.close()
    return out


def swapped_last_words_worker(ckpt_dir: str) -> dict[str, Any]:
    """Restarted with the local ranks the other way round, before saving anything: the saver's last words
    (as ``flashckpt-run`` asks for them) must not persist the snapshots in a local rank's segments, which
    another rank saved, as the files of the rank now at that local rank. Then each rank loads."""
    import torch.distributed as dist
    from flashckpt import CheckpointEngine
    from flashckpt.transport import messages as M

    rank = dist.get_rank()
    os.environ["LOCAL_RANK"] = str(1 - rank)
    eng = CheckpointEngine(ckpt_dir, max_to_keep=0)
    out: dict[str, Any] = {"rank": rank}
    try:
        dist.barrier()  # every rank said hello: both are persisting clients of the saver
        if rank == 0:
            out["last_words"] = eng._client_call(M.LastWords(timeout_s=60)).step
        dist.barrier()
        out["committed"] = eng.committed_steps()
        if 7 in out["committed"]:  # the file the manifest names as this rank's
            (rec,) = eng.layout.read_manifest(7).files_for(rank)
            out["file_of_step_7"] = _whose(torch.load(eng.layout.abs(rec.path), weights_only=True))
        out["got"] = _whose(eng.load())
        out["source"] = [eng.last_load.source, eng.last_load.step] if eng.last_load else None
    finally:
        eng.close()
    return out


def hold_worker(ckpt_dir: str, workdir: str) -> dict[str, Any]:
    """A training that stays alive: commits step 1, snapshots step 2, says so (``holding``), and waits
    until told to close its engine keeping the snapshots (``close``: it then says ``closed``) and to exit
    (``exit``)."""
    from flashckpt import CheckpointEngine, StorageType

    def told(name: str) -> bool:
        return os.path.exists(os.path.join(workdir, name))

    def say(name: str) -> None:
        with open(os.path.join(workdir, name), "w") as f:
            f.write(str(os.getpid()))

    eng = CheckpointEngine(ckpt_dir, max_to_keep=0)
    try:
        eng.save(1, rank_sd(1, 0), storage_type=StorageType.DISK)
        eng.wait(120)
        eng.save(2, rank_sd(2, 0), storage_type=StorageType.MEMORY)
        say("holding")
        wait_for(lambda: told("close"), 300, "the test to say close")
    finally:
        eng.close(release=False)
    say("closed")
    wait_for(lambda: told("exit"), 300, "the test to say exit")
    return {}


# ------------------------------------------------------------------------------------------ item 2
def test_a_rank_without_state_in_the_committed_step_is_refused_on_every_rank(ckpt_dir, tmp_path):
    """Two ranks commit step 5; three restart. Rank 2 has no file in step 5: it never gets rank 0's, and
    every rank gets the same clear refusal (so no rank trains on while another one cannot)."""
    run_ranks(save_worker, 2, str(tmp_path / "two"), args={"ckpt_dir": ckpt_dir, "plan": [[5, "disk"]],
                                                            "release": True})
    results = run_ranks(load_worker, 3, str(tmp_path / "three"), args={"ckpt_dir": ckpt_dir})
    assert "error" in results[2], f"rank 2 loaded {results[2].get('got')} (rank, step, exact) from {results[2].get('source')}"
    for r in results:
        assert "error" in r, f"rank {r['rank']} loaded {r.get('got')} from {r.get('source')} instead of a refusal"
        name, msg = r["error"]
        assert name == "RankStateNotFoundError", r
        assert "step 5" in msg and "rank 2" in msg and "2 ranks" in msg and "3" in msg, msg


def test_memory_snapshots_of_another_number_of_ranks_are_never_used(ckpt_dir, tmp_path):
    """Two ranks commit step 3 and snapshot step 7 (kept for a restart). One rank restarts: it holds its own
    snapshot of step 7 in memory, but one saved by a job of two ranks: storage's step 3 (its own file)."""
    run_ranks(save_worker, 2, str(tmp_path / "two"), env=_KEEP_ENV,
              args={"ckpt_dir": ckpt_dir, "plan": [[3, "disk"], [7, "memory"]], "release": False})
    (one,) = run_ranks(load_worker, 1, str(tmp_path / "one"), env=_KEEP_ENV, args={"ckpt_dir": ckpt_dir})
    assert "error" not in one, one
    assert one["memory_steps"] == [], one
    assert one["source"] == ["storage", 3] and one["got"] == [0, 3, True], one


def test_a_step_of_more_ranks_is_verified_whole_by_the_fewer_ranks_loading_it(ckpt_dir, tmp_path, caplog):
    """Two ranks commit steps 3 and 5; rank 1's file of step 5 is damaged. One rank restarts: no rank of
    this job owns that file, yet an adapter that reshards would read it: rank 0 verifies it too, and step 5
    is passed over as damaged (its own state of step 3 loads)."""
    from flashckpt import CheckpointEngine

    run_ranks(save_worker, 2, str(tmp_path / "two"), args={"ckpt_dir": ckpt_dir, "plan": [[3, "disk"], [5, "disk"]],
                                                            "release": True})
    damaged = os.path.join(ckpt_dir, "step_5", "rank_00001.pt")
    with open(damaged, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    eng = CheckpointEngine(ckpt_dir, max_to_keep=0)
    try:
        with caplog.at_level(logging.WARNING, logger="flashckpt"):
            sd = eng.load()
        assert _whose(sd) == [0, 3, True], f"got {_whose(sd)} from {eng.last_load}"
        assert any(damaged in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        eng.close()


def test_swapped_local_ranks_each_load_their_own_snapshot(ckpt_dir, tmp_path):
    """Two ranks on one node snapshot step 7 (after committing step 3) and restart with the local ranks the
    other way round: each rank finds its own snapshot, in the other local rank's segment, and loads it."""
    run_ranks(save_worker, 2, str(tmp_path / "first"), env=_KEEP_ENV,
              args={"ckpt_dir": ckpt_dir, "plan": [[3, "disk"], [7, "memory"]], "release": False})
    results = run_ranks(load_worker, 2, str(tmp_path / "swapped"), env=_KEEP_ENV,
                        args={"ckpt_dir": ckpt_dir, "swap_local_ranks": True})
    for r in results:
        assert r["local_rank"] == 1 - r["rank"], r
        assert "error" not in r, r
        assert r["got"] == [r["rank"], 7, True], f"rank {r['rank']} got the state of rank {r['got'][0]}: {r}"
        assert r["source"] == ["memory", 7], r
        assert r["memory_steps"][0] == 7, r


def test_last_words_never_persist_another_ranks_snapshot_as_this_ones(ckpt_dir, tmp_path):
    """After a restart with the local ranks the other way round, each local rank's segments hold the other
    rank's snapshot of step 7: the saver's last words leave it alone (it is not the new rank's), and each
    rank then loads its own step 7 from memory."""
    run_ranks(save_worker, 2, str(tmp_path / "first"), env=_KEEP_ENV,
              args={"ckpt_dir": ckpt_dir, "plan": [[3, "disk"], [7, "memory"]], "release": False})
    results = run_ranks(swapped_last_words_worker, 2, str(tmp_path / "swapped"), env=_KEEP_ENV,
                        args={"ckpt_dir": ckpt_dir})
    for r in results:
        if "file_of_step_7" in r:
            assert r["file_of_step_7"][0] == r["rank"], f"rank {r['rank']}'s file of step 7 holds {r}"
        assert r["committed"] == [3], r
        assert r["got"] == [r["rank"], 7, True] and r["source"] == ["memory", 7], r
    assert results[0]["last_words"] is None


def test_across_nodes_only_copies_saved_by_this_number_of_ranks_count():
    """The multi-node agreement (memory_across_nodes, and a saver's last words) counts a rank's copy only when
    a job of this number of ranks saved it (the inventory says, per slot); replicated state: any copy."""
    from flashckpt.engine.agreement import across_nodes

    def node(i: int, world: int | None) -> dict[str, Any]:
        held = [{"rank": r, "step": 9, "wall_time": 9.0, "seq": 9, "kind": "own", "local_rank": r % 2}
                | ({} if world is None else {"world": world}) for r in (2 * i, 2 * i + 1)]
        return {"node": i, "instance": f"i{i}", "host": "127.0.0.1", "port": 1000 + i, "held": held}

    four = [node(0, 4), node(1, 4)]
    assert across_nodes(four, range(4), replicated=False, saved_at={}, newest_committed=-1, world_size=4).step == 9
    assert across_nodes(four, range(2), replicated=False, saved_at={}, newest_committed=-1, world_size=2).step is None
    unrecorded = [node(0, None), node(1, None)]  # an older peer's inventory
    assert across_nodes(unrecorded, range(4), replicated=False, saved_at={}, newest_committed=-1,
                        world_size=4).step is None
    assert across_nodes(four, range(2), replicated=True, saved_at={}, newest_committed=-1, world_size=2).step == 9


# ------------------------------------------------------------------------------------------ item 4
def test_a_second_training_never_resumes_from_the_first_ones_live_snapshot(ckpt_dir, tmp_path, caplog):
    """Training A (no job id) commits step 1, snapshots step 2 and lives on. Training B on the same dir:
    its load() gets step 1 from storage with a warning naming A's pid, never A's snapshot of step 2, and its
    save is refused as before. A tool's SnapshotReader reads step 2. Once A closed its engine (keeping the
    snapshots for a restart), the snapshot is a restart's to load, while A's process still runs."""
    from flashckpt import CheckpointEngine, SharedMemoryError, SnapshotReader, StorageType

    work = str(tmp_path / "a")
    a = launch_ranks(hold_worker, 1, work, dist=False, args={"ckpt_dir": ckpt_dir, "workdir": work})
    try:
        a.wait_until(lambda: os.path.exists(os.path.join(work, "holding")), 120, "training A to hold step 2")
        a_pid = a.procs[0].pid
        b = CheckpointEngine(ckpt_dir, max_to_keep=0)
        try:
            with caplog.at_level(logging.WARNING, logger="flashckpt"):
                sd = b.load()
            assert _whose(sd) == [0, 1, True], f"B got {_whose(sd)} from {b.last_load}"
            assert b.last_load is not None and (b.last_load.source, b.last_load.step) == ("storage", 1)
            said = [r.getMessage() for r in caplog.records if f"pid {a_pid}" in r.getMessage()]
            assert said, f"no warning names training A (pid {a_pid}): {[r.getMessage() for r in caplog.records]}"
            assert b.memory_steps() == [], "memory_steps() lists another live training's snapshots"
            with pytest.raises(SharedMemoryError, match=f"written by pid {a_pid}"):
                b.save(3, rank_sd(3, 0), storage_type=StorageType.MEMORY)
            with SnapshotReader(ckpt_dir) as tool:  # deliberately reading the live training's memory
                assert tool.memory_steps()[0] == 2 and _whose(tool.load()) == [0, 2, True]
            # A closes its engine keeping the snapshots (a planned restart) and its process lives on.
            open(os.path.join(work, "close"), "w").close()
            a.wait_until(lambda: os.path.exists(os.path.join(work, "closed")), 120, "training A to close")
            sd = b.load()
            assert _whose(sd) == [0, 2, True] and (b.last_load.source, b.last_load.step) == ("memory", 2)
        finally:
            b.close()
        open(os.path.join(work, "exit"), "w").close()
        a.wait(120)
    finally:
        a.kill()
