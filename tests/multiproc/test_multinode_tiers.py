"""Two simulated nodes of one rank each, each node with a local tier of its own (``flashckpt-run --local-dir``,
a directory of the node's; ``tests/support/_nodes.py``), one shared durable checkpoint dir (issue #32):

1. the multi-node commit per tier: while FSDP training runs with a ``save(DISK)`` every few steps, each node's
   local dir holds its own local commits (its rank's files only), the durable dir gets each step committed
   with both ranks' files, after both nodes' local commits of it (the lag is reported: ``event=commit ...
   tier=durable lag_s=``), ``flashckpt ls DIR --local-dir L`` shows which tiers hold each step, and at the
   normal end no survivor's last words take over rank 0's commit of a step already committed;
2. a node lost whole, its local dir with it, and a fresh node joining: the job resumes from memory (the
   cross-node replica), bit exact, and goes on committing on both tiers, the fresh node's local tier
   starting empty;
3. both nodes' memory lost at once (the rendezvous store outside the nodes), their local dirs kept: the
   restarted job (DDP, ``engine.load()``) loads the newest step every rank has (the durable tier's newest: a
   newer step held on one node's local tier only is not one every rank has, until that node's next saver
   uploads and commits it, its catch-up, which may come before the ranks look), each rank from its node's local
   tier where that holds it (replicated state: global rank 0 alone writes files, so its node's), else from
   the durable tier, bit exact; then both tiers go on committing. (The FSDP adapter's
   ``get_storage_reader`` reads DCP checkpoints from the durable tier only: not this scenario's subject.)

The ranks follow the nodes: node i's agent starts after node i-1's, and the rendezvous ranks them in that
order, so rank i is node i's (checked from the nodes' events).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from typing import Any

from _fault_helpers import run_cli
from _nodes import DDP_TRAIN, FSDP_TRAIN, Cluster, cluster, committed_steps, reference_digest  # noqa: F401
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.tiers import local_layout
from flashckpt.storage.posix import PosixDiskStorage
from test_multinode import (  # the scenarios' training (its reference runs are shared) and checks
    _LOG_TIME,
    ARGS,
    PERSIST_EVERY,
    STEPS,
    _check_digest,
    _check_exit_codes,
    _check_resumed,
    _first_step_after,
    _log_time,
    _memory_step,
    _report,
    _wait_before_loss,
)

PERSISTS = list(range(PERSIST_EVERY, STEPS + 1, PERSIST_EVERY))  # the steps saved with save(DISK)
# each node's local tier keeps the 2 newest (FLASHCKPT_LOCAL_KEEP's default); the durable tier keeps every step


def _local_dir(c: Cluster, i: int) -> str:
    """Node ``i``'s local tier: a directory of its own (outside its private /dev/shm, so that it can outlive
    the node's memory; a lost node's is removed by the test)."""
    return os.path.join(c.tmp, f"node{i}-local")


def _launch(c: Cluster, script: str, args: list[str], **kw: Any) -> None:
    c.launch(script, 2, args, agent_args={i: ["--local-dir", _local_dir(c, i)] for i in range(2)}, **kw)


def _node_ranks(c: Cluster) -> dict[int, int]:
    """Node -> the rank its worker had (one rank per node; the newest start's: its last event's)."""
    out = {}
    for n in c.nodes:
        evs = c.events(n.index)
        c.check(evs, f"node {n.index}'s worker reported events")
        out[n.index] = int(evs[-1]["rank"])
    return out


def _local_steps(c: Cluster, i: int) -> list[int]:
    return local_layout(_local_dir(c, i)).committed_steps()


def _saver_lines(c: Cluster, node: int, needle: re.Pattern[str]) -> dict[int, tuple[float, re.Match[str]]]:
    """Step -> the wall time and match of the last line of node ``node``'s saver logs (every start's)
    matching ``needle`` (its group 1: the step): a step done again after a restart was committed again."""
    with c._lock:
        text = "\n".join(v for k, v in sorted(c.saver_logs.items()) if k[0] == node)
    out: dict[int, tuple[float, re.Match[str]]] = {}
    for ln in text.splitlines():
        m, hit = _LOG_TIME.match(ln), needle.search(ln)
        if m and hit:
            out[int(hit.group(1))] = (_log_time(m.group(1)), hit)
    return out


LOCAL_COMMIT = re.compile(r"event=commit step=(\d+) tier=local ")
DURABLE_COMMIT = re.compile(r"event=commit step=(\d+) tier=durable .*lag_s=([0-9.]+)")


def _check_tiers(c: Cluster, ranks: dict[int, int], steps: list[int]) -> dict[int, float]:
    """Each of ``steps`` is committed on the durable tier with the files of the ranks of ``ranks`` (node ->
    its rank: the nodes whose rank writes files), after their nodes' local commits of it, by global rank 0's
    node; each node's local commits hold its rank's files only. Returns step -> the durability lag (from the
    snapshot to the durable commit, by the manifest). The nodes ended."""
    c.wait_settled()  # the savers' uploads and durable commits may go on after their launchers exited
    committed = committed_steps(c.ckpt_dir)
    c.check(set(steps) <= set(committed), f"steps {steps} are committed on the durable tier: {committed}")
    layout = CommitLayout(c.ckpt_dir, PosixDiskStorage())
    for s in steps:
        files = layout.read_manifest(s).files
        c.check(sorted(files) == sorted(ranks.values()),
                f"the durable manifest of step {s} has the files of ranks {sorted(ranks.values())}: {sorted(files)}")
    for i, r in ranks.items():
        local = local_layout(_local_dir(c, i))
        for s in local.committed_steps():
            m = local.read_manifest(s)
            c.check(sorted(m.files) == [r] and m.extra.get("tier_ranks") == [r],
                    f"node {i}'s local commit of step {s} holds rank {r}'s files only: {sorted(m.files)}, "
                    f"tier_ranks {m.extra.get('tier_ranks')}")
            c.check(os.path.isdir(os.path.join(local.root, f"step_{s}")), f"node {i}'s local files of step {s}")
    # when each node committed each step locally: its local manifest's time while the local tier keeps the
    # step, else its saver's log line
    local_at = {i: {s: t for s, (t, _) in _saver_lines(c, i, LOCAL_COMMIT).items()} for i in ranks}
    for i in ranks:
        tier = local_layout(_local_dir(c, i))
        local_at[i].update({s: tier.read_manifest(s).time for s in tier.committed_steps()})
    logged = _saver_lines(c, next(i for i, r in ranks.items() if r == 0), DURABLE_COMMIT)
    lags = {}
    for s in steps:
        m = layout.read_manifest(s)
        c.check(all(s in local_at[i] for i in ranks),
                f"step {s} was committed on each node's local tier: {[sorted(local_at[i]) for i in ranks]}")
        c.check(all(m.time >= local_at[i][s] for i in ranks),
                f"step {s} is committed on the durable tier after both nodes' local commits: durable at "
                f"{m.time:.3f}, local at {[local_at[i][s] for i in ranks]}")
        lags[s] = round(m.time - min(float(t) for t in m.extra["saved_at_ranks"].values()), 3)
        # the saver reports the lag; its last lines may be gone (a saver that ends removes its log): the final
        # step's, or a step's commit again after a restart (then the line of its earlier commit is compared
        # with nothing)
        c.check(s in logged or s == STEPS, f"the saver logged the durable commit of step {s}: {sorted(logged)}")
        if s in logged and abs(logged[s][0] - m.time) < 1:
            c.check(abs(float(logged[s][1].group(2)) - lags[s]) < 1,
                    f"the logged lag of step {s} is its snapshot's age at the durable commit: "
                    f"{logged[s][1].group(0)} vs {lags[s]} s")
    return lags


def _check_ls(c: Cluster, i: int) -> list[dict[str, Any]]:
    """``flashckpt ls --json DIR --local-dir L`` of node ``i`` names the tiers holding each step."""
    r = run_cli(None, "ls", "--json", c.ckpt_dir, "--local-dir", _local_dir(c, i))  # type: ignore[arg-type]
    c.check(r.returncode == 0, f"flashckpt ls --local-dir: {r.stdout}{r.stderr}")
    rows = json.loads(r.stdout)
    local, durable = set(_local_steps(c, i)), set(committed_steps(c.ckpt_dir))
    want = {s: ", ".join(t for t, has in (("local", s in local), ("durable", s in durable)) if has)
            for s in local | durable}
    got = {row["step"]: row["tiers"] for row in rows if row["step"] in want}
    c.check(got == want, f"flashckpt ls --local-dir of node {i} shows the tiers: {got} != {want}")
    return rows


# ------------------------------------------------------------------------------------------ 1. commit per tier
def test_each_node_commits_locally_and_the_step_durably_once_both_did(cluster: Cluster, request) -> None:  # noqa: F811
    t0 = time.time()
    _launch(cluster, FSDP_TRAIN, ARGS)
    _check_exit_codes(cluster, cluster.wait_exit(timeout=180))
    ranks = _node_ranks(cluster)
    cluster.check(ranks == {0: 0, 1: 1}, f"rank i is node i's: {ranks}")
    due = PERSISTS
    lags = _check_tiers(cluster, ranks, due)
    # while training runs: the steps before the last are committed on both tiers before training ends
    # (the first persist starts the saver's persist worker: seconds on 2 busy cores, so not the first step)
    end = max(e["t"] for e in cluster.all_events("end"))
    durable = CommitLayout(cluster.ckpt_dir, PosixDiskStorage())
    early = [s for s in due if durable.read_manifest(s).time < end]
    cluster.check(due[-2] in early, f"step {due[-2]} is committed on the durable tier while training runs: steps "
                                    f"committed before its end: {early}")
    # a normal end: rank 0's saver committed every step, no survivor takes a commit over (it did re-persist
    # rank 0's files of the committed final step from its backup, its own list of commits being stale)
    cluster.check("event=last_words_for_rank0" not in cluster.all_text(), "no saver takes over rank 0's commit")
    for i in range(2):
        local = _local_steps(cluster, i)
        # local retention (FLASHCKPT_LOCAL_KEEP, 2 by default); the durable tier keeps every step
        cluster.check(local == due[-2:], f"node {i}'s local tier keeps its 2 newest steps: {local}")
        _check_ls(cluster, i)
    _report(request, durable=committed_steps(cluster.ckpt_dir), local={i: _local_steps(cluster, i) for i in range(2)},
            durable_lag_s=lags, committed_before_the_end=early, wall_s=round(time.time() - t0, 1))


# ------------------------------------------------------------------------------------------ 2. a node lost
def test_node_lost_with_its_local_tier_resumes_from_memory(cluster: Cluster, tmp_path, request) -> None:  # noqa: F811
    t0 = time.time()
    want = reference_digest(tmp_path, FSDP_TRAIN, 2, ARGS)
    _launch(cluster, FSDP_TRAIN, ARGS)
    _wait_before_loss(cluster, [1])
    lost_local = _local_steps(cluster, 1)
    cluster.check(lost_local, f"node 1's local tier holds steps before the loss: {lost_local}")
    t_kill = cluster.kill_node(1)
    shutil.rmtree(_local_dir(cluster, 1))  # its local disk goes with the machine
    cluster.start_node(1)  # a fresh machine: empty memory, empty local dir
    rcs = cluster.wait_exit(timeout=180)
    first_resume = min((e["t"] for e in cluster.all_events("resume", after=t_kill)), default=None)
    cluster.check(first_resume is not None, f"the job resumed after the node loss (exit codes {rcs})")
    newest = _memory_step(cluster, [1], first_resume, replicated=False)  # type: ignore[arg-type]
    resumed = {r: (e.get("source"), e.get("step")) for r, e in sorted(cluster.resumes(t_kill).items())}
    kill_to_step = _first_step_after(cluster, t_kill) - t_kill
    _check_exit_codes(cluster, rcs)
    _check_resumed(cluster, t_kill, 2, "memory", newest)
    _check_digest(cluster, want)
    cluster.check(kill_to_step < 30, f"training resumes within 30 s of the node loss: {kill_to_step:.1f} s")
    ranks = _node_ranks(cluster)
    due = [s for s in PERSISTS if s > newest]
    lags = _check_tiers(cluster, ranks, due)
    fresh = _local_steps(cluster, 1)
    cluster.check(fresh and min(fresh) > newest and set(fresh) <= set(due),
                  f"the fresh node's local tier started empty and holds steps committed after the resume at "
                  f"{newest}: {fresh}")
    cluster.check(_local_steps(cluster, 0) == PERSISTS[-2:], f"node 0's local tier goes on: {_local_steps(cluster, 0)}")
    cluster.check("event=catch_up" not in cluster.all_text(), "no catch-up upload (nothing was left half done)")
    _report(request, newest_snapshot=newest, resumed=resumed, kill_to_first_step_s=round(kill_to_step, 2),
            durable=committed_steps(cluster.ckpt_dir), local={i: _local_steps(cluster, i) for i in range(2)},
            durable_lag_s=lags, wall_s=round(time.time() - t0, 1))


# ------------------------------------------------------------------------------------------ 3. both nodes lost
def test_both_nodes_memory_lost_resume_from_the_local_tier(cluster: Cluster, tmp_path, request) -> None:  # noqa: F811
    t0 = time.time()
    want = reference_digest(tmp_path, DDP_TRAIN, 2, ARGS)
    _launch(cluster, DDP_TRAIN, ARGS, external_store=True)
    _wait_before_loss(cluster, [0, 1], replicated=True)
    t_kill = cluster.kill_nodes([0, 1])
    durable = committed_steps(cluster.ckpt_dir)
    local = {i: _local_steps(cluster, i) for i in range(2)}
    cluster.check(not local[1], f"replicated state: node 1 (rank 1) writes no files, its local tier is empty: {local}")
    cluster.start_node(0)
    cluster.start_node(1)
    rcs = cluster.wait_exit(timeout=180)
    _check_exit_codes(cluster, rcs)
    ranks = _node_ranks(cluster)
    resumed = {r: (e.get("source"), e.get("step")) for r, e in sorted(cluster.resumes(t_kill).items())}
    # the newest step every rank has: the durable tier's newest; a newer step node 0 committed locally only
    # (killed before its durable commit) is not read from there (node 1 has no copy), but node 0's next
    # saver uploads and commits it (its catch-up), maybe before the ranks look
    step = resumed.get(ranks[0], (None, None))[1]
    cluster.check(step == durable[-1] or step in [s for s in local[0] if s > durable[-1]],
                  f"the job resumes at the durable tier's newest step {durable[-1]}, or a newer one node 0 held "
                  f"locally and uploaded since: {resumed} (local {local})")
    # replicated state: any rank whose node holds rank 0's files of the step locally reads them there
    sources = {r: ("local" if step in local[i] else "storage", step) for i, r in ranks.items()}
    cluster.check(resumed == sources, f"each rank resumes at step {step} from its fastest tier holding it: "
                                      f"{resumed} != {sources} (durable {durable}, local {local}, ranks {ranks})")
    _check_digest(cluster, want)
    due = [s for s in PERSISTS if s > step]
    writer = next(i for i, r in ranks.items() if r == 0)  # replicated state: global rank 0 alone writes files
    _check_tiers(cluster, {writer: 0}, due)  # committing on both tiers goes on
    cluster.check(_local_steps(cluster, writer) == PERSISTS[-2:],
                  f"node {writer}'s local tier goes on: {_local_steps(cluster, writer)}")
    _report(request, durable_at_loss=durable, local_at_loss=local, resumed=resumed,
            kill_to_first_step_s=round(_first_step_after(cluster, t_kill) - t_kill, 2),
            durable=committed_steps(cluster.ckpt_dir), wall_s=round(time.time() - t0, 1))
