"""Node loss and the cross-node memory replica, on simulated nodes (never a pass/fail test).

Every run trains ``examples/fsdp_train.py`` (FSDP2, gloo, 1 rank per node) under ``flashckpt-run`` on
simulated nodes (``benchmarks/_simnodes.py``: a mount namespace with a private tmpfs /dev/shm per node, its
own agent, saver and memory; a c10d rendezvous on loopback; one shared checkpoint dir). The model (a GPT of
width 512 and 2 layers whose vocabulary fills the rest) is sized so that parameters + AdamW moments (fp32)
take about ``--state-gb`` in total: each of N ranks snapshots its shard, ``state / N``. A memory snapshot
every step, a persist to storage every ``--storage-interval`` steps, ``--step-sleep`` after every step.

1. **Node loss**, on 2 and on 4 nodes: once every rank saved step ``--kill-after`` (and ``--kill-delay``
   more seconds passed: the backup of that step is on its way), node 1 is killed whole (SIGSTOP, SIGKILL,
   every process of its namespace; its memory goes with its tmpfs) and a fresh node 1 is started right
   away. Rows "replica" (the default: every snapshot sent to the backup partner, capped at 1000 MB/s) and
   "storage only" (``FLASHCKPT_REPLICA=off``: a lost node's shards are only on storage). Columns: the
   newest snapshot every rank held before the kill, where and at which step every rank resumed, the steps
   lost (newest snapshot - resumed step), the time from the kill to training resumed (the last rank's
   first step after it), and on the way, from the agents' events (``FLASHCKPT_LAUNCH_EVENTS``, wall clock,
   seconds after the kill): a surviving agent noticed the failure, its last words were done, the last
   rendezvous before training resumed completed, the workers were started, and the load's own seconds
   (the longest rank's). "restarts" counts the surviving node 0's worker starts in between.
   **Shrink** (``--shrink-nodes``, 4 by default): the same loss in an elastic job (``--nnodes N-1:N``), no node
   started: the N-1 survivors resume resharded, from the memory they hold (the lost node's shards from its
   partner's backup) or, with the replica off, from storage (the newest commit).
2. **Replication throughput**: the savers log every backup sent (``event=backup_sent ... bytes= seconds=``,
   the partner's reply included) and every shard a node sent for a load after the loss, to the fresh node or
   to a node whose ranks the rendezvous renumbered (``replica_fetch_sent``);
   their GB/s per transfer, at the default cap and uncapped (``FLASHCKPT_REPLICA_MBPS=0``), next to the
   loopback limit measured in the same run: a TCP connection on 127.0.0.1 moving ``--loopback-gb`` from a
   tmpfs file with ``sendfile`` into an mmap'd tmpfs file with ``recv_into`` (the replica's mechanism), the
   same with ``sendall`` of a bytes buffer, and two ``sendfile`` streams at once, one each way (a pair of
   nodes backing up each other). The backups sent are counted against the snapshots taken, and the savers'
   "backup ... failed" warnings (the first of each streak) with their reasons.
3. **Step time**: the same 2-node training without a kill, ``--steady-steps`` steps, replica at the default
   cap, uncapped, and off: the median time between two consecutive snapshots of rank 0 (a step, its
   snapshot and the step sleep; the first two steps are left out) and the median snapshot pause (the
   example's ``save`` event: ``get_state_dict`` + ``save_checkpoint``). ``--rounds N`` runs the three N
   times, each round in a rotated order, and adds each setting's spread and the replica's cost against
   "off" of the same round (paired: a drift of the machine over the rounds cancels).

The rendezvous keep-alive is 1 s x 3 (``--rdzv-conf``; torch's default, 5 s x 3, adds its own seconds to
every node-loss restart). Machine facts and the load average are printed first: another job on the same
cores shows in every number. Usage: ``python -m benchmarks.bench_nodes [--state-gb 1.0] [--only loss,...]``;
``--state-gb 0.25`` for a quick run. Needs root and ``unshare`` (simulated nodes).
"""

from __future__ import annotations

import argparse
import mmap
import os
import re
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks._common import GB, fmt_bytes, logger, machine_info, markdown_table, print_report, rotated
from benchmarks._simnodes import REPO, SimCluster, namespace_support

