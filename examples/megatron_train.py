"""A tiny megatron-core GPT trained on the CPU with flashckpt checkpoints in Megatron-LM's layout: a memory
snapshot every iteration, a persisted ``torch_dist`` checkpoint every ``--save-interval`` iterations, and
a resume that reads shared memory when the snapshot is there (storage otherwise)::

    python examples/megatron_train.py --ckpt /tmp/mg --iters 20 --crash-at 13   # dies after iteration 13
    python examples/megatron_train.py --ckpt /tmp/mg --iters 20                 # resumes at 13, from memory
    torchrun --nproc_per_node 2 examples/megatron_train.py --ckpt /tmp/mg2 --iters 20
    torchrun --nproc_per_node 2 examples/megatron_train.py --ckpt /tmp/mg3 --iters 20 --distributed-optimizer

(Restarted under ``torchrun``, keep the job's identity so the restart finds the node's snapshots: the same
``--rdzv-id``, or ``FLASHCKPT_JOB_ID``; ``flashckpt-run`` keeps it across its own restarts.)

``/tmp/mg`` then holds ``iter_0000010/`` (``metadata.json``, ``common.pt``, ``__*_*.distcp``,
``.metadata``), ``iter_0000020/`` and ``latest_checkpointed_iteration.txt``, which vanilla
``megatron.core.dist_checkpointing.load`` and Megatron-LM read. (The crash leaves iteration 13 in memory;
the node's saver also persists it as "last words" a moment after the process died.)

Megatron-LM users do not need this file: they import ``save_checkpoint`` / ``load_checkpoint`` from
``flashckpt.patches.megatron`` (see docs/megatron.md). This example uses megatron-core alone (what is on PyPI).
By default the optimizer is a torch ``AdamW`` kept in the common state, the gradients averaged by hand.

``--distributed-optimizer``: megatron-core's own ``DistributedDataParallel`` (gradient buffers, a
reduce-scatter of the gradients, an all-gather of the parameters) and distributed optimizer
(``get_megatron_optimizer(OptimizerConfig(optimizer="adam", use_distributed_optimizer=True))``: each rank
holds its own shard of Adam's state). Its state is saved as Megatron-LM saves it, as sharded state
(``optimizer.sharded_state_dict(model_sd, metadata={"distrib_optim_sharding_type": "dp_reshardable", ...})``),
so each rank snapshots its own shard (``__<rank>_*.distcp``). megatron-core builds these on the CUDA device
and checks for CUDA tensor types; on a CPU the example runs it under ``cuda_calls_on_cpu`` (shims, see
there), and works around three slips of megatron-core 0.16.1 with torch's own Adam (no TE/apex, the CPU
case) in ``training_state`` and ``load_training_state`` (docs/megatron.md, "The distributed optimizer").
Nothing in flashckpt changes for it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

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


# ------------------------------------------------------------------------------------------ the distributed optimizer
# What Megatron-LM passes to ``sharded_state_dict`` (core_v0.16.1's ``get_sharded_sd_metadata``, defaults):
# the distributed optimizer's state as ``dp_reshardable``, each rank's contiguous shard of every bucket
# saved by that rank. (The other types in 0.16.1: ``fully_sharded_model_space`` is refused by
# megatron-core itself, "ShardedTensor.flattened_range is not supported"; ``fully_reshardable`` and
# ``dp_zero_gather_scatter`` gather the state on one rank through ``Tensor.cuda()``.)
OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                  "chained_optim_avoid_prefix": True}


def _is_cuda(device: Any) -> bool:
    return device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda")


class _CudaCallsOnCpu(TorchFunctionMode):
    """megatron-core's DDP and distributed optimizer assume CUDA in calls that have no CPU meaning here:
    scalars made with ``device='cuda'`` (the overflow buffer and unit scale of
    ``MixedPrecisionOptimizer.__init__``, the norm buffers of ``clip_grads.get_grad_norm_fp32``) and type
    checks ``param.type() == 'torch.cuda.FloatTensor'`` (``DistributedOptimizer._build_model_and_main_param_groups``,
    ``clip_grad_by_total_norm_fp32``). Inside this mode a ``device='cuda'`` argument means the CPU and a
    CPU float tensor's ``type()`` names its CUDA twin. The arithmetic is unchanged."""

    _TYPES = {"torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and out in self._TYPES:
            return out.replace("torch.", "torch.cuda.", 1)
        return out


@contextlib.contextmanager
def cuda_calls_on_cpu() -> Iterator[None]:
    """Shims for megatron-core's DDP and distributed optimizer on a CPU (this example only; on a GPU they
    run as they are): ``torch.cuda.current_device()`` (the device of the parameter and gradient buffers)
    answers "cpu" and ``torch.cuda.synchronize()`` does nothing, for the process; inside the context,
    ``_CudaCallsOnCpu``. No effect where CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None
    with _CudaCallsOnCpu():
        yield


def build_distributed_optimizer(model) -> tuple[Any, Any]:
    """megatron-core's ``DistributedDataParallel`` around ``model`` and its distributed Adam (AdamW, as the
    default path; megatron-core's defaults otherwise: weight decay 0.01, gradient clipping at 1.0)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    with cuda_calls_on_cpu():
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True),
                                      model)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True),
                                     [ddp])
    return ddp, opt


