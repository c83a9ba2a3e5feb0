"""Training overhead of checkpointing: the DDP example on 2 gloo ranks (CPU), with each checkpointing mode.

    python -m benchmarks.overhead [--steps 60] [--save-every 10] [--rounds 3] [--quick] [--out bench_out]
    python -m benchmarks.run --overhead ...          # the same, after the checkpoint benchmark

Runs ``examples/ddp_train.py`` under ``torch.distributed.run --nproc_per_node 2`` for a fixed number of steps:

* ``none``: no checkpointing (the baseline);
* ``torch_save``: rank 0 ``torch.save`` every ``--save-every`` steps;
* ``dcp_async``: DCP ``async_save`` on both ranks every ``--save-every`` steps (default stager; ``dcp_async_shm``,
  with a reused shared-memory ``DefaultStager``, on request via ``--modes``);
* ``flashckpt``: a memory snapshot every step and a persist every ``--save-every`` steps;
* ``flashckpt_mem``: memory snapshots every step and no persist: beside ``flashckpt``, what the persists add;
* ``flashckpt_overlap``: the same with overlapped snapshots (when the engine has them).

Rounds are interleaved (every mode once per round, the order rotated). Per run it takes rank 0's wall
time of each step after the first ``--save-every`` steps (one-off costs such as allocating snapshot memory
fall in that warm-up) and reports the median step and the mean step (total time / steps: it includes the
steps that checkpoint, which a median hides). The overhead is mean(mode) / mean(none) - 1 of the same
round, median over rounds. For flashckpt it also reads the CPU time the saver daemon spent over the measured
steps (``CheckpointEngine.saver_cpu_seconds``), per persist and as a share of the host's cores over that
time: what the background persists can at most take from training, whatever the noise of the step times.
Informational only; writes ``<out>/overhead.md`` and ``<out>/overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (  # noqa: E402
    REPO_ROOT,
    fmt_time,
    loadavg_note,
    logger,
    machine_info,
    markdown_table,
    median,
    rotated,
    write_json,
)

log = logger("overhead")
TRAIN = os.path.join(REPO_ROOT, "examples", "ddp_train.py")

MODES: dict[str, tuple[str, list[str]]] = {
    "none": ("no checkpointing", ["--ckpt_mode", "none"]),
    "torch_save": ("torch.save every k steps (rank 0)", ["--ckpt_mode", "torch_save"]),
    "dcp_async": ("DCP async_save every k steps", ["--ckpt_mode", "dcp_async"]),
    "dcp_async_shm": ("DCP async_save every k steps (shared-memory stager)",
                      ["--ckpt_mode", "dcp_async", "--dcp_stager", "shm"]),
    "flashckpt": ("flashckpt: memory snapshot every step, persist every k", ["--ckpt_mode", "flashckpt",
                                                                             "--save_memory_interval", "1"]),
    "flashckpt_mem": ("flashckpt: memory snapshot every step, no persist",
                      ["--ckpt_mode", "flashckpt", "--save_memory_interval", "1", "--save_every", "0",
                       "--save_storage_interval", "0"]),
    "flashckpt_overlap": ("flashckpt, overlapped snapshots", ["--ckpt_mode", "flashckpt",
                                                              "--save_memory_interval", "1", "--overlap"]),
}


def has_overlap() -> bool:
    try:
        from flashckpt import CheckpointEngine
    except ImportError:
        return False
    return hasattr(CheckpointEngine, "wait_snapshot")


def run_once(mode: str, r: int, args: argparse.Namespace, work: str) -> dict[str, Any]:
    """One training run; rank 0's per-step times and the pauses of its saves."""
    ckpt = os.path.join(work, f"{mode}-r{r}")
    metrics = ckpt + ".jsonl"
    shutil.rmtree(ckpt, ignore_errors=True)
    if os.path.exists(metrics):
        os.unlink(metrics)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", TRAIN,
           "--checkpoint_dir", ckpt, "--metrics", metrics, "--steps", str(args.steps),
           "--save_every", str(args.save_every), *MODES[mode][1], *args.model_flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FLASHCKPT_SAVER_GRACE_S="5",
               FLASHCKPT_JOB_ID=f"overhead-{os.getpid()}-{mode}-{r}",
               PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=args.timeout, cwd=REPO_ROOT)
        rc, tail = p.returncode, p.stdout[-2000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = -1, f"timed out after {args.timeout} s: {str(e.stdout or '')[-1500:]}"
    wall = time.perf_counter() - t0
    try:
        with open(metrics) as f:
            events = [json.loads(line) for line in f if line.strip()]
    except OSError:
        events = []
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
        if os.path.exists(metrics):
            os.unlink(metrics)
    end = next((e for e in events if e.get("event") == "end"), None)
    if rc != 0 or end is None or "step_seconds" not in end:
        return {"mode": mode, "round": r, "error": f"exit {rc}: {tail.strip()[-1500:]}"}
    steps = end["step_seconds"]
    first = int(end.get("first_step", 1))
    window = [s for i, s in enumerate(steps, start=first) if i > args.warmup]
    saves = [e for e in events if e.get("event") == "save" and e.get("step", 0) > args.warmup]
    persist_kinds = ("disk", "torch_save", "dcp_async")
    # the saver's CPU over the measured steps: from the last save up to the warm-up's end to the end event
    # (which follows the wait for the last persist)
    before = [e["saver_cpu_s"] for e in events
              if e.get("event") == "save" and e.get("step", 0) <= args.warmup and e.get("saver_cpu_s") is not None]
    saver_cpu = end["saver_cpu_s"] - before[-1] if before and end.get("saver_cpu_s") is not None else None
    return {"mode": mode, "round": r, "wall_s": wall, "steps_measured": len(window),
            "window_s": sum(window), "saver_cpu_s": saver_cpu,
            "persists": sum(1 for e in saves if e["storage"] == "disk"),
            "mean_step_s": sum(window) / len(window) if window else float("nan"),
            "median_step_s": median(window), "step_seconds": steps, "digest": end.get("digest"),
            "pause_memory_s": median([e["seconds"] for e in saves if e["storage"] == "memory"]),
            "pause_persist_s": median([e["seconds"] for e in saves if e["storage"] in persist_kinds]),
            "saves": len(saves)}


def summarize(runs: list[dict[str, Any]], modes: list[str], rounds: int, ncores: int) -> dict[str, Any]:
    by = {m: {r["round"]: r for r in runs if r["mode"] == m and "error" not in r} for m in modes}
    base = by.get("none", {})
    out: dict[str, Any] = {}
    for m in modes:
        ok = by[m]
        res: dict[str, Any] = {"label": MODES[m][0], "rounds_ok": len(ok)}
        if ok:
            res["mean_step_s"] = median([x["mean_step_s"] for x in ok.values()])
            res["median_step_s"] = median([x["median_step_s"] for x in ok.values()])
            res["pause_memory_s"] = median([x["pause_memory_s"] for x in ok.values() if x["pause_memory_s"] == x["pause_memory_s"]])
            res["pause_persist_s"] = median([x["pause_persist_s"] for x in ok.values() if x["pause_persist_s"] == x["pause_persist_s"]])
            paired = [ok[r]["mean_step_s"] / base[r]["mean_step_s"] - 1 for r in range(rounds) if r in ok and r in base]
            paired_med = [ok[r]["median_step_s"] / base[r]["median_step_s"] - 1 for r in range(rounds)
                          if r in ok and r in base]
            res["overhead_pct"] = 100 * median(paired) if paired else float("nan")
            res["overhead_median_step_pct"] = 100 * median(paired_med) if paired_med else float("nan")
            res["overhead_pct_per_round"] = [100 * x for x in paired]
            cpu = [x for x in ok.values() if x.get("saver_cpu_s") is not None]
            if cpu:
                res["saver_cpu_s"] = median([x["saver_cpu_s"] for x in cpu])
                res["saver_cpu_share_pct"] = median([100 * x["saver_cpu_s"] / (x["window_s"] * ncores) for x in cpu])
                if any(x["persists"] for x in cpu):
                    res["saver_cpu_per_persist_s"] = median([x["saver_cpu_s"] / x["persists"] for x in cpu
                                                             if x["persists"]])
        out[m] = res
    return out


def render(summary: dict[str, Any], args: argparse.Namespace, errors: list[str]) -> str:
    rows = []
    for m, s in summary.items():
        if "mean_step_s" not in s:
            rows.append([s["label"], "failed", "", "", "", ""])
            continue
        ov = "baseline" if m == "none" else f"{s['overhead_pct']:+.1f} %"
        ovm = "" if m == "none" else f"{s['overhead_median_step_pct']:+.1f} %"
        rows.append([s["label"], fmt_time(s["median_step_s"]), fmt_time(s["mean_step_s"]), ov, ovm,
                     " / ".join(x for x in (fmt_time(s["pause_memory_s"]) if s["pause_memory_s"] == s["pause_memory_s"] else "",
                                           fmt_time(s["pause_persist_s"]) if s["pause_persist_s"] == s["pause_persist_s"] else "")
                                if x)])
    text = markdown_table(["mode", "median step", "mean step", "overhead (mean step)", "overhead (median step)",
                           "pause per snapshot / persist"], rows, "lrrrrr")
    text += (f"\n\n2 gloo ranks on CPU, {args.steps} steps, a persist every {args.save_every} steps; steps "
             f"{args.warmup + 1}-{args.steps} measured; medians over {args.rounds} interleaved rounds. Overhead = mean "
             "step time / the no-checkpoint run's of the same round - 1. Pauses: rank 0's time inside the save call "
             "(memory snapshots / persist or torch.save / async_save calls).")
    cpu_rows = [[s["label"], fmt_time(s["saver_cpu_s"]),
                 fmt_time(s["saver_cpu_per_persist_s"]) if "saver_cpu_per_persist_s" in s else "",
                 f"{s['saver_cpu_share_pct']:.2f} %"] for s in summary.values() if "saver_cpu_s" in s]
    if cpu_rows:
        text += "\n\n" + markdown_table(["mode", "saver CPU over the measured steps", "per persist",
                                          "share of the host's cores"], cpu_rows, "lrrr")
        text += ("\n\nThe saver daemon's user + system CPU time over the measured steps (/proc), and that time over "
                 "the measured wall time times the cores: the most the background work can take from training.")
    if errors:
        text += "\n\nNotes:\n\n" + "\n".join(f"- {e}" for e in errors)
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 80; --quick 40)")
    p.add_argument("--save-every", type=int, default=10, help="persist (torch.save, DCP, flashckpt DISK) interval")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; --quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the timing (default: --save-every)")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated, from {','.join(MODES)} (default: none,torch_save,dcp_async,flashckpt and "
                        "flashckpt_overlap when the engine has it)")
    p.add_argument("--model", default="", help="extra model flags for ddp_train.py, e.g. '--dim 384 --layers 6'")
    p.add_argument("--quick", action="store_true", help="40 steps, 2 rounds")
    p.add_argument("--timeout", type=float, default=600, help="seconds per training run")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "bench_out"), help="directory for overhead.md / .json")
    args = p.parse_args(argv)
    args.steps = args.steps or (40 if args.quick else 80)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.warmup = args.save_every if args.warmup is None else args.warmup
    if args.save_every < 1 or args.rounds < 1 or args.warmup >= args.steps:
        p.error("need --save-every >= 1, --rounds >= 1 and --warmup < --steps")
    default = ["none", "torch_save", "dcp_async", "flashckpt"] + (["flashckpt_overlap"] if has_overlap() else [])
    args.modes = [m.strip() for m in args.modes.split(",")] if args.modes else default
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown --modes {bad}; choose from {list(MODES)}")
    if "none" not in args.modes:
        args.modes.insert(0, "none")
    args.model_flags = args.model.split()
    args.out = os.path.abspath(args.out)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ncores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load0 = os.getloadavg()[0]
    wall0 = time.perf_counter()
    work = os.path.join(args.out, "work", "overhead")
    os.makedirs(work, exist_ok=True)
    runs: list[dict[str, Any]] = []
    errors: list[str] = []
    for r in range(args.rounds):
        for mode in rotated(args.modes, r):
            log(f"round {r + 1}/{args.rounds}: {mode}")
            res = run_once(mode, r, args, work)
            if "error" in res:
                errors.append(f"{mode}, round {r + 1}: {res['error'][-600:]}")
                log(f"{mode} failed: {res['error'][-600:]}")
            else:
                log(f"{mode}: mean step {fmt_time(res['mean_step_s'])}, median {fmt_time(res['median_step_s'])}")
            runs.append(res)
    shutil.rmtree(work, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(work))
    except OSError:
        pass
    digests = {r.get("digest") for r in runs if "error" not in r}
    if len(digests) > 1:
        errors.append(f"the runs ended with different weights ({len(digests)} digests): checkpointing changed training")
    note = loadavg_note(load0, ncores)
    if note:
        errors.append(note)
    summary = summarize(runs, args.modes, args.rounds, ncores)
    text = render(summary, args, errors)
    print(text)
    cmd = "python -m benchmarks.overhead " + " ".join(argv if argv is not None else sys.argv[1:])
    info = machine_info()
    info["bench_wall_s"] = round(time.perf_counter() - wall0, 1)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "overhead.md"), "w") as f:
        f.write(f"# Training overhead of checkpointing\n\nCommand: `{cmd.strip()}`\n\n{text}\n")
    write_json(os.path.join(args.out, "overhead.json"),
               {"command": cmd.strip(), "machine": info,
                "config": {"steps": args.steps, "save_every": args.save_every, "rounds": args.rounds,
                           "warmup": args.warmup, "model_flags": args.model_flags, "ranks": 2},
                "modes": summary, "runs": runs, "notes": errors})
    log(f"done in {time.perf_counter() - wall0:.0f} s; wrote {args.out}/overhead.md and overhead.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
