"""Shared pieces of the benchmarks: state-dict builders, the raw-copy limit, timing and reporting.

Nothing here imports flashckpt, so the same helpers can measure any checkpointing system.
"""

from __future__ import annotations

import ctypes
import datetime as _dt
import json
import logging
import math
import mmap
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from flashckpt.transport.spawn import SAVER_MODULE
from flashckpt.util.procfs import process_cpu_seconds

__all__ = [
    "REPO_ROOT", "GB", "GPTConfig", "gpt_config_for_bytes", "gpt_param_shapes", "build_gpt_state_dict",
    "build_tiny_state_dict", "iter_tensors", "distinct_storages", "tensor_bytes", "copy_tree_into",
    "ShmCopyTarget", "Samples", "timed", "median", "fmt_time", "fmt_bytes", "fmt_rate", "markdown_table",
    "machine_info", "drop_file_cache", "cores", "rotated", "fsync_file", "torch_save_file", "dir_bytes", "SaveLog",
    "saver_persist", "saver_pids", "proc_cpu_s", "wait_savers_gone", "fingerprint", "mem_available", "fs_free", "logger",
    "loadavg_note", "finite", "write_json",
]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9  # throughput and sizes are reported in decimal GB


# ---------------------------------------------------------------------------- state dicts
@dataclass(frozen=True)
class GPTConfig:
    """A GPT-2 style decoder: token and position embeddings, ``n_layers`` blocks, final layer norm."""

    vocab: int = 50304
    ctx: int = 1024
    d_model: int = 768
    n_layers: int = 24
    tie: bool = False  # lm_head.weight is the very tensor of transformer.wte.weight

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for _, s in gpt_param_shapes(self, unique=True))

    def state_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of params + Adam exp_avg + exp_avg_sq (the step scalars are negligible)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return 3 * self.n_params * itemsize


def gpt_config_for_bytes(target_bytes: float, *, n_layers: int = 24, vocab: int = 50304, ctx: int = 1024,
                         tie: bool = False, dtype: torch.dtype = torch.float32) -> GPTConfig:
    """The GPT config whose params + Adam state are closest to ``target_bytes`` (d_model a multiple of 64)."""
    best = None
    for d in range(64, 16384 + 1, 64):
        cfg = GPTConfig(vocab=vocab, ctx=ctx, d_model=d, n_layers=n_layers, tie=tie)
        err = abs(cfg.state_bytes(dtype) - target_bytes)
        if best is None or err < best[0]:
            best = (err, cfg)
        if cfg.state_bytes(dtype) > target_bytes:
            break
    assert best is not None
    return best[1]


