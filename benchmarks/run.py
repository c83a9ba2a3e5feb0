"""The checkpoint benchmark suite: flashckpt side by side with the copy limit, torch.save, PyTorch DCP and DLRover.

    python -m benchmarks.run [--sizes 0.25,1,4] [--rounds N] [--quick] [--out bench_out] [--overhead]

Informational only: nothing passes or fails. Every case runs its systems in interleaved rounds (the order
rotated each round, so machine drift hits all systems alike) and reports medians. Cases, one after the
other (each frees its memory before the next starts):

* ``gpt-<size>GB``: a GPT-like state dict (fp32 params + Adam exp_avg/exp_avg_sq, 24 blocks) per ``--sizes``;
* ``tiny``: 20,000 tensors of 1 KiB (per-tensor overhead);
* ``tied``: a 0.25 GB GPT whose ``lm_head.weight`` is ``transformer.wte.weight`` (shared storage).

Systems, on the same state dict:

* copy limit: every storage's bytes memmoved into a preallocated, prefaulted ``/dev/shm`` buffer on all cores
  (and on one thread; the faster of the two is the limit);
* flashckpt: ``save(MEMORY)`` blocking time; ``save(DISK)`` blocking time and time until committed
  (``wait()``), hence persist throughput;
* ``torch.save`` (blocking; "until durable" adds an fsync);
* DCP ``dcp.save`` (blocking until durable: DCP fsyncs its files);
* DCP ``dcp.async_save`` with its default stager (a fresh CPU copy per save), and with a reused
  ``DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=False,
  use_non_blocking_copy=False))`` (shared-memory staging buffers kept across saves: DCP's best CPU setting);
  blocking = until ``async_save`` returns, durable = until its future completes;
* DLRover flash checkpoint (``DdpCheckpointer`` memory save), only when ``dlrover`` is importable.

Then, for the GPT cases, a load in a fresh process (a restarted trainer) into a model that already exists:
flashckpt ``load(into=model)`` and ``load()`` + copy from the saver's memory, ``torch.load`` (+ copy),
``torch.load(mmap=True)`` (+ copy) and ``dcp.load`` (in place), files in the page cache.

Before each GPT size it checks that RAM, ``/dev/shm`` and disk can hold what the case needs at its peak
(about 6x the state in RAM) and skips the size with a message otherwise. Markdown tables go to stdout and
``<out>/run.md``; everything measured (samples, medians, machine) to ``<out>/run.json``. ``--overhead``
also runs the training-overhead benchmark (``benchmarks/overhead.py``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._common import (  # noqa: E402
    GB,
    REPO_ROOT,
    GPTConfig,
    Samples,
    ShmCopyTarget,
    build_gpt_state_dict,
    build_tiny_state_dict,
    cores,
    dir_bytes,
    fingerprint,
    fmt_bytes,
    fmt_time,
    fs_free,
    fsync_file,
    gpt_config_for_bytes,
    iter_tensors,
    loadavg_note,
    logger,
    machine_info,
    markdown_table,
    median,
    mem_available,
    proc_cpu_s,
    rotated,
    saver_persist,
    saver_pids,
    tensor_bytes,
    wait_savers_gone,
    write_json,
)
from benchmarks._load import run_child  # noqa: E402

log = logger("bench")

# System ids -> labels (the JSON carries them, so plots need not import this module).
LABELS = {
    "copy_limit": "copy limit (memmove, all cores -> /dev/shm)",
    "flashckpt.snapshot": "flashckpt save(MEMORY)",
    "flashckpt.persist": "flashckpt save(DISK) -> committed",
    "torch.save": "torch.save",
    "dcp.save": "DCP dcp.save",
    "dcp.async_save": "DCP async_save (default stager)",
    "dcp.async_save.shm": "DCP async_save (DefaultStager, shared memory)",
    "dlrover.snapshot": "DLRover flash checkpoint (memory)",
    "load.flashckpt_into": "flashckpt load(into=model) from memory",
    "load.flashckpt": "flashckpt load() from memory + copy into model",
    "load.torch": "torch.load + copy into model",
    "load.torch_mmap": "torch.load(mmap=True) + copy into model",
    "load.dcp": "DCP dcp.load (in place)",
}
BLOCKING = ["copy_limit", "flashckpt.snapshot", "flashckpt.persist", "torch.save", "dcp.save", "dcp.async_save",
            "dcp.async_save.shm", "dlrover.snapshot"]
DURABLE = ["flashckpt.persist", "torch.save", "dcp.save", "dcp.async_save", "dcp.async_save.shm"]
LOAD_MODES = ["flashckpt_into", "flashckpt", "torch", "torch_mmap", "dcp"]


@dataclass
class Case:
    name: str
    kind: str  # gpt | tiny | tied
    label: str
    sd: Any
    cfg: GPTConfig | None
    nbytes: int
    ntensors: int
    work: str
    S: Samples = field(default_factory=Samples)
    failed: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- systems
class Op:
    """One measured operation: ``fn()`` returns {metric: value}; stored as ``<name>.<metric>``.

    An op that raises is recorded as failed (with the reason) and not run again in this case."""

    def __init__(self, name: str, fn: Callable[[], dict[str, float]]) -> None:
        self.name, self.fn = name, fn

    def __call__(self, case: Case) -> None:
        if self.name in case.failed:
            return
        # Dirty pages of the previous op (torch.save does not fsync) would be written back while this
        # one runs and bill it for the other's I/O: flush them first, outside the timing.
        os.sync()
        try:
            res = self.fn()
        except Exception as e:  # a system that cannot do this case: say why, keep measuring the others
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            case.failed[self.name] = reason
            log(f"{case.name}: {self.name} failed: {reason}")
            return
        for k, v in res.items():
            case.S.add(f"{self.name}.{k}", v)


def _rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


def _stop_processes(procs: set[Any]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(10)


def _clock(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


class Systems:
    """Sets up every system for one case, hands out its ops, and tears them down."""

    def __init__(self, case: Case, args: argparse.Namespace, nthreads: int, lean: bool = False) -> None:
        self.case, self.args, self.nthreads, self.lean = case, args, nthreads, lean
        self.closers: list[Callable[[], None]] = []
        self.ops: list[Op] = []
        self.step = 0
        self.engine: Any = None
        self.job_dirs: list[str] = []
        self.torch_file = os.path.join(case.work, "torch", "ckpt.pt")
        self.dcp_dir = os.path.join(case.work, "dcp_save")
        self._stager: Any = None
        self._target: ShmCopyTarget | None = None
        self._dlrover_ops: list[Op] | None = None
        self._kept_closers: list[Callable[[], None]] = []  # freed with the save side, not per lean turn

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def groups(self) -> list[tuple[str, Callable[[], None]]]:
        """Each system's setup: it appends the system's ops and the closers that free its memory."""
        g = [("copy limit", self._setup_copy), ("flashckpt", self._setup_flashckpt), ("torch.save", self._setup_torch),
             ("DCP", self._setup_dcp)]
        return g + ([("DLRover", self._setup_dlrover_once)] if self.args.dlrover else [])

    def setup(self) -> None:
        for d in ("fc", "torch", "dcp_save", "dcp_async", "dcp_async_shm", "dlrover"):
            os.makedirs(os.path.join(self.case.work, d), exist_ok=True)
        if not self.lean:
            for _, fn in self.groups():
                fn()

    def run_round(self, r: int) -> None:
        """Every op once, in an order rotated by round. Lean: one system at a time (rotated), each set up
        before its ops (with its unmeasured warm-up saves) and torn down after them, so that only the
        state and one system's buffers are in memory at once."""
        if not self.lean:
            for op in rotated(self.ops, r):
                op(self.case)
            return
        for name, fn in rotated(self.groups(), r):
            n_ops, n_close = len(self.ops), len(self.closers)
            try:
                fn()
                for op in rotated(self.ops[n_ops:], r):
                    op(self.case)
            except Exception as e:  # a setup that failed: the others still run
                self.case.notes.append(f"round {r + 1}: {name} setup failed: {type(e).__name__}: {e}"[:300])
            finally:
                turn_closers = self.closers[n_close:]
                del self.closers[n_close:], self.ops[n_ops:]
                self._run_closers(turn_closers)
                gc.collect()

    def before_loads(self) -> None:
        """Hands the state to the fresh-process loads as a restart does (lean: a flashckpt engine first
        holds it in its saver's memory). A reader passes over snapshots whose writer is alive (another
        training's), so the writing engine persists the newest snapshot (no last words then write while the
        children load) and closes keeping its snapshots, as a crashed trainer's are kept; an engine that only
        loads, which never takes the writer lease, stays attached so that the saver keeps them through every
        load round. It goes with the case's closers."""
        from flashckpt import CheckpointEngine, StorageType

        if self.lean:
            self._setup_flashckpt()
        eng = self.engine
        if eng is None:
            return
        eng.save(self.next_step(), self.case.sd, storage_type=StorageType.DISK)
        eng.wait()
        eng.close(release=False)
        keeper = CheckpointEngine(os.path.join(self.case.work, "fc"), max_to_keep=1)
        self.closers.append(keeper.close)

    def _run_closers(self, closers: list[Callable[[], None]]) -> None:
        for fn in reversed(closers):
            try:
                fn()
            except Exception as e:  # keep closing the others
                self.case.notes.append(f"close: {e}")

    def _setup_copy(self) -> None:
        c, sd = self.case, self.case.sd
        tg = ShmCopyTarget(iter_tensors(sd), threads=self.nthreads)
        self._target = tg
        self.closers.append(self._free_target)
        tg.memmove(self.nthreads)
        tg.memmove(1)
        if not tg.matches():
            c.notes.append("the raw copy does not reproduce the source bytes (benchmark bug)")
        self.ops.append(Op("copy.memmove_n", lambda: {"blocking": _clock(lambda: tg.memmove(self.nthreads))[0]}))
        if self.nthreads > 1:
            self.ops.append(Op("copy.memmove_1", lambda: {"blocking": _clock(lambda: tg.memmove(1))[0]}))

    def _free_target(self) -> None:
        if self._target is not None:
            self._target.close()
            self._target = None

    # -------------------------------------------------------------- flashckpt
    def _setup_flashckpt(self) -> None:
        from flashckpt import CheckpointEngine, StorageType

        c, sd = self.case, self.case.sd
        t_init, eng = _clock(lambda: CheckpointEngine(os.path.join(c.work, "fc"), max_to_keep=1))
        self.engine = eng
        if eng.job_dir not in self.job_dirs:
            self.job_dirs.append(eng.job_dir)

        def close() -> None:
            eng.close()
            if self.lean:  # its saver frees the segment when it exits: before the next system allocates
                left = wait_savers_gone([eng.job_dir])
                if left:
                    c.notes.append(left)

        self.closers.append(close)
        # the first two saves allocate the segment and touch both slots' pages: not measured
        t_first, _ = _clock(lambda: eng.save(self.next_step(), sd, storage_type=StorageType.MEMORY))
        eng.save(self.next_step(), sd, storage_type=StorageType.MEMORY)
        c.info.update(flashckpt_engine_init_s=t_init, flashckpt_first_save_s=t_first)
        if c.kind == "gpt":  # a new saver's first persist pays its one-off imports: not measured
            eng.save(self.next_step(), sd, storage_type=StorageType.DISK)
            eng.wait()
        pids = saver_pids([eng.job_dir])

        def snapshot() -> dict[str, float]:
            return {"blocking": _clock(lambda: eng.save(self.next_step(), sd, storage_type=StorageType.MEMORY))[0]}

        def persist() -> dict[str, float]:
            os.sync()
            step = self.next_step()
            cpu0 = proc_cpu_s(pids)
            t0 = time.perf_counter()
            eng.save(step, sd, storage_type=StorageType.DISK)
            t1 = time.perf_counter()
            eng.wait()
            t2 = time.perf_counter()
            out = {"blocking": t1 - t0, "durable": t2 - t0}
            if pids:  # CPU the saver spent on this persist: what it takes from training's cores
                out["saver_cpu"] = proc_cpu_s(pids) - cpu0
            got = saver_persist(eng, step)
            if got:
                out["bytes"], out["saver_s"] = float(got[0]), got[1]
            return out

        self.ops.append(Op("flashckpt.snapshot", snapshot))
        if c.kind == "gpt":
            self.ops.append(Op("flashckpt.persist", persist))

    # -------------------------------------------------------------- torch.save
    def _setup_torch(self) -> None:
        sd, path = self.case.sd, self.torch_file

        def save() -> dict[str, float]:
            _rm(path)
            os.sync()
            t0 = time.perf_counter()
            torch.save(sd, path)
            t1 = time.perf_counter()
            fsync_file(path)
            t2 = time.perf_counter()
            return {"blocking": t1 - t0, "durable": t2 - t0, "bytes": float(os.path.getsize(path))}

        self.ops.append(Op("torch.save", save))

    # -------------------------------------------------------------- DCP
    def _setup_dcp(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        c, sd = self.case, self.case.sd

        def dcp_save() -> dict[str, float]:
            _rm(self.dcp_dir)
            os.sync()
            dt, _ = _clock(lambda: dcp.save(sd, checkpoint_id=self.dcp_dir, no_dist=True))
            return {"blocking": dt, "durable": dt, "bytes": float(dir_bytes(self.dcp_dir))}

        def async_save(d: str, stager: Any) -> dict[str, float]:
            _rm(d)
            os.sync()
            kw = {"async_stager": stager} if stager is not None else {}
            t0 = time.perf_counter()
            fut = dcp.async_save(sd, checkpoint_id=d, no_dist=True, **kw)
            t1 = time.perf_counter()
            (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
            t2 = time.perf_counter()
            return {"blocking": t1 - t0, "durable": t2 - t0, "bytes": float(dir_bytes(d))}

        d_def, d_shm = os.path.join(c.work, "dcp_async"), os.path.join(c.work, "dcp_async_shm")
        self.ops.append(Op("dcp.save", dcp_save))
        self.ops.append(Op("dcp.async_save", lambda: async_save(d_def, None)))
        opts = StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=False,
                              use_non_blocking_copy=False)
        try:
            stager = DefaultStager(opts)
            self._stager = stager
            self.closers.append(self._close_stager)
            # the first save allocates the staging buffers (kept for the next saves): not measured
            t_first, _ = _clock(lambda: async_save(d_shm, stager))
            c.info["dcp_shm_first_save_s"] = t_first
            self.ops.append(Op("dcp.async_save.shm", lambda: async_save(d_shm, stager)))
        except Exception as e:
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
            c.failed["dcp.async_save.shm"] = reason
            log(f"{c.name}: dcp.async_save.shm failed: {reason}")
            self._close_stager()

    def _close_stager(self) -> None:
        if self._stager is not None:
            try:
                self._stager.close()
            except Exception as e:  # closing a half-built stager: nothing else to do
                self.case.notes.append(f"DefaultStager.close(): {e}")
            self._stager = None
            gc.collect()

    # -------------------------------------------------------------- DLRover (optional, untested here)
    def _setup_dlrover_once(self) -> None:
        """DLRover's checkpointer is set up once per case and kept (lean turns included): a second one in
        the same process fails to attach once the first one's segment is unlinked."""
        if self._dlrover_ops is None:
            n_ops, n_close = len(self.ops), len(self.closers)
            self._setup_dlrover()
            self._dlrover_ops = self.ops[n_ops:]
            self._kept_closers += self.closers[n_close:]
            del self.closers[n_close:]
        else:
            self.ops += self._dlrover_ops

    def _setup_dlrover(self) -> None:
        c, sd = self.case, self.case.sd
        try:
            import torch.distributed as dist
            from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer as DlroverCheckpointer
            from dlrover.trainer.torch.flash_checkpoint.ddp import StorageType as DlroverStorageType

            if not dist.is_initialized():  # DLRover's checkpointer needs a process group (world size 1 here)
                store = os.path.join(tempfile.mkdtemp(prefix="bench-dlrover-"), "store")
                dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
            before = set(multiprocessing.active_children())
            ck = DlroverCheckpointer(os.path.join(c.work, "dlrover"))
            # Standalone, DLRover forks its saver, which maps the segment: it must go with the case, or it
            # holds the memory and the next case's checkpointer talks to its closed sockets
            saver_procs = set(multiprocessing.active_children()) - before
            self.closers.append(lambda: _stop_processes(saver_procs))
            path = os.path.join(c.work, "dlrover", "ckpt.pt")
            for _ in range(2):  # allocation and first touch: not measured
                ck.save_checkpoint(self.next_step(), sd, path, storage_type=DlroverStorageType.MEMORY)

            def snap() -> dict[str, float]:
                dt, _ = _clock(lambda: ck.save_checkpoint(self.next_step(), sd, path,
                                                          storage_type=DlroverStorageType.MEMORY))
                return {"blocking": dt}

            self.ops.append(Op("dlrover.snapshot", snap))
            eng = getattr(ck, "_engine", None)
            closer = getattr(eng, "close", None)
            if closer is not None:
                self.closers.append(closer)
            # Without DLRover's agent nobody unlinks its segment (/dev/shm/ckpt_shm_<local rank>): do it here.
            unlink = getattr(getattr(eng, "_shm_handler", None), "unlink", None)
            if unlink is not None:
                self.closers.append(unlink)
        except Exception as e:
            c.failed["dlrover.snapshot"] = f"{type(e).__name__}: {e}"[:300]
            log(f"{c.name}: DLRover failed: {c.failed['dlrover.snapshot']}")

    # -------------------------------------------------------------- teardown
    def free_save_side(self) -> None:
        """Frees what only the save rounds need (copy buffer, DCP staging cache, DLRover) before the loads."""
        self._free_target()
        self._close_stager()
        # DLRover's op holds the state and its forked saver a copy of it: both go before the loads
        self._run_closers(self._kept_closers)
        self._kept_closers.clear()
        self._dlrover_ops = None
        self.ops.clear()
        gc.collect()

    def close(self) -> None:
        self.free_save_side()
        self._run_closers(self.closers)
        self.closers.clear()


# ---------------------------------------------------------------------------------------------- cases
def fit_check(nbytes: float, work: str, dlrover: bool, lean: bool = False) -> str | None:
    """Why a GPT case of ``nbytes`` cannot run here (all systems set up at once, or ``lean``: one at a
    time), or None.

    Peak in RAM (save rounds): the state, the copy-limit buffer, flashckpt's two snapshot slots, DCP's
    shared-memory staging cache and a transient default-stager copy (6x; DLRover adds 2x); of those,
    /dev/shm holds the copy buffer, both slots and the staging cache (4x). Lean: the state and the
    largest single system, flashckpt's two slots (3x; 2x in /dev/shm), and DLRover's buffers, which stay.
    Disk: torch.save, three DCP directories and up to two flashckpt steps (6x)."""
    ram_need = ((3 if lean else 6) + (2 if dlrover else 0)) * nbytes + 0.5 * GB
    shm_need = ((2 if lean else 4) + (2 if dlrover else 0)) * nbytes
    disk_need = 6 * nbytes
    ram, shm, disk = mem_available(), fs_free("/dev/shm"), fs_free(work)
    why = []
    if ram and ram < ram_need:
        why.append(f"about {ram_need / GB:.1f} GB of RAM at its peak, {ram / GB:.1f} GB available")
    if shm < shm_need:
        why.append(f"about {shm_need / GB:.1f} GB in /dev/shm, {shm / GB:.1f} GB free")
    if disk < disk_need:
        why.append(f"about {disk_need / GB:.1f} GB of disk in {work}, {disk / GB:.1f} GB free")
    return "; ".join(why) or None


def make_case(name: str, work: str, size_gb: float | None = None) -> Case:
    if name == "tiny":
        sd = build_tiny_state_dict(20_000, 1024)
        return Case("tiny", "tiny", "20,000 x 1 KiB", sd, None, tensor_bytes(sd), len(iter_tensors(sd)),
                    os.path.join(work, "tiny"))
    if name == "tied":
        cfg = gpt_config_for_bytes(0.25 * GB, tie=True)
        sd = build_gpt_state_dict(cfg, seed=1)
        c = Case("tied", "tied", "tied GPT 0.25 GB", sd, cfg, tensor_bytes(sd), len(iter_tensors(sd)),
                 os.path.join(work, "tied"))
        c.info["entry_bytes"] = tensor_bytes(sd, distinct=False)
        return c
    assert size_gb is not None
    cfg = gpt_config_for_bytes(size_gb * GB)
    sd = build_gpt_state_dict(cfg)
    return Case(name, "gpt", f"GPT {size_gb:g} GB", sd, cfg, tensor_bytes(sd), len(iter_tensors(sd)),
                os.path.join(work, name))


def run_case(case: Case, args: argparse.Namespace, nthreads: int, lean: bool = False) -> None:
    _rm(case.work)
    os.makedirs(case.work)
    sysm = Systems(case, args, nthreads, lean)
    if lean:
        case.info["lean"] = True
        case.notes.append("run lean: one system in memory at a time, each set up (with its unmeasured warm-up "
                          "saves) and freed again in every round, since all of them at once do not fit here")
    try:
        log(f"{case.name}: {case.ntensors} tensors, {fmt_bytes(case.nbytes)}; setting up" + (" (lean)" if lean else ""))
        sysm.setup()
        for r in range(args.rounds):
            log(f"{case.name}: save round {r + 1}/{args.rounds}")
            gc.collect()
            sysm.run_round(r)
        if case.kind == "tied":
            tied_info(case, sysm)
        if case.kind == "gpt" and not args.no_load:
            expect = fingerprint(case.sd)
            sysm.before_loads()
            case.sd = None  # the children load it; free the parent's copy
            sysm.free_save_side()
            run_loads(case, sysm, args, expect)
    finally:
        sysm.close()
        case.sd = None
        gc.collect()
        if sysm.job_dirs:
            left = wait_savers_gone(sysm.job_dirs)
            if left:
                case.notes.append(left)
        if not args.keep:
            _rm(case.work)


def tied_info(case: Case, sysm: Systems) -> None:
    """Whether each system stores the tied tensor once, and whether flashckpt restores the tie."""
    eng = sysm.engine
    plan = getattr(getattr(eng, "_handler", None), "_plan", None)
    case.info["flashckpt_snapshot_bytes"] = getattr(plan, "tensor_bytes", None)
    back = eng.load()
    m = back.get("model", {}) if isinstance(back, dict) else {}
    case.info["flashckpt_restores_tie"] = bool(
        m and m["lm_head.weight"].untyped_storage().data_ptr() == m["transformer.wte.weight"].untyped_storage().data_ptr())
    for k in ("torch.save.bytes", "dcp.save.bytes", "dcp.async_save.bytes", "dcp.async_save.shm.bytes"):
        if k in case.S:
            case.info[k.replace(".bytes", "_file_bytes")] = case.S.median(k)


def run_loads(case: Case, sysm: Systems, args: argparse.Namespace, expect: list[float]) -> None:
    assert case.cfg is not None
    fc_dir = os.path.join(case.work, "fc")
    modes = [m for m in LOAD_MODES
             if not (m.startswith("torch") and "torch.save" in case.failed)
             and not (m == "dcp" and "dcp.save" in case.failed)]
    for r in range(args.rounds):
        log(f"{case.name}: load round {r + 1}/{args.rounds} (fresh processes)")
        for mode in rotated(modes, r):
            key = f"load.{mode}"
            if key in case.failed:
                continue
            res = run_child(mode, case.cfg, ckpt_dir=sysm.dcp_dir if mode == "dcp" else fc_dir,
                            file=sysm.torch_file)
            if "error" in res:
                case.failed[key] = res["error"][-300:]
                log(f"{case.name}: load {mode} failed: {res['error'][-300:]}")
                continue
            if mode.startswith("flashckpt") and res.get("source") != "memory":
                case.notes.append(f"load {mode}: came from {res.get('source')!r}, not from memory")
            if res.get("fingerprint") != expect:
                case.notes.append(f"load {mode}: the loaded tensors differ from the saved ones (round {r + 1})")
            case.S.add(key, res["load_s"] + res.get("copy_s", 0.0))
            case.S.add(f"{key}.load_only", res["load_s"])
            case.S.add(f"{key}.wall", res["wall_s"])
            if "init_s" in res:
                case.S.add(f"{key}.init", res["init_s"])


# ---------------------------------------------------------------------------------------------- report
def summarize(case: Case) -> dict[str, Any]:
    """Medians, spreads, the copy limit and per-round ratios to it."""
    S = case.S
    med = {k: S.median(k) for k in S.data}
    spread = {k: list(S.spread(k)) for k in S.data}
    lim_keys = [k for k in ("copy.memmove_n.blocking", "copy.memmove_1.blocking") if k in S]
    limit = min((med[k] for k in lim_keys), default=float("nan"))
    per_round_limit = [min(S.data[k][i] for k in lim_keys) for i in range(min(len(S.data[k]) for k in lim_keys))] \
        if lim_keys else []
    med["copy_limit.blocking"] = limit
    ratios: dict[str, float] = {}
    for sysid in BLOCKING[1:]:
        xs = S.data.get(f"{sysid}.blocking", [])
        if xs and len(xs) == len(per_round_limit):
            ratios[sysid] = median([x / lim for x, lim in zip(xs, per_round_limit, strict=True)])
        elif xs and limit == limit:
            ratios[sysid] = median(xs) / limit
    if "load.torch" in S:
        base = S.data["load.torch"]
        for m in LOAD_MODES:
            xs = S.data.get(f"load.{m}", [])
            if xs and len(xs) == len(base):
                ratios[f"load.{m}_speedup_vs_torch"] = median([b / x for b, x in zip(base, xs, strict=True)])
    return {"name": case.name, "kind": case.kind, "label": case.label, "bytes": case.nbytes,
            "tensors": case.ntensors, "config": case.cfg.__dict__ if case.cfg else None, "rounds": len(per_round_limit),
            "medians": med, "spread": spread, "x_copy_limit": ratios, "failed": case.failed, "info": case.info,
            "notes": case.notes, "samples": S.data}


def _cell_time(c: dict[str, Any], key: str, ratio: float | None = None) -> str:
    if key not in c["medians"]:
        return ""
    s = fmt_time(c["medians"][key])
    return f"{s} ({ratio:.2f}x)" if ratio is not None and ratio == ratio else s


def render(cases: list[dict[str, Any]], skipped: dict[str, str], args: argparse.Namespace) -> str:
    out: list[str] = []
    ran = cases
    # A: training paused per checkpoint
    heads = ["system: training paused per checkpoint"] + [f"{c['label']} ({fmt_bytes(c['bytes'])})" for c in ran]
    rows = []
    for sysid in BLOCKING:
        key = f"{sysid}.blocking"
        cells = []
        for c in ran:
            if sysid in c["failed"]:
                cells.append("failed")
            elif sysid == "copy_limit":
                cells.append(_cell_time(c, key, 1.0))
            else:
                cells.append(_cell_time(c, key, c["x_copy_limit"].get(sysid)))
        if any(cells):
            label = LABELS[sysid] + (" (blocking part)" if sysid == "flashckpt.persist" else "")
            rows.append([label] + cells)
    out.append(markdown_table(heads, rows))
    out.append(f"\nMedians of {args.rounds} interleaved rounds; in brackets: times the copy limit of the same case "
               "(median of per-round ratios). torch.save without fsync; dcp.save fsyncs its files.")
    # B: until durable (GPT cases)
    gpts = [c for c in ran if c["kind"] == "gpt"]
    if gpts:
        heads = ["system: until durable on disk"] + [c["label"] for c in gpts]
        rows = []
        for sysid in DURABLE:
            cells = []
            for c in gpts:
                k = f"{sysid}.durable"
                if sysid in c["failed"]:
                    cells.append("failed")
                elif k in c["medians"]:
                    nb = c["medians"].get(f"{sysid}.bytes", c["bytes"])
                    cells.append(f"{fmt_time(c['medians'][k])} ({nb / c['medians'][k] / GB:.2f} GB/s)")
                else:
                    cells.append("")
            label = LABELS[sysid] + (" + fsync" if sysid == "torch.save" else "")
            rows.append([label] + cells)
        if any("flashckpt.persist.saver_s" in c["medians"] for c in gpts):
            rows.append(["  flashckpt: the saver's own persist time (saver.log)"]
                        + [_cell_time(c, "flashckpt.persist.saver_s") for c in gpts])
        if any("flashckpt.persist.saver_cpu" in c["medians"] for c in gpts):
            rows.append(["  flashckpt: CPU time the saver spent on it (per GB)"]
                        + [_cell_time(c, "flashckpt.persist.saver_cpu")
                           + (f" ({c['medians']['flashckpt.persist.saver_cpu'] / (c['bytes'] / GB):.2f} s/GB)"
                              if "flashckpt.persist.saver_cpu" in c["medians"] else "") for c in gpts])
        out += ["", markdown_table(heads, rows),
                "\nFrom the call until the checkpoint is on disk (fsynced); in brackets the state's bytes as written "
                "per second. For flashckpt: save(DISK) until wait() returns (persisted and committed)."]
        # C: load after a restart
        if any("load.torch" in c["medians"] or "load.flashckpt_into" in c["medians"] for c in gpts):
            heads = ["load into an existing model, fresh process"] + [c["label"] for c in gpts]
            rows = []
            for m in LOAD_MODES:
                cells = []
                for c in gpts:
                    k = f"load.{m}"
                    if k in c["failed"]:
                        cells.append("failed")
                    else:
                        sp = c["x_copy_limit"].get(f"load.{m}_speedup_vs_torch")
                        cells.append(_cell_time(c, k) + (f" ({sp:.1f}x)" if sp and m != "torch" else ""))
                rows.append([LABELS[f"load.{m}"]] + cells)
            out += ["", markdown_table(heads, rows),
                    "\nOnly the load and the copy into the model's existing (prefaulted) tensors are timed, not the "
                    "interpreter start; in brackets: speed-up over torch.load + copy (median of per-round ratios; below 1: "
                    "slower). "
                    "Files are in the page cache (warm)."]
    # info
    lines = []
    for c in ran:
        if c["kind"] == "tied":
            i = c["info"]
            lines.append(
                f"- tied weights: {fmt_bytes(c['bytes'])} distinct, {fmt_bytes(i.get('entry_bytes', 0))} of entries; "
                f"flashckpt snapshot holds {fmt_bytes(i.get('flashckpt_snapshot_bytes') or 0)} and restores the tie: "
                f"{'yes' if i.get('flashckpt_restores_tie') else 'NO'}; bytes on disk: "
                + ", ".join(f"{k.replace('_file_bytes', '')} {fmt_bytes(v)}" for k, v in i.items()
                            if k.endswith("_file_bytes")))
        for s, why in c["failed"].items():
            lines.append(f"- {c['label']}: {LABELS.get(s, s)} failed: {why}")
        lines += [f"- {c['label']}: {n}" for n in c["notes"]]
    for name, why in skipped.items():
        lines.append(f"- {name} skipped: {why}")
    if lines:
        out += ["", "Notes:", ""] + lines
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=None, help="GPT state sizes in GB, comma-separated (default 0.25,1,4)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per case (default 5)")
    p.add_argument("--quick", action="store_true", help="0.25 GB only, 3 rounds (a few minutes)")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "bench_out"), help="directory for run.md / run.json")
    p.add_argument("--dir", default=None, help="disk directory for checkpoints (default <out>/work)")
    p.add_argument("--no-load", action="store_true", help="skip the fresh-process loads")
    p.add_argument("--no-extra", action="store_true", help="skip the 20,000-tensor and tied-weights cases")
    p.add_argument("--threads", type=int, default=0, help="threads of the copy limit (default: cores)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints written")
    p.add_argument("--lean", action="store_true",
                   help="one system in memory at a time (set up and freed per round); automatic for a size whose "
                        "systems do not fit in memory together")
    p.add_argument("--overhead", action="store_true", help="also run the training-overhead benchmark")
    args = p.parse_args(argv)
    args.sizes = [float(x) for x in (args.sizes or ("0.25" if args.quick else "0.25,1,4")).split(",") if x.strip()]
    args.rounds = args.rounds or (3 if args.quick else 5)
    if args.rounds < 1 or any(s <= 0 for s in args.sizes):
        p.error("--rounds must be >= 1 and --sizes > 0")
    args.out = os.path.abspath(args.out)
    args.dir = os.path.abspath(args.dir or os.path.join(args.out, "work"))
    args.dlrover = importlib.util.find_spec("dlrover") is not None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A benchmark that dies must not leave savers holding GBs of /dev/shm for the default 10 minutes.
    os.environ.setdefault("FLASHCKPT_SAVER_GRACE_S", "30")
    warnings.filterwarnings("ignore", module="torch.distributed.checkpoint")
    warnings.filterwarnings("ignore", message=".*TypedStorage.*")
    n = cores()
    nthreads = args.threads or n
    load0 = os.getloadavg()[0]
    wall0 = time.perf_counter()
    if load0 > 0.5 * n:
        log(f"warning: load average {load0:.1f} on {n} cores at the start: expect noisy numbers")
    if not args.dlrover:
        print('note: DLRover is not installed (pip install "dlrover[torch]" grpcio): its column is skipped',
              flush=True)
    os.makedirs(args.dir, exist_ok=True)
    names: list[tuple[str, float | None]] = [(f"gpt-{s:g}GB", s) for s in args.sizes]
    if not args.no_extra:
        names += [("tiny", None), ("tied", None)]
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for name, size in names:
        gc.collect()
        log(f"{name}: {mem_available() / GB:.1f} GB of RAM available, {fs_free('/dev/shm') / GB:.1f} GB free in /dev/shm")
        lean = args.lean
        if size is not None:
            why = fit_check(size * GB, args.dir, args.dlrover, lean)
            if why and not lean:
                why_lean = fit_check(size * GB, args.dir, args.dlrover, lean=True)
                if why_lean is None:
                    log(f"{name}: all systems at once need {why}: running it lean (one system at a time)")
                    lean = True
                why = why_lean and f"{why_lean} even with one system in memory at a time"
            if why:
                msg = f"needs {why}"
                skipped[name] = msg
                print(f"note: skipping {name}: it {msg}", flush=True)
                continue
        case = make_case(name, args.dir, size)
        run_case(case, args, nthreads, lean)
        results.append(summarize(case))
        del case
    try:
        os.rmdir(args.dir)
    except OSError:
        pass
    info = machine_info({"checkpoint_dir": args.dir, "shm": "/dev/shm"})
    info.update(copy_threads=nthreads, rounds=args.rounds, dlrover=args.dlrover,
                bench_wall_s=round(time.perf_counter() - wall0, 1))
    note = loadavg_note(load0, n)
    text = render(results, skipped, args)
    if note:
        text += f"\n- {note}"
    print(text)
    cmd = "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "run.md"), "w") as f:
        f.write(f"# Checkpoint benchmark\n\nCommand: `{cmd.strip()}`\n\n{text}\n\n## Machine\n\n"
                + markdown_table(["key", "value"], [[k, str(v)] for k, v in info.items()], "ll") + "\n")
    write_json(os.path.join(args.out, "run.json"),
               {"command": cmd.strip(), "machine": info, "labels": LABELS, "blocking_systems": BLOCKING,
                "cases": results, "skipped": skipped, "notes": [note] if note else []})
    log(f"done in {time.perf_counter() - wall0:.0f} s; wrote {args.out}/run.md and run.json")
    if args.overhead:
        from benchmarks import overhead

        return overhead.main((["--quick"] if args.quick else []) + ["--out", args.out])
    return 0


if __name__ == "__main__":
    sys.exit(main())
