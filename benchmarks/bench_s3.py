"""Checkpoints to S3, side by side: flashckpt's ``s3://`` persist and load against the common recipes.

    python -m benchmarks.bench_s3 [--server seaweedfs] [--sizes 1,4] [--rounds 3] [--quick] [--out bench_out/]

Informational only: it never passes or fails. It starts a local S3-compatible server
(``benchmarks._s3server``, ``--server``; SeaweedFS by default: see docs/benchmarks.md for why), prints
markdown tables and writes every sample as JSON to ``<out>/bench_s3.json``. A local server on this
machine's cores bounds the absolute speed: read the ratios.

For each size (a GPT-like state dict of fp32 params + Adam state, ``benchmarks._common``), ``--rounds``
rounds, the systems' order rotated per round, one system in memory at a time:

* ours: ``CheckpointEngine("s3://bucket/ours").save(step, sd, storage_type=StorageType.DISK)`` then
  ``wait()``: the training pause (the ``save`` call) and the time until the step is committed; the saver's
  own persist time (saver.log), the saver's and its persist worker's CPU, and the persist worker's private
  memory (RssAnon) growth, sampled every 20 ms. The engine is made and warmed before the measured save
  (a memory snapshot and two persists: the persist worker started, both shared-memory slots written)
  and closed after it; the first persist of a fresh saver is reported apart;
* for every system, the growth of private memory while it persists (a copy of the state held in the
  process shows as 1.0x: ours sends straight from shared memory);
* ``torch.save`` into ``io.BytesIO``, then boto3 ``upload_fileobj`` (the common recipe; the pause is all of
  it): serialization and upload timed apart, this process's CPU and RssAnon growth;
* boto3 ``upload_file`` of a ``torch.save`` file already on disk (written beforehand, not timed: the
  client's own best).

Both boto3 recipes use ``TransferConfig(64 MiB parts, 8 threads)``, the same part size and parallelism as
``S3Options``' defaults, and botocore's default checksums. Then the loads, each in a fresh process, after
every engine closed (the snapshots released, so flashckpt reads the store):

* ours: ``CheckpointEngine(url).load()`` (engine construction not timed); the bytes it fetched from the
  store are counted by wrapping ``S3Storage.read_scatter`` and ``read_bytes`` in the child;
* boto3 ``download_fileobj`` into ``io.BytesIO`` + ``torch.load``.

* ours with ``load(into=...)``: the child first makes a state dict of the same shapes (zeros, not timed),
  and the load reads the store's bytes straight into those tensors.
A size whose peak (about 4x the state: the state, two snapshot slots, the server's copy) does not fit
in the memory available, or in /dev/shm, is skipped with a message. ``--quick``: 0.25 GB, one round.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (  # noqa: E402
    GB,
    REPO_ROOT,
    GPTConfig,
    Samples,
    SaveLog,
    build_gpt_state_dict,
    cores,
    fingerprint,
    fmt_bytes,
    fmt_time,
    fs_free,
    gpt_config_for_bytes,
    loadavg_note,
    logger,
    machine_info,
    markdown_table,
    mem_available,
    proc_cpu_s,
    rotated,
    saver_persist,
    saver_pids,
    tensor_bytes,
    torch_save_file,
    wait_savers_gone,
    write_json,
)
from benchmarks._s3server import SERVERS, LocalS3, start_server  # noqa: E402
from benchmarks.bench_s3_clients import PART, THREADS, versions  # noqa: E402

log = logger("bench_s3")

CHILD_TAG = "BENCH_S3_CHILD "
SYSTEMS = ("ours", "torch_bytesio", "upload_file")


# ------------------------------------------------------------------------------------------ memory
def rss_kb(pid: int) -> dict[str, int]:
    """RssAnon / RssShmem / VmHWM of ``pid`` in KiB (from /proc; {} when gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for ln in f:
                k, _, v = ln.partition(":")
                if k in ("RssAnon", "RssShmem", "VmHWM", "VmRSS"):
                    out[k] = int(v.split()[0])
    except OSError:
        pass
    return out


class RssSampler:
    """The highest RssAnon (private memory) of a set of processes, sampled every ``period`` s in a thread."""

    def __init__(self, pids: list[int], period: float = 0.02) -> None:
        self.pids = pids
        self.base = {p: rss_kb(p).get("RssAnon", 0) for p in pids}
        self.peak = dict(self.base)
        self.period = period
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for p in self.pids:
                v = rss_kb(p).get("RssAnon", 0)
                if v > self.peak.get(p, 0):
                    self.peak[p] = v
            self._stop.wait(self.period)

    def stop(self) -> int:
        """Stops; returns the largest growth of RssAnon over the start, in bytes, of any one process."""
        self._stop.set()
        self._t.join()
        return max((self.peak[p] - self.base[p] for p in self.pids), default=0) * 1024


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def children_of(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    return out


# ------------------------------------------------------------------------------------------ the child (loads)
def child_main(argv: list[str]) -> int:
    """``--child ours|torch``: one load in this fresh process; prints one JSON line."""
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=("ours", "ours_into", "torch"), required=True)
    p.add_argument("--gpt", default="", help="ours_into: the GPTConfig fields (JSON) of the state to load into")
    p.add_argument("--url", required=True, help="ours: the checkpoint dir; torch: s3://bucket/key")
    a = p.parse_args(argv)
    import torch

    out: dict[str, Any] = {"mode": a.child}
    hwm0 = rss_kb(os.getpid()).get("VmHWM", 0)
    if a.child in ("ours", "ours_into"):
        from flashckpt import CheckpointEngine
        from flashckpt.storage.s3.backend import S3Storage

        fetched = [0, 0]  # bytes, calls
        spent = {"ranged": 0.0, "whole": 0.0}  # seconds in the backend's ranged reads and whole-object reads
        read_scatter, read_bytes = S3Storage.read_scatter, S3Storage.read_bytes

        def counted_scatter(self: Any, path: str, segments: Any) -> None:
            fetched[0] += sum(len(v) for _, v in segments)
            fetched[1] += 1
            t = time.perf_counter()
            try:
                read_scatter(self, path, segments)
            finally:
                spent["ranged"] += time.perf_counter() - t

        def counted_bytes(self: Any, path: str) -> bytes:
            t = time.perf_counter()
            try:
                data: bytes = read_bytes(self, path)
            finally:
                spent["whole"] += time.perf_counter() - t
            fetched[0] += len(data)
            fetched[1] += 1
            return data

        # wrapped in this child only: what the load fetches (every ranged read, read_into's included, goes
        # through read_scatter), and where its time goes
        setattr(S3Storage, "read_scatter", counted_scatter)  # noqa: B010
        setattr(S3Storage, "read_bytes", counted_bytes)  # noqa: B010
        t0 = time.perf_counter()
        engine = CheckpointEngine(a.url, max_to_keep=1)
        out["init_s"] = time.perf_counter() - t0
        # ours_into: the model's tensors exist already (a state dict of the same shapes, zeros), and the load
        # reads straight into them: load(into=...)
        into = build_gpt_state_dict(GPTConfig(**json.loads(a.gpt)), fill="zeros") if a.child == "ours_into" else None
        try:
            hwm0 = rss_kb(os.getpid()).get("VmHWM", 0)
            c0, t0 = cpu_s(), time.perf_counter()
            sd = engine.load(into=into)
            out["load_s"] = time.perf_counter() - t0
            out["cpu_s"] = cpu_s() - c0
            ll = engine.last_load
            out["source"] = ll.source if ll else "?"
            out["step"] = ll.step if ll else None
        finally:
            engine.close()
        out["fetched_bytes"], out["fetched_calls"] = fetched
        out["ranged_s"], out["whole_s"] = spent["ranged"], spent["whole"]
    else:
        import boto3
        from boto3.s3.transfer import TransferConfig

        bucket, key = a.url[len("s3://"):].split("/", 1)
        c = boto3.client("s3")
        cfg = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=THREADS)
        c0, t0 = cpu_s(), time.perf_counter()
        buf = io.BytesIO()
        c.download_fileobj(bucket, key, buf, Config=cfg)
        out["download_s"] = time.perf_counter() - t0
        out["fetched_bytes"] = len(buf.getbuffer())
        buf.seek(0)
        sd = torch.load(buf, map_location="cpu", weights_only=True)
        out["load_s"] = time.perf_counter() - t0
        out["cpu_s"] = cpu_s() - c0
        del buf
        c.close()
        out["source"] = "storage"
    out["peak_rss_growth"] = (rss_kb(os.getpid()).get("VmHWM", 0) - hwm0) * 1024
    out["fingerprint"] = fingerprint(sd)
    print(CHILD_TAG + json.dumps(out), flush=True)
    sys.stderr.flush()
    os._exit(0)  # skip tearing down GBs of tensors


