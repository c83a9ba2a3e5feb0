"""Every framework adapter with the node-local tier (``local_dir=``), with the real frameworks, real savers and
real rank processes: a ``save(DISK)`` committed on the local tier and the checkpoint dir, the checkpointer closed
releasing memory (memory cannot serve), a new one loads from the local tier (``source`` "local") bit for bit;
the local dir wiped (a replaced node): the next load reads the checkpoint dir, bit for bit.

- DDP (1 rank), FSDP2 (2 ranks, DCP: every rank reads the ``.metadata`` and may read another rank's file),
  DeepSpeed ZeRO-1 (1 rank: ``latest`` and the tag dir under the local dir), the HF Trainer
  (``checkpoint-N`` under the local dir), Accelerate's ``AcceleratorCheckpointer``, Lightning's
  ``FlashCheckpointIO``, megatron-core ``dist_checkpointing`` (``iter_XXXXXXX``) and the Megatron-LM patch
  (through test_megatron.py's stand-in of Megatron-LM's module, given ``args.ckpt_step``).
- A local tier holding only part of the step (its local manifest names rank 0 of 2, rank 1's files gone:
  what a node of a multi-node job holds) makes every rank read the checkpoint dir. The partial copy is made
  by editing the local manifest and deleting rank 1's files (one node here; a real second node is
  tests/multiproc/test_multinode.py's business, minutes rather than seconds).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import pytest
import torch
from _fault_helpers import assert_bit_equal, make_state
from helpers import run_ranks

pytestmark = pytest.mark.multiproc

ENV = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


# ------------------------------------------------------------------------------------------ shared
@pytest.fixture(autouse=True)
def _framework_env(monkeypatch: Any) -> None:
    """No downloads; DeepSpeed on CPU. Lightning's and Accelerate's CUDA probe may set
    PYTORCH_NVML_BASED_CUDA_CHECK: recorded here, so that teardown restores it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")


