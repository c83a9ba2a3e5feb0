"""flashckpt demo (CPU): a 2-rank DDP job loses a rank mid-run and recovers from host memory.

1. Launches the small GPT of ``ddp_train.py`` on 2 gloo ranks with ``flashckpt-run --max_restarts 1``,
   snapshotting to memory every step and persisting every 10 steps. Rank 1 kills itself with SIGKILL
   after step 23. The node's saver persists and commits that newest snapshot as its last words (it
   notices the dead client; the launcher's agent also asks for it while it restarts both workers), and
   the workers resume from shared memory at step 23, not from the step-20 checkpoint on disk. The
   restarted workers are the launcher's warm workers: processes that had torch imported already.
2. Runs the same job without a crash and checks that both end with bit-identical weights.
3. Prints what happened, how long recovery took (crash to the first training step after it, per phase)
   against loading the disk checkpoint, and how long
   training paused per checkpoint against ``torch.save`` of the same state.
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
from collections.abc import Callable

import torch
from flashckpt.commit.layout import CommitLayout
from flashckpt.storage.posix import PosixDiskStorage

HERE = os.path.dirname(os.path.abspath(__file__))


def stream(cmd: list[str], env: dict[str, str], show: Callable[[str], None]) -> tuple[int, list[str]]:
    """Runs ``cmd`` and hands ``show`` each line of its output (stdout and stderr) as soon as it is written,
    not at the end: a training job's progress appears while it runs. Returns the exit code and every line."""
    lines: list[str] = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            show(lines[-1])
    return proc.returncode, lines


def _show(line: str) -> None:
    """Prints the job's lines a reader follows: the ranks' own and the launcher's last words."""
    if line.startswith("[rank ") or "last words" in line:
        print("   ", line, flush=True)


def launch(ckpt_dir: str, metrics: str, job: str, *extra: str) -> int:
    cmd = [sys.executable, "-m", "flashckpt.launch.launcher", "--nproc_per_node", "2", "--standalone",
           "--max_restarts", "1", os.path.join(HERE, "ddp_train.py"), "--checkpoint_dir", ckpt_dir,
           "--metrics", metrics, "--resume", *extra]
    env = dict(os.environ, FLASHCKPT_JOB_ID=job, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               FLASHCKPT_LAUNCH_EVENTS=metrics)  # the agent's events beside the workers' (the breakdown)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    rc, lines = stream(cmd, env, _show)
    if rc != 0:
        print("\n".join(lines)[-4000:])
        raise SystemExit(f"the training job failed (exit {rc}); its output is above")
    return rc


def events(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--crash_at_step", type=int, default=23)
    p.add_argument("--storage_interval", type=int, default=10)
    p.add_argument("--keep", action="store_true", help="keep the checkpoint dirs")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="flashckpt-demo-")
    job = f"demo-{os.getpid()}"
    common = ["--steps", str(args.steps), "--save_memory_interval", "1",
              "--save_storage_interval", str(args.storage_interval)]
    ckpt, metrics = os.path.join(work, "ckpt"), os.path.join(work, "metrics.jsonl")
    try:
        print(f"== 1. flashckpt-run, 2 ranks; rank 1 is killed (SIGKILL) after step {args.crash_at_step}")
        rc = launch(ckpt, metrics, job, *common, "--crash_at_step", str(args.crash_at_step), "--compare_torch_save")
        ev = events(metrics)
        crash = next(e for e in ev if e["event"] == "crash")
        resume = [e for e in ev if e["event"] == "resume"][-1]
        end_resumed = [e for e in ev if e["event"] == "end"][-1]

        print("== 2. the same job without a crash, for reference")
        ref_dir, ref_metrics = os.path.join(work, "ref"), os.path.join(work, "ref.jsonl")
        launch(ref_dir, ref_metrics, job + "-ref", *common)
        end_ref = [e for e in events(ref_metrics) if e["event"] == "end"][-1]

        disk_step = (args.crash_at_step // args.storage_interval) * args.storage_interval
        disk_file = os.path.join(ckpt, f"step_{disk_step}", "checkpoint.pt")
        t0 = time.perf_counter()
        torch.load(disk_file, weights_only=True)
        disk_load_s = time.perf_counter() - t0
        step_s = statistics.median(b["t"] - a["t"] for a, b in zip(ev, ev[1:])
                                   if a["event"] == b["event"] == "save" and b["step"] == a["step"] + 1)

        mem = [e["seconds"] for e in ev if e["event"] == "save" and e["storage"] == "memory"]
        disk = [e["seconds"] for e in ev if e["event"] == "save" and e["storage"] == "disk"]
        tsave = [e["seconds"] for e in ev if e["event"] == "torch_save"]
        state_mb = os.path.getsize(disk_file) / 2**20
        lost = args.crash_at_step - disk_step
        print()
        print(f"## Result ({state_mb:.0f} MB of model + AdamW state, 2 CPU ranks, {step_s * 1e3:.0f} ms per step)")
        print()
        print("| checkpoint | training paused per checkpoint (median) |")
        print("|---|---|")
        print(f"| flashckpt, to memory | {statistics.median(mem) * 1e3:.1f} ms |")
        print(f"| flashckpt, to memory + background persist | {statistics.median(disk) * 1e3:.1f} ms |")
        print(f"| torch.save of the same state | {statistics.median(tsave) * 1e3:.1f} ms |")
        print()
        print("| after the crash | |")
        print("|---|---|")
        print(f"| rank 1 killed after | step {crash['step']} |")
        print(f"| resumed from | **{resume['source']}**, step {resume['step']} (newest periodic disk checkpoint: "
              f"step {disk_step}) |")
        print(f"| steps lost | {args.crash_at_step - (resume['step'] or 0)} (a restart from disk loses {lost}, "
              f"{lost * step_s:.1f} s of training) |")
        after = [e for e in ev if e["t"] >= crash["t"]]

        def at(name: str) -> float:
            return next(e["t"] for e in after if e["event"] == name) - crash["t"]

        warm = sum(e["event"] == "warm_worker_used" for e in after)
        print(f"| crash to first training step after resume | **{at('first_step'):.2f} s**: the agent noticing "
              f"the failure {at('failure_noticed'):.2f} s, stopping the group and a new rendezvous "
              f"{at('rendezvous_done') - at('failure_noticed'):.2f} s, {warm} warm workers (torch imported) "
              f"to the process group {at('started') - at('rendezvous_done'):.2f} s, model + load "
              f"{resume['t'] - crash['t'] - at('started'):.2f} s, one step {at('first_step') - at('resume'):.2f} s "
              "(the last snapshot is persisted beside all this) |")
        print(f"| of which the load | {resume['seconds'] * 1e3:.1f} ms from memory (torch.load of the "
              f"step-{disk_step} file: {disk_load_s * 1e3:.1f} ms) |")
        committed = sorted(CommitLayout(ckpt, PosixDiskStorage()).committed_steps())
        print(f"| committed checkpoints | steps {committed} (step {args.crash_at_step}: the saver's last words after the crash) |")
        same = end_resumed["digest"] == end_ref["digest"]
        print(f"| final weights equal an uninterrupted run | {'yes' if same else 'NO'} |")
        ok = rc == 0 and resume["source"] == "memory" and resume["step"] == args.crash_at_step and same
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