def run_child(mode: str, url: str, env: dict[str, str], timeout: float = 1800, gpt: str = "") -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_s3", "--child", mode, "--url", url, "--gpt", gpt]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT,
                           env=dict(os.environ, **env))
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(CHILD_TAG):
            res: dict[str, Any] = json.loads(line[len(CHILD_TAG):])
            return res
    return {"error": f"exit {p.returncode}: {p.stderr.strip()[-2000:]}"}


# ------------------------------------------------------------------------------------------ one size
class SizeRun:
    """The rounds of one size against one server."""

    def __init__(self, args: argparse.Namespace, srv: LocalS3, size_gb: float, S: Samples, notes: list[str]) -> None:
        self.args, self.srv, self.S, self.notes = args, srv, S, notes
        self.k = f"{size_gb:g}GB"
        self.cfg = gpt_config_for_bytes(size_gb * GB)
        self.url = f"s3://{srv.bucket}/ours"
        self.torch_key = "torch/state.pt"
        self.step = 0
        self.sd: Any = None
        self.nbytes = 0
        self.file_bytes = 0
        self.fingerprint: list[float] = []
        self.tmp = tempfile.mkdtemp(prefix="fcbench-s3-", dir=args.tmp_dir or None)
        self.save_log = SaveLog()

    def add(self, key: str, v: float) -> None:
        self.S.add(f"{self.k}.{key}", v)

    # -- the systems --------------------------------------------------------------------------------
    def ours(self) -> None:
        from flashckpt import CheckpointEngine, StorageType

        engine = CheckpointEngine(self.url, max_to_keep=1)
        job = engine.job_dir
        try:
            # warm-up: a memory snapshot, then two persists, waited for: the saver's persist worker starts on
            # the first persist (and stays while persists come), and the saves so far wrote both snapshot
            # slots (a slot's first save pays the page faults of fresh shared memory: 0.5-1 s/GB here)
            self.step += 1
            engine.save(self.step, self.sd, storage_type=StorageType.MEMORY)
            for first in (True, False):
                self.step += 1
                t0 = time.perf_counter()
                engine.save(self.step, self.sd, storage_type=StorageType.DISK)
                engine.wait()
                if first:
                    self.add("ours.first_persist", time.perf_counter() - t0)
            savers = saver_pids([job])
            workers = [c for p in savers for c in children_of(p)]
            cpu0, scpu0, srv0 = cpu_s(), proc_cpu_s(savers), self.srv.cpu_s()
            sampler = RssSampler(workers)
            self.step += 1
            self.save_log.last = None
            t0 = time.perf_counter()
            engine.save(self.step, self.sd, storage_type=StorageType.DISK)
            t1 = time.perf_counter()
            engine.wait()
            t2 = time.perf_counter()
            grow = sampler.stop()
            self.add("ours.pause", t1 - t0)
            self.add("ours.committed", t2 - t0)
            self.add("ours.trainer_cpu", cpu_s() - cpu0)
            self.add("ours.saver_cpu", proc_cpu_s(savers) - scpu0)
            self.add("ours.server_cpu", self.srv.cpu_s() - srv0)
            self.add("ours.worker_rss_growth", grow)
            if self.save_log.last is not None:
                self.add("ours.snapshot_copy", self.save_log.last)
            got = saver_persist(engine, self.step)
            if got:
                self.add("ours.persist_bytes", got[0])
                self.add("ours.persist_saver", got[1])
            if not workers:
                self.notes.append("ours: no persist worker process found under the saver (its memory not sampled)")
        finally:
            engine.close()
        left = wait_savers_gone([job], timeout=120)
        if left:
            self.notes.append(f"ours: {left}")

    def torch_bytesio(self) -> None:
        import torch
        from boto3.s3.transfer import TransferConfig

        c = self.srv.client(max_pool_connections=2 * THREADS)
        cfg = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=THREADS)
        sampler = RssSampler([os.getpid()])
        cpu0, srv0 = cpu_s(), self.srv.cpu_s()
        t0 = time.perf_counter()
        buf = io.BytesIO()
        torch.save(self.sd, buf)
        t1 = time.perf_counter()
        size = buf.tell()
        buf.seek(0)
        c.upload_fileobj(buf, self.srv.bucket, self.torch_key, Config=cfg)
        t2 = time.perf_counter()
        del buf
        self.add("torch_bytesio.serialize", t1 - t0)
        self.add("torch_bytesio.upload", t2 - t1)
        self.add("torch_bytesio.committed", t2 - t0)
        self.add("torch_bytesio.pause", t2 - t0)
        self.add("torch_bytesio.trainer_cpu", cpu_s() - cpu0)
        self.add("torch_bytesio.server_cpu", self.srv.cpu_s() - srv0)
        self.add("torch_bytesio.rss_growth", sampler.stop())
        self.add("torch_bytesio.file_bytes", size)
        self.file_bytes = size

    def upload_file(self) -> None:
        from boto3.s3.transfer import TransferConfig

        path = os.path.join(self.tmp, "state.pt")
        torch_save_file(self.sd, path, fsync=True)  # beforehand, not timed
        try:
            c = self.srv.client(max_pool_connections=2 * THREADS)
            cfg = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=THREADS)
            sampler = RssSampler([os.getpid()])
            cpu0, srv0 = cpu_s(), self.srv.cpu_s()
            t0 = time.perf_counter()
            c.upload_file(path, self.srv.bucket, "file/state.pt", Config=cfg)
            t1 = time.perf_counter()
            self.add("upload_file.committed", t1 - t0)
            self.add("upload_file.trainer_cpu", cpu_s() - cpu0)
            self.add("upload_file.server_cpu", self.srv.cpu_s() - srv0)
            self.add("upload_file.rss_growth", sampler.stop())
            self.add("upload_file.file_bytes", os.path.getsize(path))
            c.delete_object(Bucket=self.srv.bucket, Key="file/state.pt")
        finally:
            os.unlink(path)

    def load(self, mode: str) -> None:
        url = f"s3://{self.srv.bucket}/{self.torch_key}" if mode == "torch" else self.url
        res = run_child(mode, url, self.srv.env(), gpt=json.dumps(dataclasses.asdict(self.cfg)))
        if "error" in res:
            self.notes.append(f"{self.k} load {mode}: {res['error']}")
            log(f"load {mode} failed: {res['error']}")
            return
        if res.get("source") != "storage":
            self.notes.append(f"{self.k} load {mode}: came from {res.get('source')!r}, not from the store")
        if res.get("fingerprint") != self.fingerprint:
            self.notes.append(f"{self.k} load {mode}: the loaded state differs from the saved one")
        for key in ("load_s", "cpu_s", "fetched_bytes", "peak_rss_growth", "download_s", "init_s", "fetched_calls",
                    "ranged_s", "whole_s"):
            if key in res:
                self.add(f"load.{mode}.{key}", res[key])

    # -- the rounds ----------------------------------------------------------------------------------
    def run(self) -> None:
        log(f"{self.k}: building the GPT state dict ({self.cfg}) ...")
        self.sd = build_gpt_state_dict(self.cfg)
        self.nbytes = tensor_bytes(self.sd)
        self.fingerprint = fingerprint(self.sd)
        elog = logging.getLogger("flashckpt.engine.engine")
        elog.addHandler(self.save_log)
        elog.setLevel(logging.INFO)
        elog.propagate = False
        systems = {"ours": self.ours, "torch_bytesio": self.torch_bytesio, "upload_file": self.upload_file}
        try:
            for r in range(self.args.rounds):
                for name in rotated(list(SYSTEMS), r):
                    log(f"{self.k} round {r + 1}/{self.args.rounds}: {name}")
                    try:
                        systems[name]()
                    except Exception as e:  # a server that failed a request: reported, the other rounds go on
                        self.notes.append(f"{self.k} round {r + 1}, {name}: failed: {type(e).__name__}: {e}")
                        log(f"{name} failed: {e}")
            self.sd = None  # the loads run in children: free the state first
            for r in range(self.args.rounds):
                for mode in rotated(["ours", "ours_into", "torch"], r):
                    log(f"{self.k} round {r + 1}/{self.args.rounds}: load {mode}")
                    self.load(mode)
        finally:
            elog.removeHandler(self.save_log)
            self.sd = None
            with contextlib.suppress(OSError):
                os.rmdir(self.tmp)
            n = self.srv.empty_bucket()
            log(f"{self.k}: removed {n} objects from the bucket")


