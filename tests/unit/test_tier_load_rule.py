"""Which step a load takes from the node-local tiers of a multi-node job (``engine.tiers``): each rank proposes
its newest intact local step when the checkpoint dir has nothing newer (``local_candidate``), and the ranks
take it only when every one proposed the same (``common_step``); else each reads the checkpoint dir's newest,
from its own local copy where it holds one (``local_copy``). Two nodes of one rank each, node 0 with rank 0,
their local dirs and a durable dir on this file system (the collective's min/max is ``common_step`` over the
ranks' proposals, made here in one process)."""

from __future__ import annotations

import os
from typing import Any

from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.protocol import commit_step
from flashckpt.commit.tiers import DURABLE_ROOT, local_layout
from flashckpt.engine.tiers import common_step, local_candidate, local_copy
from flashckpt.storage.posix import PosixDiskStorage


class Job:
    """A durable dir and two nodes' local tiers (node r holds rank r's files)."""

    def __init__(self, tmp: Any) -> None:
        self.durable = CommitLayout(str(tmp / "durable"), PosixDiskStorage())
        self.local = [local_layout(str(tmp / f"node{r}")) for r in range(2)]
        for d in (self.durable, *self.local):
            os.makedirs(d.root)

    def commit_local(self, node: int, step: int) -> None:
        """Node ``node``'s local commit of ``step`` (its rank's file, snapshot taken at wall time ``step``)."""
        tier = self.local[node]
        rec = tier.storage.write_bytes(os.path.join(tier.root, f"step_{step}", f"rank_{node}.pt"), b"%d" % step)
        tier.write_done(step, node, [rec], saved_at=float(step))
        commit_step(tier, step, [node], 2, replicated=False, timeout=5,
                    extra={"tier_ranks": [node], DURABLE_ROOT: self.durable.root})

    def commit_durable(self, step: int) -> None:
        """``step`` on the durable tier with both ranks' files."""
        for r in range(2):
            rec = self.durable.storage.write_bytes(os.path.join(self.durable.root, f"step_{step}", f"rank_{r}.pt"),
                                                   b"%d" % step)
            self.durable.write_done(step, r, [rec], saved_at=float(step))
        commit_step(self.durable, step, [0, 1], 2, replicated=False, extra={}, timeout=5)

    def agreed(self, exclude: frozenset[int] = frozenset()) -> int | None:
        committed = self.durable.committed_steps()
        return common_step([local_candidate(self.local[r], self.durable, committed, r, exclude) for r in range(2)])

    def reads_locally(self, step: int) -> list[bool]:
        """Per rank: whether it reads the checkpoint dir's ``step`` from its local copy."""
        return [local_copy(self.local[r], step, r, self.durable.root) for r in range(2)]


def test_every_rank_holding_the_newer_step_locally_loads_it(tmp_path: Any) -> None:
    job = Job(tmp_path)
    for step in (10, 20):
        for node in range(2):
            job.commit_local(node, step)
    job.commit_durable(10)  # step 20 is committed on both local tiers, its durable commit not done yet
    assert job.agreed() == 20


def test_a_rank_never_loads_a_local_step_another_rank_lacks(tmp_path: Any) -> None:
    """Node 1 was lost between its local commits: node 0 holds step 20, node 1 only step 10 (the durable
    newest): no rank loads 20, each reads 10 from its own local copy."""
    job = Job(tmp_path)
    for node in range(2):
        job.commit_local(node, 10)
    job.commit_durable(10)
    job.commit_local(0, 20)
    assert job.agreed() is None
    assert job.reads_locally(10) == [True, True]


def test_a_replaced_node_reads_the_durable_tier_and_the_others_their_local_copy(tmp_path: Any) -> None:
    job = Job(tmp_path)
    job.commit_local(0, 10)
    job.commit_durable(10)  # node 1's local dir was wiped (a fresh machine)
    assert job.agreed() is None
    assert job.reads_locally(10) == [True, False]


def test_a_damaged_or_excluded_local_copy_is_not_proposed(tmp_path: Any) -> None:
    job = Job(tmp_path)
    for step in (10, 20):
        for node in range(2):
            job.commit_local(node, step)
    job.commit_durable(10)
    assert job.agreed(exclude=frozenset({20})) == 10  # 20 found damaged by a load: the ranks take 10
    with open(os.path.join(job.local[1].root, "step_20", "rank_1.pt"), "wb") as f:
        f.write(b"xx")  # same size, other bytes
    assert job.agreed() is None
    assert job.reads_locally(10) == [True, True]


def test_a_local_step_older_than_the_durable_newest_is_not_proposed(tmp_path: Any) -> None:
    """The checkpoint dir has a newer step than any local tier (committed by a job whose local tiers were
    elsewhere): the ranks load it from the durable tier, not their older local step."""
    job = Job(tmp_path)
    for node in range(2):
        job.commit_local(node, 10)
    job.commit_durable(10)
    job.commit_durable(30)
    assert job.agreed() is None
    assert job.reads_locally(30) == [False, False]
