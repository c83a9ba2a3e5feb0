"""Pause per checkpoint of a megatron-core GPT's ``sharded_state_dict()`` in the ``torch_dist`` format:
flashckpt (``flashckpt.patches.megatron.dist_ckpt.save``) against vanilla ``dist_checkpointing.save``, in the same
run, on the same state; and the load after a restart: flashckpt from memory against vanilla
``dist_checkpointing.load`` from the files.

    python benchmarks/bench_megatron.py [--params-m 100] [--rounds 5] [--dir /path/on/the/disk]
    torchrun --nproc_per_node 2 benchmarks/bench_megatron.py ...

Informational only (never passes or fails). Every round, in rotated order: vanilla
``dist_checkpointing.save`` with megatron-core's default ``torch_dist`` strategy (synchronous: planning,
then the write of every file with fsync, as Megatron-LM without ``--async-save`` does), and flashckpt's
``save`` with ``storage_type=MEMORY`` and ``DISK`` (the pause: until it returns; the persist then runs in
the saver). Each flashckpt DISK save is waited for (reported as "persisted") before the next system
runs, so no background write overlaps a timed pause. The first save of each kind is a warm-up and is not
counted. The weights change between rounds. Loads, into a fresh model: vanilla ``dist_checkpointing.load``
of the last vanilla checkpoint, once after evicting its files from the page cache and once with them
cached (a best case for storage), and flashckpt's ``load`` from memory. Times are the slowest rank's, medians over rounds.

CPU-only machines: vanilla megatron-core's save calls ``torch.cuda.synchronize()`` after its (here
absent) device-to-host copies and ``torch.cuda.current_device()`` for a flag tensor; both are made CPU
no-ops below, for the vanilla side only (flashckpt's path calls neither).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (  # noqa: E402
    drop_file_cache,
    fmt_bytes,
    fmt_time,
    loadavg_note,
    markdown_table,
    median,
)


def build(params_m: float, seed: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    hidden, vocab = 1024, 8192
    per_layer = 12 * hidden * hidden + 13 * hidden
    layers = max(1, round((params_m * 1e6 - vocab * hidden) / per_layer))
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=16,
                            use_cpu_initialization=True, pipeline_dtype=torch.float32)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                    max_sequence_length=1024)


def slowest(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params-m", type=float, default=100.0, help="model size, millions of parameters")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="", help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--json", default="", help="also write the results here")
    opts = ap.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29519")
    dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))
    rank, world = dist.get_rank(), dist.get_world_size()
    load0 = os.getloadavg()[0]
    torch.cuda.synchronize = lambda *a, **k: None  # vanilla megatron-core's save on a CPU (see the docstring)
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    from flashckpt.patches.megatron.dist_ckpt import MegatronCheckpointer, StorageType, iteration_dir, load, save
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    base = opts.dir or (tempfile.mkdtemp(prefix="bench-megatron-") if rank == 0 else "")
    obj = [base]
    dist.broadcast_object_list(obj, src=0)
    base = obj[0]
    root, vroot = os.path.join(base, "flash"), os.path.join(base, "vanilla")
    model = build(opts.params_m, 0)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ckpt = MegatronCheckpointer(root, max_to_keep=2)
    times: dict[str, list[float]] = {"vanilla": [], "memory": [], "disk": [], "persisted": []}
    systems = ["vanilla", "memory", "disk"]
    it = 0
    try:
        for r in range(opts.rounds + 1):
            for name in systems[r % 3:] + systems[:r % 3]:
                it += 1
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1e-3)
                dist.barrier()
                t0 = time.perf_counter()
                if name == "vanilla":
                    path = iteration_dir(vroot, it)
                    if rank == 0:
                        shutil.rmtree(vroot, ignore_errors=True)
                        os.makedirs(path)
                    dist.barrier()
                    t0 = time.perf_counter()
                    dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": it}, path)
                else:
                    kind = StorageType.MEMORY if name == "memory" else StorageType.DISK
                    save({"model": model.sharded_state_dict(), "iteration": it}, iteration_dir(root, it),
                         checkpointer=ckpt, step=it, storage_type=kind, tracker=True)
                pause = slowest(time.perf_counter() - t0)
                if name == "disk":
                    ckpt.wait()
                    persisted = slowest(time.perf_counter() - t0)
                if r > 0:
                    times[name].append(pause)
                    if name == "disk":
                        times["persisted"].append(persisted)
        # loads into a fresh model: vanilla from the last vanilla files (page cache dropped, then warm),
        # flashckpt from memory
        fresh = build(opts.params_m, 1)
        vanilla_loads = []
        for cold in (True, False):
            if cold and rank == 0:
                for name in os.listdir(path):
                    drop_file_cache(os.path.join(path, name))
            dist.barrier()
            t0 = time.perf_counter()
            sd = dist_checkpointing.load({"model": fresh.sharded_state_dict()}, path)
            fresh.load_state_dict(sd["model"])
            vanilla_loads.append(slowest(time.perf_counter() - t0))
        vanilla_cold, vanilla_load = vanilla_loads
        dist.barrier()
        t0 = time.perf_counter()
        sd = load({"model": fresh.sharded_state_dict()}, checkpointer=ckpt)
        fresh.load_state_dict(sd["model"])
        flash_load = slowest(time.perf_counter() - t0)
        source = ckpt.last_load.source if ckpt.last_load else "none"
    finally:
        ckpt.close()
        if rank == 0 and not opts.dir:
            shutil.rmtree(base, ignore_errors=True)
    if rank != 0:
        dist.destroy_process_group()
        return
    rows = [["vanilla dist_checkpointing.save (sync, fsync)", fmt_time(median(times["vanilla"])), "-"],
            ["flashckpt save, MEMORY", fmt_time(median(times["memory"])), "-"],
            ["flashckpt save, DISK", fmt_time(median(times["disk"])), fmt_time(median(times["persisted"]))]]
    print(f"megatron-core GPT, {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters "
          f"({fmt_bytes(nbytes)} fp32 per rank), {world} rank(s), {opts.rounds} rounds, CPU")
    print(markdown_table(["save", "pause (median)", "persisted (median)"], rows))
    print()
    print(markdown_table(["load into a fresh model", "time"],
                         [["vanilla dist_checkpointing.load (page cache dropped first)", fmt_time(vanilla_cold)],
                          ["vanilla dist_checkpointing.load (files in page cache)", fmt_time(vanilla_load)],
                          [f"flashckpt load (from {source})", fmt_time(flash_load)]]))
    note = loadavg_note(load0, os.cpu_count() or 1)
    if note:
        print(f"\nnote: {note}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"params_m": opts.params_m, "world": world, "times": times, "vanilla_load": vanilla_load, "vanilla_load_cold": vanilla_cold,
                       "flash_load": flash_load, "flash_load_source": source}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
