"""The CUDA path, side by side in one run: a GPT-like training state on the GPU snapshotted, persisted and
restored by flashckpt, ``torch.save`` / ``torch.load`` and PyTorch DCP, against this machine's PCIe limits.

    python -m benchmarks.bench_gpu [--sizes 1,4] [--rounds 3] [--steps 8] [--out bench_out]

(``bash scripts/gpu.sh`` runs it with the ``gpu`` test tier on a machine with a GPU.) Informational only:
nothing passes or fails. Rounds are interleaved, tables show medians. Per size (fp32 params + Adam
exp_avg/exp_avg_sq, all on ``cuda:0``):

* limits: every tensor copied device-to-host into a pinned (``pin_memory=True``) buffer and into a pageable,
  prefaulted one; host-to-device from each; ``cudaHostRegister`` of a prefaulted buffer of the state's size;
* flashckpt: ``save(MEMORY)`` (blocking: the device-to-host copy into the page-locked slot), the first save
  (allocation and page-locking of the slot), ``save(MEMORY, overlap=True)`` (returns once the copies are
  queued) and its ``wait_snapshot``, ``save(DISK)`` until committed; a restore in a new engine (the saver's
  memory, as after a crash; the segment not page-locked in this process yet) into the model's CUDA tensors,
  as each ``FLASHCKPT_CUDA_LOAD`` mode copies (``staged``, the default: pinned staging buffers filled by the
  copy threads; ``register``: the slot page-locked for the restore; ``pageable``), and ``load()`` into new
  CUDA tensors;
* ``torch.save`` of the CUDA state (blocking) and ``torch.load(map_location="cuda")`` + copy into the model;
* DCP: ``dcp.save``; ``dcp.async_save`` with its default stager, and with a reused
  ``DefaultStager(StagingOptions(use_pinned_memory=True, use_async_staging=True, use_non_blocking_copy=True))``
  (DCP's GPU setting: pinned staging buffers, copies on a stream); ``dcp.load`` into the CUDA state;
* training: ``--steps`` steps of bf16 matrix products (the forward/backward) and an in-place update of every
  state tensor (the optimizer step), with no checkpoint, a blocking flashckpt snapshot every step, and an
  overlapped one (``save(overlap=True)`` after the optimizer step, ``wait_snapshot()`` before the next).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from flashckpt.format.tree import tensors_by_path  # noqa: E402

from benchmarks._common import (  # noqa: E402
    GB,
    Samples,
    fmt_rate,
    fmt_time,
    gpt_config_for_bytes,
    gpt_param_shapes,
    iter_tensors,
    logger,
    machine_info,
    markdown_table,
    print_report,
    rotated,
    write_json,
)

log = logger("bench_gpu")


def gpu_state(size_gb: float, seed: int, fill: bool = True) -> dict[str, Any]:
    """params + Adam state of a GPT config of ``size_gb`` GB, built on ``cuda:0`` (random, or zeros)."""
    cfg = gpt_config_for_bytes(size_gb * GB)
    g = torch.Generator(device="cuda").manual_seed(seed)

    def new(shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.empty(shape, device="cuda")
        return t.normal_(0.0, 0.02, generator=g) if fill else t.zero_()

    # a plain dict, as model.state_dict() is not: DCP's pinned stager of torch 2.11 fails on an OrderedDict
    model: dict[str, torch.Tensor] = {name: new(shape) for name, shape in gpt_param_shapes(cfg)}
    state = {i: {"step": torch.tensor(1000.0), "exp_avg": new(p.shape), "exp_avg_sq": new(p.shape)}
             for i, p in enumerate(model.values())}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(range(len(model)))}]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}, "step": 1000}


def cuda_tensors(sd: Any) -> list[torch.Tensor]:
    return [t for t in iter_tensors(sd) if t.is_cuda]


def _sync_time(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _started_and_done(start: Callable[[], Any], finish: Callable[[], Any]) -> tuple[float, float]:
    """Seconds, from an idle GPU, until ``start()`` returned and until ``finish()`` (called next) returned."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start()
    t1 = time.perf_counter()
    finish()
    return t1 - t0, time.perf_counter() - t0


