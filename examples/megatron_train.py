"""A tiny megatron-core GPT trained on the CPU with flashckpt checkpoints in Megatron-LM's layout: a memory
snapshot every iteration, a persisted ``torch_dist`` checkpoint every ``--save-interval`` iterations, and
a resume that reads shared memory when the snapshot is there (storage otherwise)::

    python examples/megatron_train.py --ckpt /tmp/mg --iters 20 --crash-at 13   # dies after iteration 13
    python examples/megatron_train.py --ckpt /tmp/mg --iters 20                 # resumes at 13, from memory
    torchrun --nproc_per_node 2 examples/megatron_train.py --ckpt /tmp/mg2 --iters 20

(Restarted under ``torchrun``, keep the job's identity so the restart finds the node's snapshots: the same
``--rdzv-id``, or ``FLASHCKPT_JOB_ID``; ``flashckpt-run`` keeps it across its own restarts.)

``/tmp/mg`` then holds ``iter_0000010/`` (``metadata.json``, ``common.pt``, ``__*_*.distcp``,
``.metadata``), ``iter_0000020/`` and ``latest_checkpointed_iteration.txt``, which vanilla
``megatron.core.dist_checkpointing.load`` and Megatron-LM read. (The crash leaves iteration 13 in memory;
the node's saver also persists it as "last words" a moment after the process died.)

Megatron-LM users do not need this file: they import ``save_checkpoint`` / ``load_checkpoint`` from
``flashckpt.patches.megatron`` (see docs/megatron.md). This example uses megatron-core alone (what is on PyPI);
the optimizer is a torch ``AdamW`` kept in the common state (megatron-core's own optimizers need CUDA).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_model():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.transformer_config import TransformerConfig

    class CpuAttention(DotProductAttention):
        """megatron-core's ``DotProductAttention`` computes in a CUDA buffer; the same causal attention
        through torch's SDPA runs on a CPU (no parameters: the checkpoint is the same)."""

        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = CpuAttention
    torch.manual_seed(0)
    # no dropout: its random state is not checkpointed, and a resumed run must end with the weights of an
    # uninterrupted one
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                            pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=128, max_sequence_length=32)


def batch(iteration: int, rank: int, seq: int = 32):
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    tokens = torch.randint(0, 128, (4, seq + 1), generator=g)
    pos = torch.arange(seq)[None].expand(4, seq)
    return tokens[:, :-1], pos, None, tokens[:, 1:]  # causal attention: no mask tensor


def digest(model) -> str:
    h = hashlib.sha256()
    for v in model.state_dict().values():
        if isinstance(v, torch.Tensor):
            h.update(v.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # (the second spellings are the other examples', which the multi-node tests pass to every script)
    ap.add_argument("--ckpt", "--checkpoint_dir", required=True, help="checkpoint root (Megatron-LM's --save/--load)")
    ap.add_argument("--iters", "--steps", type=int, default=20)
    ap.add_argument("--save-interval", "--save_storage_interval", type=int, default=10,
                    help="persist every this many iterations")
    ap.add_argument("--crash-at", type=int, default=0, help="die (os._exit) right after this iteration")
    ap.add_argument("--resume", action="store_true", help="(always on: a run resumes from the newest checkpoint)")
    ap.add_argument("--metrics", default="", help="append JSON lines of events (resume, save, first_step, end)")
    ap.add_argument("--metrics_all_ranks", action="store_true", help="every rank appends to --metrics")
    ap.add_argument("--step_sleep", type=float, default=0.0, help="sleep this many seconds after every iteration")
    opts = ap.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))
    rank, world = dist.get_rank(), dist.get_world_size()

    def emit(**ev: object) -> None:
        if opts.metrics and (rank == 0 or opts.metrics_all_ranks):
            with open(opts.metrics, "a") as f:
                f.write(json.dumps({**ev, "t": time.time(), "rank": rank}) + "\n")

    from flashckpt.patches.megatron.dist_ckpt import MegatronCheckpointer, StorageType, iteration_dir, load, save
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)  # data parallel over all ranks
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = MegatronCheckpointer(opts.ckpt)

    t0 = time.perf_counter()
    state = load({"model": model.sharded_state_dict()}, checkpointer=ckpt)
    start = 1
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["iteration"] + 1
    info = ckpt.last_load
    emit(event="resume", step=start - 1 if state is not None else None,
         source=info.source if info is not None and state is not None else "none", seconds=time.perf_counter() - t0)
    if state is not None:
        if rank == 0:
            source = ckpt.last_load.source if ckpt.last_load is not None else "?"
            print(f"resumed at iteration {state['iteration']} from {source} in "
                  f"{time.perf_counter() - t0:.3f} s (weights {digest(model)})")

    pauses: dict[StorageType, list[float]] = {StorageType.MEMORY: [], StorageType.DISK: []}
    for it in range(start, opts.iters + 1):
        tokens, pos, mask, labels = batch(it, rank)
        loss = model(tokens, pos, mask, labels=labels).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # data parallel: average the gradients
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()

        kind = StorageType.DISK if it % opts.save_interval == 0 else StorageType.MEMORY
        t = time.perf_counter()
        save({"model": model.sharded_state_dict(), "optimizer": opt.state_dict(), "iteration": it},
             iteration_dir(opts.ckpt, it), checkpointer=ckpt, step=it, storage_type=kind, tracker=True)
        pauses[kind].append(time.perf_counter() - t)
        emit(event="save", step=it, storage=kind.value, seconds=pauses[kind][-1])
        if rank == 0:
            print(f"iteration {it:3d}  loss {loss.item():.4f}  {kind.value} checkpoint")
        if it == opts.crash_at:
            print(f"rank {rank}: crashing after iteration {it}", flush=True)
            os._exit(17)
        if it == start and start > 1:
            emit(event="first_step", step=it)
        if opts.step_sleep > 0:
            time.sleep(opts.step_sleep)

    ckpt.wait()
    emit(event="end", step=opts.iters, digest=digest(model) if rank == 0 else None)
    if rank == 0:
        for kind, xs in pauses.items():
            if xs:
                print(f"{kind.value:6s} saves: {len(xs)}, median pause {sorted(xs)[len(xs) // 2] * 1e3:.1f} ms")
        print(f"final weights {digest(model)}; tracker: "
              f"{open(os.path.join(opts.ckpt, 'latest_checkpointed_iteration.txt')).read()}")
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
