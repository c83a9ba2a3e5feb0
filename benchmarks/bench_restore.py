"""Restore from memory after a restart, against the copy limit (never a pass/fail test).

A GPT state of ``--size-gb`` (model + Adam state, fp32) is snapshotted into shared memory once; then each
round starts fresh interpreters, as restarted trainers, that build the model's tensors (every page
touched) and time, in that one process:

* ``load(into=the model's tensors)``: the first restore of the process (the one a restart pays);
* ``load()``: into new memory;
* the limits of the same bytes on this machine: ``memmove`` between resident buffers on the copier's
  threads, torch's ``copy_`` between resident tensors, and ``clone()`` (new memory + copy).

Variants show what each part of the restore path buys: ``before`` is the previous path (map the segment,
MADV_POPULATE_READ, memmove; Python's collector free to start a full collection in the middle), ``+ file
reads`` reads the segment file into the destinations with preadv instead (on a huge-page tmpfs, where
the mapping is faster, only ``load()`` does), ``+ collector held`` is the current path. With root, the
same again with the runtime dir on a tmpfs mounted ``huge=always`` (a segment of 2 MiB pages).

Usage: ``python -m benchmarks.bench_restore [--size-gb 1] [--rounds 3] [--out bench_out/restore.md]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._common import (  # noqa: E402
    REPO_ROOT,
    GPTConfig,
    build_gpt_state_dict,
    fmt_time,
    gpt_config_for_bytes,
    iter_tensors,
    machine_info,
    markdown_table,
    median,
    timed,
    write_json,
)

VARIANTS = ("before: mapping", "+ file reads", "+ collector held (now)")
TAG = "BENCH_RESTORE "


def _apply(variant: str) -> None:
    """Puts the restore path of ``variant`` in place (the earlier ones by switching parts of the current
    one off in this child process)."""
    from flashckpt.engine import engine
    from flashckpt.format import segment
    from flashckpt.memory import reader as snapshot_reader

    if variant != VARIANTS[2]:
        engine.gc_paused = contextlib.nullcontext  # type: ignore[misc,assignment]
        snapshot_reader.gc_paused = contextlib.nullcontext  # type: ignore[misc,assignment]
    if variant == VARIANTS[0]:
        segment.Segment.read_fd = lambda self: contextlib.nullcontext(None)  # type: ignore[method-assign,assignment,return-value]


def child(ckpt: str, cfg_json: str, variant: str) -> None:
    from flashckpt import CheckpointEngine
    from flashckpt.config import Knobs
    from flashckpt.util.copy import Copier

    cfg = GPTConfig(**json.loads(cfg_json))
    model = build_gpt_state_dict(cfg, fill="zeros")
    dst = list(iter_tensors(model))
    for t in dst:
        t.fill_(1)  # a model that exists before the load: every page touched
    _apply(variant)
    eng = CheckpointEngine(ckpt, max_to_keep=1)
    out: dict[str, Any] = {"variant": variant}
    out["into_s"] = timed(lambda: eng.load(into=model))[0]
    out["load_s"], loaded = timed(eng.load)
    src = list(iter_tensors(loaded))  # resident now: the source of the limits
    out["bytes"] = sum(t.numel() * t.element_size() for t in src)
    copier = Copier(Knobs.from_env().copy_threads)
    tasks = [(d.data_ptr(), s.data_ptr(), d.numel() * d.element_size()) for d, s in zip(dst, src)]
    out["memmove_s"] = min(timed(lambda: copier.run(tasks))[0] for _ in range(3))
    out["copy_s"] = min(timed(lambda: [d.copy_(s) for d, s in zip(dst, src)])[0] for _ in range(3))
    out["clone_s"], _clones = timed(lambda: [s.clone() for s in src])
    copier.close()
    eng.close()
    print(TAG + json.dumps(out), flush=True)


def _mount_huge(path: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=always,mode=700", "tmpfs", path],
                          stderr=subprocess.DEVNULL).returncode == 0


def run_setup(label: str, runtime: str, cfg: GPTConfig, rounds: int, work: str) -> list[dict[str, Any]]:
    from flashckpt import CheckpointEngine, StorageType

    env = dict(os.environ, FLASHCKPT_RUNTIME_DIR=runtime, FLASHCKPT_JOB_ID=f"restore-{os.getpid()}-{label}",
               PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]))
    ckpt = os.path.join(work, label)
    os.makedirs(ckpt, exist_ok=True)
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        eng = CheckpointEngine(ckpt, max_to_keep=1)
        eng.save(1, build_gpt_state_dict(cfg), storage_type=StorageType.MEMORY)
        eng.wait_snapshot()
        results = []
        for r in range(rounds):
            for v in VARIANTS:
                proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_restore", "--child", ckpt,
                                       json.dumps(asdict(cfg)), v], env=env, cwd=REPO_ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(TAG)), None)
                if line is None:
                    print(proc.stdout[-3000:], file=sys.stderr)
                    continue
                res = json.loads(line[len(TAG):])
                res.update(setup=label, round=r)
                results.append(res)
                print(f"  {label:>10} round {r} {v:<24} into {fmt_time(res['into_s']):>9}  "
                      f"load {fmt_time(res['load_s']):>9}  copy_ {fmt_time(res['copy_s']):>9}", flush=True)
        eng.close(release=True)
        return results
    finally:
        os.environ.clear()
        os.environ.update(saved)


def report(results: list[dict[str, Any]], gb: float) -> str:
    rows = []
    for setup in dict.fromkeys(r["setup"] for r in results):
        for v in VARIANTS:
            rs = [r for r in results if r["setup"] == setup and r["variant"] == v]
            if not rs:
                continue

            def ratio(a: str, b: str, rs: list[dict[str, Any]] = rs) -> str:
                return f"{median([r[a] / r[b] for r in rs]):.2f}x"

            rows.append([setup, v, f"{fmt_time(median([r['into_s'] for r in rs]))}",
                         ratio("into_s", "copy_s"), ratio("into_s", "memmove_s"),
                         f"{fmt_time(median([r['load_s'] for r in rs]))}", ratio("load_s", "clone_s")])
    lim = [["limits (same process, same bytes)", "", "copy_ " + fmt_time(median([r["copy_s"] for r in results])),
            "", "memmove " + fmt_time(median([r["memmove_s"] for r in results])),
            "clone " + fmt_time(median([r["clone_s"] for r in results])), ""]]
    return (f"Restore of a {gb:.2f} GB GPT state from memory in a fresh process (median of rounds; "
            "ratios: median of per-process ratios)\n\n"
            + markdown_table(["segment on", "restore path", "load(into=model)", "x copy_", "x memmove",
                              "load()", "x clone()"], rows + lim))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "bench_out", "restore.md"))
    args = p.parse_args()
    cfg = gpt_config_for_bytes(args.size_gb * 1e9)
    work = tempfile.mkdtemp(prefix="flashckpt-restore-")
    huge = os.path.join(work, "huge-tmpfs")
    os.makedirs(huge)
    mounted = _mount_huge(huge)
    results: list[dict[str, Any]] = []
    try:
        shm = tempfile.mkdtemp(prefix="flashckpt-restore-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            results += run_setup("/dev/shm", shm, cfg, args.rounds, work)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        if mounted:
            rt = os.path.join(huge, "rt")
            os.makedirs(rt, mode=0o700)
            results += run_setup("huge tmpfs", rt, cfg, args.rounds, work)
        else:
            print("(no huge-page tmpfs: needs root to mount one)")
    finally:
        if mounted:
            subprocess.run(["umount", "-l", huge])
        shutil.rmtree(work, ignore_errors=True)
    if not results:
        return 1
    text = report(results, results[0]["bytes"] / 1e9)
    info = machine_info()
    text += f"\n\n{info.get('cpu', '?')}, {info.get('cores', '?')} cores, torch {torch.__version__}\n"
    print()
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    write_json(os.path.splitext(args.out)[0] + ".json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
