"""Frameworks on the GPU (tier ``gpu``, issue #35): each one's own CUDA code paths under flashckpt's integration
for it, a training process killed with SIGKILL mid-run and a new process that resumes from memory bit for bit.

- DeepSpeed ZeRO-2 and ZeRO-3 (``DeepSpeedCheckpointer``) with DeepSpeed's own optimizer, built by
  ``deepspeed.initialize`` from the config's ``"optimizer"`` section, on the CUDA accelerator and NCCL;
- megatron-core's ``GPTModel`` (local layer spec, no TransformerEngine; initialized on the GPU with
  megatron-core's model-parallel CUDA RNG) with its own ``DistributedDataParallel`` and distributed optimizer,
  saved as sharded state through ``flashckpt.patches.megatron.dist_ckpt`` (``save`` / ``load``), NCCL;
- Lightning, ``Trainer(accelerator="gpu", devices=1)`` with ``FlashCheckpointIO`` and ``FlashMemorySnapshot``.

Each test: a process trains with a memory snapshot every step (and one step persisted to storage), queues the
next step's forward and backward on the device and is killed with SIGKILL; a new process of the same job loads
through the integration, which must say "memory" at the step of the last snapshot, with the weights the killed
process had then, and trains on; its final weights equal those of an uninterrupted run of the same steps
(built and trained again in that process). World size 1: NCCL refuses two ranks on one GPU.

CPU mode: with ``FLASHCKPT_GPU_TIER_ON_CPU=1`` the same tests run on a machine without a GPU (device "cpu",
gloo, ``DS_ACCELERATOR=cpu``, ``accelerator="cpu"``; the ranks see no CUDA device), so that their logic is
checked where the suite runs. megatron-core has no CPU path for two of the pieces used here: its
``DotProductAttention`` computes in a CUDA buffer and its DDP and distributed optimizer allocate on
``torch.cuda.current_device()`` and check CUDA tensor types. In CPU mode the model is therefore
``examples/megatron_train.py``'s (the same config; SDPA in place of that attention; initialized on the CPU) and
the DDP and optimizer run under that example's ``cuda_calls_on_cpu`` shims: the closest thing a CPU runs. On
the GPU nothing is shimmed.

Run: ``bash scripts/gpu.sh`` on a machine with a GPU (it installs DeepSpeed and megatron-core from the wheels
in ``.whl``: ``scripts/gpu_wheels.sh``); ``FLASHCKPT_GPU_TIER_ON_CPU=1 pytest tests/gpu/test_gpu_frameworks.py``
anywhere. A framework that is not installed skips its test (fails it under scripts/gpu.sh, which installs them).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import signal
import sys
from typing import Any

import pytest
import torch
from helpers import RankGroup, launch_ranks, tree_digest, wait_for

ON_CPU = os.environ.get("FLASHCKPT_GPU_TIER_ON_CPU", "").strip() == "1"
DEVICE = "cpu" if ON_CPU else "cuda"

pytestmark = pytest.mark.skipif(not ON_CPU and not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (FLASHCKPT_GPU_TIER_ON_CPU=1 runs these tests on the CPU)")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The steps of every test: one persisted to storage, memory snapshots up to KILL_AFTER, killed during the next;
# the resumed process trains to END.
DISK_STEP, KILL_AFTER, END = 3, 5, 8


def _env(job: str) -> dict[str, str]:
    """The environment of a test's training processes."""
    env = {"FLASHCKPT_JOB_ID": job, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
           # the killed process's saver keeps its snapshots this long for the new process (which imports a
           # framework first)
           "FLASHCKPT_SAVER_GRACE_S": "120",
           # cuBLAS's deterministic workspace (torch.use_deterministic_algorithms, below, needs it): the killed
           # process's steps and the uninterrupted run's are computed in different processes
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
           "DS_ACCELERATOR": DEVICE, "DS_BUILD_OPS": "0"}
    if ON_CPU:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU mode on a machine that has a GPU too: the ranks see none
    return env


