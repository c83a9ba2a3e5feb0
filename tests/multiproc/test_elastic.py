"""Elastic jobs (issue #33): a job under ``flashckpt-run --nnodes MIN:MAX`` that loses a node and goes on with
fewer, or that a fresh node joins, resumes from the memory of the nodes it has, resharded to the new number of
ranks: each rank reads the old ranks' snapshots it needs from its own node's memory (its own, a backup of a
lost partner's) or fetched from the peer holding them. Simulated nodes as in ``test_multinode.py`` (a mount
namespace with a private /dev/shm each, one ``flashckpt-run`` each, c10d rendezvous on loopback).

The training's data depends on the number of ranks, so a resumed run cannot end with an uninterrupted run's
weights; instead the example emits the digest of the unsharded training state (weights and optimizer) after
every save and at the resume (``--state_digests``): the state a smaller or larger job resumes must be, bit for
bit, the state the old job saved at that step.

1. FSDP2, 2 nodes -> 1 (node 1 lost, not replaced): the survivor resumes from memory at the newest step of
   which it holds node 1's backup, resharded, trains on and commits, and gives the old layout's memory (node 1's
   backup) back once a step of the new one is committed;
2. DDP (replicated state), 2 nodes -> 1: from memory, any copy; megatron-core with its distributed optimizer,
   2 nodes -> 1 (data-parallel size 2 -> 1): from memory, resharded by megatron-core (``--extended``, as 2);
3. FSDP2, 4 nodes -> 3 -> 4 (``--extended``, as 4): one node lost, the three go on from memory; a fresh node joins
   and the four go on from memory again;
4. both nodes of a backup pair lost (4 -> 2, ``--extended``): the pair's shards are held nowhere: storage, with
   the log line that says why.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
from _nodes import (  # noqa: F401
    DDP_TRAIN,
    FSDP_TRAIN,
    MEGATRON_TRAIN,
    Cluster,
    cluster,
    committed_steps,
    first_step_after,
    memory_step,
)

STEPS = 30
PERSIST_EVERY = 10
KILL_AT = 15
ARGS = ["--steps", str(STEPS), "--dim", "64", "--layers", "2", "--vocab", "512",
        "--save_storage_interval", str(PERSIST_EVERY), "--step_sleep", "0.15"]
# megatron-core with its distributed optimizer: each rank snapshots its shard of Adam's state (dp_reshardable),
# resharded by megatron-core's own planner to the new data-parallel size (its digests: the weights)
MEGATRON_ARGS = ["--steps", str(STEPS), "--save_storage_interval", str(PERSIST_EVERY), "--step_sleep", "0.15"]
# The rendezvous of the smaller world closes soon after the survivors arrive (torch's default waits 30 s for
# more nodes); keep-alive and failure detection are flashckpt-run's defaults.
RDZV = "last_call_timeout=2"
PAIRS = {"FLASHCKPT_REPLICA_GROUP_SIZE": "2", "FLASHCKPT_REPLICA_STRIDE": "2"}


def _saved_digest(c: Cluster, step: int, world: int, before: float) -> str:
    """The digest of the unsharded state the ``world``-rank job saved at ``step`` (rank 0's ``state`` event)."""
    got = [e["state_digest"] for e in c.all_events("state") if e["t"] < before and e.get("rank") == 0
           and e["step"] == step and e.get("world") == world]
    c.check(got, f"the {world}-rank job's state digest of step {step}")
    return got[-1]


def _resumed(c: Cluster, after: float, world: int) -> dict[int, dict]:
    """Every rank's resume after ``after`` by a job of ``world`` ranks (the last one per rank)."""
    res = {r: e for r, e in c.resumes(after).items() if e.get("world") == world}
    c.check(sorted(res) == list(range(world)), f"every rank of the {world}-rank job resumed: {c.resumes(after)}")
    return res


def _check_from_memory(c: Cluster, res: dict[int, dict], step: int, digest: str, *, sharded: bool) -> None:
    got = {r: (e.get("source"), e.get("step")) for r, e in sorted(res.items())}
    c.check(all(v == ("memory", step) for v in got.values()), f"every rank resumes from memory at step {step}: {got}")
    if sharded:
        c.check(res[0].get("state_digest") == digest,
                f"the resumed state equals the state saved at step {step}: {res[0].get('state_digest')} != {digest}")


def _report(request: pytest.FixtureRequest, **values: object) -> None:
    for k, v in values.items():
        request.node.user_properties.append((k, v))
    print(f"{request.node.name}: " + ", ".join(f"{k}={v}" for k, v in values.items()))


def _lose(c: Cluster, lost: list[int], *, replicated: bool) -> float:
    c.wait_for(lambda: PERSIST_EVERY in committed_steps(c.ckpt_dir), 150, f"step {PERSIST_EVERY} to be committed")
    if replicated:
        c.wait_saved(lost, KILL_AT, timeout=150)
    else:
        c.wait_backed_up(lost, KILL_AT, timeout=150)
    return c.kill_nodes(lost)


@pytest.mark.parametrize("kind", ["fsdp", "ddp", "megatron-distopt"])
def test_a_node_lost_and_not_replaced_the_survivor_goes_on_from_memory(cluster: Cluster, request, kind) -> None:  # noqa: F811
    if kind == "megatron-distopt" and importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron.core is not installed")
    sharded = kind != "ddp"
    script = {"fsdp": FSDP_TRAIN, "ddp": DDP_TRAIN, "megatron-distopt": MEGATRON_TRAIN}[kind]
    args = ([*MEGATRON_ARGS, "--distributed-optimizer"] if kind == "megatron-distopt" else ARGS)
    extra = ["--state_digests"] if sharded else []
    cluster.launch(script, 2, [*args, *extra], nnodes_spec="1:2", rdzv_conf=RDZV)
    t_kill = _lose(cluster, [1], replicated=not sharded)
    rcs = cluster.wait_exit([0], timeout=240)
    res = _resumed(cluster, t_kill, 1)
    newest = memory_step(cluster, [1], res[0]["t"], replicated=not sharded)
    digest = _saved_digest(cluster, newest, 2, t_kill) if sharded else ""
    committed = committed_steps(cluster.ckpt_dir)
    kill_to_step = first_step_after(cluster, t_kill) - t_kill
    _report(request, newest_snapshot=newest, resumed={r: (e["source"], e["step"]) for r, e in res.items()},
            kill_to_first_step_s=round(kill_to_step, 2), committed=committed, exit_codes=rcs)
    cluster.check(rcs == [0], f"the survivor's launcher exits 0 after training: {rcs}")
    _check_from_memory(cluster, res, newest, digest, sharded=sharded)
    if sharded:
        text = cluster.all_text()
        cluster.check("event=reshard_plan" in text and "from_ranks=2 to_ranks=1" in text,
                      "the decision is logged (event=reshard_plan ... from_ranks=2 to_ranks=1)")
    cluster.check(max(committed) == STEPS, f"training went on on one node and committed step {STEPS}: {committed}")
    if kind == "fsdp":  # node 1's shard (its backup on node 0) goes once a step of the one-rank job is committed
        released = [ln for ln in cluster.all_text().splitlines() if "event=layout_released world=1" in ln]
        cluster.check(released and "bak-r00001" in released[0],
                      f"node 0 gives back the 2-rank layout's memory (rank 1's backup) after a commit: {released}")


def _four_nodes(c: Cluster, lost: list[int]) -> float:
    c.launch(FSDP_TRAIN, 4, [*ARGS, "--state_digests"], env=PAIRS, start_timeout=90, nnodes_spec=f"{4 - len(lost)}:4",
             rdzv_conf=RDZV)
    return _lose(c, lost, replicated=False)


def test_four_nodes_shrink_to_three_then_grow_back_from_memory(cluster: Cluster, request) -> None:  # noqa: F811
    t_kill = _four_nodes(cluster, [3])
    res3 = cluster.wait_for(lambda: _maybe_resumed(cluster, t_kill, 3), 120, "the three nodes to resume")
    newest = memory_step(cluster, [3], res3[0]["t"], replicated=False)
    _check_from_memory(cluster, res3, newest, _saved_digest(cluster, newest, 4, t_kill), sharded=True)
    # a fresh node joins: the next rendezvous makes the job four ranks again, from memory
    cluster.wait_for(lambda: [e for e in cluster.all_events("state", after=res3[0]["t"]) if e.get("world") == 3
                              and e["step"] > newest + 2], 90, "the three-rank job to save a few steps")
    t_join = time.time()
    cluster.start_node(3)
    rcs = cluster.wait_exit(timeout=300)
    res4 = _resumed(cluster, t_join, 4)
    step4 = res4[0]["step"]
    _check_from_memory(cluster, res4, step4, _saved_digest(cluster, step4, 3, t_join + 60), sharded=True)
    _report(request, shrink=(newest, res3[0]["source"]), grow=(step4, res4[0]["source"]), exit_codes=rcs,
            committed=committed_steps(cluster.ckpt_dir))
    cluster.check(all(rc == 0 for rc in rcs), f"every launcher exits 0: {rcs}")
    cluster.check(max(committed_steps(cluster.ckpt_dir)) == STEPS, "training went on and committed the last step")


def _maybe_resumed(c: Cluster, after: float, world: int) -> dict[int, dict] | None:
    res = {r: e for r, e in c.resumes(after).items() if e.get("world") == world}
    return res if sorted(res) == list(range(world)) else None


def test_both_nodes_of_a_pair_lost_the_job_shrinks_to_storage_and_says_why(cluster: Cluster, request) -> None:  # noqa: F811
    t_kill = _four_nodes(cluster, [1, 3])
    rcs = cluster.wait_exit([0, 2], timeout=240)
    res = _resumed(cluster, t_kill, 2)
    got = {r: (e.get("source"), e.get("step")) for r, e in sorted(res.items())}
    _report(request, resumed=got, committed=committed_steps(cluster.ckpt_dir), exit_codes=rcs)
    cluster.check(all(v[0] == "storage" for v in got.values()), f"every rank resumes from storage: {got}")
    cluster.check("no node holds the snapshots of ranks [1, 3]" in cluster.all_text(),
                  "the log says which ranks no node holds")
    cluster.check(rcs == [0, 0], f"the two survivors exit 0: {rcs}")
