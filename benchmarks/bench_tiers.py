"""Tiers, side by side (issue #32): memory, then a node-local disk, then the object store, against flashckpt
straight to the store and the recipe users write today.

    python -m benchmarks.bench_tiers [--server seaweedfs] [--sizes 1,4] [--outage-s 60] [--quick] [--out bench_out/]

Informational only: it never passes or fails. It starts a local S3-compatible server (``benchmarks._s3server``,
``--server``) and prints two markdown tables (every sample also goes to ``<out>/bench_tiers.json``).

**Saves**, for each size (a GPT-like state dict, ``benchmarks._common``), one system in memory at a time, each
warmed by a first save that is not measured:

* flashckpt with tiers: ``CheckpointEngine("s3://bucket/tiers", local_dir=<disk>)``, ``save(DISK)``: the
  training pause (the ``save`` call), the time to the local commit (the local tier's commit records, polled
  every 5 ms) and to the durable commit (``wait()``);
* flashckpt straight to the store: ``CheckpointEngine("s3://bucket/direct")``, the pause and the commit;
* the recipe: ``torch.save`` to a local file (fsynced; the pause is all of it, and it is the local copy),
  then boto3 ``upload_file`` (the durable copy);
* the limits of this machine: writing the bytes to the local disk (direct I/O, 64 MiB writes, fsync) and boto3's
  ``upload_file`` of a file already on disk (the store's speed from this client).

**Goodput with the store down**, a simulated job (a 200 MB state, a 0.25 s step, ``save(DISK)`` every 4 steps,
``--outage-s`` of a store that answers every request with 500 InternalError through the fault proxy of the test suite,
starting 10 s in, then 30 s more): the share of the training time spent on steps kept (the final ``wait()``
for storage to catch up is shown beside it, not counted: a longer job overlaps it with later steps), the steps
redone, the largest lag ``engine.durability()`` reported and whether every step the store should hold reached it, for
tiers + ``on_persist_error="warn"``, straight to the store with "warn", and straight to the store with
"raise", where the error ends the job and a restart (a new engine, ``load()``) follows at once, as under an
orchestrator that restarts failed jobs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (  # noqa: E402
    GB,
    REPO_ROOT,
    build_gpt_state_dict,
    fmt_bytes,
    fmt_time,
    fs_free,
    gpt_config_for_bytes,
    logger,
    machine_info,
    markdown_table,
    mem_available,
    tensor_bytes,
    write_json,
)
from benchmarks._s3server import SERVERS, LocalS3, start_server  # noqa: E402

log = logger("bench_tiers")
_POLL_S = 0.005


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_tiers", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", choices=SERVERS, default="seaweedfs", help="the local S3-compatible server")
    p.add_argument("--sizes", default="1,4", help="state sizes in GB, comma-separated")
    p.add_argument("--outage-s", type=float, default=60.0, help="how long the store is down in the goodput run")
    p.add_argument("--no-goodput", action="store_true", help="skip the goodput run")
    p.add_argument("--quick", action="store_true", help="0.25 GB, a 15 s outage")
    p.add_argument("--out", default="bench_out", help="where the JSON goes")
    p.add_argument("--tmp-dir", default="", help="the local tier and the recipe's file (default: the temp dir)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ saves
def _local_committed(local_dir: str) -> list[int]:
    from flashckpt.commit.layout import CommitLayout
    from flashckpt.storage.posix import PosixDiskStorage

    try:
        return CommitLayout(local_dir, PosixDiskStorage()).committed_steps()
    except Exception:  # not readied yet
        return []


def _timed_save(engine: Any, step: int, sd: Any, local_dir: str | None) -> dict[str, float]:
    from flashckpt import StorageType

    t0 = time.perf_counter()
    engine.save(step, sd, storage_type=StorageType.DISK)
    out = {"pause": time.perf_counter() - t0}
    if local_dir is not None:
        while step not in _local_committed(local_dir):
            time.sleep(_POLL_S)
        out["local"] = time.perf_counter() - t0
    engine.wait()
    out["durable"] = time.perf_counter() - t0
    return out


def bench_flashckpt(url: str, sd: Any, local_dir: str | None) -> dict[str, float]:
    from flashckpt import CheckpointEngine

    kw: dict[str, Any] = {"local_dir": local_dir} if local_dir else {}
    with CheckpointEngine(url, max_to_keep=1, **kw) as engine:
        _timed_save(engine, 1, sd, local_dir)  # warm: the persist worker, both slots, the store's first objects
        res = _timed_save(engine, 2, sd, local_dir)
    return res


def bench_recipe(srv: LocalS3, sd: Any, path: str) -> dict[str, float]:
    import torch

    client = srv.client()
    res: dict[str, float] = {}
    for rnd in range(2):  # the first warms the client and the page cache's free pages
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        res["pause"] = res["local"] = time.perf_counter() - t0
        client.upload_file(path, srv.bucket, f"recipe/state_{rnd}.pt")
        res["durable"] = time.perf_counter() - t0
        res["upload"] = res["durable"] - res["local"]
    return res


def disk_limit(path: str, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to ``path`` and make them durable: direct I/O (``O_DIRECT``, 64 MiB aligned
    writes, then fsync), the way the persist worker writes; buffered writes + fsync where the file system
    refuses ``O_DIRECT``."""
    import mmap

    chunk = 64 << 20
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 20) * 64)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = os.open(path, flags)
    t0 = time.perf_counter()
    try:
        left = -(-nbytes // chunk) * chunk  # whole chunks: O_DIRECT writes whole blocks
        while left > 0:
            left -= os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    os.unlink(path)
    buf.close()
    return dt


def run_size(args: argparse.Namespace, srv: LocalS3, size_gb: float, tmp: str) -> dict[str, Any]:
    cfg = gpt_config_for_bytes(size_gb * GB)
    sd = build_gpt_state_dict(cfg)
    nbytes = tensor_bytes(sd)
    log(f"GPT {size_gb:g} GB ({fmt_bytes(nbytes)})")
    local = os.path.join(tmp, f"local_{size_gb:g}")
    out: dict[str, Any] = {"bytes": nbytes}
    out["tiers"] = bench_flashckpt(f"s3://{srv.bucket}/tiers_{size_gb:g}", sd, local)
    log(f"  tiers: {out['tiers']}")
    shutil.rmtree(local, ignore_errors=True)
    out["direct"] = bench_flashckpt(f"s3://{srv.bucket}/direct_{size_gb:g}", sd, None)
    log(f"  direct: {out['direct']}")
    path = os.path.join(tmp, "recipe.pt")
    out["recipe"] = bench_recipe(srv, sd, path)
    log(f"  recipe: {out['recipe']}")
    t0 = time.perf_counter()
    srv.client().upload_file(path, srv.bucket, "limit/state.pt")
    out["limit_upload"] = time.perf_counter() - t0
    os.unlink(path)
    out["limit_disk"] = disk_limit(path, nbytes)
    log(f"  limits: disk {out['limit_disk']:.2f} s, upload {out['limit_upload']:.2f} s")
    del sd
    return out


def save_table(results: dict[str, dict[str, Any]]) -> str:
    def cell(r: dict[str, float], k: str, nbytes: int) -> str:
        if k not in r:
            return "-"
        return f"{fmt_time(r[k])} ({nbytes / r[k] / GB:.2f} GB/s)" if k != "pause" else fmt_time(r[k])

    sizes = list(results)
    rows = []
    for name, key in (("flashckpt, tiers (memory → local disk → store)", "tiers"),
                      ("flashckpt, straight to the store", "direct"),
                      ("recipe: `torch.save` to a local file, then `upload_file`", "recipe")):
        for what, k in (("training paused", "pause"), ("committed on the local disk", "local"),
                        ("committed on the store (the lag)", "durable")):
            rows.append([f"{name}: {what}", *[cell(results[s][key], k, results[s]["bytes"]) for s in sizes]])
    rows.append(["limit: direct I/O write + fsync to the local disk",
                 *[cell({"x": results[s]["limit_disk"]}, "x", results[s]["bytes"]) for s in sizes]])
    rows.append(["limit: boto3 `upload_file` of a file on disk",
                 *[cell({"x": results[s]["limit_upload"]}, "x", results[s]["bytes"]) for s in sizes]])
    return markdown_table(["", *[f"GPT {s} ({fmt_bytes(results[s]['bytes'])})" for s in sizes]], rows)


# ------------------------------------------------------------------------------------------ goodput
_STEP_S = 0.25
_EVERY = 4


def _outage_proxy(srv: LocalS3) -> Any:
    sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "support"))
    from s3_proxy import FaultProxy

    return FaultProxy(srv.endpoint)


