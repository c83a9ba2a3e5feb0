"""flashckpt at two revisions of its source, side by side in one run: the snapshot pause, the persist
throughput and the restore time from memory, on the same machine, rounds interleaved.

    python -m benchmarks.bench_revisions --before 64b9ccb [--after WORKTREE] [--size-gb 1.0] [--rounds 5]

What a reshaping of the code (issue #31's layered packages) must show: no cost. Each revision's
``flashckpt_core/`` is made importable as ``flashckpt`` from a directory of its own (``git archive`` of
``--before``; the working tree for ``--after`` unless a revision is given), and every measurement runs in
a fresh interpreter that imports only that copy, with its own runtime dir (so its own saver daemon, started
from that copy). Per round and revision, in alternating order:

* snapshot pause: ``engine.save(step, sd, storage_type=MEMORY)``, the time the call blocks (the first save,
  which sizes the segment and starts the saver, is left out), median of ``--saves``;
* persist throughput: a ``DISK`` save until ``wait()`` returns (committed), bytes / seconds (the first
  one, which starts the persist worker, is left out);
* restore: ``CheckpointEngine(dir).load()`` from the saver's shared memory in a new process (the engine's
  construction apart).

Informational only: it never passes or fails. The state dict is float32 tensors of 4-64 MiB
(a GPT-like mix of sizes), ``--size-gb`` in all. Only the public API (``CheckpointEngine``, ``StorageType``)
is used, so any revision since 0.1 runs.
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
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = "BENCH_REVISION "


def _state_dict(size_gb: float) -> dict[str, Any]:
    import torch

    total = int(size_gb * (1 << 30)) // 4
    sizes = [1 << 20, 4 << 20, 16 << 20, 2 << 20, 8 << 20]  # elements: 4-64 MiB tensors
    sd: dict[str, Any] = {}
    i = 0
    gen = torch.Generator().manual_seed(0)
    while total > 0:
        n = min(sizes[i % len(sizes)], total)
        sd[f"layer{i}.weight"] = torch.randn(n, generator=gen)
        total -= n
        i += 1
    return {"model": sd, "step": 0}


def child(pkg_dir: str, what: str, ckpt: str, size_gb: float, saves: int) -> None:
    """Runs in a fresh interpreter that imports flashckpt from ``pkg_dir`` only; prints one JSON line."""
    sys.path.insert(0, pkg_dir)
    import flashckpt
    from flashckpt import CheckpointEngine, StorageType

    assert os.path.realpath(flashckpt.__file__).startswith(os.path.realpath(os.path.join(pkg_dir, "flashckpt"))), \
        flashckpt.__file__
    out: dict[str, Any] = {}
    if what == "save":
        sd = _state_dict(size_gb)
        engine = CheckpointEngine(ckpt, max_to_keep=1)
        engine.save(1, sd, storage_type=StorageType.MEMORY)
        pauses = []
        for step in range(2, 2 + saves):
            t0 = time.perf_counter()
            engine.save(step, sd, storage_type=StorageType.MEMORY)
            pauses.append(time.perf_counter() - t0)
        engine.save(2 + saves, sd, storage_type=StorageType.DISK)  # starts the persist worker (not timed)
        engine.wait()
        t0 = time.perf_counter()
        engine.save(3 + saves, sd, storage_type=StorageType.DISK)
        engine.wait()
        out["persist_s"] = time.perf_counter() - t0
        out["pause_s"] = statistics.median(pauses)
        engine.close(release=False)  # the saver keeps the snapshot for the restore in a new process
    else:
        t0 = time.perf_counter()
        engine = CheckpointEngine(ckpt, max_to_keep=1)
        out["init_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        sd = engine.load()
        out["restore_s"] = time.perf_counter() - t0
        assert sd and engine.last_load is not None and engine.last_load.source == "memory", engine.last_load
        engine.close()
    print(TAG + json.dumps(out), flush=True)


def _package_dir(rev: str | None, work: str, label: str) -> str:
    """A directory holding ``flashckpt`` -> that revision's flashckpt_core (the working tree's for None)."""
    d = os.path.join(work, f"pkg-{label}")
    os.makedirs(d)
    if rev is None:
        src = os.path.join(REPO, "flashckpt_core")
    else:
        tree = os.path.join(work, f"src-{label}")
        os.makedirs(tree)
        archive = subprocess.run(["git", "-C", REPO, "archive", rev, "flashckpt_core"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        src = os.path.join(tree, "flashckpt_core")
    os.symlink(src, os.path.join(d, "flashckpt"))
    return d


def _run(pkg: str, what: str, ckpt: str, runtime: str, args: argparse.Namespace) -> dict[str, Any]:
    # PYTHONPATH: the saver daemon and persist worker this copy starts import the same copy
    env = dict(os.environ, FLASHCKPT_RUNTIME_DIR=runtime, PYTHONPATH=pkg)
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", pkg, what, ckpt,
                        str(args.size_gb), str(args.saves)], env=env, capture_output=True, text=True,
                       timeout=900, cwd=os.path.dirname(ckpt))
    for line in p.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])
    raise RuntimeError(f"{what} child failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="git revision to compare against (e.g. 64b9ccb)")
    ap.add_argument("--after", default=None, help="git revision (default: the working tree)")
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--saves", type=int, default=5, help="memory saves timed per round")
    ap.add_argument("--dir", default=None, help="checkpoint dirs under here (default: a temp dir on /tmp)")
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="flashckpt-revs-", dir=args.dir)
    labels = {"before": args.before, "after": args.after or "working tree"}
    try:
        pkgs = {"before": _package_dir(args.before, work, "before"), "after": _package_dir(args.after, work, "after")}
        samples: dict[str, dict[str, list[float]]] = {k: {} for k in pkgs}
        for r in range(args.rounds):
            for label in (("before", "after") if r % 2 == 0 else ("after", "before")):
                ckpt = os.path.join(work, f"ckpt-{label}-{r}")
                runtime = tempfile.mkdtemp(prefix=f"fct-rev-{label}-", dir="/dev/shm")
                try:
                    res = _run(pkgs[label], "save", ckpt, runtime, args)
                    res.update(_run(pkgs[label], "load", ckpt, runtime, args))
                finally:
                    _wait_runtime_idle(runtime)
                    shutil.rmtree(ckpt, ignore_errors=True)
                for k, v in res.items():
                    samples[label].setdefault(k, []).append(v)
                print(f"round {r + 1}/{args.rounds} {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in res.items()),
                      file=sys.stderr, flush=True)
        print(_report(samples, labels, args))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _wait_runtime_idle(runtime: str, timeout: float = 60.0) -> None:
    """The saver of ``runtime`` exits once its last engine closed with release; then its dir goes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = subprocess.run(["pgrep", "-f", runtime], capture_output=True).returncode == 0
        if not busy:
            break
        time.sleep(0.2)
    shutil.rmtree(runtime, ignore_errors=True)