def gpt_param_shapes(cfg: GPTConfig, *, unique: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every model parameter in ``state_dict()`` order (HF GPT-2 naming).

    With ``unique`` a tied ``lm_head.weight`` (the same tensor as ``transformer.wte.weight``) is left out."""
    d = cfg.d_model
    out: list[tuple[str, tuple[int, ...]]] = []
    out.append(("transformer.wte.weight", (cfg.vocab, d)))
    out.append(("transformer.wpe.weight", (cfg.ctx, d)))
    for i in range(cfg.n_layers):
        p = f"transformer.h.{i}."
        out += [(p + "ln_1.weight", (d,)), (p + "ln_1.bias", (d,)),
                (p + "attn.c_attn.weight", (d, 3 * d)), (p + "attn.c_attn.bias", (3 * d,)),
                (p + "attn.c_proj.weight", (d, d)), (p + "attn.c_proj.bias", (d,)),
                (p + "ln_2.weight", (d,)), (p + "ln_2.bias", (d,)),
                (p + "mlp.c_fc.weight", (d, 4 * d)), (p + "mlp.c_fc.bias", (4 * d,)),
                (p + "mlp.c_proj.weight", (4 * d, d)), (p + "mlp.c_proj.bias", (d,))]
    out += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]
    if not (unique and cfg.tie):
        out.append(("lm_head.weight", (cfg.vocab, d)))
    return out


def _fill(t: torch.Tensor, fill: str, gen: torch.Generator, std: float) -> torch.Tensor:
    if fill == "random":
        t.normal_(0.0, std, generator=gen)
    elif fill == "zeros":
        t.zero_()  # touches every page: a prefaulted, ready-to-load-into tensor
    elif fill != "empty":
        raise ValueError(f"fill={fill!r}: use 'random', 'zeros' or 'empty'")
    return t


def build_gpt_state_dict(cfg: GPTConfig, *, fill: str = "random", dtype: torch.dtype = torch.float32,
                         seed: int = 0) -> dict[str, Any]:
    """A training checkpoint of a GPT-like model with Adam, shaped like ``torch.optim.Adam.state_dict()``::

        {"model": {name: tensor}, "optimizer": {"state": {i: {"step", "exp_avg", "exp_avg_sq"}},
                                                "param_groups": [{..., "params": [0, 1, ...]}]},
         "step": int}

    With ``cfg.tie`` the model holds ``lm_head.weight`` as the very tensor of ``transformer.wte.weight``
    (as ``model.state_dict()`` does for tied weights); the optimizer has state for it once.
    """
    gen = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = OrderedDict()
    unique: list[torch.Tensor] = []
    for name, shape in gpt_param_shapes(cfg):
        if name == "lm_head.weight":
            if cfg.tie:
                model[name] = model["transformer.wte.weight"]
                continue
        std = 1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.02
        t = _fill(torch.empty(shape, dtype=dtype), fill, gen, std)
        model[name] = t
        unique.append(t)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, p in enumerate(unique):
        state[i] = {"step": torch.tensor(1000.0),
                    "exp_avg": _fill(torch.empty_like(p), fill, gen, 1e-3),
                    "exp_avg_sq": _fill(torch.empty_like(p), fill, gen, 1e-6).abs_()}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
               "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
               "fused": None, "params": list(range(len(unique)))}]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}, "step": 1000}


def build_tiny_state_dict(n: int = 20_000, nbytes: int = 1024, *, fill: str = "random",
                          dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, Any]:
    """``n`` tensors of ``nbytes`` each, under a model-like flat namespace."""
    gen = torch.Generator().manual_seed(seed)
    numel = nbytes // torch.empty(0, dtype=dtype).element_size()
    model = OrderedDict((f"blocks.{i // 16}.p{i % 16}.weight", _fill(torch.empty(numel, dtype=dtype), fill, gen, 0.02))
                        for i in range(n))
    return {"model": model, "step": 1000}


def iter_tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor of a nested dict/list/tuple in traversal order (insertion order of dicts)."""
    out: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(tree)
    return out


def distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per distinct (non-empty) storage, first occurrence kept."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        out.append(t)
    return out


def tensor_bytes(tree: Any, *, distinct: bool = True) -> int:
    """Bytes of tensor data: of distinct storages (what must be copied) or of every tensor entry."""
    ts = iter_tensors(tree)
    if distinct:
        return sum(t.untyped_storage().nbytes() for t in distinct_storages(ts))
    return sum(t.untyped_storage().nbytes() for t in ts)


def copy_tree_into(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``load_state_dict``-style: ``d.copy_(s)`` for every pair, under no_grad."""
    with torch.no_grad():
        for d, s in zip(dst, src, strict=False):
            d.copy_(s)


# ---------------------------------------------------------------------------- the copy limit
_memmove = ctypes.memmove


def _run_tasks(tasks: list[tuple[int, int, int]]) -> None:
    mv = _memmove
    for dst, src, n in tasks:
        mv(dst, src, n)


class _Workers:
    """``n`` persistent threads that each run one task list per ``run`` (the caller runs list 0)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._jobs: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
        self._start = threading.Barrier(n) if n > 1 else None
        self._done = threading.Barrier(n) if n > 1 else None
        self._stop = False
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(1, n)]
        for t in self._threads:
            t.start()

    def _loop(self, i: int) -> None:
        assert self._start is not None and self._done is not None
        while True:
            self._start.wait()
            if self._stop:
                return
            _run_tasks(self._jobs[i])
            self._done.wait()

    def run(self, jobs: list[list[tuple[int, int, int]]]) -> None:
        if self.n == 1:
            _run_tasks(jobs[0])
            return
        assert self._start is not None and self._done is not None
        self._jobs = jobs
        self._start.wait()
        _run_tasks(jobs[0])
        self._done.wait()

    def close(self) -> None:
        if self._start is not None:
            self._stop = True
            self._start.wait()
            for t in self._threads:
                t.join()
            self._start = None


def _split_even(tasks: list[tuple[int, int, int]], nbins: int) -> list[list[tuple[int, int, int]]]:
    """Cuts a task list into ``nbins`` lists of (nearly) equal bytes, splitting large copies.

    Copies below 256 KiB are never split (they land whole in the current bin)."""
    total = sum(n for _, _, n in tasks)
    per = max(1, -(-total // nbins))
    bins: list[list[tuple[int, int, int]]] = [[] for _ in range(nbins)]
    cur, filled = 0, 0
    for dst, src, n in tasks:
        while n > 0:
            take = n if (cur == nbins - 1 or n < (256 << 10)) else min(n, per - filled)
            bins[cur].append((dst, src, take))
            dst, src, n, filled = dst + take, src + take, n - take, filled + take
            if filled >= per and cur < nbins - 1:
                cur, filled = cur + 1, 0
    return bins


class ShmCopyTarget:
    """A preallocated, prefaulted ``/dev/shm`` buffer laid out for a list of tensors: the copy limit.

    Every distinct storage gets a 64-byte aligned region. ``memmove(threads)`` copies every storage's
    bytes with ``ctypes.memmove`` on ``threads`` threads (the bytes split evenly, the task lists built
    beforehand); ``torch_copy()`` does a typed ``dst.copy_(src)`` per tensor (torch's own threads).
    Close it with ``close()``; the file is unlinked at once, so nothing is left behind even on a crash.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], *, threads: int, shm_dir: str = "/dev/shm") -> None:
        self.srcs = distinct_storages(tensors)
        regions, off = [], 0
        for t in self.srcs:
            n = t.untyped_storage().nbytes()
            regions.append((off, n))
            off = (off + n + 63) // 64 * 64
        self.nbytes = sum(n for _, n in regions)
        self.size = max(off, 4096)
        path = os.path.join(shm_dir, f"flashckpt-bench-copy-{os.getpid()}-{id(self):x}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.unlink(path)
            os.ftruncate(fd, self.size)
            os.posix_fallocate(fd, 0, self.size)
            self.mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self._cbuf = (ctypes.c_char * self.size).from_buffer(self.mm)
        self.base = ctypes.addressof(self._cbuf)
        ctypes.memset(self.base, 0, self.size)  # prefault for writing
        self.tasks = [(self.base + o, t.untyped_storage().data_ptr(), n) for t, (o, n) in zip(self.srcs, regions, strict=True)]
        self._bins = {1: [self.tasks]}
        self._workers: dict[int, _Workers] = {}
        self.threads = max(1, threads)
        self._typed: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t, (o, n) in zip(self.srcs, regions, strict=True):
            st = t.untyped_storage()
            if t.is_contiguous() and t.storage_offset() == 0 and t.numel() * t.element_size() == n:
                dst = torch.frombuffer(self.mm, dtype=t.dtype, count=t.numel(), offset=o).view(t.shape)
                self._typed.append((dst, t))
            else:
                dst = torch.frombuffer(self.mm, dtype=torch.uint8, count=n, offset=o)
                self._typed.append((dst, torch.empty(0, dtype=torch.uint8).set_(st)))

    def memmove(self, threads: int) -> None:
        threads = max(1, threads)
        if threads not in self._bins:
            self._bins[threads] = _split_even(self.tasks, threads)
        if threads not in self._workers:
            self._workers[threads] = _Workers(threads)
        self._workers[threads].run(self._bins[threads])

    def torch_copy(self) -> None:
        for d, s in self._typed:
            d.copy_(s)

    def matches(self) -> bool:
        """Whether the buffer holds the sources' bytes (a sanity check, not timed)."""
        return all(torch.equal(d.reshape(-1).view(torch.uint8), s.reshape(-1).view(torch.uint8))
                   for d, s in self._typed)

    def close(self) -> None:
        for w in self._workers.values():
            w.close()
        self._workers.clear()
        self._typed.clear()
        del self._cbuf
        self.mm.close()


# ---------------------------------------------------------------------------- timing
def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call, by ``time.perf_counter``."""
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Samples:
    """Per-metric lists of samples, one per round."""

    def __init__(self) -> None:
        self.data: dict[str, list[float]] = {}

    def add(self, key: str, value: float) -> None:
        self.data.setdefault(key, []).append(float(value))

    def median(self, key: str) -> float:
        return median(self.data.get(key, []))

    def spread(self, key: str) -> tuple[float, float]:
        xs = self.data.get(key, [])
        return (min(xs), max(xs)) if xs else (float("nan"), float("nan"))

    def __contains__(self, key: str) -> bool:
        return bool(self.data.get(key))


# ---------------------------------------------------------------------------- formatting
def fmt_time(s: float) -> str:
    if s != s:
        return "n/a"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1.0:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def fmt_bytes(n: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_rate(nbytes: float, seconds: float) -> str:
    if not seconds or seconds != seconds:
        return "n/a"
    return f"{nbytes / seconds / GB:.2f} GB/s"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` is one of l/r per column (default: first left, rest right)."""
    align = align or ("l" + "r" * (len(headers) - 1))
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align, strict=True)) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else (":" + "-" * (w + 1)) for w, a in zip(widths, align, strict=True)) + "|"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