def _flat_u8(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _packed(tensors: list[torch.Tensor], buf: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each tensor's bytes paired with its slice of ``buf``, the tensors laid out one after another."""
    pairs, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        pairs.append((_flat_u8(t), buf[off:off + n]))
        off += n
    return pairs


class Case:
    """One size: its state on the GPU, a target of the same shapes, host buffers, work dirs and samples."""

    def __init__(self, size_gb: float, work: str) -> None:
        self.size_gb = size_gb
        self.work = os.path.join(work, f"gpu-{size_gb:g}GB")
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.work)
        self.sd = gpu_state(size_gb, 0)
        self.target = gpu_state(size_gb, 1, fill=False)
        self.tensors = cuda_tensors(self.sd)
        self.target_tensors = cuda_tensors(self.target)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.s = Samples()
        self.info: dict[str, Any] = {"cuda_tensors": len(self.tensors)}
        self.failed: dict[str, str] = {}

    def record(self, key: str, fn: Callable[[], float | dict[str, float]]) -> None:
        """Runs one measurement; a failure is recorded (the report says which and why), never fatal."""
        if key in self.failed:
            return
        try:
            r = fn()
        except Exception as e:
            self.failed[key] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
            log(f"{self.size_gb:g} GB: {key} failed: {self.failed[key]}")
            return
        for k, v in (r.items() if isinstance(r, dict) else [("", r)]):
            self.s.add(f"{key}.{k}" if k else key, v)


# ------------------------------------------------------------------------------------------ limits
def limits(c: Case, rounds: int) -> None:
    pinned = torch.empty(c.nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(c.nbytes, dtype=torch.uint8)
    pageable.zero_()

    def d2h(dst: torch.Tensor) -> float:
        def run() -> None:
            for dev, host in _packed(c.tensors, dst):
                host.copy_(dev, non_blocking=True)
        return _sync_time(run)

    def h2d(src: torch.Tensor) -> float:
        def run() -> None:
            for dev, host in _packed(c.target_tensors, src):
                dev.copy_(host, non_blocking=True)
        return _sync_time(run)

    def register() -> dict[str, float]:
        buf = torch.empty(c.nbytes, dtype=torch.uint8)
        buf.zero_()
        rt = torch.cuda.cudart()
        t0 = time.perf_counter()
        rc = int(rt.cudaHostRegister(buf.data_ptr(), c.nbytes, 0))
        t1 = time.perf_counter()
        if rc:
            raise RuntimeError(f"cudaHostRegister: CUDA error {rc}")
        rt.cudaHostUnregister(buf.data_ptr())
        return {"register": t1 - t0, "unregister": time.perf_counter() - t1}

    for _ in range(rounds):
        c.record("limit.d2h_pinned", lambda: d2h(pinned))
        c.record("limit.d2h_pageable", lambda: d2h(pageable))
        c.record("limit.h2d_pinned", lambda: h2d(pinned))
        c.record("limit.h2d_pageable", lambda: h2d(pageable))
    c.record("limit.host_register", register)


# ------------------------------------------------------------------------------------------ flashckpt
class Flash:
    def __init__(self, c: Case) -> None:
        from flashckpt import CheckpointEngine

        self.c = c
        self.dir = os.path.join(c.work, "flash")
        self.engine = CheckpointEngine(self.dir, max_to_keep=1)
        self.step = 0
        self.reader: Any = None
        # The first two snapshots (one per reserved slot), overlapped: the first one's plan and segment are
        # made on the snapshot thread, and each slot is page-locked in the background, its copies waiting.
        for n in (1, 2):
            returns, complete = _started_and_done(lambda: self.save(overlap=True), self.engine.wait_snapshot)
            c.info[f"flashckpt_first_save_{n}_returns_s"] = returns
            c.info[f"flashckpt_first_save_{n}_complete_s"] = complete
        dev = self.engine._handler._device  # the writer's page-locking record; no public accessor for it
        t0 = time.perf_counter()
        dev.wait_registered()
        c.info["flashckpt_register_wait_s"] = time.perf_counter() - t0
        c.info["flashckpt_register_s"] = sorted(dev.register_s.values())
        c.info["flashckpt_native"] = _native_status()

    def save(self, *, overlap: bool = False, disk: bool = False) -> None:
        from flashckpt import StorageType

        self.step += 1
        self.engine.save(self.step, self.c.sd, storage_type=StorageType.DISK if disk else StorageType.MEMORY,
                         overlap=overlap)

    def snapshot(self) -> float:
        return _sync_time(self.save)

    def overlapped(self) -> dict[str, float]:
        returns, complete = _started_and_done(lambda: self.save(overlap=True), self.engine.wait_snapshot)
        return {"returns": returns, "complete": complete}

    def persist(self) -> dict[str, float]:
        blocking, committed = _started_and_done(lambda: self.save(disk=True), self.engine.wait)
        return {"blocking": blocking, "committed": committed}

    def open_reader(self) -> None:
        """Closes the writer (its page-locked slots go) and opens a new engine on the saver's memory."""
        self.save()  # the newest snapshot is in memory only (the last persist is an older step)
        self.reopen(prestage=False)

    def reopen(self, *, prestage: bool) -> None:
        """A new engine on the saver's memory, as a restarted process makes one (the old one closed)."""
        from flashckpt import CheckpointEngine

        self.engine.close(release=False)
        os.environ["FLASHCKPT_CUDA_PRESTAGE"] = "1" if prestage else "0"
        try:
            self.engine = CheckpointEngine(self.dir, max_to_keep=1)
        finally:
            del os.environ["FLASHCKPT_CUDA_PRESTAGE"]

    def restore_prestaged(self) -> dict[str, float]:
        """A restart's restore: a new engine page-locks the newest snapshot's slot in the background at once
        (as while the process builds its model), then ``load(into=model)`` copies straight from it."""
        t0 = time.perf_counter()
        self.reopen(prestage=True)
        staged = self.engine._reader.prestaged()  # waits for the page-locking; no public accessor for it
        waited = time.perf_counter() - t0
        t = _sync_time(lambda: self.engine.load(into=self.c.target))
        self._check_exact()
        return {"load": t, "prestage": staged if staged is not None else float("nan"), "engine_and_prestage": waited}

    def restore_into(self, mode: str) -> float:
        os.environ["FLASHCKPT_CUDA_LOAD"] = mode
        try:
            t = _sync_time(lambda: self.engine.load(into=self.c.target))
        finally:
            del os.environ["FLASHCKPT_CUDA_LOAD"]
        self._check_exact()
        return t

    def _check_exact(self) -> None:
        last = self.engine.last_load
        ok = last is not None and last.source == "memory" and all(
            torch.equal(x, y) for x, y in zip(self.c.target_tensors, self.c.tensors, strict=True))
        self.c.info["restore_bit_exact"] = self.c.info.get("restore_bit_exact", True) and ok
        for t in self.c.target_tensors:  # the next restore fills zeros again
            t.zero_()

    def restore_new(self) -> float:
        out: list[Any] = []
        t = _sync_time(lambda: out.append(self.engine.load()))
        out.clear()
        return t

    def close(self) -> None:
        self.engine.close(release=True)


def _native_status() -> str:
    from flashckpt.util import cuda, native

    runtime = "cudaMemcpyAsync found" if cuda.runtime_fn("cudaMemcpyAsync") else "no CUDA runtime reached: Python copies"
    return ("loaded" if native.get() is not None else native.status()) + f" ({runtime})"


# ------------------------------------------------------------------------------------------ torch / DCP
def torch_save(c: Case) -> dict[str, float]:
    path = os.path.join(c.work, "torch.pt")
    t = _sync_time(lambda: torch.save(c.sd, path))
    return {"blocking": t}


def torch_load(c: Case) -> dict[str, float]:
    path = os.path.join(c.work, "torch.pt")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    sd = torch.load(path, map_location="cuda", weights_only=True)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    loaded = tensors_by_path(sd)
    for key, dst in tensors_by_path(c.target).items():
        if dst.is_cuda:
            dst.copy_(loaded[key])
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    del sd
    return {"load": t1 - t0, "load_copy": t2 - t0}


def dcp_ops(c: Case) -> tuple[list[tuple[str, Callable[[], dict[str, float]]]], Callable[[], None]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    d_save, d_def, d_pin = (os.path.join(c.work, n) for n in ("dcp_save", "dcp_async", "dcp_pinned_async"))
    stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True,
                                          use_non_blocking_copy=True))

    def save() -> dict[str, float]:
        shutil.rmtree(d_save, ignore_errors=True)
        return {"blocking": _sync_time(lambda: dcp.save(c.sd, checkpoint_id=d_save, no_dist=True))}

    def async_save(d: str, st: Any) -> dict[str, float]:
        shutil.rmtree(d, ignore_errors=True)
        kw = {"async_stager": st} if st is not None else {}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fut = dcp.async_save(c.sd, checkpoint_id=d, no_dist=True, **kw)
        t1 = time.perf_counter()
        staged = t1
        if hasattr(fut, "staging_completion"):
            fut.staging_completion.result()
            staged = time.perf_counter()
        (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
        out = {"blocking": t1 - t0, "staged": staged - t0, "durable": time.perf_counter() - t0}
        shutil.rmtree(d, ignore_errors=True)  # disk space: only dcp.save's files are kept (for dcp.load)
        return out

    def load() -> dict[str, float]:
        tgt = {"model": c.target["model"], "optimizer": c.target["optimizer"], "step": 0}
        return {"load": _sync_time(lambda: dcp.load(tgt, checkpoint_id=d_save, no_dist=True))}

    # the first pinned save allocates (and pins) the staging buffers, kept for the next: not measured
    t_first = async_save(d_pin, stager)["blocking"]
    c.info["dcp_pinned_first_save_s"] = t_first
    ops = [("dcp.save", save), ("dcp.async_save", lambda: async_save(d_def, None)),
           ("dcp.pinned_async_save", lambda: async_save(d_pin, stager)), ("dcp.load", load)]
    return ops, stager.close


# ------------------------------------------------------------------------------------------ training
def training(c: Case, flash: Flash, steps: int) -> dict[str, float]:
    """Step time with no checkpoint, a blocking snapshot every step, and an overlapped one."""
    from flashckpt import StorageType

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    n_mm = 60  # ~1.4 ms each at ~800 TFLOP/s: a ~90 ms forward/backward
    tensors = c.tensors

    def compute() -> None:
        x = a
        for _ in range(n_mm):
            x = torch.mm(x, b)
            x.mul_(1e-4)

    def optimizer() -> None:
        torch._foreach_add_(tensors, 1e-7)

    eng = flash.engine

    def step(mode: str) -> None:
        compute()
        if mode == "overlap":
            eng.wait_snapshot()  # the previous step's snapshot, copied while this step computed
        optimizer()
        flash.step += 1
        if mode == "blocking":
            eng.save(flash.step, c.sd, storage_type=StorageType.MEMORY)
        elif mode == "overlap":
            eng.save(flash.step, c.sd, storage_type=StorageType.MEMORY, overlap=True)

    # No synchronization inside the loop (as in training, where the host runs ahead of the GPU): the
    # steps' mean is the time of the whole run over the steps, after two steps of warm-up.
    for mode in ("none", "blocking", "overlap"):
        for _ in range(2):
            step(mode)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(mode)
        eng.wait_snapshot()
        torch.cuda.synchronize()
        c.s.add(f"train.{mode}", (time.perf_counter() - t0) / steps)
    return {}


# ------------------------------------------------------------------------------------------ the run
def run_case(c: Case, rounds: int, steps: int) -> None:
    log(f"{c.size_gb:g} GB ({c.nbytes / GB:.2f} GB in {len(c.tensors)} CUDA tensors): limits")
    limits(c, rounds)
    flash = Flash(c)
    stager_close = None
    ops: list[tuple[str, Callable[[], Any]]] = [
        ("flashckpt.snapshot", flash.snapshot), ("flashckpt.overlap", flash.overlapped),
        ("flashckpt.persist", flash.persist), ("torch.save", lambda: torch_save(c)),
    ]
    try:
        dops, stager_close = dcp_ops(c)
        ops += dops[:3]
        load_ops = [dops[3]]
    except Exception as e:
        c.failed["dcp"] = f"{type(e).__name__}: {e}"
        load_ops = []
    for r in range(rounds):
        log(f"{c.size_gb:g} GB: save round {r + 1}/{rounds}")
        for key, fn in rotated(ops, r):
            c.record(key, fn)
    log(f"{c.size_gb:g} GB: training steps")
    c.record("train", lambda: training(c, flash, steps))
    if stager_close is not None:
        stager_close()
    flash.open_reader()
    loads: list[tuple[str, Callable[[], Any]]] = [
        ("flashckpt.restore_prestaged", flash.restore_prestaged),
        ("flashckpt.restore_staged", lambda: flash.restore_into("staged")),
        ("flashckpt.restore_register", lambda: flash.restore_into("register")),
        ("flashckpt.restore_pageable", lambda: flash.restore_into("pageable")),
        ("flashckpt.restore_new", flash.restore_new), ("torch.load", lambda: torch_load(c)), *load_ops]
    for r in range(rounds):
        log(f"{c.size_gb:g} GB: load round {r + 1}/{rounds}")
        for key, fn in rotated(loads, r):
            c.record(key, fn)
    flash.close()


def render(cases: list[Case], machine: dict[str, Any]) -> str:
    def m(c: Case, key: str) -> float:
        return c.s.median(key)

    def cell(c: Case, key: str) -> str:
        if any(key == f or key.startswith(f + ".") for f in c.failed):
            return "failed"
        v = m(c, key)
        return "n/a" if v != v else f"{fmt_time(v)} ({fmt_rate(c.nbytes, v)})"

    out = [f"# bench_gpu: {machine.get('gpu', '?')}, {machine['cores']} cores, torch {machine['torch']}\n"]
    heads = ["", *[f"{c.size_gb:g} GB" for c in cases]]
    rows = [
        ["limit: device-to-host, pinned buffer", *[cell(c, "limit.d2h_pinned") for c in cases]],
        ["limit: device-to-host, pageable buffer", *[cell(c, "limit.d2h_pageable") for c in cases]],
        ["limit: cudaHostRegister of the state's size", *[cell(c, "limit.host_register.register") for c in cases]],
        ["**flashckpt snapshot (blocking)**", *[cell(c, "flashckpt.snapshot") for c in cases]],
        ["flashckpt first snapshot, overlapped: save() returns",
         *[fmt_time(c.info.get("flashckpt_first_save_1_returns_s", float("nan"))) for c in cases]],
        ["flashckpt first snapshot, overlapped: complete (plan, segment, page-locking, one DMA)",
         *[fmt_time(c.info.get("flashckpt_first_save_1_complete_s", float("nan"))) for c in cases]],
        ["flashckpt second snapshot (the other slot), overlapped: save() returns / complete",
         *[f"{fmt_time(c.info.get('flashckpt_first_save_2_returns_s', float('nan')))} / "
           f"{fmt_time(c.info.get('flashckpt_first_save_2_complete_s', float('nan')))}" for c in cases]],
        ["flashckpt page-locking of each slot (background thread)",
         *[", ".join(fmt_time(x) for x in c.info.get("flashckpt_register_s", [])) or "n/a" for c in cases]],
        ["**flashckpt overlapped: save() returns**", *[cell(c, "flashckpt.overlap.returns") for c in cases]],
        ["flashckpt overlapped: snapshot complete", *[cell(c, "flashckpt.overlap.complete") for c in cases]],
        ["flashckpt save(DISK): blocking", *[cell(c, "flashckpt.persist.blocking") for c in cases]],
        ["flashckpt save(DISK): committed", *[cell(c, "flashckpt.persist.committed") for c in cases]],
        ["torch.save (blocking)", *[cell(c, "torch.save.blocking") for c in cases]],
        ["DCP save (blocking)", *[cell(c, "dcp.save.blocking") for c in cases]],
        ["DCP async_save, default stager: blocking", *[cell(c, "dcp.async_save.blocking") for c in cases]],
        ["DCP async_save, pinned async stager: blocking", *[cell(c, "dcp.pinned_async_save.blocking") for c in cases]],
        ["DCP async_save, pinned async stager: staged", *[cell(c, "dcp.pinned_async_save.staged") for c in cases]],
        ["DCP async_save, pinned async stager: durable", *[cell(c, "dcp.pinned_async_save.durable") for c in cases]],
    ]
    out.append("## Save: how long training waits\n\n" + markdown_table(heads, rows))
    rows = [
        ["limit: host-to-device, pinned buffer", *[cell(c, "limit.h2d_pinned") for c in cases]],
        ["limit: host-to-device, pageable buffer", *[cell(c, "limit.h2d_pageable") for c in cases]],
        ["**flashckpt load(into=model), pre-staged (a restart's engine)**",
         *[cell(c, "flashckpt.restore_prestaged.load") for c in cases]],
        ["flashckpt pre-staging: page-locking in the background (new engine to done)",
         *[f"{fmt_time(m(c, 'flashckpt.restore_prestaged.prestage'))} "
           f"({fmt_time(m(c, 'flashckpt.restore_prestaged.engine_and_prestage'))})" for c in cases]],
        ["flashckpt load(into=model), staged (no pre-staging)", *[cell(c, "flashckpt.restore_staged") for c in cases]],
        ["flashckpt load(into=model), slot page-locked", *[cell(c, "flashckpt.restore_register") for c in cases]],
        ["flashckpt load(into=model), pageable", *[cell(c, "flashckpt.restore_pageable") for c in cases]],
        ["flashckpt load() into new CUDA tensors", *[cell(c, "flashckpt.restore_new") for c in cases]],
        ["torch.load(map_location=cuda) (page cache)", *[cell(c, "torch.load.load") for c in cases]],
        ["torch.load + copy into the model", *[cell(c, "torch.load.load_copy") for c in cases]],
        ["dcp.load into the model (page cache)", *[cell(c, "dcp.load.load") for c in cases]],
    ]
    out.append("## Restore into the model's CUDA tensors (a new engine on the saver's memory)\n\n"
               + markdown_table(heads, rows))
    rows = []
    for mode, label in (("none", "no checkpoint"), ("blocking", "flashckpt snapshot every step, blocking"),
                        ("overlap", "flashckpt snapshot every step, overlapped")):
        rows.append([label, *[fmt_time(m(c, f"train.{mode}")) for c in cases]])
    out.append("## Training step (bf16 products ~90 ms + in-place update of the state)\n\n" + markdown_table(heads, rows))
    notes = [f"{c.size_gb:g} GB: {k} failed: {v}" for c in cases for k, v in c.failed.items()]
    notes += [f"{c.size_gb:g} GB: every flashckpt restore from memory, bit exact: {c.info.get('restore_bit_exact')}"
              for c in cases]
    for c in cases:  # the targets of issue #35, read off this run
        h2d, pre = m(c, "limit.h2d_pinned"), m(c, "flashckpt.restore_prestaged.load")
        first, later = c.info.get("flashckpt_first_save_1_returns_s", float("nan")), m(c, "flashckpt.overlap.returns")
        notes.append(f"{c.size_gb:g} GB: pre-staged restore at {h2d / pre:.2f}x the host-to-device limit; save() "
                     f"returns in {fmt_time(later)} ({c.info.get('cuda_tensors')} CUDA tensors); first snapshot's save() "
                     f"{first / later:.2f}x a later one's; native fast path: {c.info.get('flashckpt_native')}")
    notes.append("machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()))
    out.append("\n".join(f"- {n}" for n in notes))
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,4", help="state sizes in GB, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="training steps per mode")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--work", default=None, help="where files are written (default: <out>/work)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU on this machine; nothing to measure (run it where one is)")
        return 0
    work = args.work or os.path.join(args.out, "work")
    machine = machine_info({"work": work, "shm": "/dev/shm"})
    machine["gpu"] = torch.cuda.get_device_name(0)
    cases: list[Case] = []
    for size in [float(x) for x in args.sizes.split(",") if x.strip()]:
        c = Case(size, work)
        try:
            run_case(c, args.rounds, args.steps)
        finally:
            cases.append(c)
            shutil.rmtree(c.work, ignore_errors=True)
            c.sd = c.target = {}
            c.tensors = c.target_tensors = []
            gc.collect()
            torch.cuda.empty_cache()
        print_report(render(cases, machine), os.path.join(args.out, "bench_gpu.md"))
        write_json(os.path.join(args.out, "bench_gpu.json"),
                   {"machine": machine, "cases": [{"size_gb": c.size_gb, "bytes": c.nbytes, "samples": c.s.data,
                                                   "info": c.info, "failed": c.failed} for c in cases]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
