"""Pause per checkpoint of a sharded model (FSDP2 ``fully_shard``, gloo, CPU): flashckpt's
``FsdpShardCheckpointer`` against PyTorch DCP's ``async_save`` with a shared-memory ``DefaultStager`` and
against a plain ``dcp.save``, in the same run, interleaved round by round (never a pass/fail test).

The model is ``--layers`` Linear(``--width``, ``--width``) layers in fp32, each sharded with ``fully_shard``
(``--gb`` of weights in all, split over the ranks); the checkpoint is ``{"model": get_model_state_dict(model)}``
(DTensor shards). Per round and rank it times how long each call blocks the training loop:

- flashckpt MEMORY: ``save_checkpoint(..., StorageType.MEMORY)`` (DCP planning with a cached plan, then the
  copy into shared memory), with its split into planning and copy;
- flashckpt DISK: the same, plus scheduling the background persist (waited for before the next call);
- ``dcp.async_save(..., async_stager=DefaultStager(StagingOptions(use_shared_memory=True, ...)))``: the copy
  into the stager's (reused) shared-memory buffers; planning and writing run in its thread (waited for);
- ``dcp.save`` with ``FileSystemWriter``: the whole synchronous save.

Round 0 is a warm-up (plans, buffers, segments) and is left out; figures are medians over the other rounds,
per rank, and the slowest rank's median. Usage::

    python -m benchmarks.bench_fsdp [--gb 1.0] [--ranks 2 4] [--rounds 5] [--workdir /tmp/flashckpt-bench-fsdp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any, cast

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------ worker (one rank)
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, REPO)
    from flashckpt.integrations.fsdp import FsdpShardCheckpointer, StorageType

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        g = torch.Generator().manual_seed(rank)
        for p in model.parameters():
            cast(Any, p).to_local().uniform_(-0.01, 0.01, generator=g)  # a DTensor parameter
    sd: dict[str, Any] = {"model": get_model_state_dict(model)}
    local_bytes = sum(cast(Any, v).to_local().nbytes for v in sd["model"].values())

    flash_dir = os.path.join(args.workdir, "flash")
    dcp_dir = os.path.join(args.workdir, "dcp")
    ckpt = FsdpShardCheckpointer(flash_dir, max_to_keep=1)
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=False,
                                          use_non_blocking_copy=False))
    async_pg = dist.new_group(backend="gloo")  # DCP's advice: async collectives on a group of their own
    times: dict[str, list[float]] = {k: [] for k in ("flash_memory", "flash_memory_plan", "flash_memory_copy",
                                                     "flash_disk", "dcp_async_save", "dcp_save")}

    def timed(fn, *a, **kw) -> tuple[float, object]:
        dist.barrier()
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        return time.perf_counter() - t0, out

    def rm_dcp(step: int) -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(dcp_dir, f"async_{step}"), ignore_errors=True)
            shutil.rmtree(os.path.join(dcp_dir, f"sync_{step}"), ignore_errors=True)
        dist.barrier()

    try:
        for rnd in range(args.rounds + 1):
            step = 2 * rnd
            t, _ = timed(ckpt.save_checkpoint, step, sd, f"step_{step}", storage_type=StorageType.MEMORY)
            split = ckpt.last_save
            assert split is not None
            t_disk, _ = timed(ckpt.save_checkpoint, step + 1, sd, f"step_{step + 1}", storage_type=StorageType.DISK)
            ckpt.wait_latest_checkpoint(1800)
            t_async, fut = timed(dcp.async_save, sd, checkpoint_id=os.path.join(dcp_dir, f"async_{rnd}"),
                                 async_stager=stager, process_group=async_pg)
            cast(Any, fut).result()
            t_sync, _ = timed(dcp.save, sd, checkpoint_id=os.path.join(dcp_dir, f"sync_{rnd}"))
            rm_dcp(rnd)
            if rnd == 0:
                continue  # warm-up
            times["flash_memory"].append(t)
            times["flash_memory_plan"].append(split.plan_s)
            times["flash_memory_copy"].append(split.snapshot_s)
            times["flash_disk"].append(t_disk)
            times["dcp_async_save"].append(t_async)
            times["dcp_save"].append(t_sync)
            if rank == 0:
                print(f"round {rnd}: flash mem {t:.3f} s disk {t_disk:.3f} s | async_save {t_async:.3f} s | "
                      f"dcp.save {t_sync:.3f} s", flush=True)
    finally:
        stager.close()
        ckpt.close()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"local_bytes": local_bytes, "times": times})
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ driver
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0, help="model weights in GB (fp32), over all ranks")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workdir", default="/tmp/flashckpt-bench-fsdp")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    width = int((args.gb * 1e9 / 4 / args.layers) ** 0.5) // 64 * 64
    total = width * width * 4 * args.layers
    import torch

    print(f"model: {args.layers} x Linear({width}, {width}) fp32 = {total / 1e9:.2f} GB of weights; torch "
          f"{torch.__version__}; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for n in args.ranks:
        work = os.path.join(args.workdir, f"ranks{n}")
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
        result = os.path.join(work, "result.json")
        env = dict(os.environ, FLASHCKPT_JOB_ID=f"bench-fsdp-{uuid.uuid4().hex[:8]}", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
               os.path.abspath(__file__), "--worker", "--width", str(width), "--layers", str(args.layers),
               "--rounds", str(args.rounds), "--workdir", work, "--result", result]
        print(f"--- {n} ranks", flush=True)
        rc = subprocess.run(cmd, env=env).returncode
        if rc != 0:
            print(f"{n} ranks failed (exit {rc})", file=sys.stderr)
            return rc
        with open(result) as f:
            per_rank = json.load(f)
        shutil.rmtree(work, ignore_errors=True)
        rows.append((n, per_rank))

    print("\nblocking time per checkpoint (median over rounds; per rank, and the slowest rank's median)")
    keys = [("flash_memory", "flashckpt MEMORY"), ("flash_memory_plan", "  of which DCP planning"),
            ("flash_memory_copy", "  of which copy to shm"), ("flash_disk", "flashckpt DISK"),
            ("dcp_async_save", "dcp.async_save (shm stager)"), ("dcp_save", "dcp.save (sync)")]
    for n, per_rank in rows:
        shard = per_rank[0]["local_bytes"] / 1e9
        print(f"\n{n} ranks, {shard:.2f} GB per rank")
        print(f"| {'':30} | " + " | ".join(f"rank {r:<3}" for r in range(n)) + " | slowest |")
        print(f"|{'-' * 32}|" + "|".join("-" * 10 for _ in range(n)) + "|---------|")
        for key, label in keys:
            meds = [statistics.median(r["times"][key]) for r in per_rank]
            print(f"| {label:30} | " + " | ".join(f"{m * 1e3:6.0f} ms" for m in meds) + f" | {max(meds) * 1e3:4.0f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