def _start(device: str) -> None:
    """What every training process does first: bit-reproducible kernels (warn_only: an op without a
    deterministic variant warns rather than fails), and on CUDA the one GPU as the current device."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device == "cuda":
        assert torch.cuda.is_available(), "a CUDA test process sees no GPU"
        torch.cuda.set_device(0)
    else:
        assert not torch.cuda.is_available(), "CPU mode: the training process must not see a GPU"


def _init_dist(device: str, rdzv: str) -> None:
    """A process group of one rank: NCCL on the GPU, gloo on the CPU."""
    import torch.distributed as dist

    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method="file://" + rdzv, rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=120))


def _ready(path: str, out: dict[str, Any]) -> None:
    """Writes the killed process's report whole (a rename) before it dies."""
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.rename(path + ".tmp", path)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _crash_then_resume(tmp_path, crash_fn, resume_fn, args: dict[str, Any], job: str,
                       dist: bool = True) -> tuple[dict, dict]:
    """Runs ``crash_fn`` in a process that must die of SIGKILL after writing its report (``args["ready"]``),
    then ``resume_fn`` in a new process of the same job; returns (the report, the resumed process's result)."""
    ready = str(tmp_path / "ready.json")
    args = {**args, "device": DEVICE, "ready": ready}
    if dist:
        args["rdzv"] = str(tmp_path / "rdzv-crash")
    crashed: RankGroup = launch_ranks(crash_fn, 1, str(tmp_path / "crash"), dist=False, env=_env(job), args=args)
    try:
        wait_for(lambda: crashed.procs[0].poll() is not None, 150, "the training process to be killed")
    finally:
        crashed.kill()
    assert crashed.procs[0].returncode == -signal.SIGKILL, crashed.logs()
    assert os.path.exists(ready), crashed.logs()
    with open(ready) as f:
        report = json.load(f)
    if dist:
        args["rdzv"] = str(tmp_path / "rdzv-resume")
    del args["ready"]
    (resumed,) = launch_ranks(resume_fn, 1, str(tmp_path / "resume"), dist=False, env=_env(job), args=args).wait(150)
    return report, resumed


def _where(checkpointer: Any) -> list[Any]:
    """[source, step] of the checkpointer's last load."""
    loc = checkpointer.last_load
    assert loc is not None, "no load was made"
    return [loc.source, loc.step]


def _needs(module: str) -> None:
    """Skips the test when ``module`` is not installed; fails it where scripts/gpu.sh installed the frameworks
    from wheels (FLASHCKPT_GPU_FRAMEWORKS_REQUIRED=1): there a missing one is an error, never a quiet skip."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # (its parent package is missing)
        found = False
    if not found:
        if os.environ.get("FLASHCKPT_GPU_FRAMEWORKS_REQUIRED") == "1":
            pytest.fail(f"{module} is not importable, although scripts/gpu.sh installed the wheels of .whl")
        pytest.skip(f"{module} is not installed")


# ------------------------------------------------------------------------------------------ DeepSpeed
def _ds_engine(stage: int) -> Any:
    """A small MLP under DeepSpeed ZeRO ``stage`` with DeepSpeed's own optimizer (AdamW)."""
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    cfg = {"train_micro_batch_size_per_gpu": 8, "train_batch_size": 8, "steps_per_print": 10**9,
           "zero_optimization": {"stage": stage},
           # DeepSpeed's optimizer, built by deepspeed.initialize from this section. "torch_adam": its AdamW is
           # torch's rather than FusedAdam, which DeepSpeed JIT-builds with nvcc on first use (minutes of a lent
           # GPU machine's time, and a CUDA toolkit it may not have)
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _ds_forward_backward(engine: Any, step: int) -> None:
    """Step ``step``'s forward and backward; its batch is fixed by the step (made on the CPU, moved over)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 16, generator=g).to(engine.device)
    target = x[:, :4].cumsum(1)
    engine.backward((engine(x) - target).pow(2).mean())


def _ds_train(engine: Any, first: int, last: int) -> None:
    for step in range(first, last + 1):
        _ds_forward_backward(engine, step)
        engine.step()


def _ds_digest(engine: Any) -> str:
    """Every parameter, gathered under ZeRO-3, bit for bit."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return tree_digest([p.detach() for p in params])


def _ds_facts(engine: Any) -> list[Any]:
    """What runs: the ZeRO stage, the optimizer DeepSpeed built and wraps, the device of the weights."""
    import deepspeed

    inner = getattr(engine.optimizer, "optimizer", None)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params[:1], enabled=engine.zero_optimization_stage() == 3):
        device = params[0].device.type
    return [engine.zero_optimization_stage(), type(engine.optimizer).__name__, type(inner).__name__, device]