def _report(samples: dict[str, dict[str, list[float]]], labels: dict[str, str], args: argparse.Namespace) -> str:
    nbytes = args.size_gb * (1 << 30)
    for s in samples.values():  # what a restarted trainer waits for: the engine and its load
        s["resume_s"] = [a + b for a, b in zip(s["init_s"], s["restore_s"])]
    med = {k: {m: statistics.median(v) for m, v in s.items()} for k, s in samples.items()}

    def row(name: str, key: str, rate: bool = False) -> str:
        cells = []
        for k in ("before", "after"):
            v = med[k][key]
            cells.append(f"{nbytes / v / 1e9:.2f} GB/s ({v:.3f} s)" if rate else f"{v * 1e3:.1f} ms")
        ratio = med["after"][key] / med["before"][key]
        return f"| {name} | {cells[0]} | {cells[1]} | {ratio:.2f}x |"

    return "\n".join([
        f"{args.size_gb:g} GiB float32 state dict, {args.rounds} rounds interleaved, medians "
        f"(before = {labels['before']}, after = {labels['after']}); time ratio after/before",
        "",
        "| measure | before | after | after/before (time) |",
        "|---|---|---|---|",
        row("snapshot pause: save(MEMORY)", "pause_s"),
        row("persist: save(DISK) until committed", "persist_s", rate=True),
        row("restore: load() from memory, new process", "restore_s"),
        row("  engine construction in that process", "init_s"),
        row("  construction + load (what a restart waits for)", "resume_s"),
    ])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]), int(sys.argv[6]))
    else:
        raise SystemExit(main())