FSDP_TRAIN = os.path.join(REPO, "examples", "fsdp_train.py")
FAST_RDZV = "keep_alive_interval=1,keep_alive_max_attempt=3"
DIM, LAYERS, CTX = 512, 2, 16
log = logger("bench_nodes")

_SENT = re.compile(r"event=backup_sent rank=(\d+) step=(\d+) node=(\d+) bytes=(\d+) seconds=([\d.]+)")
_FETCH = re.compile(r"event=replica_fetch_sent rank=(\d+) step=(\d+) bytes=(\d+) seconds=([\d.]+)")
_FAILED = re.compile(r"backup of rank \S+ step \d+ to node \d+ failed: (.*?) \(retried")


# ------------------------------------------------------------------------------------------ the model
def model_flags(state_gb: float) -> tuple[list[str], int]:
    """Flags of a TinyGPT whose params + 2 AdamW moments (fp32) take about ``state_gb``, and its bytes."""
    import torch

    sys.path.insert(0, REPO)
    from examples.ddp_train import TinyGPT

    with torch.device("meta"):
        base = sum(p.numel() for p in TinyGPT(1024, DIM, LAYERS, ctx=CTX).parameters()) - 1024 * DIM
    vocab = max(1024, round((state_gb * GB / 12 - base) / DIM))
    flags = ["--dim", str(DIM), "--layers", str(LAYERS), "--vocab", str(vocab), "--batch_size", "1",
             "--ctx", str(CTX)]
    return flags, 12 * (base + vocab * DIM)


# ------------------------------------------------------------------------------------------ runs
def _saver_stats(c: SimCluster) -> dict[str, Any]:
    sent, fetched, failed = [], [], []
    for _node, ln in c.saver_log_lines():
        if m := _SENT.search(ln):
            sent.append((int(m.group(4)), float(m.group(5))))
        elif m := _FETCH.search(ln):
            fetched.append((int(m.group(3)), float(m.group(4))))
        elif m := _FAILED.search(ln):
            failed.append(m.group(1))
    return {"sent": sent, "fetched": fetched, "failed": failed, "snapshots": len(c.events("save"))}