def ds_crash_worker(stage: int, ckpt: str, device: str, ready: str, rdzv: str) -> None:
    """Trains with a memory snapshot every step (DISK_STEP persisted), reports after step KILL_AFTER, queues the
    next step's forward and backward and dies of SIGKILL."""
    from flashckpt.integrations.deepspeed import DeepSpeedCheckpointer, StorageType

    _start(device)
    _init_dist(device, rdzv)
    engine = _ds_engine(stage)
    ck = DeepSpeedCheckpointer(engine, ckpt)
    assert ck.load_checkpoint(ckpt) == (None, None) and _where(ck) == ["none", None]
    for step in range(1, KILL_AFTER + 1):
        _ds_train(engine, step, step)
        ck.save_checkpoint(ckpt, client_state={"step": step},
                           storage_type=StorageType.DISK if step == DISK_STEP else StorageType.MEMORY)
        if step == DISK_STEP:
            ck.wait(60)
    _ready(ready, {"digest": _ds_digest(engine), "facts": _ds_facts(engine),
                   "latest": open(os.path.join(ckpt, "latest")).read()})
    _ds_forward_backward(engine, KILL_AFTER + 1)  # mid-run: work queued on the device
    _die()


def ds_resume_worker(stage: int, ckpt: str, device: str, rdzv: str) -> dict:
    """Resumes through DeepSpeedCheckpointer and trains to END; then an uninterrupted run of END steps."""
    from flashckpt.integrations.deepspeed import DeepSpeedCheckpointer

    _start(device)
    _init_dist(device, rdzv)
    out: dict[str, Any] = {}
    engine = _ds_engine(stage)
    with DeepSpeedCheckpointer(engine, ckpt) as ck:
        _path, client = ck.load_checkpoint(ckpt)
        out["resumed"] = [*_where(ck), engine.global_steps, client["step"]]
        out["loaded"] = _ds_digest(engine)
        _ds_train(engine, engine.global_steps + 1, END)
        out["final"] = _ds_digest(engine)
        out["facts"] = _ds_facts(engine)
    ref = _ds_engine(stage)
    _ds_train(ref, 1, END)
    out["reference"] = _ds_digest(ref)
    return out


@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_deepspeed_zero_killed_resumes_from_memory_bit_exact(tmp_path, stage):
    _needs("deepspeed")
    ckpt = str(tmp_path / "ckpt")
    report, r = _crash_then_resume(tmp_path, ds_crash_worker, ds_resume_worker, {"stage": stage, "ckpt": ckpt},
                                   f"gpu-ds{stage}")
    zero_opt = "DeepSpeedZeroOptimizer" if stage == 2 else "DeepSpeedZeroOptimizer_Stage3"
    assert report["facts"] == r["facts"] == [stage, zero_opt, "AdamW", DEVICE], (report, r)
    assert report["latest"] == f"global_step{DISK_STEP}", report  # the memory snapshots were never persisted
    assert r["resumed"] == ["memory", KILL_AFTER, KILL_AFTER, KILL_AFTER], r
    assert r["loaded"] == report["digest"], "the weights loaded from memory are not those of the killed process"
    assert r["final"] == r["reference"], "the resumed run ends with other weights than an uninterrupted one"
    assert r["loaded"] != r["final"]


# ------------------------------------------------------------------------------------------ megatron-core
def _megatron_example() -> Any:
    """examples/megatron_train.py as a module: its batches, its state to save and load (megatron-core's
    distributed optimizer, as Megatron-LM saves it) and, in CPU mode, its model and shims."""
    import importlib

    sys.path.insert(0, os.path.join(REPO, "examples"))
    return importlib.import_module("megatron_train")


def _mg_build(mt: Any, device: str) -> tuple[Any, Any, Any]:
    """A tiny GPTModel with megatron-core's DDP and distributed optimizer: (model, ddp, optimizer)."""
    if device == "cpu":  # the closest thing on a CPU (module docstring)
        model = mt.build_model()
    else:
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)  # the initialization's CUDA RNG, as Megatron-LM seeds it
        # the example's config, initialized on the GPU; no dropout: its RNG state is no part of the checkpoint
        cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, pipeline_dtype=torch.float32,
                                hidden_dropout=0.0, attention_dropout=0.0)
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                         max_sequence_length=32)
        model.cuda(torch.cuda.current_device())
    ddp, opt = mt.build_distributed_optimizer(model)
    return model, ddp, opt


def _mg_forward_backward(mt: Any, ddp: Any, opt: Any, it: int, device: str) -> None:
    from megatron.core.distributed import finalize_model_grads

    tokens, pos, mask, labels = (t if t is None else t.to(device) for t in mt.batch(it, 0))
    ddp.zero_grad_buffer()
    opt.zero_grad()
    ddp(tokens, pos, mask, labels=labels).mean().backward()
    finalize_model_grads([ddp])