# ---------------------------------------------------------------------------- machine
def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _mount_of(path: str) -> str:
    path = os.path.realpath(path)
    best = ("", "?", "?")
    for line in _read("/proc/mounts").splitlines():
        parts = line.split()
        if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")):
            if len(parts[1]) >= len(best[0]):
                best = (parts[1], parts[2], parts[0])
    return f"{best[1]} ({best[2]} on {best[0]})"


def machine_info(dirs: dict[str, str] | None = None) -> dict[str, Any]:
    """What the numbers depend on: CPU, cores, memory, /dev/shm, file systems, kernel, versions."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines()
                if ln.startswith("model name")), platform.processor() or "?")
    mem = next((ln.split()[1] for ln in _read("/proc/meminfo").splitlines() if ln.startswith("MemTotal")), "0")
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    st = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    thp = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    try:
        rev = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO_ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        rev = rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        rev = "?"
    info = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": cores,
        "cpu_count": os.cpu_count(),
        "memory_gib": round(int(mem) / 2**20, 1),
        "dev_shm_gib": round(st.f_blocks * st.f_frsize / 2**30, 1) if st else None,
        "kernel": platform.release(),
        "transparent_hugepage": thp,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "git": rev,
    }
    for name, d in (dirs or {}).items():
        info[f"fs_{name}"] = _mount_of(d)
    return info


def drop_file_cache(path: str) -> None:
    """Evicts a (synced) file's clean pages from the page cache: the next read comes from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def to_jsonable(x: Any) -> Any:
    if hasattr(x, "__dataclass_fields__"):
        return asdict(x)
    return json.loads(json.dumps(x, default=str))


