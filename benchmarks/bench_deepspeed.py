"""Pause per checkpoint of a DeepSpeed engine: DeepSpeedCheckpointer against ``engine.save_checkpoint``
with DeepSpeed's default checkpoint engine, in the same run, on the same state.

    DS_ACCELERATOR=cpu python benchmarks/bench_deepspeed.py [--params-m 50] [--zero 2] [--bf16] [--rounds 5]
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 benchmarks/bench_deepspeed.py ...

Informational only (never passes or fails). Every round, in rotated order: vanilla
``engine.save_checkpoint(dir)`` (synchronous ``torch.save`` of every file, no fsync, as DeepSpeed does),
``DeepSpeedCheckpointer.save_checkpoint(..., storage_type=MEMORY)`` and ``(..., storage_type=DISK)``
(the pause: until it returns; the persist then runs in the saver). Each flashckpt DISK save is waited for
(``wait()``, reported as "persisted") before the next system runs, so no background write overlaps a
timed pause. The first save of each kind is a warm-up (segment allocation, saver start) and is not
counted. A training step runs between rounds. Times are the slowest rank's, medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashckpt.integrations.deepspeed import DeepSpeedCheckpointer, StorageType  # noqa: E402


def build(params_m: float, zero: int, bf16: bool, world: int):
    import deepspeed

    torch.manual_seed(0)
    d = 1024
    n_layers = max(1, round(params_m * 1e6 / (d * d + d)))
    layers: list[torch.nn.Module] = []
    for _ in range(n_layers):
        layers += [torch.nn.Linear(d, d), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers)
    cfg: dict = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * world, "steps_per_print": 10**9,
                 "zero_optimization": {"stage": zero}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    n_params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine, n_params


def train_step(engine) -> None:
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    x = torch.randn(2, 1024).to(dtype)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _d, fs in os.walk(path) for f in fs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params-m", type=float, default=50.0, help="model parameters, in millions")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=2)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default="", help="where both write checkpoints (default: a temp dir, removed)")
    args = p.parse_args(argv)

    import deepspeed

    if "RANK" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    base = args.dir or (tempfile.mkdtemp(prefix="bench-ds-", dir="/tmp") if rank == 0 else "")
    holder = [base]
    torch.distributed.broadcast_object_list(holder, src=0)
    base = holder[0]
    flash_dir, vanilla_dir = os.path.join(base, "flash"), os.path.join(base, "vanilla")
    engine, n_params = build(args.params_m, args.zero, args.bf16, world)
    ckpt = DeepSpeedCheckpointer(engine, flash_dir, max_to_keep=1)
    samples: dict[str, list[float]] = {"vanilla": [], "memory": [], "disk": [], "persisted": []}
    sizes = {}
    try:
        for rnd in range(args.rounds + 1):
            train_step(engine)
            order = ["vanilla", "memory", "disk"]
            order = order[rnd % 3:] + order[:rnd % 3]
            for kind in order:
                torch.distributed.barrier()
                t0 = time.perf_counter()
                if kind == "vanilla":
                    tag = f"global_step{engine.global_steps}"
                    engine.save_checkpoint(vanilla_dir, tag=tag)  # DeepSpeed's default engine
                else:
                    st = StorageType.MEMORY if kind == "memory" else StorageType.DISK
                    ckpt.save_checkpoint(flash_dir, storage_type=st)
                dt = slowest(time.perf_counter() - t0)
                if kind == "disk":
                    ckpt.wait()
                    persisted = slowest(time.perf_counter() - t0)
                    if rnd:
                        samples["persisted"].append(persisted)
                if rnd:
                    samples[kind].append(dt)
                if kind == "vanilla" and rank == 0:
                    sizes["vanilla"] = dir_bytes(os.path.join(vanilla_dir, tag))
                    if rnd < args.rounds:
                        shutil.rmtree(os.path.join(vanilla_dir, tag))
            # the same step is saved by memory and disk: next round trains first, so tags stay unique
        torch.distributed.barrier()
        if rank == 0:
            tag = open(os.path.join(flash_dir, "latest")).read()
            sizes["flash"] = dir_bytes(os.path.join(flash_dir, tag))
    finally:
        ckpt.close()
        torch.distributed.barrier()
        if rank == 0 and not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in samples.items() if v}
        print(f"\nDeepSpeed {deepspeed.__version__}, ZeRO-{args.zero}{' bf16' if args.bf16 else ''}, {world} rank(s), "
              f"{n_params / 1e6:.1f} M parameters; tag directory {sizes.get('vanilla', 0) / 1e6:.0f} MB (vanilla), "
              f"{sizes.get('flash', 0) / 1e6:.0f} MB (flashckpt); medians of {args.rounds} rounds, slowest rank\n")
        print("| checkpoint | pause (training blocked) | vs engine.save_checkpoint |")
        print("|---|---|---|")
        v = med["vanilla"]
        print(f"| engine.save_checkpoint (default TorchCheckpointEngine) | {v * 1e3:.1f} ms | 1.00x |")
        print(f"| DeepSpeedCheckpointer MEMORY | {med['memory'] * 1e3:.1f} ms | {med['memory'] / v:.2f}x |")
        print(f"| DeepSpeedCheckpointer DISK | {med['disk'] * 1e3:.1f} ms | {med['disk'] / v:.2f}x |")
        print(f"| (DISK until persisted and committed, in the background) | {med['persisted'] * 1e3:.1f} ms | - |")
        print(json.dumps({"bench": "deepspeed", "zero": args.zero, "bf16": args.bf16, "world": world,
                          "params": n_params, "rounds": args.rounds, "median_s": med,
                          "samples_s": samples, "tag_bytes": sizes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