# ------------------------------------------------------------------------------------------ reporting
def _med(S: Samples, key: str) -> float:
    return S.median(key)


def report(S: Samples, sizes: dict[str, int], rounds: int) -> tuple[str, dict[str, Any]]:
    """The markdown tables and the numbers behind them."""
    out: dict[str, Any] = {}
    cols = list(sizes)
    rows = []

    def rate(nbytes: int, s: float) -> str:
        return f"{nbytes / s / GB:.2f} GB/s" if s == s and s > 0 else "n/a"

    def cell(k: str, key: str, *, base: str | None = None) -> str:
        s = _med(S, f"{k}.{key}")
        if s != s:
            return "n/a"
        txt = f"{fmt_time(s)} ({rate(sizes[k], s)})"
        if base:
            b = _med(S, f"{k}.{base}")
            if b == b:
                txt += f", {b / s:.2f}x"
        return txt

    persist = [("ours: save(DISK) -> wait(), committed", "ours.committed", True),
               ("  ours: a saver's first persist (starts its persist worker)", "ours.first_persist", True),
               ("  ours: the saver's persist (saver.log)", "ours.persist_saver", True),
               ("torch.save(BytesIO) + upload_fileobj", "torch_bytesio.committed", False),
               ("  of which torch.save into BytesIO", "torch_bytesio.serialize", False),
               ("  of which upload_fileobj", "torch_bytesio.upload", False),
               ("upload_file of a file on disk (written beforehand)", "upload_file.committed", True)]
    for label, key, ratio in persist:
        rows.append([label] + [cell(k, key, base="torch_bytesio.committed" if ratio else None) for k in cols])
    t1 = markdown_table(["until stored (state bytes / s; x: torch recipe's time / this)"] +
                        [f"GPT {k} ({fmt_bytes(sizes[k])})" for k in cols], rows)
    rows = []
    for label, key in (("ours: save(DISK) call", "ours.pause"), ("  of which the snapshot copy (engine log)",
                                                                  "ours.snapshot_copy"),
                       ("torch.save(BytesIO) + upload_fileobj", "torch_bytesio.pause")):
        rows.append([label] + [fmt_time(_med(S, f"{k}.{key}")) + (
            f" ({_med(S, f'{k}.torch_bytesio.pause') / _med(S, f'{k}.{key}'):.0f}x shorter)"
            if key == "ours.pause" else "") for k in cols])
    t2 = markdown_table(["training paused"] + [f"GPT {k}" for k in cols], rows)

    rows = []
    cpu = [("ours: trainer (the snapshot copy)", "ours.trainer_cpu"),
           ("ours: saver + persist worker", "ours.saver_cpu"),
           ("torch.save(BytesIO) + upload_fileobj", "torch_bytesio.trainer_cpu"),
           ("upload_file", "upload_file.trainer_cpu")]
    for label, key in cpu:
        rows.append([label] + [f"{_med(S, f'{k}.{key}') / (sizes[k] / GB):.2f}" for k in cols])
    for label, key in (("server: ours", "ours.server_cpu"), ("server: torch.save + upload_fileobj",
                                                              "torch_bytesio.server_cpu"),
                       ("server: upload_file", "upload_file.server_cpu")):
        rows.append([label] + [f"{_med(S, f'{k}.{key}') / (sizes[k] / GB):.2f}" for k in cols])
    rows.append(["peak private memory growth, x state: ours' persist worker"] +
                [f"{_med(S, f'{k}.ours.worker_rss_growth') / sizes[k]:.2f}" for k in cols])
    rows.append(["  torch.save(BytesIO) + upload_fileobj (this process)"] +
                [f"{_med(S, f'{k}.torch_bytesio.rss_growth') / sizes[k]:.2f}" for k in cols])
    rows.append(["  upload_file (this process)"] + [f"{_med(S, f'{k}.upload_file.rss_growth') / sizes[k]:.2f}"
                                                    for k in cols])
    t3 = markdown_table(["CPU seconds per GB of state"] + [f"GPT {k}" for k in cols], rows)

    rows = []
    for label, mode in (("ours: CheckpointEngine(url).load()", "ours"),
                        ("ours: load(into=the model's tensors)", "ours_into"),
                        ("download_fileobj(BytesIO) + torch.load", "torch")):
        r = [label]
        for k in cols:
            s = _med(S, f"{k}.load.{mode}.load_s")
            txt = f"{fmt_time(s)} ({rate(sizes[k], s)})" if s == s else "n/a"
            if mode != "torch":
                b = _med(S, f"{k}.load.torch.load_s")
                if b == b and s == s:
                    txt += f", {b / s:.2f}x"
            r.append(txt)
        rows.append(r)
    for label, key in (("  ours: of which ranged GETs (the file's directory, then its tensors, checksum on the way)",
                        "load.ours.ranged_s"),
                       ("  ours: of which whole-object GETs (commit records)", "load.ours.whole_s"),
                       ("  torch recipe: of which download_fileobj", "load.torch.download_s")):
        rows.append([label] + [fmt_time(_med(S, f"{k}.{key}")) for k in cols])
    for label, mode in (("  bytes fetched / state bytes: ours", "ours"), ("  ... ours, into", "ours_into"),
                        ("  ... torch recipe", "torch")):
        rows.append([label] + [f"{_med(S, f'{k}.load.{mode}.fetched_bytes') / sizes[k]:.2f}" for k in cols])
    for label, mode in (("  CPU s/GB: ours", "ours"), ("  ... ours, into", "ours_into"), ("  ... torch recipe", "torch")):
        rows.append([label] + [f"{_med(S, f'{k}.load.{mode}.cpu_s') / (sizes[k] / GB):.2f}" for k in cols])
    for label, mode in (("  peak memory growth, x state: ours", "ours"), ("  ... ours, into (the model's own tensors)",
                                                                          "ours_into"), ("  ... torch recipe", "torch")):
        rows.append([label] + [f"{_med(S, f'{k}.load.{mode}.peak_rss_growth') / sizes[k]:.2f}" for k in cols])
    t4 = markdown_table(["load in a fresh process, from the store (x: torch recipe's time / ours)"] +
                        [f"GPT {k}" for k in cols], rows)
    text = "\n\n".join([t1, t2, t3, t4]) + (
        f"\n\nMedians of {rounds} rounds (systems interleaved, order rotated per round). Throughput: the "
        "state's tensor bytes per second. CPU: user + system seconds per GB of state (ours: the trainer's "
        "during save+wait, and the saver's with its persist worker; the recipes: this process's).")
    for k in cols:
        out[k] = {key.split(".", 1)[1]: {"median": S.median(key), "samples": S.data[key]}
                  for key in S.data if key.startswith(k + ".")}
    return text, out


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_s3", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", default="seaweedfs", choices=SERVERS)
    p.add_argument("--sizes", default="1,4", help="state sizes in GB, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="rounds per size (medians)")
    p.add_argument("--quick", action="store_true", help="a smoke run: --sizes 0.25 --rounds 1")
    p.add_argument("--data-dir", default="", help="where the server keeps its data (default: the temp dir)")
    p.add_argument("--tmp-dir", default="", help="where upload_file's file is written (default: the temp dir)")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "bench_out"), help="directory for bench_s3.json")
    return p.parse_args(argv)


