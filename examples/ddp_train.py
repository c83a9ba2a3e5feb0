"""A small GPT-like model trained with DDP on synthetic data, checkpointed with flashckpt.

Runs on CPU with gloo (2+ ranks)::

    torchrun --nproc_per_node 2 examples/ddp_train.py --steps 40 \
        --save_memory_interval 1 --save_storage_interval 10 --checkpoint_dir /tmp/ckpt --resume

Deterministic: the data of step ``s`` comes from a generator seeded with ``s`` and the model has no
dropout, so a run that is interrupted and resumed reaches exactly the weights of an uninterrupted one.
``--crash_at_step N --crash_rank R`` makes rank R kill itself with SIGKILL after step N, once: a run that
resumed from a checkpoint does not crash again (for demos and tests). ``--metrics FILE`` appends one JSON line
per event (save timings, the resume source, the end): rank 0's, or every rank's with ``--metrics_all_ranks``
(each line carries its rank). ``--step_sleep S`` sleeps S seconds after every step (tests use it to act
between steps).

For overhead comparisons (``benchmarks/overhead.py``), ``--ckpt_mode`` picks the checkpointing:
``flashckpt`` (the default: a memory snapshot every ``--save_memory_interval`` steps, a persist every
``--save_every`` (else ``--save_storage_interval``) steps; ``--overlap`` runs each snapshot's copy in the
background during the next forward/backward), ``torch_save`` (rank 0 ``torch.save`` every ``--save_every``
steps, keeping the newest file), ``dcp_async`` (``torch.distributed.checkpoint.async_save`` on all ranks every
``--save_every`` steps, on its own gloo group; ``--dcp_stager shm`` reuses a shared-memory ``DefaultStager``)
or ``none``. The ``end`` event carries rank 0's wall time of every step (``step_seconds``).
"""

from __future__ import annotations

import time as _time

_T_SCRIPT = _time.time()  # before torch is imported: for the restart breakdown (``started`` event)

import argparse  # noqa: E402
import ctypes  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashckpt import CheckpointEngine, storage_type_for  # noqa: E402
from flashckpt.integrations.ddp import DdpCheckpointer, StorageType  # noqa: E402

_T_IMPORTED = time.time()