def _wipe(d: str) -> None:
    """``rm -rf d/*``: the node's local disk replaced (the directory itself stays)."""
    for name in os.listdir(d):
        p = os.path.join(d, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.remove(p)


def _drop_rank(local: str, rank: int) -> list[int]:
    """Makes the local tier's newest step a partial copy: its manifest names every rank but ``rank``, whose
    files are deleted (as a node of a multi-node job holds only its own ranks'). Returns the steps edited."""
    from flashckpt.commit.tiers import local_layout

    layout = local_layout(local)
    step = layout.committed_steps()[-1]
    path = layout.manifest_path(step)
    with open(path) as f:
        m = json.load(f)
    for rec in m["files"].pop(str(rank)):
        os.remove(os.path.join(local, rec["path"]))
    with open(path, "w") as f:
        json.dump(m, f)
    return [step]


def _local_then_wiped(local: str, load_once: Any) -> dict:
    """``load_once()`` (a fresh checkpointer's load: [source, step, ...]) with the local tier as saved, and
    again after the local dir was wiped."""
    out = {}
    for case in ("local", "wiped"):
        out[case] = load_once()
        _wipe(local)
    return out


def _one_rank(worker: Any, tmp_path: Any) -> dict:
    """``worker(durable, local)``'s result, run in one rank process."""
    (out,) = run_ranks(worker, 1, str(tmp_path / "w"), args={"durable": str(tmp_path / "ckpt"),
                                                             "local": str(tmp_path / "nvme")}, env=ENV, timeout=240)
    return out  # type: ignore[no-any-return]


def _digest(tensors: Any) -> str:
    h = hashlib.sha256()
    for k, v in sorted(tensors.items()):
        if isinstance(v, torch.Tensor):
            h.update(k.encode())
            h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ DDP
def test_ddp_loads_the_local_tier_then_the_checkpoint_dir(tmp_path: Any) -> None:
    from flashckpt.integrations.ddp import DdpCheckpointer, StorageType

    durable, local = str(tmp_path / "ckpt"), str(tmp_path / "nvme")
    want = make_state(3, 0.25)
    with DdpCheckpointer(durable, local_dir=local, local_max_to_keep=1) as ck:
        ck.save_checkpoint(3, want, storage_type=StorageType.DISK)
        ck.wait_latest_checkpoint(120)
    assert os.path.exists(os.path.join(local, "step_3", "checkpoint.pt"))
    for source in ("local", "storage"):
        with DdpCheckpointer(durable, local_dir=local) as ck:
            assert_bit_equal(ck.load_checkpoint(), want)
            assert ck.last_load is not None and (ck.last_load.source, ck.last_load.step) == (source, 3), ck.last_load
        _wipe(local)


# ------------------------------------------------------------------------------------------ FSDP2 (2 ranks)
def fsdp_worker(durable: str, local: str) -> dict:
    """Saves step 1 (DISK), then three fresh checkpointers load: the whole local copy, the partial one (rank 1's
    files gone from the local tier), and the wiped local dir."""
    import torch.distributed as dist
    from flashckpt.integrations.fsdp import FsdpShardCheckpointer, StorageType
    from test_fsdp import build as _fsdp_model  # the FSDP2 MLP of tests/framework/test_fsdp.py
    from test_fsdp import local_digest as _fsdp_digest
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = _fsdp_model(world)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    opt.step()
    want = _fsdp_digest(model, opt)
    ck = FsdpShardCheckpointer(durable, local_dir=local)
    msd, osd = get_state_dict(model, opt)
    ck.save_checkpoint(1, {"model": msd, "optim": osd, "step": 1}, storage_type=StorageType.DISK)
    ck.wait_latest_checkpoint(120)
    ck.close()
    dist.barrier()
    out: dict = {}
    for case in ("whole", "partial", "wiped"):
        if rank == 0 and case == "partial":
            out["edited"] = _drop_rank(local, 1)
        if rank == 0 and case == "wiped":
            _wipe(local)
        dist.barrier()
        m, o = _fsdp_model(world)
        c = FsdpShardCheckpointer(durable, local_dir=local)
        try:
            extra = c.load_checkpoint(m, o)
            assert c.last_load is not None
            out[case] = [c.last_load.source, c.last_load.step, _fsdp_digest(m, o) == want, extra.get("step")]
        finally:
            c.close()
        dist.barrier()
    return out


def test_fsdp2_two_ranks_local_whole_partial_and_wiped(tmp_path: Any) -> None:
    pytest.importorskip("torch.distributed.fsdp")
    durable, local = str(tmp_path / "ckpt"), str(tmp_path / "nvme")
    results = run_ranks(fsdp_worker, 2, str(tmp_path / "w"), args={"durable": durable, "local": local}, env=ENV,
                        timeout=150)
    for out in results:
        assert out["whole"] == ["local", 1, True, 1], out
        # rank 0's node lacks rank 1's files: every rank reads the checkpoint dir, never a mix
        assert out["partial"] == ["storage", 1, True, 1], out
        assert out["wiped"] == ["storage", 1, True, 1], out
    assert results[0]["edited"] == [1]


# ------------------------------------------------------------------------------------------ DeepSpeed
def _ds_engine() -> Any:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 1}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _ds_state(engine: Any) -> str:
    sd = engine.module.state_dict()
    opt = engine.optimizer.state_dict()
    fp32 = opt.get("single_partition_of_fp32_groups", [])
    return _digest({**sd, **{f"fp32.{i}": t for i, t in enumerate(fp32)}})


def ds_worker(durable: str, local: str) -> dict:
    from flashckpt.integrations.deepspeed import DeepSpeedCheckpointer, StorageType

    torch.set_num_threads(1)
    engine = _ds_engine()
    for s in (1, 2):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(s))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    want = _ds_state(engine)
    ck = DeepSpeedCheckpointer(engine, durable, local_dir=local)
    ck.save_checkpoint(durable, client_state={"epoch": 7}, storage_type=StorageType.DISK)
    ck.wait_latest_checkpoint(120)
    ck.close()
    out: dict = {"local_latest": open(os.path.join(local, "latest")).read()}

    def load_once() -> list:
        fresh = _ds_engine()
        with DeepSpeedCheckpointer(fresh, durable, local_dir=local) as c:
            load_path, client = c.load_checkpoint(durable)
            assert c.last_load is not None
            return [c.last_load.source, c.last_load.step, _ds_state(fresh) == want, client.get("epoch"),
                    load_path.startswith(local)]

    return {**out, **_local_then_wiped(local, load_once)}


def test_deepspeed_zero1_loads_the_local_tag_then_the_checkpoint_dir(tmp_path: Any) -> None:
    pytest.importorskip("deepspeed")
    out = _one_rank(ds_worker, tmp_path)
    assert out["local_latest"] == "global_step2", out
    assert out["local"] == ["local", 2, True, 7, True], out
    assert out["wiped"] == ["storage", 2, True, 7, False], out