def fits(size_gb: float, data_dir: str) -> str | None:
    """Why a size cannot run here, or None. The peak is about 4x the state: the state, two snapshot slots
    in /dev/shm (or the torch recipe's BytesIO and its part copies), the server's buffers."""
    need = 4.0 * size_gb * GB + 1.5 * GB
    if mem_available() < need:
        return f"needs about {fmt_bytes(need)} of memory, {fmt_bytes(mem_available())} available"
    if fs_free("/dev/shm") < 2.2 * size_gb * GB:
        return f"needs {fmt_bytes(2.2 * size_gb * GB)} in /dev/shm, {fmt_bytes(fs_free('/dev/shm'))} free"
    if fs_free(data_dir or tempfile.gettempdir()) < 4 * size_gb * GB:
        return f"needs {fmt_bytes(4 * size_gb * GB)} of disk for the server and the torch.save file"
    return None


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if "--child" in raw:
        return child_main(raw)
    args = parse_args(argv)
    if args.quick:
        args.sizes, args.rounds = "0.25", 1
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    os.environ.setdefault("FLASHCKPT_SAVER_GRACE_S", "30")  # a crashed run must not hold /dev/shm for long
    sizes = [float(s) for s in args.sizes.split(",") if s]
    load0 = os.getloadavg()[0]
    S = Samples()
    notes: list[str] = []
    done: dict[str, int] = {}
    file_bytes: dict[str, int] = {}
    info = machine_info()
    info.update(versions=versions(), part_bytes=PART, threads=THREADS, rounds=args.rounds)
    saved_env = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                                 "AWS_ENDPOINT_URL", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
                                                 "AWS_EC2_METADATA_DISABLED")}
    with start_server(args.server, data_dir=args.data_dir, log=log) as srv:
        info["server"] = f"{srv.kind} {srv.version}"
        os.environ.update(srv.env())  # the engine, its saver and persist worker, the children reach it
        try:
            for size in sizes:
                why = fits(size, args.data_dir)
                if why:
                    notes.append(f"GPT {size:g}GB skipped: {why}")
                    log(notes[-1])
                    continue
                run = SizeRun(args, srv, size, S, notes)
                run.run()
                done[run.k] = run.nbytes
                file_bytes[run.k] = run.file_bytes
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    busy = loadavg_note(load0, cores())
    if busy:
        notes.append(busy)
    text, results = report(S, done, args.rounds) if done else ("(no size ran)", {})
    head = (f"Server: {info['server']} on 127.0.0.1 (data on {info.get('fs_data', 'the temp dir')}); boto3 "
            f"{info['versions'].get('boto3')}, torch {info['torch']}; {info['cores']} cores.")
    print(head + "\n\n" + text)
    if notes:
        print("\nNotes:\n" + "\n".join(f"- {n}" for n in notes))
    out = os.path.join(args.out, "bench_s3.json")
    write_json(out, {"command": " ".join(["python -m benchmarks.bench_s3"] + sys.argv[1:]), "machine": info,
                     "sizes": done, "torch_file_bytes": file_bytes, "notes": notes, "results": results,
                     "samples": S.data, "table": text})
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
