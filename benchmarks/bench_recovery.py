"""Crash recovery and launcher overhead, measured with real processes (never a pass/fail test).

Runs ``examples/ddp_train.py`` on 2 gloo ranks with a GPT sized to ``--state-gb`` of model + AdamW state:

1. under ``flashckpt-run --max_restarts 1`` with a memory snapshot every step and a persist every
   ``--storage-interval`` steps; rank 1 is SIGKILLed after step ``--crash-at``; the agent restarts the
   workers and they resume from shared memory;
2. the same with snapshots only at persist steps and no memory kept across the crash (what a disk-only
   checkpointer gives): the restart loads the last persisted step from storage and redoes the lost steps;
3. plain ``torchrun`` without a crash, to compare the pause per snapshot with (1): the launcher adds none.

Reports crash -> training resumed (wall clock between the crash event and the resume event, which
covers failure detection, last words, worker restart, rendezvous and the load), the load itself, and
the lost work. Usage: ``python -m benchmarks.bench_recovery [--state-gb 1.0] [--out bench_out/recovery.md]``.
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
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if out.returncode != 0:
        print(out.stdout[-3000:], file=sys.stderr)
    return out.returncode


def events(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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
        res = {}
        # "disk": snapshots only at persist steps and a saver that frees memory as soon as its clients are
        # gone (grace 0), so the restart loads the last persisted checkpoint from storage.
        for name, launcher, extra, env in (
                ("memory", agent, crash + ["--save_memory_interval", "1"], {}),
                ("disk", agent, crash + ["--save_memory_interval", "0"], {"FLASHCKPT_SAVER_GRACE_S": "0"}),
                ("torchrun", ["torch.distributed.run"], ["--save_memory_interval", "1"], {})):
            ckpt, metrics = os.path.join(work, name), os.path.join(work, name + ".jsonl")
            t0 = time.perf_counter()
            rc = run(launcher, ckpt, metrics, f"rec-{name}-{os.getpid()}", flags + extra, env)
            ev = events(metrics)
            res[name] = (rc, ev, time.perf_counter() - t0)
            print(f"[bench_recovery] {name}: exit {rc}, {time.perf_counter() - t0:.0f} s", flush=True)
        step_s = statistics.median(b["t"] - a["t"] for a, b in zip(res["torchrun"][1], res["torchrun"][1][1:])
                                   if a["event"] == b["event"] == "save" and b["step"] == a["step"] + 1)
        state_mb = max(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(work, "torchrun"))
                       for f in fs if f.endswith(".pt")) / 2**20
        for name in ("memory", "disk"):
            rc, ev, _ = res[name]
            c = next(e for e in ev if e["event"] == "crash")
            r = [e for e in ev if e["event"] == "resume"][-1]
            lost = args.crash_at - (r["step"] or 0)
            rows.append((f"restart from {r['source']} (step {r['step']})", f"{r['t'] - c['t']:.1f} s",
                         f"{r['seconds']:.2f} s", f"{lost} ({lost * step_s:.1f} s)",
                         f"{r['t'] - c['t'] + lost * step_s:.1f} s"))
        mem_pause = [e["seconds"] for e in res["memory"][1] if e["event"] == "save"]
        trun_pause = [e["seconds"] for e in res["torchrun"][1] if e["event"] == "save"]
        lines = [f"# Crash recovery, 2 CPU ranks, {state_mb:.0f} MB of model + AdamW state, "
                 f"{step_s:.2f} s per step", "",
                 "| restart | crash -> training resumed | of which load | steps lost (time) | total time lost |",
                 "|---|---|---|---|---|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines += ["", "| launcher | pause per snapshot (median) |", "|---|---|",
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