# ---------------------------------------------------------------------------- shared by the benchmarks
def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def rotated(items: list[Any], r: int) -> list[Any]:
    """``items`` rotated left by ``r``: round ``r`` of an interleaved benchmark starts with a different system."""
    if not items:
        return []
    k = r % len(items)
    return items[k:] + items[:k]


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save_file(sd: Any, path: str, fsync: bool) -> None:
    """``torch.save(sd, path)``, then (with ``fsync``) an fsync of the file."""
    torch.save(sd, path)
    if fsync:
        fsync_file(path)


def dir_bytes(path: str) -> int:
    """Bytes of the regular files under ``path`` (a file: its size; missing: 0)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


class SaveLog(logging.Handler):
    """Captures the engine's ``event=save ... seconds=`` log line (the copy part of save(), without the RPC).

    Attach it to the ``flashckpt.engine.engine`` logger; ``last`` is the newest save's seconds."""

    _SECONDS = re.compile(r"seconds=([0-9.]+)")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.last: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, str) and record.msg.startswith("event=save"):
            m = self._SECONDS.search(record.getMessage())
            if m:
                self.last = float(m.group(1))


_PERSIST_RE = re.compile(r"event=persist step=(\d+) rank=\d+ bytes=(\d+) seconds=([0-9.]+)")