# ------------------------------------------------------------------------------------------ HF Trainer
class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _hf_trainer(out: str, local: str, *, resumed: dict | None = None) -> Any:
    """A FlashCkptTrainer of a tiny GPT-2 saving checkpoint-2 (``resumed``: a resume that saves nothing and
    records the weights' digest as training begins, right after the checkpoint was loaded)."""
    from flashckpt.integrations.hf import FlashCkptConfig, FlashCkptTrainer
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    class Loaded(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if resumed is not None:
                resumed["digest"] = _digest(model.state_dict())

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(out, max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, dataloader_num_workers=0,
                             **({"save_strategy": "no"} if resumed is not None else {"save_strategy": "steps",
                                                                                       "save_steps": 2}))
    return FlashCkptTrainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[Loaded()],
                            flashckpt_config=FlashCkptConfig(local_dir=local))


def test_hf_trainer_resumes_from_the_local_tier_then_the_checkpoint_dir(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # save_pretrained's bar would start tqdm's monitor thread, which outlives the test
    torch.set_num_threads(1)
    out, local = str(tmp_path / "out"), str(tmp_path / "nvme")
    first = _hf_trainer(out, local)
    first.train()
    want = _digest(first.model.state_dict())
    assert os.path.exists(os.path.join(local, "checkpoint-2", "trainer_state.json"))
    for source in ("local", "storage"):
        resumed: dict = {}
        again = _hf_trainer(out, local, resumed=resumed)
        again.train(resume_from_checkpoint=True)
        got = again.flashckpt_last_resume
        assert got is not None and (got.source, got.step) == (source, 2), got
        assert (got.path or "").startswith(local if source == "local" else out), got
        assert resumed["digest"] == want, source  # the weights as loaded, bit for bit
        _wipe(local)


def test_accelerate_loads_the_local_tier_then_the_checkpoint_dir(tmp_path: Any) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from flashckpt.integrations.accelerate import AcceleratorCheckpointer

    torch.set_num_threads(1)
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(4, 8)).pow(2).mean())
    opt.step()
    want = _digest(model.state_dict())
    durable, local = str(tmp_path / "ckpt"), str(tmp_path / "nvme")
    with AcceleratorCheckpointer(acc, durable, local_dir=local) as ck:
        ck.save_state(os.path.join(durable, "step_1"), step=1)
        ck.wait()
    for source in ("local", "storage"):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        with AcceleratorCheckpointer(acc, durable, local_dir=local) as ck:
            loc = ck.load_state()
        assert (loc.source, loc.step) == (source, 1), loc
        assert (loc.path or "").startswith(local if source == "local" else durable), loc
        assert _digest(model.state_dict()) == want
        _wipe(local)


# ------------------------------------------------------------------------------------------ Lightning
def test_lightning_io_loads_the_local_tier_then_the_checkpoint_dir(tmp_path: Any) -> None:
    pytest.importorskip("lightning")
    from flashckpt.integrations.lightning import FlashCheckpointIO

    durable, local = str(tmp_path / "ckpt"), str(tmp_path / "nvme")
    path = os.path.join(durable, "last.ckpt")
    want = {"state_dict": make_state(5, 0.25)["model"], "global_step": 5, "epoch": 0}
    io = FlashCheckpointIO(durable, local_dir=local)
    io.save_checkpoint(want, path)
    io.teardown()
    assert os.path.exists(os.path.join(local, "last.ckpt"))
    for source, where in (("local", os.path.join(local, "last.ckpt")), ("storage", path)):
        io = FlashCheckpointIO(durable, local_dir=local)
        try:
            assert_bit_equal(io.load_checkpoint(path), want)
            assert io.last_load == (source, where), io.last_load
        finally:
            io.teardown()
        _wipe(local)


# ------------------------------------------------------------------------------------------ megatron-core
def _gpt(seed: int) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                            pipeline_dtype=torch.float32)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                    max_sequence_length=16)