def goodput_run(srv: LocalS3, proxy: Any, name: str, tmp: str, *, tiers: bool, policy: str,
                outage: tuple[float, float], total_s: float) -> dict[str, Any]:
    """One simulated job (see the module docstring): steps of ``_STEP_S`` (sleep: the compute), ``save(DISK)``
    every ``_EVERY`` steps; the store down during ``outage`` (seconds from the start)."""
    import torch
    from flashckpt import CheckpointEngine, FlashCheckpointError, StorageType
    from s3_proxy import Fault

    url = f"s3://{srv.bucket}/goodput_{name}"
    local = os.path.join(tmp, f"goodput_{name}")
    kw: dict[str, Any] = {"local_dir": local} if tiers else {}
    sd = {"w": torch.randn(50_000_000)}  # 200 MB of fp32
    engine = CheckpointEngine(url, max_to_keep=2, on_persist_error=policy, **kw)
    start = time.perf_counter()
    step, kept_s, redone, restarts, max_lag = 0, 0.0, 0, 0, 0.0
    down = False

    def tick() -> float:  # the store goes down and comes back on time, whatever the job is doing
        nonlocal down
        now = time.perf_counter() - start
        if not down and outage[0] <= now < outage[1]:
            proxy.set_faults([Fault("error500", times=None)])
            down = True
        elif down and now >= outage[1]:
            proxy.set_faults([])
            down = False
        return now

    try:
        while tick() < total_s:
            time.sleep(_STEP_S)
            step += 1
            kept_s += _STEP_S
            try:
                if step % _EVERY == 0:
                    sd["w"][0] = step
                    engine.save(step, sd, storage_type=StorageType.DISK)
                max_lag = max(max_lag, engine.durability().lag_s)
            except FlashCheckpointError as e:  # "raise": the job fails and is restarted from what load() finds
                restarts += 1
                log(f"  {name}: step {step}: {type(e).__name__}; restarting")
                engine.close(release=False)
                engine, got = _restart(url, policy, kw, name, tick)
                back = int(got["w"][0]) if got else 0
                redone += step - back
                kept_s -= (step - back) * _STEP_S
                step = back
        trained = time.perf_counter() - start  # the job's training time: the goodput's denominator
        proxy.set_faults([])
        try:
            engine.wait()
        except FlashCheckpointError as e:  # a persist of the outage, reported now ("raise")
            log(f"  {name}: at the end: {type(e).__name__}")
        stored = engine.committed_steps()
    finally:
        proxy.set_faults([])
        engine.close()
        shutil.rmtree(local, ignore_errors=True)
    drain = time.perf_counter() - start - trained
    return {"goodput": kept_s / trained, "redone": redone, "restarts": restarts, "max_lag_s": max_lag,
            "newest_stored": stored[-1] if stored else None, "last_step": step, "wall_s": trained,
            "drain_s": drain}


