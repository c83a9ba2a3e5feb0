"""A small GPT-like model trained with DDP on synthetic data, checkpointed with flashckpt.

Runs on CPU with gloo (2+ ranks)::

    torchrun --nproc_per_node 2 examples/ddp_train.py --steps 40 \
        --save_memory_interval 1 --save_storage_interval 10 --checkpoint_dir /tmp/ckpt --resume

Deterministic: the data of step ``s`` comes from a generator seeded with ``s`` and the model has no
dropout, so a run that is interrupted and resumed reaches exactly the weights of an uninterrupted one.
``--crash_at_step N --crash_rank R`` makes rank R kill itself with SIGKILL after step N, once: a run that
resumed from a checkpoint does not crash again (for demos and tests). ``--metrics FILE`` appends one JSON line per event (save timings, the resume source, the end).
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
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from integrations.ddp import DdpCheckpointer, StorageType  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, pre-norm blocks, and an LM head tied to the token embedding."""

    def __init__(self, vocab: int = 4096, d: int = 256, layers: int = 4, heads: int = 4, ctx: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied weights
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def batch(step: int, rank: int, *, bs: int, ctx: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randint(0, vocab, (bs, ctx + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def weights_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        t = v.detach().contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.nbytes))  # raw bytes; no numpy needed
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--checkpoint_dir", default="/tmp/flashckpt-ddp")
    p.add_argument("--save_memory_interval", type=int, default=1)
    p.add_argument("--save_storage_interval", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="resume from the newest checkpoint (memory first)")
    p.add_argument("--crash_at_step", type=int, default=-1)
    p.add_argument("--crash_rank", type=int, default=1)
    p.add_argument("--compare_torch_save", action="store_true",
                   help="rank 0 also times torch.save of the same state at every storage save")
    p.add_argument("--metrics", default="", help="append JSON lines of events to this file")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--ctx", type=int, default=64)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0

    def emit(*, any_rank: bool = False, **ev: object) -> None:
        if args.metrics and (rank == 0 or any_rank):
            with open(args.metrics, "a") as f:
                f.write(json.dumps({**ev, "t": time.time(), "rank": rank}) + "\n")

    model = TinyGPT(args.vocab, args.dim, args.layers, ctx=args.ctx)
    ddp = nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = DdpCheckpointer(args.checkpoint_dir)

    start = 1
    if args.resume:
        sd = ckpt.load_checkpoint()
        if sd:
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optimizer"])
            start = int(sd["step"]) + 1
        info = ckpt.last_load
        emit(event="resume", step=info.step if info else None, source=info.source if info else "none",
             seconds=info.seconds if info else 0.0)
        if rank == 0:
            print(f"[rank 0] resumed from {info.source if info else 'none'} at step {info.step if info else None} "
                  f"in {info.seconds if info else 0:.3f} s", flush=True)

    for step in range(start, args.steps + 1):
        x, y = batch(step, rank, bs=args.batch_size, ctx=args.ctx, vocab=args.vocab)
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sd = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
        kind = None
        if args.save_storage_interval and step % args.save_storage_interval == 0:
            kind = StorageType.DISK
        elif args.save_memory_interval and step % args.save_memory_interval == 0:
            kind = StorageType.MEMORY
        if kind is not None:
            t0 = time.perf_counter()
            ckpt.save_checkpoint(step, sd, storage_type=kind)
            emit(event="save", step=step, storage=kind.value, seconds=time.perf_counter() - t0)
            if kind == StorageType.DISK and args.compare_torch_save and rank == 0:
                path = os.path.join(args.checkpoint_dir, ".torch_save_compare.pt")
                t0 = time.perf_counter()
                torch.save(sd, path)
                emit(event="torch_save", step=step, seconds=time.perf_counter() - t0)
                os.unlink(path)
        if rank == 0 and (step % 10 == 0 or step == args.steps):
            print(f"[rank 0] step {step} loss {loss.item():.4f}", flush=True)
        if step == args.crash_at_step and rank == args.crash_rank and start == 1:
            # Only a run that started from scratch crashes, so a restarted one cannot crash-loop.
            print(f"[rank {rank}] crashing (SIGKILL) after step {step}", flush=True)
            emit(any_rank=True, event="crash", step=step)
            os.kill(os.getpid(), signal.SIGKILL)

    ckpt.wait_latest_checkpoint(timeout=600)
    digest = weights_digest(model)
    emit(event="end", step=args.steps, digest=digest)
    if rank == 0:
        print(f"[rank 0] done: {args.steps} steps, weights sha256 {digest[:16]}", flush=True)
    ckpt.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