def _cluster(args: argparse.Namespace, work: str, name: str, nnodes: int, steps: int, flags: list[str],
             state: int, env: dict[str, str], *, shrink: bool = False) -> SimCluster:
    per_rank = state / nnodes
    shm_gib = max(1, int(6 * per_rank / 2**30) + 1)  # own segment (2 slots), a partner's backup (2), a fetch
    script_args = [*flags, "--steps", str(steps), "--save_memory_interval", "1", "--save_storage_interval",
                   str(args.storage_interval), "--step_sleep", str(args.step_sleep)]
    if args.no_warm_workers:
        env = dict(env, FLASHCKPT_WARM_WORKERS="0")
    d = os.path.join(work, re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-"))
    if shrink:  # an elastic job (--nnodes N-1:N) whose rendezvous closes soon after the survivors arrive
        shm_gib = max(1, int((6 + nnodes) * per_rank / 2**30) + 1)  # + the old ranks' states a load reads
        return SimCluster(d, nnodes, FSDP_TRAIN, script_args, env=env, shm_size=f"{shm_gib}g",
                          rdzv_conf=",".join(c for c in [args.rdzv_conf, "last_call_timeout=2"] if c),
                          nnodes_spec=f"{nnodes - 1}:{nnodes}")
    return SimCluster(d, nnodes, FSDP_TRAIN, script_args, env=env, shm_size=f"{shm_gib}g",
                      rdzv_conf=args.rdzv_conf)


def _failure_note(c: SimCluster, why: str) -> str:
    tails = []
    for n in c.nodes:
        lines = [ln for ln in c.tail(n.index, 3000).splitlines() if ln.strip()]
        err = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
        tails.append(f"node {n.index}: {err.strip()[:200]}")
    return f"{why}; " + "; ".join(tails)


def run_loss(args: argparse.Namespace, work: str, name: str, nnodes: int, flags: list[str], state: int,
             env: dict[str, str], *, shrink: bool = False) -> dict[str, Any]:
    """Kills node 1 whole after step ``--kill-after`` and starts a fresh one (``shrink``: none; the job goes on
    with one node fewer); what the resume cost."""
    with _cluster(args, work, name, nnodes, args.steps, flags, state, env, shrink=shrink) as c:
        c.launch()
        deadline = time.monotonic() + args.timeout
        while c.newest_step() < args.kill_after:
            if time.monotonic() > deadline or any(c.exited(i) for i in range(nnodes)):
                return {"error": _failure_note(c, f"step {args.kill_after} not reached by every rank")}
            time.sleep(0.05)
        time.sleep(args.kill_delay)
        t_kill = c.kill_node(1)
        if not shrink:
            c.start_node(1)
        rcs = c.wait_exit(args.timeout)
        if shrink:
            rcs = [rc for i, rc in enumerate(rcs) if i != 1]  # node 1's launcher was killed with it
        c.mirror_now()
        newest = c.newest_step(before=t_kill)
        firsts: dict[int, float] = {}
        for e in c.events("first_step", after=t_kill):
            firsts.setdefault(e["rank"], e["t"])
        if len(firsts) < nnodes - shrink:
            return {"error": _failure_note(c, f"training did not resume on every rank (exit codes {rcs})"),
                    "saver": _saver_stats(c)}
        t_up = max(firsts.values())
        resumes: dict[int, dict[str, Any]] = {}
        for e in c.events("resume", after=t_kill):
            if e["t"] <= t_up:
                resumes[e["rank"]] = e
        agent = [dict(e, node=i) for i in range(nnodes) for e in c.agent_events(i, after=t_kill)]

        def first(event: str, after: float = t_kill) -> float | None:
            return min((e["t"] for e in agent if e["event"] == event and e["t"] >= after), default=None)

        def last(event: str) -> float | None:
            return max((e["t"] for e in agent if e["event"] == event and e["t"] <= t_up), default=None)

        saves = [e for e in c.events("save") if e["rank"] == 0 and e["t"] < t_kill]
        gaps = [b["t"] - a["t"] for a, b in zip(saves, saves[1:]) if b["step"] == a["step"] + 1 and a["step"] > 2]
        noticed = first("failure_noticed")
        got = sorted({(e.get("source"), e.get("step")) for e in resumes.values()}, key=str)
        ends = [e for e in c.events("end", after=t_kill) if e.get("rank") == 0]
        return {
            "newest": newest,
            "resumed": got,
            "lost": newest - min((s or 0) for _, s in got) if got else None,
            "up": t_up - t_kill,
            "step_s": statistics.median(gaps) if gaps else None,
            "noticed": noticed and noticed - t_kill,
            "last_words": (lw := first("last_words_done", noticed or t_kill)) and lw - t_kill,
            "rendezvous": (rv := last("rendezvous_done")) and rv - t_kill,
            "started": (ws := last("workers_started")) and ws - t_kill,
            "load": max((float(e.get("seconds") or 0) for e in resumes.values()), default=None),
            "restarts": sum(e["event"] == "workers_started" and e["node"] == 0 and e["t"] <= t_up for e in agent),
            "rcs": rcs,
            "digest": ends[-1].get("digest") if ends else None,
            "saver": _saver_stats(c),
        }


def run_steady(args: argparse.Namespace, work: str, name: str, flags: list[str], state: int,
               env: dict[str, str]) -> dict[str, Any]:
    """2 nodes, no kill: step time and snapshot pause, and the backups' throughput."""
    with _cluster(args, work, name, 2, args.steady_steps, flags, state, env) as c:
        c.launch()
        rcs = c.wait_exit(args.timeout)
        c.mirror_now()
        saves = [e for e in c.events("save") if e["rank"] == 0]
        # a restart at the start (the job's first attempt failed) repeats steps: the last attempt's saves
        starts = [i for i, (a, b) in enumerate(zip(saves, saves[1:])) if b["step"] <= a["step"]]
        attempts = len(starts) + 1
        saves = saves[starts[-1] + 1:] if starts else saves
        gaps = [b["t"] - a["t"] for a, b in zip(saves, saves[1:]) if b["step"] == a["step"] + 1 and a["step"] > 2]
        pauses = [e["seconds"] for e in saves if e["step"] > 2]
        out = {"rcs": rcs, "step": statistics.median(gaps) if gaps else None,
               "pause": statistics.median(pauses) if pauses else None, "attempts": attempts,
               "saver": _saver_stats(c)}
        if not gaps:
            out["error"] = _failure_note(c, f"no steps measured (exit codes {rcs})")
        ends = [e for e in c.events("end") if e.get("rank") == 0]
        out["digest"] = ends[-1].get("digest") if ends else None
        return out


# ------------------------------------------------------------------------------------------ loopback
def _tmpfs_file(path: str, nbytes: int, fill: bool) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, nbytes)
    if fill:  # real pages (a segment's), not holes
        chunk = os.urandom(1 << 20) * 64
        off = 0
        while off < nbytes:
            off += os.pwrite(fd, chunk[: nbytes - off], off)
    return fd