def _restart(url: str, policy: str, kw: dict[str, Any], name: str, tick: Any) -> tuple[Any, Any]:
    """A restarted job: a new engine and its load(); while the store cannot be read, the restart fails and is
    tried again a second later (a scheduler's restart loop; ``tick()`` keeps the outage's clock)."""
    from flashckpt import CheckpointEngine, FlashCheckpointError

    while True:
        engine = None
        try:
            engine = CheckpointEngine(url, max_to_keep=2, on_persist_error=policy, **kw)
            return engine, engine.load()
        except FlashCheckpointError as e:
            log(f"  {name}: the restart failed ({type(e).__name__}); again in 1 s")
            if engine is not None:
                engine.close(release=False)
            time.sleep(1.0)
            tick()


def goodput_table(res: dict[str, dict[str, Any]], outage_s: float) -> str:
    rows = [[name, f"{r['goodput'] * 100:.1f} %", r["restarts"], r["redone"], fmt_time(r["max_lag_s"]),
             f"{r['newest_stored']} of {r['last_step']}", fmt_time(r["drain_s"])] for name, r in res.items()]
    return markdown_table([f"store down {outage_s:g} s", "goodput", "restarts", "steps redone", "largest lag",
                           "newest step on the store / last step", "wait() at the end"], rows)


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.sizes, args.outage_s = "0.25", 15.0
    os.environ.setdefault("FLASHCKPT_SAVER_GRACE_S", "30")
    os.environ.setdefault("FLASHCKPT_S3_DEADLINE_S", "20")  # a persist to a store that is down gives up in 20 s
    sizes = [float(s) for s in args.sizes.split(",") if s]
    tmp = tempfile.mkdtemp(prefix="fcbench-tiers-", dir=args.tmp_dir or None)
    info = machine_info({"local": tmp})
    results: dict[str, dict[str, Any]] = {}
    good: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    try:
        with start_server(args.server, log=log) as srv:
            info["server"] = f"{srv.kind} {srv.version}"
            os.environ.update(srv.env())
            for size in sizes:
                need = 4.0 * size * GB + 1.5 * GB
                if mem_available() < need or fs_free(tmp) < 3 * size * GB:
                    notes.append(f"GPT {size:g}GB skipped: not enough memory or disk")
                    continue
                results[f"{size:g}GB"] = run_size(args, srv, size, tmp)
            if not args.no_goodput:
                with contextlib.closing(_outage_proxy(srv)) as proxy:
                    os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint  # the goodput jobs go through the proxy
                    outage = (10.0, 10.0 + args.outage_s)
                    total = outage[1] + 30.0
                    for name, tiers, policy in (("tiers + warn", True, "warn"), ("store + warn", False, "warn"),
                                                ("store + raise (restart)", False, "raise")):
                        log(f"goodput: {name}")
                        good[name] = goodput_run(srv, proxy, name.split()[0] + "_" + policy, tmp, tiers=tiers,
                                                 policy=policy, outage=outage, total_s=total)
                        log(f"  {good[name]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = (f"Server: {info.get('server')} on 127.0.0.1; local tier on {info.get('fs_local', tmp)}; "
            f"{info['cores']} cores.\n\n")
    if results:
        text += save_table(results) + "\n\n"
    if good:
        text += goodput_table(good, args.outage_s) + "\n"
    print(text)
    if notes:
        print("Notes:\n" + "\n".join(f"- {n}" for n in notes))
    write_json(os.path.join(args.out, "bench_tiers.json"), {"machine": info, "saves": results, "goodput": good,
                                                             "notes": notes, "table": text})
    return 0


if __name__ == "__main__":
    sys.exit(main())
