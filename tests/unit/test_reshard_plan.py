"""The rule of a resharded resume from memory (``transport.peers.reshard_plan``): from what every node holds
(own snapshots, fetched copies, backups of other nodes, each saved by a job of some number of ranks), the newest
step saved by another number of ranks than the job has now of which every old rank's snapshot is on some node,
not older than the newest commit; one step and one number of ranks for every rank's state, never a mix.

Property-based: ``hypothesis`` generates what the nodes hold (several old layouts, steps, holes, duplicates,
commits) and the rule is checked against a brute-force reading of its definition."""

from __future__ import annotations

from typing import Any

from flashckpt.transport.peers import reshard_plan
from hypothesis import given, settings
from hypothesis import strategies as st


def entry(rank: int, step: int, world: int, *, kind: str = "own", t: float | None = None) -> dict[str, Any]:
    return {"rank": rank, "step": step, "world": world, "kind": kind, "wall_time": float(step) if t is None else t,
            "local_rank": 0 if kind == "own" else -1}


def node(i: int, held: list[dict[str, Any]]) -> dict[str, Any]:
    return {"node": i, "instance": f"n{i}", "host": "127.0.0.1", "port": 4000 + i, "held": held}


def test_a_lost_node_whose_partner_holds_its_shard_is_served_from_the_backup() -> None:
    # 4 nodes of one rank, pairs {0,2} {1,3}; node 3 lost: its rank 3 is a backup on node 1.
    nodes = [node(0, [entry(0, 23, 4), entry(2, 23, 4, kind="backup")]),
             node(1, [entry(1, 23, 4), entry(3, 23, 4, kind="backup")]),
             node(2, [entry(2, 23, 4), entry(0, 23, 4, kind="backup")])]
    plan = reshard_plan(nodes, world_size=3, newest_committed=20, committed_world=4, saved_at={})
    assert (plan.step, plan.world) == (23, 4)
    assert [h["node"] for h in plan.sources[3]] == [1]
    assert [h["kind"] for h in plan.sources[2]] == ["own", "backup"]  # own copies are read first


def test_a_shard_held_nowhere_gives_no_step_and_names_the_missing_ranks() -> None:
    nodes = [node(0, [entry(0, 23, 4), entry(2, 23, 4, kind="backup")]),
             node(2, [entry(2, 23, 4), entry(0, 23, 4, kind="backup")])]
    plan = reshard_plan(nodes, world_size=2, newest_committed=20, committed_world=4, saved_at={})
    assert plan.step is None and plan.partial == (4, 23) and plan.missing == (1, 3)


def test_the_newest_step_every_rank_has_wins_over_a_newer_partial_one() -> None:
    # step 24 reached only node 0 (rank 1's snapshot of it died with node 1 before its backup was sent)
    nodes = [node(0, [entry(0, 24, 2), entry(0, 23, 2), entry(1, 23, 2, kind="backup")])]
    plan = reshard_plan(nodes, world_size=1, newest_committed=-1, committed_world=0, saved_at={})
    assert (plan.step, plan.world) == (23, 2)


def test_this_jobs_own_layout_and_snapshots_older_than_the_newest_commit_are_not_resharded() -> None:
    nodes = [node(0, [entry(0, 30, 2), entry(1, 30, 2), entry(0, 23, 4), entry(1, 23, 4), entry(2, 23, 4),
                      entry(3, 23, 4)])]
    assert reshard_plan(nodes, world_size=2, newest_committed=-1, committed_world=0, saved_at={}).world == 4
    # a newer commit (by the 2-rank job) makes the 4-rank snapshot of step 23 stale
    assert reshard_plan(nodes, world_size=2, newest_committed=25, committed_world=2, saved_at={}).step is None
    # the same step committed by the same 4 ranks, from these very snapshots: not older
    four = [node(0, [entry(r, 23, 4) for r in range(4)])]
    saved_at = {str(r): 23.0 for r in range(4)}
    assert reshard_plan(four, world_size=3, newest_committed=23, committed_world=4, saved_at=saved_at).step == 23
    # ... but a commit of step 23 from a later save (a snapshot taken after these) is newer
    later = {str(r): 99.0 for r in range(4)}
    assert reshard_plan(four, world_size=3, newest_committed=23, committed_world=4, saved_at=later).step is None


@st.composite
def held_by_nodes(draw: Any) -> tuple[list[dict[str, Any]], int, int]:
    """Nodes holding snapshots of a few old layouts and steps, with holes; this job's number of ranks; the
    newest committed step."""
    worlds = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3, unique=True))
    steps = draw(st.lists(st.integers(0, 12), min_size=1, max_size=4, unique=True))
    nnodes = draw(st.integers(1, 4))
    nodes = []
    for i in range(nnodes):
        held = []
        for w in worlds:
            for s in steps:
                for r in range(w):
                    if draw(st.booleans()):
                        held.append(entry(r, s, w, kind=draw(st.sampled_from(["own", "backup"]))))
        nodes.append(node(i, held))
    return nodes, draw(st.integers(1, 5)), draw(st.integers(-1, 12))


@settings(max_examples=300, deadline=None)
@given(held_by_nodes())
def test_the_plan_is_the_newest_whole_step_of_another_layout_and_never_mixes(case: Any) -> None:
    nodes, world_size, newest_committed = case
    plan = reshard_plan(nodes, world_size=world_size, newest_committed=newest_committed, committed_world=0,
                        saved_at={})
    # brute force over the definition
    whole = set()
    for w in {e["world"] for n in nodes for e in n["held"]} - {world_size}:
        for s in {e["step"] for n in nodes for e in n["held"] if e["world"] == w and e["step"] >= newest_committed}:
            have = {e["rank"] for n in nodes for e in n["held"] if e["world"] == w and e["step"] == s}
            if have == set(range(w)):
                whole.add((s, w))
    if not whole:
        assert plan.step is None and plan.sources == {}
        return
    assert plan.step == max(s for s, _w in whole)
    assert (plan.step, plan.world) in whole and plan.world != world_size
    assert sorted(plan.sources) == list(range(plan.world))  # every old rank, each from a holder of that step
    for r, holders in plan.sources.items():
        assert holders
        for h in holders:
            n = next(n for n in nodes if n["instance"] == h["instance"])
            assert any(e["rank"] == r and e["step"] == plan.step and e["world"] == plan.world for e in n["held"])