def _mg_train(mt: Any, ddp: Any, opt: Any, first: int, last: int, device: str) -> None:
    """Iterations first..last as ``mt.train_step`` runs them, with the batch on ``device``."""
    for it in range(first, last + 1):
        _mg_forward_backward(mt, ddp, opt, it, device)
        with mt.cuda_calls_on_cpu():  # (nothing on the GPU)
            opt.step()


def _mg_digest(model: Any) -> str:
    return tree_digest({k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)})


def _mg_optim_digest(opt: Any) -> str:
    """This rank's part of the distributed optimizer: its main parameters and Adam's state, in order."""
    return tree_digest([[p, sorted(o.optimizer.state[p].items())] for o in opt.chained_optimizers
                        for group in o.optimizer.param_groups for p in group["params"]])


def _mg_facts(model: Any, ddp: Any, opt: Any) -> list[Any]:
    """What runs: megatron-core's DDP, its distributed optimizer's class, the attention and the device."""
    attn = type(model.decoder.layers[0].self_attention.core_attention)
    return [type(ddp).__name__, [type(o).__name__ for o in opt.chained_optimizers], attn.__name__,
            attn.__module__.startswith("megatron.core."), next(model.parameters()).device.type]


def _mg_setup(device: str, rdzv: str) -> Any:
    from megatron.core import parallel_state

    _start(device)
    _init_dist(device, rdzv)
    parallel_state.initialize_model_parallel(1, 1)
    return _megatron_example()


def megatron_crash_worker(ckpt: str, device: str, ready: str, rdzv: str) -> None:
    """Trains with a memory snapshot every iteration (DISK_STEP persisted), reports after KILL_AFTER, queues
    the next iteration's forward and backward and dies of SIGKILL."""
    from flashckpt.patches.megatron.dist_ckpt import MegatronCheckpointer, StorageType, iteration_dir, save

    mt = _mg_setup(device, rdzv)
    model, ddp, opt = _mg_build(mt, device)
    ck = MegatronCheckpointer(ckpt)
    for it in range(1, KILL_AFTER + 1):
        _mg_train(mt, ddp, opt, it, it, device)
        save(mt.training_state(model, opt, ddp, it), iteration_dir(ckpt, it), checkpointer=ck, step=it,
             storage_type=StorageType.DISK if it == DISK_STEP else StorageType.MEMORY, tracker=True)
        if it == DISK_STEP:
            ck.wait(60)
    _ready(ready, {"digest": _mg_digest(model), "optim": _mg_optim_digest(opt), "facts": _mg_facts(model, ddp, opt),
                   "tracker": open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read()})
    _mg_forward_backward(mt, ddp, opt, KILL_AFTER + 1, device)  # mid-run: work queued on the device
    _die()


def megatron_resume_worker(ckpt: str, device: str, rdzv: str) -> dict:
    """Loads through flashckpt's ``load`` (memory first) and trains to END; then an uninterrupted run."""
    from flashckpt.patches.megatron.dist_ckpt import MegatronCheckpointer, load

    mt = _mg_setup(device, rdzv)
    out: dict[str, Any] = {}
    ck = MegatronCheckpointer(ckpt)
    try:
        model, ddp, opt = _mg_build(mt, device)
        state = load(mt.training_state(model, opt, ddp, None), checkpointer=ck)
        out["resumed"] = _where(ck)
        it = mt.load_training_state(model, opt, ddp, state)
        out["loaded"] = [it, _mg_digest(model), _mg_optim_digest(opt)]
        _mg_train(mt, ddp, opt, it + 1, END, device)
        out["final"] = _mg_digest(model)
        out["facts"] = _mg_facts(model, ddp, opt)
    finally:
        ck.close(release=True)
    model, ddp, opt = _mg_build(mt, device)
    _mg_train(mt, ddp, opt, 1, END, device)
    out["reference"] = _mg_digest(model)
    return out


def test_megatron_core_distributed_optimizer_killed_resumes_from_memory_bit_exact(tmp_path):
    _needs("megatron.core")
    ckpt = str(tmp_path / "ckpt")
    report, r = _crash_then_resume(tmp_path, megatron_crash_worker, megatron_resume_worker, {"ckpt": ckpt},
                                   "gpu-megatron")
    attention = "CpuAttention" if ON_CPU else "DotProductAttention"
    assert report["facts"] == r["facts"] == ["DistributedDataParallel", ["DistributedOptimizer"], attention,
                                             not ON_CPU, DEVICE], (report, r)
    assert report["tracker"] == str(DISK_STEP), report  # the memory snapshots were never persisted
    assert r["resumed"] == ["memory", KILL_AFTER], r
    assert r["loaded"] == [KILL_AFTER, report["digest"], report["optim"]], \
        "the weights and optimizer shard loaded from memory are not those of the killed process"
    assert r["final"] == r["reference"], "the resumed run ends with other weights than an uninterrupted one"
    assert r["loaded"][1] != r["final"]


