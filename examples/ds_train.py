"""A small MLP trained with DeepSpeed (ZeRO stage 0-3, optional bf16) on synthetic data, checkpointed with
flashckpt's DeepSpeedCheckpointer.

Runs on CPU with gloo (one process, or several under torchrun)::

    DS_ACCELERATOR=cpu python examples/ds_train.py --steps 30 --zero 2 --checkpoint_dir /tmp/ds-ckpt
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/ds_train.py --zero 3 --bf16 --resume

A memory snapshot every ``--save_memory_interval`` steps, a persisted checkpoint (DeepSpeed's own
``global_step<N>`` layout and ``latest``) every ``--save_storage_interval`` steps. ``--resume`` loads the
newest checkpoint, from memory when the previous run of this job left it there.
``--crash_at_step N`` makes rank ``--crash_rank`` (0) kill itself with SIGKILL after step N (only in a run
that did not resume): run again with ``--resume`` within the saver's grace period and it resumes from memory.
``--metrics FILE`` appends one JSON line per event (resume, save, first_step after a resume, crash, end with
the weights digest): rank 0's, or every rank's with ``--metrics_all_ranks``; ``--step_sleep`` pauses after
every step (the multi-node tests act between two steps).
Deterministic: the data of step ``s`` on rank ``r`` is seeded by (s, r), so a resumed run ends with the
weights of an uninterrupted one (the final digest is printed).

The optimizer is ``torch.optim.AdamW`` (passing a torch optimizer keeps DeepSpeed from building FusedAdam,
which needs a compiler toolchain on CPU). DeepSpeed compiles a small shared-memory op the first time it
initializes on CPU (about a minute, cached in ~/.cache/torch_extensions afterwards).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashckpt import storage_type_for  # noqa: E402
from flashckpt.integrations.deepspeed import DeepSpeedCheckpointer  # noqa: E402


def build(args: argparse.Namespace):
    import deepspeed

    torch.manual_seed(0)
    d = args.dim
    model = torch.nn.Sequential(torch.nn.Linear(32, d), torch.nn.GELU(), torch.nn.Linear(d, d), torch.nn.GELU(),
                                torch.nn.Linear(d, 8))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg: dict = {"train_micro_batch_size_per_gpu": 8, "train_batch_size": 8 * world, "steps_per_print": 10**9,
                 "zero_optimization": {"stage": args.zero}}
    if args.bf16:
        cfg["bf16"] = {"enabled": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def digest(engine) -> str:
    import deepspeed

    h = hashlib.sha256()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        for p in params:
            h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--checkpoint_dir", default="/tmp/flashckpt-ds")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--save_memory_interval", type=int, default=1)
    p.add_argument("--save_storage_interval", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="resume from the newest checkpoint (memory first)")
    p.add_argument("--crash_at_step", type=int, default=-1)
    p.add_argument("--crash_rank", type=int, default=0)
    p.add_argument("--metrics", default="", help="append JSON lines of events to this file")
    p.add_argument("--metrics_all_ranks", action="store_true",
                   help="every rank appends its events to --metrics (default: rank 0 only, and crashes)")
    p.add_argument("--step_sleep", type=float, default=0.0, help="sleep this many seconds after every step")
    args = p.parse_args(argv)

    import deepspeed

    torch.set_num_threads(1)
    if "RANK" not in os.environ:  # a plain `python` run: one rank
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()

    def emit(*, any_rank: bool = False, **ev: object) -> None:
        if args.metrics and (rank == 0 or any_rank or args.metrics_all_ranks):
            with open(args.metrics, "a") as f:
                f.write(json.dumps({**ev, "t": time.time(), "rank": rank}) + "\n")

    engine = build(args)
    ckpt = DeepSpeedCheckpointer(engine, args.checkpoint_dir)
    resumed = False
    if args.resume:
        path, client_state = ckpt.load_checkpoint(args.checkpoint_dir)
        info = ckpt.last_load
        resumed = path is not None
        emit(event="resume", step=info.step if info else None, source=info.source if info else "none",
             seconds=info.seconds if info else 0.0)
        if rank == 0:
            print(f"[rank 0] resumed from {info.source if info else 'none'}: {path} (global step "
                  f"{engine.global_steps}, {info.seconds if info else 0:.3f} s)", flush=True)

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    pauses: dict[str, list[float]] = {"memory": [], "disk": []}
    start = engine.global_steps + 1
    while engine.global_steps < args.steps:
        step = engine.global_steps + 1
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 32, generator=g).to(dtype)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        kind = storage_type_for(step, args.save_memory_interval, args.save_storage_interval)
        if kind is not None:
            t0 = time.perf_counter()
            ckpt.save_checkpoint(args.checkpoint_dir, client_state={"loss": loss.item()}, storage_type=kind)
            pauses[kind.value].append(time.perf_counter() - t0)
            emit(event="save", step=step, storage=kind.value, seconds=pauses[kind.value][-1])
        if rank == 0 and step % 10 == 0:
            print(f"[rank 0] step {step} loss {loss.item():.5f}", flush=True)
        if step == args.crash_at_step and rank == args.crash_rank and not resumed:
            print(f"[rank {rank}] crashing after step {step} (SIGKILL)", flush=True)
            emit(any_rank=True, event="crash", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        if step == start and resumed:
            emit(event="first_step", step=step)
        if args.step_sleep > 0:
            time.sleep(args.step_sleep)
    ckpt.wait()
    d = digest(engine)
    emit(event="end", step=engine.global_steps, digest=d if rank == 0 else None)
    ckpt.close()
    if rank == 0:
        def med(v: list[float]) -> str:
            return f"{sorted(v)[len(v) // 2] * 1e3:.1f} ms" if v else "-"

        print(f"[rank 0] done at step {engine.global_steps}; weights {d}; pause per checkpoint: memory "
              f"{med(pauses['memory'])}, disk {med(pauses['disk'])}; latest = "
              f"{open(os.path.join(args.checkpoint_dir, 'latest')).read()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