def saver_persist(engine: Any, step: int) -> tuple[int, float] | None:
    """(bytes, seconds) of a step's persist from the saver's log (``<engine.job_dir>/saver.log``)."""
    path = os.path.join(engine.job_dir, "saver.log")
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    for m in _PERSIST_RE.finditer(text):
        if int(m.group(1)) == step:
            return int(m.group(2)), float(m.group(3))
    return None


def proc_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` (all their threads) and their children (the
    saver's persist worker) have used so far."""
    return sum(process_cpu_seconds(p, children=True) or 0.0 for p in pids)


def saver_pids(job_dirs: list[str]) -> list[int]:
    """Saver daemons serving one of ``job_dirs`` (by their command line)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if SAVER_MODULE.encode() in argv and any(j.encode() in argv for j in job_dirs):
            out.append(int(pid))
    return out


def wait_savers_gone(job_dirs: list[str], timeout: float = 30.0) -> str | None:
    """Waits until the savers of ``job_dirs`` have exited and removed their runtime dirs (after every
    engine closed with ``release=True``); a note on what is left after ``timeout``, else None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (any(os.path.exists(j) for j in job_dirs) or saver_pids(job_dirs)):
        time.sleep(0.2)
    left = [j for j in job_dirs if os.path.exists(j)]
    pids = saver_pids(job_dirs)
    return f"left behind after close(): runtime dirs {left}, saver pids {pids}" if (left or pids) else None


def fingerprint(tree: Any, k: int = 3) -> list[float]:
    """Float64 sums of the first, middle and last ``k`` tensors: a cheap check that two trees hold the same data."""
    ts = iter_tensors(tree)
    if not ts:
        return []
    picks = sorted(set(list(range(min(k, len(ts)))) + [len(ts) // 2] + list(range(max(0, len(ts) - k), len(ts)))))
    return [float(ts[i].detach().double().sum()) for i in picks]


def mem_available() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable)."""
    for ln in _read("/proc/meminfo").splitlines():
        if ln.startswith("MemAvailable"):
            return int(ln.split()[1]) * 1024
    return 0


def fs_free(path: str) -> int:
    """Free bytes on the file system of ``path`` (for /dev/shm: tmpfs space left)."""
    while not os.path.exists(path):
        path = os.path.dirname(path) or "/"
    return shutil.disk_usage(path).free


def logger(prefix: str) -> Callable[[str], None]:
    """A ``log(msg)`` that prints ``[prefix HH:MM:SS] msg`` to stderr."""
    def log(msg: str) -> None:
        print(f"[{prefix} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
    return log


def loadavg_note(start: float, n: int) -> str | None:
    """A note when the 1-minute load average (at start or now) shows other processes using the cores."""
    now = os.getloadavg()[0]
    if max(start, now) > 0.5 * n:
        return (f"load average (1 min) {start:.2f} at the start, {now:.2f} at the end, on {n} cores: other "
                "processes competed for the machine during this run; the numbers are noisier than usual")
    return None


def finite(x: Any) -> Any:
    """``x`` with NaN and infinite floats (nested in dicts, lists, tuples) replaced by None: strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def write_json(path: str, obj: Any) -> None:
    """Writes ``obj`` as indented, strict JSON (NaN/inf as null, other non-JSON values as strings)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(finite(json.loads(json.dumps(obj, default=str))), f, indent=1, allow_nan=False)
    os.replace(tmp, path)


def print_report(text: str, path: str) -> None:
    """Prints a benchmark's report and writes it to ``path`` (its directory made when missing)."""
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")