# ------------------------------------------------------------------------------------------ Lightning
def _lightning_model() -> Any:
    """A small regressor whose batch of step ``s`` comes from a generator seeded with ``s`` (made on the CPU,
    moved to the module's device), its optimizer AdamW with a step-wise LR schedule."""
    import lightning as L

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(1000 + self.global_step)
            x = torch.randn(8, 16, generator=g).to(self.device)
            return torch.nn.functional.mse_loss(self.net(x), x.sum(1, keepdim=True))

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(100)), batch_size=1)

    torch.manual_seed(0)
    return Regressor()


def _lightning_trainer(device: str, steps: int, **kw: Any) -> Any:
    import lightning as L

    return L.Trainer(max_steps=steps, accelerator="gpu" if device == "cuda" else "cpu", devices=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, **kw)


def _weights_digest(model: Any) -> str:
    return tree_digest(dict(model.state_dict()))


def lightning_crash_worker(ckpt: str, device: str, ready: str) -> None:
    """Fits with FlashCheckpointIO, a memory snapshot every step (FlashMemorySnapshot) and ModelCheckpoint at
    DISK_STEP; during step KILL_AFTER + 1, after its backward, reports and dies of SIGKILL."""
    from flashckpt.integrations.lightning import FlashCheckpointIO, FlashMemorySnapshot
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    _start(device)

    class KillDuringNextStep(Callback):
        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            if trainer.global_step == KILL_AFTER:  # the weights are still step KILL_AFTER's
                _ready(ready, {"digest": _weights_digest(pl_module), "device": pl_module.device.type})
                _die()

    io = FlashCheckpointIO(ckpt)
    assert io.resume_path() is None
    trainer = _lightning_trainer(device, END, plugins=[io], callbacks=[
        FlashMemorySnapshot(every_n_train_steps=1), KillDuringNextStep(),
        ModelCheckpoint(dirpath=ckpt, every_n_train_steps=DISK_STEP, save_top_k=-1, filename="{step}")])
    trainer.fit(_lightning_model())
    raise AssertionError("the run was supposed to be killed")


def lightning_resume_worker(ckpt: str, device: str) -> dict:
    """Fits from ``resume_path()`` (memory) to END; then a vanilla Trainer's uninterrupted run."""
    from flashckpt.integrations.lightning import FlashCheckpointIO, FlashMemorySnapshot
    from lightning.pytorch.callbacks import Callback

    _start(device)

    class Start(Callback):
        step: int | None = None
        loaded: str | None = None
        device: str | None = None  # (at the end of fit Lightning moves the module back to the CPU)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.step, self.loaded, self.device = trainer.global_step, _weights_digest(pl_module), pl_module.device.type

    io, start = FlashCheckpointIO(ckpt), Start()
    resume = io.resume_path()
    model = _lightning_model()
    _lightning_trainer(device, END, plugins=[io], callbacks=[FlashMemorySnapshot(every_n_train_steps=1), start],
                       enable_checkpointing=False).fit(model, ckpt_path=resume)
    out = {"resume": resume, "load": list(io.last_load or ()), "start": start.step, "loaded": start.loaded,
           "final": _weights_digest(model), "device": start.device}
    ref = _lightning_model()
    _lightning_trainer(device, END, enable_checkpointing=False).fit(ref)
    out["reference"] = _weights_digest(ref)
    return out


def test_lightning_trainer_killed_resumes_from_memory_bit_exact(tmp_path):
    _needs("lightning")
    ckpt = str(tmp_path / "ckpt")
    report, r = _crash_then_resume(tmp_path, lightning_crash_worker, lightning_resume_worker, {"ckpt": ckpt},
                                   "gpu-lightning", dist=False)
    snapshot = os.path.join(ckpt, "last-flash.ckpt")
    assert report["device"] == r["device"] == DEVICE, (report, r)
    assert (r["resume"], r["load"], r["start"]) == (snapshot, ["memory", snapshot], KILL_AFTER), r
    assert r["loaded"] == report["digest"], "the weights loaded from memory are not those of the killed process"
    assert r["final"] == r["reference"], "the resumed run ends with other weights than an uninterrupted one"
    assert r["loaded"] != r["final"]