def _pair() -> tuple[socket.socket, socket.socket]:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    srv.close()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


def _transfer(streams: list[tuple[int | bytes, int, mmap.mmap]]) -> float:
    """Moves each stream (a tmpfs file's fd, or a bytes buffer; its size; the mapping it lands in) over a
    loopback TCP connection of its own, all at once, each side in its own thread (blocking sockets); the
    seconds from the start to the last byte received."""
    conns = [_pair() for _ in streams]
    errors: list[BaseException] = []

    def send(sock: socket.socket, src: int | bytes, n: int) -> None:
        try:
            if isinstance(src, bytes):
                sock.sendall(src)
                return
            off = 0
            while off < n:
                off += os.sendfile(sock.fileno(), src, off, min(n - off, 64 << 20))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def recv(sock: socket.socket, dst: mmap.mmap, n: int) -> None:
        try:
            view, got = memoryview(dst), 0
            while got < n:
                k = sock.recv_into(view[got:n], min(n - got, 64 << 20))
                if k == 0:
                    raise ConnectionError("closed mid-transfer")
                got += k
            view.release()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = []
    for (a, b), (src, n, dst) in zip(conns, streams):
        threads += [threading.Thread(target=recv, args=(b, dst, n)), threading.Thread(target=send, args=(a, src, n))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    for a, b in conns:
        a.close()
        b.close()
    if errors:
        raise errors[0]
    return dt


def loopback(nbytes: int, rounds: int = 3) -> list[tuple[str, int, float]]:
    """(what, bytes moved, best seconds of ``rounds``) of the loopback transfers (see the docstring)."""
    d = tempfile.mkdtemp(prefix="flashckpt-loopback-", dir="/dev/shm")
    fds: list[int] = []
    maps: list[mmap.mmap] = []
    try:
        for i in range(2):
            fds.append(_tmpfs_file(os.path.join(d, f"src{i}"), nbytes, fill=True))
            dst = _tmpfs_file(os.path.join(d, f"dst{i}"), nbytes, fill=False)
            maps.append(mmap.mmap(dst, nbytes))
            os.close(dst)
        buf = os.pread(fds[0], nbytes, 0)
        cases: list[tuple[str, list[tuple[int | bytes, int, mmap.mmap]]]] = [
            ("sendfile (tmpfs file) -> recv_into (tmpfs mapping), 1 stream", [(fds[0], nbytes, maps[0])]),
            ("sendall (bytes buffer) -> recv_into (tmpfs mapping), 1 stream", [(buf, nbytes, maps[0])]),
            ("sendfile -> recv_into, 2 streams at once (one each way)",
             [(fds[0], nbytes, maps[0]), (fds[1], nbytes, maps[1])]),
        ]
        out = []
        for what, streams in cases:
            best = min(_transfer(streams) for _ in range(rounds))
            out.append((what, nbytes * len(streams), best))
        del buf
        return out
    finally:
        for m in maps:
            m.close()
        for fd in fds:
            os.close(fd)
        shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------------------ tables
def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def _plus(x: float | None) -> str:
    return "n/a" if x is None else f"+{x:.2f} s"


def _rate(pairs: list[tuple[int, float]]) -> tuple[str, str, str, str]:
    """(count, size each, median s and GB/s per transfer, aggregate GB/s) of (bytes, seconds) pairs."""
    if not pairs:
        return "0", "n/a", "n/a", "n/a"
    per = [b / s / GB for b, s in pairs if s > 0]
    med_b = statistics.median(b for b, _ in pairs)
    med_s = statistics.median(s for _, s in pairs)
    agg = sum(b for b, _ in pairs) / max(1e-9, sum(s for _, s in pairs)) / GB
    return (str(len(pairs)), fmt_bytes(med_b), f"{med_s:.3f} s, {statistics.median(per):.2f} GB/s" if per else "n/a",
            f"{agg:.2f} GB/s")


def steady_summary(steady: list[tuple[str, str, int, dict[str, str]]], res: dict[str, dict[str, Any]],
                   rounds: int) -> list[str]:
    """Over the rounds: each setting's steps, and the replica's cost as paired differences (the same round)."""
    def step(name: str, r: int) -> float | None:
        return res.get(f"{name} #{r + 1}", {}).get("step")

    off = steady[-1][0]
    out = ["Over the rounds (each a rotated order of the three runs):", ""]
    for name, *_ in steady:
        steps = [x for r in range(rounds) if (x := step(name, r)) is not None]
        if steps:
            out.append(f"- {name}: median {_s(statistics.median(steps))} of {len(steps)} runs "
                       f"({_s(min(steps))} - {_s(max(steps))})")
    for name, *_ in steady[:-1]:
        diffs = [(a / b - 1) * 100 for r in range(rounds)
                 if (a := step(name, r)) is not None and (b := step(off, r)) is not None]
        if diffs:
            out.append(f"- {name} against off in the same round: median {statistics.median(diffs):+.1f} % "
                       f"({', '.join(f'{d:+.1f} %' for d in diffs)})")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-gb", type=float, default=1.0, help="model + AdamW state of the whole job, GB")
    p.add_argument("--nodes", default="2,4", help="node counts of the node-loss runs")
    p.add_argument("--shrink-nodes", default="4", help="node counts of the shrink runs (an elastic job, node 1 "
                                                       "lost and not replaced; '' for none)")
    p.add_argument("--steps", type=int, default=14, help="training steps of a node-loss run")
    p.add_argument("--kill-after", type=int, default=12, help="node 1 is killed once every rank saved this step")
    p.add_argument("--kill-delay", type=float, default=1.0, help="seconds from that save to the kill")
    p.add_argument("--storage-interval", type=int, default=10, help="persist to storage every N steps")
    p.add_argument("--steady-steps", type=int, default=8, help="training steps of a step-time run")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of the step-time runs, each in a rotated order (the order's drift cancels)")
    p.add_argument("--step-sleep", type=float, default=0.3, help="the example's --step_sleep")
    p.add_argument("--loopback-gb", type=float, default=1.0, help="bytes each loopback transfer moves")
    p.add_argument("--rdzv-conf", default=FAST_RDZV)
    p.add_argument("--no-warm-workers", action="store_true", help="FLASHCKPT_WARM_WORKERS=0 on every node")
    p.add_argument("--timeout", type=float, default=300.0, help="bound on every wait of a run, seconds")
    p.add_argument("--only", default="", help="comma-separated parts of run names to run ('2 nodes', '4 nodes', "
                                              "'storage only', 'steady', 'uncapped', 'loopback', ...)")
    p.add_argument("--keep", action="store_true", help="keep the work dir (node logs, events, saver logs)")
    p.add_argument("--out", default=os.path.join(REPO, "bench_out", "nodes.md"))
    args = p.parse_args()
    # SIGTERM and SIGINT (even where a background shell ignores it) unwind: every node is killed on the way
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    why = namespace_support()
    if why:
        print(f"bench_nodes: {why}", file=sys.stderr)
        return 2
    load0 = os.getloadavg()
    t_start = time.monotonic()
    flags, state = model_flags(args.state_gb)
    nodes = [int(n) for n in args.nodes.split(",") if n.strip()]
    runs: list[tuple[str, str, int, dict[str, str]]] = []
    for n in nodes:
        runs += [(f"{n} nodes replica", "loss", n, {}),
                 (f"{n} nodes storage only", "loss", n, {"FLASHCKPT_REPLICA": "off"})]
    for n in [int(x) for x in args.shrink_nodes.split(",") if x.strip()]:
        runs += [(f"shrink {n} -> {n - 1} nodes, from memory", "shrink", n, {}),
                 (f"shrink {n} -> {n - 1} nodes, storage only", "shrink", n, {"FLASHCKPT_REPLICA": "off"})]
    steady: list[tuple[str, str, int, dict[str, str]]] = [
        ("steady replica (cap 1000 MB/s)", "steady", 2, {}),
        ("steady replica uncapped", "steady", 2, {"FLASHCKPT_REPLICA_MBPS": "0"}),
        ("steady replica off", "steady", 2, {"FLASHCKPT_REPLICA": "off"})]
    for k in range(args.rounds):
        runs += [(f"{name} #{k + 1}" if args.rounds > 1 else name, kind, n, env)
                 for name, kind, n, env in rotated(steady, k)]
    only = [o.strip() for o in args.only.split(",") if o.strip()]
    if only:
        runs = [r for r in runs if any(o in r[0] for o in only)]
    work = tempfile.mkdtemp(prefix="flashckpt-nodes-")
    res: dict[str, dict[str, Any]] = {}
    lb: list[tuple[str, int, float]] = []
    try:
        if not only or any(o in "loopback" for o in only):
            t0 = time.perf_counter()
            lb = loopback(int(args.loopback_gb * GB))
            log(f"loopback: {time.perf_counter() - t0:.0f} s")
        for name, kind, n, env in runs:
            t0 = time.perf_counter()
            try:
                res[name] = (run_loss(args, work, name, n, flags, state, env, shrink=kind == "shrink")
                             if kind in ("loss", "shrink") else run_steady(args, work, name, flags, state, env))
            except (RuntimeError, OSError) as e:
                res[name] = {"error": str(e)[:500]}
            r = res[name]
            got = (f"; step {_s(r['step'])}, snapshot pause {r['pause'] * 1e3:.0f} ms" if r.get("step") is not None
                   else f"; resumed {r['resumed']}, kill -> resumed {_s(r['up'])}" if "up" in r else "")
            log(f"{name}: {time.perf_counter() - t0:.0f} s{got}{'; ' + r['error'] if 'error' in r else ''}")
    finally:
        if args.keep:
            log(f"work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    info = machine_info()
    load1 = os.getloadavg()
    lines = [f"# Node loss and the memory replica: {fmt_bytes(state)} of model + AdamW state (FSDP, 1 rank per "
             f"simulated node), snapshot every step, persist every {args.storage_interval} steps",
             "",
             f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB memory, /dev/shm "
             f"{info['dev_shm_gib']} GiB (each simulated node: a tmpfs of its own), kernel {info['kernel']}, "
             f"torch {info['torch']}, git {info['git']}. Load average (1 min) {load0[0]:.2f} before the "
             f"benchmark started anything, {load1[0]:.2f} at the end (its own nodes included)"
             + (": other processes used the cores at the start, the numbers are noisier than usual."
                if load0[0] > 0.5 * info["cores"] else ".")
             + f" Whole benchmark: {time.monotonic() - t_start:.0f} s.", ""]
    notes: list[str] = []

    loss_rows = []
    for name, kind, n, _ in runs:
        if kind not in ("loss", "shrink"):
            continue
        r = res[name]
        if "error" in r:
            loss_rows.append((name, f"{fmt_bytes(state / n)}", *["n/a"] * 11))
            notes.append(f"{name}: {r['error']}")
            continue
        resumed = ", ".join(f"{src} (step {step})" for src, step in r["resumed"])
        lost = str(r["lost"]) + (f" ({r['lost'] * r['step_s']:.1f} s)" if r["step_s"] and r["lost"] is not None else "")
        loss_rows.append((name, fmt_bytes(state / n), _s(r["step_s"]), str(r["newest"]), resumed, lost,
                          f"**{_s(r['up'])}**",
                          _plus(r["noticed"]), _plus(r["last_words"]), _plus(r["rendezvous"]), _plus(r["started"]),
                          _s(r["load"]), str(r["restarts"])))
        if any(rc != 0 for rc in r["rcs"]):
            notes.append(f"{name}: launcher exit codes {r['rcs']}")
        if name.endswith("replica") and any(src != "memory" for src, _ in r["resumed"]):
            sv = r["saver"]
            notes.append(f"{name}: resumed from storage although the replica was on: {len(sv['sent'])} of "
                         f"{sv['snapshots']} snapshots reached a partner (table 2), so the lost node's shards of "
                         "the newest steps were in no surviving memory")
    if loss_rows:
        lines += [f"## 1. Node 1 lost whole after step {args.kill_after} (+{args.kill_delay:g} s), a fresh node 1 "
                  "started at once; shrink: none started (an elastic job, --nnodes N-1:N, goes on with N-1, "
                  "resharded)", "",
                  markdown_table(("run", "snapshot per rank", "step before", "newest snapshot", "resumed from",
                                  "steps lost",
                                  "kill -> training resumed", "failure noticed", "last words done",
                                  "rendezvous done", "workers started", "load", "restarts"), loss_rows), "",
                  "Times after the kill (wall clock, agent events of the surviving and the fresh node); \"load\" is "
                  "the longest rank's load itself; \"restarts\": node 0's worker starts until training resumed; "
                  "\"step before\": rank 0's median step before the kill (steps 1-2 left out), which the steps "
                  "lost are also given in.",
                  ""]
        digests = {name: res[name].get("digest") for name, kind, n, _ in runs if kind == "loss" and n == 2}
        if len(digests) == 2 and all(digests.values()):
            same = len(set(digests.values())) == 1
            notes.append("the 2-node runs (replica, storage only) ended with " + ("the same weights (bit exact)"
                         if same else f"different weights: {digests}"))

    tp_rows = []
    for name, kind, _n, env in runs:
        r = res.get(name, {})
        sv = r.get("saver")
        if not sv or env.get("FLASHCKPT_REPLICA") == "off":
            continue
        cap = "uncapped" if env.get("FLASHCKPT_REPLICA_MBPS") == "0" else "1000 MB/s"
        fails = len(sv["failed"])
        why = f" ({', '.join(sorted(set(sv['failed'])))[:80]})" if fails else ""
        count, *rest = _rate(sv["sent"])
        tp_rows.append((f"backups sent, {name}" + (" (node-loss run)" if kind == "loss" else ""), cap, f"{count} of {sv['snapshots']}", *rest, f"{fails}{why}"))
        if sv["fetched"]:
            tp_rows.append((f"shards fetched after the loss, {name} (node-loss run)", "uncapped",
                            *_rate(sv["fetched"]), "-"))
    for what, nbytes, secs in lb:
        rate = f"{nbytes / secs / GB:.2f} GB/s"
        tp_rows.append((f"loopback: {what}", "-", "1 (best of 3)", fmt_bytes(nbytes), f"{secs:.3f} s, {rate}", rate, "-"))
    if tp_rows:
        lines += ["## 2. Replication throughput vs the loopback limit", "",
                  markdown_table(("transfer", "cap", "count", "size each", "per transfer (median)", "aggregate",
                                  "backup failure warnings"), tp_rows), "",
                  "\"count\" of backups: sent (the partner kept it) of the memory snapshots every rank took (a "
                  "sender skips to the newest snapshot, so a slow or failed send means fewer sent). \"aggregate\": "
                  "all bytes / all seconds of the transfers (a backup's seconds include the partner's reply). A "
                  "saver warns at the first failure of a partner's streak only (the next ones of that streak are "
                  "silent). Both nodes of a pair send at the same time, as the 2-stream loopback row does.", ""]

    st_rows = []
    for name, kind, _n, _ in runs:
        if kind != "steady":
            continue
        r = res[name]
        if r.get("step") is None:
            st_rows.append((name, "n/a", "n/a", "n/a"))
            notes.append(f"{name}: {r.get('error')}")
            continue
        st_rows.append((name, _s(r["step"]), f"{r['pause'] * 1e3:.0f} ms", str(r["attempts"])))
        if any(rc != 0 for rc in r["rcs"]):
            notes.append(f"{name}: launcher exit codes {r['rcs']}")
    if st_rows:
        lines += [f"## 3. Step time on 2 nodes, no kill ({args.steady_steps} steps, step sleep {args.step_sleep:g} s)",
                  "", markdown_table(("run", "step (median)", "snapshot pause (median)", "job attempts"), st_rows),
                  "", "A step: from one snapshot of rank 0 to its next (compute, snapshot, step sleep); steps 1-2 "
                  "left out. \"job attempts\" > 1: the job's first attempt failed and the agents restarted it.", ""]
        if args.rounds > 1:
            lines += [*steady_summary(steady, res, args.rounds), ""]
    if notes:
        lines += ["Notes:", *[f"- {n}" for n in notes], ""]
    text = "\n".join(lines)
    print_report(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