def train_step(model, opt, ddp, it: int, rank: int, world: int) -> torch.Tensor:
    """One iteration: the default path (torch AdamW, gradients averaged by hand) when ``ddp`` is None,
    else megatron-core's (gradients reduce-scattered into each rank's shard, parameters all-gathered)."""
    tokens, pos, mask, labels = batch(it, rank)
    if ddp is None:
        loss = model(tokens, pos, mask, labels=labels).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # data parallel: average the gradients
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        return loss
    from megatron.core.distributed import finalize_model_grads

    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(tokens, pos, mask, labels=labels).mean()
    loss.backward()
    finalize_model_grads([ddp])
    with cuda_calls_on_cpu():
        opt.step()
    return loss


def training_state(model, opt, ddp, it: int | None) -> dict[str, Any]:
    """The sharded state dict to save (``it``) or to load into (None): the model's shards, the optimizer
    (the default path's ``state_dict()`` as a common value; the distributed optimizer's own shards) and the
    iteration."""
    if ddp is None:
        sd: dict[str, Any] = {"model": model.sharded_state_dict()}
        if it is not None:
            sd.update(optimizer=opt.state_dict(), iteration=it)
        return sd
    model_sd = model.sharded_state_dict(metadata=OPTIM_METADATA)
    with cuda_calls_on_cpu():
        if it is None:
            # A fresh torch Adam has no state yet, and megatron-core's state_dict() needs its "step"
            # (HAVE_APEX_OR_TE is False): megatron-core's own helper makes it (a step with zero gradients;
            # everything it touches is then loaded)
            for o in opt.chained_optimizers:
                if not o.optimizer.state:
                    o._init_optimizer_states_with_dummy_values()
        optim_sd = opt.sharded_state_dict(model_sd, is_loading=it is None, metadata=OPTIM_METADATA)
    sd = {"model": model_sd, "optimizer": optim_sd}
    if it is not None:
        sd["iteration"] = it
    return sd


def load_training_state(model, opt, ddp, state: dict[str, Any]) -> int:
    """Puts a loaded ``training_state`` into the model and the optimizer; returns its iteration."""
    model.load_state_dict(state["model"])
    if ddp is None:
        opt.load_state_dict(state["optimizer"])
        return int(state["iteration"])
    # no_grad: in fp32, the distributed optimizer's main parameters are views of the model's parameters,
    # which megatron-core 0.16.1 copies into (_set_main_param_and_optimizer_states) with autograd on
    with torch.no_grad(), cuda_calls_on_cpu():
        opt.load_state_dict(state["optimizer"])
    # With torch's Adam (no TE/apex: a "step" tensor per parameter), megatron-core 0.16.1 saves the step in
    # the param groups, then (DistributedOptimizer.load_state_dict) gives every parameter's state one
    # shared "step" tensor, which the dp_reshardable load overwrites with the step the optimizer had
    # before the load: each parameter's step becomes the saved one, a tensor of its own, as torch keeps it
    for o in opt.chained_optimizers:
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                if isinstance(o.optimizer.state.get(p, {}).get("step"), torch.Tensor) and "step" in group:
                    o.optimizer.state[p]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)
    return int(state["iteration"])


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
    ap.add_argument("--distributed-optimizer", "--distributed_optimizer", action="store_true",
                    help="megatron-core's DistributedDataParallel and distributed optimizer (each rank saves its shard)")
    ap.add_argument("--state_digests", action="store_true",
                    help="emit the weights' digest at every save and at the resume (the same on any number of "
                         "ranks: a job that resumes on another number of ranks must resume the weights it saved)")
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
    ddp: Any = None
    if opts.distributed_optimizer:
        ddp, opt = build_distributed_optimizer(model)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = MegatronCheckpointer(opts.ckpt)

    t0 = time.perf_counter()
    state = None
    if ddp is None or ckpt.locate().step is not None:  # (the distributed optimizer's load makes its state first)
        state = load(training_state(model, opt, ddp, None), checkpointer=ckpt)
    start = 1
    if state is not None:
        start = load_training_state(model, opt, ddp, state) + 1
    info = ckpt.last_load
    emit(event="resume", step=start - 1 if state is not None else None,
         source=info.source if info is not None and state is not None else "none", seconds=time.perf_counter() - t0,
         world=world, state_digest=digest(model) if opts.state_digests else None)
    if state is not None:
        if rank == 0:
            source = ckpt.last_load.source if ckpt.last_load is not None else "?"
            print(f"resumed at iteration {state['iteration']} from {source} in "
                  f"{time.perf_counter() - t0:.3f} s (weights {digest(model)})")

    pauses: dict[StorageType, list[float]] = {StorageType.MEMORY: [], StorageType.DISK: []}
    for it in range(start, opts.iters + 1):
        loss = train_step(model, opt, ddp, it, rank, world)

        kind = StorageType.DISK if it % opts.save_interval == 0 else StorageType.MEMORY
        if opts.state_digests:
            emit(event="state", step=it, world=world, state_digest=digest(model))
        t = time.perf_counter()
        save(training_state(model, opt, ddp, it), iteration_dir(opts.ckpt, it), checkpointer=ckpt, step=it,
             storage_type=kind, tracker=True)
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