def megatron_worker(durable: str, local: str) -> dict:
    from flashckpt.patches.megatron.dist_ckpt import MegatronCheckpointer, StorageType, iteration_dir, load, save
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model = _gpt(1)
    want = _digest(model.state_dict())
    ck = MegatronCheckpointer(durable, local_dir=local)
    save({"model": model.sharded_state_dict(), "iteration": 10}, iteration_dir(durable, 10), checkpointer=ck,
         step=10, storage_type=StorageType.DISK, tracker=True)
    ck.wait(120)
    ck.close()
    from helpers import saver_pids, wait_for

    # the saver lets the snapshots go and exits after the final goodbye: memory cannot serve the next load
    wait_for(lambda: not saver_pids(os.environ["FLASHCKPT_RUNTIME_DIR"]), 60, "the saver to exit after close()")
    out: dict = {"local_tracker": open(os.path.join(local, "latest_checkpointed_iteration.txt")).read()}

    def load_once() -> list:
        fresh = _gpt(2)
        with MegatronCheckpointer(durable, local_dir=local) as c:
            sd = load({"model": fresh.sharded_state_dict()}, checkpointer=c)
            fresh.load_state_dict(sd["model"])
            assert c.last_load is not None
            return [c.last_load.source, c.last_load.step, _digest(fresh.state_dict()) == want, sd["iteration"]]

    return {**out, **_local_then_wiped(local, load_once)}


def test_megatron_core_loads_the_local_iteration_then_the_checkpoint_dir(tmp_path: Any) -> None:
    pytest.importorskip("megatron.core")
    out = _one_rank(megatron_worker, tmp_path)
    assert out["local_tracker"] == "10", out
    assert out["local"] == ["local", 10, True, 10], out
    assert out["wiped"] == ["storage", 10, True, 10], out


# ------------------------------------------------------------------------------------------ Megatron-LM
def test_megatron_lm_patch_loads_the_local_iteration_then_the_checkpoint_dir(monkeypatch: Any, tmp_path: Any) -> None:
    """``flashckpt.patches.megatron`` around test_megatron.py's stand-in of Megatron-LM's checkpointing module
    (Megatron-LM is not installed here), given ``args.ckpt_step`` as Megatron-LM's ``_load_base_checkpoint``
    reads it: ``configure(local_dir=...)``, iteration 10 saved; a new process's load reads it from the local
    dir (``args.load`` pointed there for the call, restored after), then, wiped, from ``--load``."""
    pytest.importorskip("megatron.core")
    import sys
    import types
    from argparse import Namespace

    import flashckpt.patches.megatron._lm as lm
    from megatron.core.safe_globals import register_safe_globals
    from test_megatron import _STANDIN

    register_safe_globals()  # Megatron-LM does this: its checkpoints hold an argparse.Namespace
    standin = _STANDIN.replace("    iteration, release = read_metadata(tracker_filename)\n",
                               "    iteration, release = read_metadata(tracker_filename)\n"
                               "    if getattr(args, 'ckpt_step', None):\n"
                               "        iteration, release = args.ckpt_step, False\n")
    assert "ckpt_step" in standin
    mod = types.ModuleType("megatron.training.checkpointing")
    exec(compile(standin, "<Megatron-LM stand-in>", "exec"), mod.__dict__)
    monkeypatch.setitem(sys.modules, "megatron.training", types.ModuleType("megatron.training"))
    monkeypatch.setitem(sys.modules, "megatron.training.checkpointing", mod)
    monkeypatch.setattr(lm, "_CHECKPOINTERS", {})
    monkeypatch.setattr(lm, "_OPTIONS", dict(lm._OPTIONS))
    root, local = str(tmp_path / "ckpt"), str(tmp_path / "nvme")
    mod.ARGS = Namespace(save=root, load=root, async_save=False, ckpt_step=None)
    lm.configure(local_dir=local)
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(1.5)
    try:
        lm.save_checkpoint(10, [model], None, None, 111, storage_type=lm.StorageType.DISK)
        lm.get_checkpointer(root).wait(60)
    finally:
        lm.finalize()
    from helpers import saver_pids, wait_for

    # (the saver lets the snapshot go as it exits after the close: until then a new load finds it in memory)
    wait_for(lambda: not saver_pids(os.environ["FLASHCKPT_RUNTIME_DIR"]), 60, "the saver to exit after finalize()")
    assert os.path.exists(os.path.join(local, "iter_0000010", "mp_rank_00", "model_optim_rng.pt"))
    for source in ("local", "storage"):
        fresh = torch.nn.Linear(4, 3)
        try:
            assert lm.load_checkpoint([fresh], None, None) == (10, 111)
            assert lm.get_checkpointer(root).last_load.source == source
        finally:
            lm.finalize()
        assert torch.equal(fresh.weight, torch.full((3, 4), 1.5))
        assert (mod.ARGS.load, mod.ARGS.ckpt_step) == (root, None)  # restored after the call
        _wipe(local)