def _process_start_time() -> float:
    """Wall-clock time this process was started (from /proc; 0.0 where unavailable)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return 0.0


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
        mask = self.mask
        assert isinstance(mask, torch.Tensor)  # a registered buffer
        for b in self.blocks:
            x = b(x, mask[:t, :t])
        return self.head(self.ln(x))


def batch(step: int, rank: int, *, bs: int, ctx: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randint(0, vocab, (bs, ctx + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def checkpoint_summary(stats: object) -> str:
    """One line of what checkpointing cost and did in this run (``CheckpointEngine.stats()``)."""
    s: Any = stats
    rate = f" at {s.persist_mb_per_s:.0f} MB/s" if s.persist_mb_per_s else ""
    sent = f"; {s.replica_sent_bytes / 1e6:.1f} MB of backups sent to the partner node" if s.replica_sent_bytes else ""
    return (f"checkpointing: {s.snapshots} snapshots, training paused {s.pause_s_total * 1e3:.0f} ms in all (the "
            f"longest {s.pause_s_max * 1e3:.1f} ms); {s.persists} persists of this rank, {s.persisted_bytes / 1e6:.1f} "
            f"MB{rate}; newest durable step {s.durable_step}{sent}")


def _plain(stats: object) -> dict[str, Any] | None:
    """``stats`` as JSON values (for the metrics file)."""
    if stats is None:
        return None
    return {k: v for k, v in vars(stats).items() if k != "last_load"}


def resume_line(info: object) -> str:
    """The one line a resume prints: where from and which step, or that there was nothing to resume."""
    source, step, secs = (getattr(info, "source", "none"), getattr(info, "step", None), getattr(info, "seconds", 0.0))
    if source == "none" or step is None:
        return f"[rank 0] no checkpoint to resume (memory and storage looked at in {secs:.3f} s): starting at step 1"
    return f"[rank 0] resumed from {source} at step {step} in {secs:.3f} s"


def weights_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        t = v.detach().contiguous()
        h.update(ctypes.string_at(t.data_ptr(), t.nbytes))  # raw bytes; no numpy needed
    return h.hexdigest()


class OtherCheckpointing:
    """The baselines of the overhead comparison: ``torch.save`` on rank 0, or DCP ``async_save`` on all ranks.

    torch_save keeps only the newest file (``step_<N>.pt``). dcp_async waits for the previous save
    before starting the next (one in flight, as DCP asks) and runs its collectives on a gloo group of
    its own, so they never interleave with DDP's all-reduces on the default group."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.mode, self.rank, self.dir = args.ckpt_mode, rank, args.checkpoint_dir
        os.makedirs(self.dir, exist_ok=True)
        self.last: str | None = None
        self.future: object = None
        self.stager = None
        self.group = None
        if self.mode == "dcp_async":
            if dist.is_initialized():
                self.group = dist.new_group(backend="gloo")
            if args.dcp_stager == "shm":
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

                self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                                                           use_async_staging=False, use_non_blocking_copy=False))

    def save(self, step: int, sd: dict) -> None:
        if self.mode == "torch_save":
            if self.rank == 0:
                path = os.path.join(self.dir, f"step_{step}.pt")
                torch.save(sd, path)
                if self.last:
                    os.unlink(self.last)
                self.last = path
            return
        import torch.distributed.checkpoint as dcp

        self.wait()
        kw: dict[str, Any] = {"async_stager": self.stager} if self.stager is not None else {}
        self.future = dcp.async_save(sd, checkpoint_id=os.path.join(self.dir, f"dcp_step_{step}"),
                                     process_group=self.group, **kw)

    def wait(self) -> None:
        fut, self.future = self.future, None
        if fut is not None:
            done: Any = fut.upload_completion if hasattr(fut, "upload_completion") else fut
            done.result()

    def close(self) -> None:
        self.wait()
        if self.stager is not None:
            self.stager.close()
        if self.group is not None:
            dist.destroy_process_group(self.group)


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
    p.add_argument("--metrics_all_ranks", action="store_true",
                   help="every rank appends its events to --metrics (default: rank 0 only, and crashes)")
    p.add_argument("--step_sleep", type=float, default=0.0, help="sleep this many seconds after every step")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--ckpt_mode", choices=("flashckpt", "none", "torch_save", "dcp_async"), default="flashckpt",
                   help="checkpointing to use (for overhead comparisons; default flashckpt)")
    p.add_argument("--save_every", type=int, default=0,
                   help="persist every this many steps (all modes; default: --save_storage_interval)")
    p.add_argument("--dcp_stager", choices=("default", "shm"), default="default",
                   help="dcp_async: async_save's default stager, or a reused shared-memory DefaultStager")
    p.add_argument("--overlap", action="store_true",
                   help="flashckpt: overlapped snapshots (the copy runs during the next forward/backward)")
    args = p.parse_args(argv)
    if args.save_every < 0:
        p.error("--save_every must be >= 0")
    persist_every = args.save_every or args.save_storage_interval
    if args.ckpt_mode != "flashckpt" and (args.resume or args.crash_at_step >= 0 or args.overlap):
        p.error("--resume, --crash_at_step and --overlap need --ckpt_mode flashckpt")
    if args.ckpt_mode in ("torch_save", "dcp_async") and persist_every <= 0:
        p.error(f"--ckpt_mode {args.ckpt_mode} needs --save_every (or --save_storage_interval) > 0")
    if args.overlap and not hasattr(CheckpointEngine, "wait_snapshot"):
        p.error("--overlap: this flashckpt has no overlapped snapshots (CheckpointEngine.wait_snapshot)")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0

    def emit(*, any_rank: bool = False, **ev: object) -> None:
        if args.metrics and (rank == 0 or any_rank or args.metrics_all_ranks):
            with open(args.metrics, "a") as f:
                f.write(json.dumps({**ev, "t": time.time(), "rank": rank}) + "\n")

    # Where a (re)started worker's first second goes: process start, imports, process group (rank 0).
    emit(event="started", proc_start=_process_start_time(), script=_T_SCRIPT, imported=_T_IMPORTED)
    model = TinyGPT(args.vocab, args.dim, args.layers, ctx=args.ctx)
    ddp = nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = DdpCheckpointer(args.checkpoint_dir) if args.ckpt_mode == "flashckpt" else None
    other = OtherCheckpointing(args, rank) if args.ckpt_mode in ("torch_save", "dcp_async") else None
    step_seconds: list[float] = []

    start = 1
    if args.resume and ckpt is not None:
        sd = ckpt.load_checkpoint()
        if sd:
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optimizer"])
            start = int(sd["step"]) + 1
        info = ckpt.last_load
        emit(event="resume", step=info.step if info else None, source=info.source if info else "none",
             seconds=info.seconds if info else 0.0, world=dist.get_world_size() if dist.is_initialized() else 1)
        if rank == 0:
            print(resume_line(info), flush=True)

    for step in range(start, args.steps + 1):
        t_step = time.perf_counter()
        x, y = batch(step, rank, bs=args.batch_size, ctx=args.ctx, vocab=args.vocab)
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.overlap and ckpt is not None:
            ckpt.engine.wait_snapshot()  # the last snapshot's copy must be done before the weights change
        opt.step()
        sd = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
        kind = None
        if ckpt is not None:
            kind = storage_type_for(step, args.save_memory_interval, persist_every)
        elif other is not None and step % persist_every == 0:
            t0 = time.perf_counter()
            other.save(step, sd)
            emit(event="save", step=step, storage=args.ckpt_mode, seconds=time.perf_counter() - t0)
        if kind is not None and ckpt is not None:
            t0 = time.perf_counter()
            if args.overlap:
                ckpt.engine.save(step, sd, None, kind, overlap=True)
            else:
                ckpt.save_checkpoint(step, sd, storage_type=kind)
            emit(event="save", step=step, storage=kind.value, seconds=time.perf_counter() - t0,
                 saver_cpu_s=ckpt.engine.saver_cpu_seconds() if rank == 0 else None)
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
        step_seconds.append(time.perf_counter() - t_step)
        if step == start and start > 1:
            emit(event="first_step", step=step)
        if args.step_sleep > 0:
            time.sleep(args.step_sleep)

    if ckpt is not None:
        ckpt.wait_latest_checkpoint(timeout=600)
    if other is not None:
        other.close()
    digest = weights_digest(model)
    stats = ckpt.engine.stats() if ckpt is not None else None
    emit(event="end", step=args.steps, digest=digest, mode=args.ckpt_mode, overlap=args.overlap,
         first_step=start, step_seconds=step_seconds,
         saver_cpu_s=ckpt.engine.saver_cpu_seconds() if ckpt is not None and rank == 0 else None,
         stats=_plain(stats))
    if rank == 0:
        print(f"[rank 0] done: {args.steps} steps, weights sha256 {digest[:16]}", flush=True)
        if stats is not None:
            print(f"[rank 0] {checkpoint_summary(stats)}", flush=True)
    if ckpt is not None:
        ckpt.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
