"""Crash recovery and launcher overhead, measured with real processes (never a pass/fail test).

Runs ``examples/ddp_train.py`` on 2 gloo ranks with a GPT sized to ``--state-gb`` of model + AdamW state:

1. under ``flashckpt-run --max_restarts 1`` with a memory snapshot every step and a persist every
   ``--storage-interval`` steps; rank 1 is SIGKILLed after step ``--crash-at``; the agent restarts the
   workers (handed to its warm workers) and they resume from shared memory, while the last-words persist
   runs beside the restart;
2. the same with new worker processes (``--no-warm-workers``), and with new processes and the restart
   waiting for the last words first (``FLASHCKPT_LAST_WORDS_BLOCKING=1``: how ``flashckpt-run``
   restarted before issue #20);
3. (1) and the first of (2) on 2 simulated nodes (an agent per node, one rank each, c10d rendezvous on
   loopback, a runtime dir per node);
4. plain ``torchrun --max_restarts 1`` with snapshots only at persist steps and no memory kept across the
   crash (what a disk-only checkpointer gives): the restart ``torch.load``s the last persisted step and
   redoes the lost steps;
5. DLRover's ``dlrover-run`` (its launcher only; the example checkpoints with flashckpt either way), when
   it is installed (``pip install "dlrover[torch]" -c constraints.txt``): dlrover 0.6.1 fails to start
   with torch 2.13, which the table then says;
6. plain ``torchrun`` without a crash: the step time, and the pause per snapshot to compare with (1).

Reports, per restart, where the time from the crash to the first training step after it goes (agent and
worker events, wall clock; ``FLASHCKPT_LAUNCH_EVENTS``), and the lost work. Usage:
``python -m benchmarks.bench_recovery [--state-gb 1.0] [--out bench_out/recovery.md]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks._common import print_report
from benchmarks._s3server import free_ports

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "examples", "ddp_train.py")


def model_flags(state_gb: float) -> list[str]:
    """A GPT whose params + 2 AdamW moments (fp32) take about ``state_gb``; vocab and width grow together."""
    dim = 1024
    layers = 4
    per_layer = 12 * dim * dim
    params = state_gb * 1e9 / 12  # 3 fp32 copies of every parameter
    vocab = max(4096, int((params - layers * per_layer) / dim))
    return ["--dim", str(dim), "--layers", str(layers), "--vocab", str(vocab), "--batch_size", "1", "--ctx", "16"]


def run(launcher: list[str], ckpt: str, metrics: str, job: str, extra: list[str], env_extra: dict[str, str],
        nodes: int = 1) -> tuple[int, str]:
    """One training job of 2 ranks: 2 per node on 1 node, or 1 per node on 2 simulated nodes (an agent
    each, a c10d rendezvous on loopback, each node's own runtime dir: its own savers and memory). Returns
    the exit status (the worst node's) and the end of the output when it failed."""
    if nodes == 1:
        shape = [["--nproc_per_node", "2", "--standalone"]]
    else:
        endpoint = f"127.0.0.1:{free_ports(1)[0]}"
        shape = [["--nnodes", str(nodes), "--nproc_per_node", str(2 // nodes), "--rdzv_backend", "c10d",
                  "--rdzv_endpoint", endpoint, "--rdzv_id", job, "--node_rank", str(n)] for n in range(nodes)]
    env = dict(os.environ, FLASHCKPT_JOB_ID=job, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), **env_extra)
    procs = []
    for n, node_args in enumerate(shape):
        cmd = [*launcher, *node_args, TRAIN, "--checkpoint_dir", ckpt, "--metrics", metrics, "--resume", *extra]
        node_env = dict(env, FLASHCKPT_RUNTIME_DIR=os.path.join(os.path.dirname(ckpt), f"node{n}")) \
            if nodes > 1 else env
        procs.append(subprocess.Popen(cmd, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    rc, tail = 0, ""
    for p in procs:
        try:
            out, _ = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            p.returncode = 124
        if p.returncode != 0:
            rc, tail = rc or p.returncode, out[-3000:]
    return rc, tail


def events(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


COLUMNS = ("resumed from", "restarted as", "notice", "stop", "last words", "rendezvous", "spawn", "start + imports",
           "process group", "model + load (load)", "first step", "crash -> first step", "steps lost")


def breakdown(name: str, ev: list[dict], crash_at: int, step_s: float, beside: bool) -> tuple[str, ...]:
    """One row of COLUMNS from a run's worker and agent events (wall clock; each phase from the end of
    the one before; "n/a" where an event is missing, e.g. plain torchrun has no agent events). With
    ``beside``, the last words run beside the restart: not a phase of it."""
    crash = next(e for e in ev if e["event"] == "crash")

    def first(event: str, after: float) -> dict | None:
        return next((e for e in ev if e["event"] == event and e["t"] >= after), None)

    resume = [e for e in ev if e["event"] == "resume"][-1]
    started = [e for e in ev if e["event"] == "started"][-1]
    step1 = first("first_step", resume["t"])
    marks: list[tuple[str, float | None]] = []
    for key in ("failure_noticed", "workers_stopped", "last_words_done", "rendezvous_done", "workers_started"):
        e = first(key, crash["t"])
        marks.append((key, e["t"] if e and not (key == "last_words_done" and beside) else None))
    marks += [("imported", started["imported"] if started["proc_start"] else None), ("pg", started["t"]),
              ("resume", resume["t"]), ("first_step", step1["t"] if step1 else None)]
    cells, prev = [], crash["t"]
    for key, t in marks:
        if t is None:
            cells.append("beside" if key == "last_words_done" and beside else "n/a")
            continue
        cell = f"{t - prev:.2f} s"
        if key == "resume":
            cell += f" ({resume['seconds']:.2f} s)"
        cells.append(cell)
        prev = t
    lost = crash_at - (resume["step"] or 0)
    total = (step1["t"] if step1 else resume["t"]) - crash["t"]
    agent = any(e["event"] == "workers_started" for e in ev)
    warm = sum(e["event"] == "warm_worker_used" and e["t"] >= crash["t"] for e in ev)
    restarted = f"{warm} warm, {2 - warm} new" if warm else "2 new"
    return (name, f"{resume['source']} (step {resume['step']})", restarted if agent else "2 new", *cells,
            f"**{total:.2f} s**",
            f"{lost} ({lost * step_s:.1f} s)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-gb", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--crash-at", type=int, default=8)
    p.add_argument("--storage-interval", type=int, default=5)
    p.add_argument("--only", default="", help="comma-separated parts of row names to run (and the reference)")
    p.add_argument("--out", default=os.path.join(REPO, "bench_out", "recovery.md"))
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="flashckpt-recovery-")
    flags = model_flags(args.state_gb) + ["--steps", str(args.steps), "--save_storage_interval",
                                          str(args.storage_interval)]
    crash = ["--crash_at_step", str(args.crash_at)]
    fc = [sys.executable, "-m", "flashckpt.launch.launcher", "--max_restarts", "1"]
    cold = [*fc, "--no-warm-workers"]
    mem = crash + ["--save_memory_interval", "1"]
    rows = []
    try:
        res: dict[str, tuple[int, list[dict], str]] = {}
        runs: list[tuple[str, list[str], list[str], dict[str, str], int]] = [
            ("flashckpt-run (now)", fc, mem, {}, 1),
            ("flashckpt-run, new processes", cold, mem, {}, 1),
            ("flashckpt-run, new processes, last words first (before #20)", cold, mem,
             {"FLASHCKPT_LAST_WORDS_BLOCKING": "1"}, 1),
            ("flashckpt-run, 2 nodes (now)", fc, mem, {}, 2),
            ("flashckpt-run, 2 nodes, new processes", cold, mem, {}, 2),
            # "disk": snapshots only at persist steps and a saver that frees memory as soon as its clients
            # are gone (grace 0), so the restart loads the last persisted checkpoint from storage (a fresh
            # rendezvous store per attempt, as flashckpt-run sets: torch's shared one makes about a third of
            # gloo restarts hang, pytorch/pytorch#135712)
            ("torchrun + load from disk", [sys.executable, "-m", "torch.distributed.run", "--max_restarts", "1"],
             crash + ["--save_memory_interval", "0"],
             {"FLASHCKPT_SAVER_GRACE_S": "0", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, 1),
        ]
        dlrover = shutil.which("dlrover-run", path=os.path.dirname(sys.executable))
        if dlrover:  # the launcher only: the example's checkpoints are flashckpt's either way
            runs.append(("dlrover-run", [dlrover, "--max_restarts", "1"], mem, {}, 1))
        runs.append(("torchrun, no crash", [sys.executable, "-m", "torch.distributed.run"],
                     ["--save_memory_interval", "1"], {}, 1))
        if args.only:
            runs = [r for r in runs if r[0] == "torchrun, no crash" or any(o in r[0] for o in args.only.split(","))]
        for name, launcher, extra, env, nodes in runs:
            ckpt, metrics = os.path.join(work, f"run{len(res)}", "ckpt"), os.path.join(work, f"run{len(res)}.jsonl")
            t0 = time.perf_counter()
            rc, tail = run(launcher, ckpt, metrics, f"rec-{len(res)}-{os.getpid()}", flags + extra,
                           dict(env, FLASHCKPT_LAUNCH_EVENTS=metrics), nodes=nodes)
            res[name] = (rc, events(metrics) if os.path.exists(metrics) else [], tail)
            print(f"[bench_recovery] {name}: exit {rc}, {time.perf_counter() - t0:.0f} s", flush=True)
        ref = res["torchrun, no crash"][1]
        step_s = statistics.median(b["t"] - a["t"] for a, b in zip(ref, ref[1:])
                                   if a["event"] == b["event"] == "save" and b["step"] == a["step"] + 1)
        state_mb = max(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(work)
                       for f in fs if f.endswith(".pt")) / 2**20
        notes = []
        for name, launcher, _, env, _ in runs[:-1]:
            rc, ev, tail = res[name]
            if rc != 0 or not any(e["event"] == "resume" for e in ev):
                why = next((ln for ln in reversed(tail.splitlines()) if "Error" in ln), f"exit {rc}").strip()
                rows.append((name, "did not run", *["n/a"] * (len(COLUMNS) - 1)))
                notes.append(f"{name}: {why[:300]}")
                continue
            agent = launcher[:3] == fc[:3]  # flashckpt-run: last words beside the restart unless told otherwise
            rows.append(breakdown(name, ev, args.crash_at, step_s,
                                  beside=agent and "FLASHCKPT_LAST_WORDS_BLOCKING" not in env))
        steady = []  # training before the crash: what the launcher's own processes cost it
        for name in ("flashckpt-run (now)", "flashckpt-run, new processes", "torchrun, no crash"):
            if name in res and res[name][0] == 0:
                ev = res[name][1]
                crash_t = next((e["t"] for e in ev if e["event"] == "crash"), float("inf"))
                saves = [e for e in ev if e["event"] == "save" and e["t"] < crash_t]
                gaps = [b["t"] - a["t"] for a, b in zip(saves[1:], saves[2:])]  # the first step warms up
                steady.append(f"| {name} | {statistics.median(gaps):.2f} s | "
                              f"{statistics.median(e['seconds'] for e in saves) * 1e3:.1f} ms |")
        lines = [f"# Crash recovery, 2 CPU ranks, {state_mb:.0f} MB of model + AdamW state, "
                 f"{step_s:.2f} s per step", "",
                 "| launcher | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines += ["", "Each column runs from the end of the one before it: the agent noticing the failure (its "
                  "monitor polls every 0.1 s), stopping the surviving worker, the last-words persist when the "
                  "restart waits for it, the rendezvous, spawning the workers (a new process, or the hand-over "
                  "to a warm one), their interpreter start and imports (torch, flashckpt; a warm worker has "
                  "them), the process group, building the model (DDP's first construction imports "
                  "torch._dynamo in a new process) and the load, the first step. 2 nodes: one agent and one "
                  "rank per simulated node (own runtime dir), c10d rendezvous on loopback; rank 1 (node 1) "
                  "crashes.", *[f"- {n}" for n in notes],
                  "", "| training before the crash | step (median) | pause per snapshot (median) |",
                  "|---|---|---|", *steady, "",
                  "The same memory snapshot every step in all three: a difference is what flashckpt-run's own "
                  "processes (the warm workers' imports, 5 s after the start, at nice +10) cost the training "
                  "processes on this machine's cores."]
        text = "\n".join(lines)
        print_report(text, args.out)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
