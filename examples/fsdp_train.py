"""The small GPT of ``ddp_train.py``, sharded with FSDP2 (``fully_shard``), checkpointed with flashckpt's
``FsdpShardCheckpointer`` in PyTorch Distributed Checkpoint format.

Runs on CPU with gloo (2+ ranks)::

    torchrun --nproc_per_node 2 examples/fsdp_train.py --steps 40 \
        --save_memory_interval 1 --save_storage_interval 10 --checkpoint_dir /tmp/ckpt --resume

Every rank snapshots its own shard; persisted steps are DCP checkpoints (``step_<N>/__<rank>_0.distcp``
and ``.metadata``) that ``torch.distributed.checkpoint.load`` reads without flashckpt, on any number of
ranks. Deterministic like the DDP example, so an interrupted and resumed run ends with exactly the weights
of an uninterrupted one. ``--crash_at_step N --crash_rank R`` makes rank R kill itself with SIGKILL after
step N, once (a resumed run does not crash again). ``--metrics FILE`` appends one JSON line per event:
rank 0's, or every rank's with ``--metrics_all_ranks`` (each line carries its rank; the ``end`` event's
digest is rank 0's only). ``--step_sleep S`` sleeps S seconds after every step (tests use it to act
between steps). ``--state_digests`` adds the digest of the unsharded training state at every save and at
the resume, the same whatever the number of ranks: a job that resumes on fewer or more ranks (an elastic
``flashckpt-run --nnodes MIN:MAX`` that lost or gained a node) must resume exactly the state it saved.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashckpt import storage_type_for  # noqa: E402
from flashckpt.integrations.fsdp import FsdpShardCheckpointer  # noqa: E402

from examples.ddp_train import TinyGPT, _plain, batch, checkpoint_summary, resume_line  # noqa: E402


def full_weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the unsharded weights (collective: every rank calls it; rank 0's value is meaningful)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    h = hashlib.sha256()
    for k, v in sorted(sd.items()):
        if not isinstance(v, torch.Tensor):
            continue
        h.update(k.encode())
        t = v.detach().contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.nbytes))
    return h.hexdigest()


def full_state_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """SHA-256 of the unsharded weights and optimizer state, by key (collective; rank 0's value is meaningful):
    the same for the same training state whatever the number of ranks that holds it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    h = hashlib.sha256()

    def walk(prefix: str, x: object) -> None:
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(f"{prefix}/{k}", x[k])
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(f"{prefix}/{i}", v)
        elif isinstance(x, torch.Tensor):
            t = x.detach().contiguous()
            h.update(f"{prefix}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(ctypes.string_at(t.data_ptr(), t.nbytes))
        else:
            h.update(f"{prefix}={x!r}".encode())

    walk("model", msd)
    walk("optim", osd)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checkpoint_dir", default="/tmp/flashckpt-fsdp")
    p.add_argument("--save_memory_interval", type=int, default=1)
    p.add_argument("--save_storage_interval", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="resume from the newest checkpoint (memory first)")
    p.add_argument("--crash_at_step", type=int, default=-1)
    p.add_argument("--crash_rank", type=int, default=1)
    p.add_argument("--metrics", default="", help="append JSON lines of events to this file")
    p.add_argument("--metrics_all_ranks", action="store_true",
                   help="every rank appends its events to --metrics (default: rank 0 only, and crashes)")
    p.add_argument("--step_sleep", type=float, default=0.0, help="sleep this many seconds after every step")
    p.add_argument("--state_digests", action="store_true",
                   help="after every save and at the resume, emit the digest of the unsharded training state "
                        "(weights and optimizer; collective): a resume on another number of ranks must match it")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--ctx", type=int, default=64)
    args = p.parse_args(argv)

    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    torch.set_num_threads(1)
    if "RANK" not in os.environ:
        p.error("launch with torchrun (or flashckpt-run): FSDP needs a process group")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def emit(*, any_rank: bool = False, **ev: object) -> None:
        if args.metrics and (rank == 0 or any_rank or args.metrics_all_ranks):
            with open(args.metrics, "a") as f:
                f.write(json.dumps({**ev, "t": time.time(), "rank": rank}) + "\n")

    model = TinyGPT(args.vocab, args.dim, args.layers, ctx=args.ctx)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = FsdpShardCheckpointer(args.checkpoint_dir)

    start = 1
    if args.resume:
        extra = ckpt.load_checkpoint(model, opt)
        if extra:
            start = int(extra["step"]) + 1
        info = ckpt.last_load
        digest = full_state_digest(model, opt) if args.state_digests else None
        emit(event="resume", step=info.step if info else None, source=info.source if info else "none",
             seconds=info.seconds if info else 0.0, world=world, state_digest=digest)
        if rank == 0:
            print(resume_line(info), flush=True)

    for step in range(start, args.steps + 1):
        x, y = batch(step, rank, bs=args.batch_size, ctx=args.ctx, vocab=args.vocab)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        kind = storage_type_for(step, args.save_memory_interval, args.save_storage_interval)
        if kind is not None:
            if args.state_digests:  # (before the save: a worker stopped right after it still left its digest)
                emit(event="state", step=step, world=world, state_digest=full_state_digest(model, opt))
            t0 = time.perf_counter()
            model_sd, optim_sd = get_state_dict(model, opt)
            ckpt.save_checkpoint(step, {"model": model_sd, "optim": optim_sd, "step": step}, f"step_{step}",
                                 storage_type=kind)
            emit(event="save", step=step, storage=kind.value, seconds=time.perf_counter() - t0, world=world)
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            print(f"[rank 0] step {step} loss {loss.item():.4f}", flush=True)
        if step == args.crash_at_step and rank == args.crash_rank and start == 1:
            # Only a run that started from scratch crashes, so a restarted one cannot crash-loop.
            print(f"[rank {rank}] crashing (SIGKILL) after step {step}", flush=True)
            emit(any_rank=True, event="crash", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == start and start > 1:
            emit(event="first_step", step=step)
        if args.step_sleep > 0:
            time.sleep(args.step_sleep)

    ckpt.wait_latest_checkpoint(timeout=600)
    digest = full_weights_digest(model)
    stats = ckpt.engine.stats()
    emit(event="end", step=args.steps, digest=digest if rank == 0 else None,  # only rank 0 has the full weights
         stats=_plain(stats))
    if rank == 0:
        print(f"[rank 0] done: {args.steps} steps, weights sha256 {digest[:16]}", flush=True)
        print(f"[rank 0] {checkpoint_summary(stats)}", flush=True)
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
