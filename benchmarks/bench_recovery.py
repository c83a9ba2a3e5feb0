"""Crash recovery and launcher overhead, measured with real processes (never a pass/fail test).

Runs ``examples/ddp_train.py`` on 2 gloo ranks with a GPT sized to ``--state-gb`` of model + AdamW state:

1. under ``flashckpt-run --max_restarts 1`` with a memory snapshot every step and a persist every
   ``--storage-interval`` steps; rank 1 is SIGKILLed after step ``--crash-at``; the agent restarts the
   workers and they resume from shared memory, while the last-words persist runs beside the restart;
2. the same with the restart waiting for the last words first (``FLASHCKPT_LAST_WORDS_BLOCKING=1``: how
   ``flashckpt-run`` restarted before issue #20);
3. plain ``torchrun --max_restarts 1`` with snapshots only at persist steps and no memory kept across the
   crash (what a disk-only checkpointer gives): the restart ``torch.load``s the last persisted step and
   redoes the lost steps;
4. plain ``torchrun`` without a crash: the step time, and the pause per snapshot to compare with (1).

Reports, per restart, where the time from the crash to the first training step after it goes (agent and
worker events, wall clock; ``FLASHCKPT_LAUNCH_EVENTS``), and the lost work. DLRover's ``dlrover-run`` (dlrover 0.6.1
installs beside these versions) is not in the table yet. Usage:
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


def run(launcher: list[str], ckpt: str, metrics: str, job: str, extra: list[str], env_extra: dict[str, str]) -> int:
    cmd = [sys.executable, "-m", *launcher, "--nproc_per_node", "2", "--standalone", TRAIN,
           "--checkpoint_dir", ckpt, "--metrics", metrics, "--resume", *extra]
    env = dict(os.environ, FLASHCKPT_JOB_ID=job, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), **env_extra)
    try:
        out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        print(f"{launcher[0]} did not finish in 600 s", file=sys.stderr)
        return 124
    if out.returncode != 0:
        print(out.stdout[-3000:], file=sys.stderr)
    return out.returncode


def events(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


COLUMNS = ("resumed from", "notice", "stop", "last words", "rendezvous", "spawn", "start + imports",
           "process group", "model + load (load)", "first step", "crash -> first step", "steps lost")


def breakdown(name: str, ev: list[dict], crash_at: int, step_s: float) -> tuple[str, ...]:
    """One row of COLUMNS from a run's worker and agent events (wall clock; each phase from the end of
    the one before; "n/a" where an event is missing, e.g. plain torchrun has no agent events)."""
    crash = next(e for e in ev if e["event"] == "crash")

    def first(event: str, after: float) -> dict | None:
        return next((e for e in ev if e["event"] == event and e["t"] >= after), None)

    resume = [e for e in ev if e["event"] == "resume"][-1]
    started = [e for e in ev if e["event"] == "started"][-1]
    step1 = first("first_step", resume["t"])
    marks: list[tuple[str, float | None]] = []
    for key in ("failure_noticed", "workers_stopped", "last_words_done", "rendezvous_done", "workers_started"):
        e = first(key, crash["t"])
        # last words beside the restart end after it began: not a phase of it
        marks.append((key, e["t"] if e and (key != "last_words_done" or e["t"] < resume["t"]) else None))
    marks += [("imported", started["imported"] if started["proc_start"] else None), ("pg", started["t"]),
              ("resume", resume["t"]), ("first_step", step1["t"] if step1 else None)]
    cells, prev = [], crash["t"]
    for key, t in marks:
        if t is None:
            cells.append("n/a" if key != "last_words_done" else "beside")
            continue
        cell = f"{t - prev:.2f} s"
        if key == "resume":
            cell += f" ({resume['seconds']:.2f} s)"
        cells.append(cell)
        prev = t
    lost = crash_at - (resume["step"] or 0)
    total = (step1["t"] if step1 else resume["t"]) - crash["t"]
    return (name, f"{resume['source']} (step {resume['step']})", *cells, f"**{total:.2f} s**",
            f"{lost} ({lost * step_s:.1f} s)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-gb", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--crash-at", type=int, default=8)
    p.add_argument("--storage-interval", type=int, default=5)
    p.add_argument("--out", default=os.path.join(REPO, "bench_out", "recovery.md"))
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="flashckpt-recovery-")
    flags = model_flags(args.state_gb) + ["--steps", str(args.steps), "--save_storage_interval",
                                          str(args.storage_interval)]
    crash = ["--crash_at_step", str(args.crash_at)]
    agent = ["flashckpt.launcher", "--max_restarts", "1"]
    rows = []
    try:
        res: dict[str, tuple[int, list[dict], float]] = {}
        # "disk": snapshots only at persist steps and a saver that frees memory as soon as its clients are
        # gone (grace 0), so the restart loads the last persisted checkpoint from storage.
        runs: tuple[tuple[str, list[str], list[str], dict[str, str]], ...] = (("flashckpt-run", agent, crash + ["--save_memory_interval", "1"], {}),
                ("flashckpt-run, last words before the restart", agent, crash + ["--save_memory_interval", "1"],
                 {"FLASHCKPT_LAST_WORDS_BLOCKING": "1"}),
                # (a fresh rendezvous store per attempt, as flashckpt-run sets: torch's shared one makes
                # about a third of gloo restarts hang, pytorch/pytorch#135712)
                ("torchrun + load from disk", ["torch.distributed.run", "--max_restarts", "1"],
                 crash + ["--save_memory_interval", "0"],
                 {"FLASHCKPT_SAVER_GRACE_S": "0", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
                ("torchrun", ["torch.distributed.run"], ["--save_memory_interval", "1"], {}))
        for name, launcher, extra, env in runs:
            ckpt, metrics = os.path.join(work, f"run{len(res)}"), os.path.join(work, f"run{len(res)}.jsonl")
            t0 = time.perf_counter()
            rc = run(launcher, ckpt, metrics, f"rec-{len(res)}-{os.getpid()}", flags + extra,
                     dict(env, FLASHCKPT_LAUNCH_EVENTS=metrics))
            res[name] = (rc, events(metrics), time.perf_counter() - t0)
            print(f"[bench_recovery] {name}: exit {rc}, {time.perf_counter() - t0:.0f} s", flush=True)
        ref = res["torchrun"][1]
        step_s = statistics.median(b["t"] - a["t"] for a, b in zip(ref, ref[1:])
                                   if a["event"] == b["event"] == "save" and b["step"] == a["step"] + 1)
        state_mb = max(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(work)
                       for f in fs if f.endswith(".pt")) / 2**20
        for name, *_ in runs[:3]:
            rc, ev, _ = res[name]
            rows.append(breakdown(name, ev, args.crash_at, step_s))
        mem_pause = [e["seconds"] for e in res["flashckpt-run"][1] if e["event"] == "save"]
        trun_pause = [e["seconds"] for e in res["torchrun"][1] if e["event"] == "save"]
        lines = [f"# Crash recovery, 2 CPU ranks, {state_mb:.0f} MB of model + AdamW state, "
                 f"{step_s:.2f} s per step", "",
                 "| launcher | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines += ["", "Each column runs from the end of the one before it: the agent noticing the failure (its "
                  "monitor polls every 0.1 s), stopping the surviving worker, the last-words persist when the "
                  "restart waits for it, the rendezvous, spawning the workers, their interpreter start and "
                  "imports (torch, flashckpt), the process group, building the model and the load, the first step.",
                  "", "| launcher | pause per snapshot (median) |", "|---|---|",
                  f"| flashckpt-run | {statistics.median(mem_pause) * 1e3:.1f} ms |",
                  f"| torchrun | {statistics.median(trun_pause) * 1e3:.1f} ms |", "",
                  "Crash -> resumed covers failure detection by the agent, the last-words persist, restarting 2 "
                  "workers (Python + torch import), rendezvous, process-group set-up and the load."]
        text = "\n".join(lines)
        print(text)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
