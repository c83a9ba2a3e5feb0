"""``flashckpt export`` (issue #34), run as a real subprocess of the command line, on checkpoints written by
the real frameworks under flashckpt's adapters, each export read back with the reader a user would use
(``safetensors.torch.load_file`` per shard through the index, ``from_pretrained``, ``torch.load``) and
compared tensor by tensor with the state that was saved:

- the HF Trainer (a tiny GPT-2 built from config, trained a few steps by ``FlashCkptTrainer``): sharded
  safetensors with their index and the model's config, which vanilla ``AutoModelForCausalLM`` loads;
- FSDP2 on 2 gloo ranks (``FsdpShardCheckpointer``, DCP files): one torch file and safetensors;
- DeepSpeed ZeRO-2 on 1 rank (CPU): the fp32 weights ``zero_to_fp32`` puts together;
- the engine's own file (``CheckpointEngine.save``) and a snapshot in memory held by the saver;
- bad input: exit 2, one line, the checkpoint untouched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("huggingface_hub")

from safetensors.torch import load_file  # noqa: E402


# ------------------------------------------------------------------------------------------ helpers
def export(*args: str) -> subprocess.CompletedProcess[str]:
    """``flashckpt export ARGS`` in a subprocess (stderr is a pipe, so no progress bar)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "flashckpt.cli", "export", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def exported_ok(*args: str) -> str:
    r = export(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def read_safetensors(out: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors export: through its index when sharded, each shard with load_file."""
    index = os.path.join(out, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_file(os.path.join(out, "model.safetensors"))
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    got: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        part = load_file(os.path.join(out, shard))
        assert {k for k, v in weight_map.items() if v == shard} == set(part), shard
        got.update(part)
    return got


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def tree_files(d: str) -> dict[str, int]:
    """name -> size of every file under ``d`` (to check that an export never touches the checkpoint)."""
    return {os.path.relpath(os.path.join(r, n), d): os.path.getsize(os.path.join(r, n))
            for r, _ds, ns in os.walk(d) for n in ns}


def engine_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"layer.weight": torch.randn(16, 8, generator=g), "layer.bias": torch.randn(16, generator=g),
                      "emb": torch.randn(10, 4, generator=g).to(torch.bfloat16), "steps": torch.tensor(7)},
            "optimizer": {"lr": 0.1, "exp_avg": torch.randn(16, generator=g)}, "epoch": 3}


# ------------------------------------------------------------------------------------------ the engine
def test_engine_file_and_memory_snapshot_export(make_engine, ckpt_dir, tmp_path):
    """A state dict saved by the engine exports its ``model`` (the default key) to safetensors and to one torch
    file; ``--key ''`` exports the whole state; a newer snapshot held only in memory exports with
    ``--from-memory`` while the engine holds it."""
    eng = make_engine()
    eng.save(1, engine_state(1), storage_type=_storage("DISK"))
    eng.wait(60)
    eng.save(2, engine_state(2), storage_type=_storage("MEMORY"))
    try:
        before = tree_files(ckpt_dir)
        out = str(tmp_path / "st")
        line = exported_ok(ckpt_dir, out)
        assert "step 1 (engine, from storage)" in line and "4 tensors of 'model'" in line
        assert_same(read_safetensors(out), engine_state(1)["model"])

        pt = str(tmp_path / "model.pt")
        exported_ok(ckpt_dir, pt, "--format", "torch", "--step", "1", "--strip-prefix", "layer.")
        want = {k.removeprefix("layer."): v for k, v in engine_state(1)["model"].items()}
        assert_same(torch.load(pt, weights_only=True), want)

        whole = str(tmp_path / "whole")
        r = export(ckpt_dir, whole, "--key", "")
        assert r.returncode == 0, r.stderr
        assert "left out 2 non-tensor values" in r.stderr  # optimizer.lr and epoch: safetensors holds tensors
        want_whole = {**{f"model.{k}": v for k, v in engine_state(1)["model"].items()},
                      "optimizer.exp_avg": engine_state(1)["optimizer"]["exp_avg"]}
        assert_same(read_safetensors(whole), want_whole)

        mem = str(tmp_path / "mem")
        line = exported_ok(ckpt_dir, mem, "--from-memory")
        assert "step 2 (engine, from memory)" in line
        assert_same(read_safetensors(mem), engine_state(2)["model"])
        assert tree_files(ckpt_dir) == before  # only read
    finally:
        eng.close()


def _storage(name: str):
    from flashckpt import StorageType

    return getattr(StorageType, name)


def test_bad_input_is_one_line_and_exit_2(make_engine, ckpt_dir, tmp_path):
    """No such step, an output that exists, a bad shard size or key, a dir with nothing committed, and a
    snapshot memory does not hold: exit 2 with one line on stderr, nothing written, the checkpoint
    untouched."""
    empty = str(tmp_path / "empty")
    os.mkdir(empty)
    r = export(empty, str(tmp_path / "o0"))
    assert r.returncode == 2 and "holds no committed step" in r.stderr and len(r.stderr.splitlines()) == 1
    eng = make_engine()
    eng.save(1, engine_state(1), storage_type=_storage("DISK"))
    eng.wait(60)
    eng.close()
    before = tree_files(ckpt_dir)
    exists = str(tmp_path / "exists")
    os.mkdir(exists)
    cases = [((ckpt_dir, str(tmp_path / "o1"), "--step", "5"), "step 5 is not committed"),
             ((ckpt_dir, exists), "exists"),
             ((ckpt_dir, str(tmp_path / "o2"), "--max-shard-size", "lots"), "max_shard_size 'lots'"),
             ((ckpt_dir, str(tmp_path / "o3"), "--key", "decoder"), "holds no 'decoder'"),
             ((ckpt_dir, str(tmp_path / "no" / "o4")), "is not a directory"),
             ((ckpt_dir, str(tmp_path / "o5"), "--from-memory", "--step", "9"), "holds no snapshot of step 9")]
    for args, says in cases:
        r = export(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert r.stderr.startswith("flashckpt export: ")
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", "empty", "exists"] + [n for n in os.listdir(tmp_path)
                                                                              if n.startswith(".")])
    assert tree_files(ckpt_dir) == before


# ------------------------------------------------------------------------------------------ HF Trainer
def test_hf_trainer_checkpoint_to_sharded_safetensors_that_from_pretrained_loads(tmp_path, monkeypatch):
    """A tiny GPT-2 trained 3 steps by FlashCkptTrainer (the last step committed to storage) exports to
    several safetensors shards with their index and the model's config; every shard read with load_file
    and the vanilla ``AutoModelForCausalLM.from_pretrained(OUT)`` hold the trained weights bit for bit."""
    pytest.importorskip("transformers")
    from test_hf import make_trainer, weights

    # Accelerate's CUDA probe may leave PYTORCH_NVML_BASED_CUDA_CHECK set (as test_hf's _hf_env says)
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")
    from transformers import AutoModelForCausalLM, TrainerCallback

    run = str(tmp_path / "run")
    seen: dict = {"line": ""}

    class _ExportFromMemory(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step == 2:
                seen["step2"] = weights(model)
            elif state.global_step == 3:
                seen["line"] = exported_ok(run, str(tmp_path / "from-memory"), "--from-memory")

    trainer = make_trainer(run, max_steps=3, save_steps=3, callbacks=[_ExportFromMemory()])
    trainer.train()
    trained = weights(trainer.model)
    before = tree_files(run)
    out = str(tmp_path / "export")
    line = exported_ok(run, out, "--max-shard-size", "20KB")
    assert "step 3 (hf, from storage)" in line
    shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", shards
    assert {"model.safetensors.index.json", "config.json"} <= set(os.listdir(out))
    got = read_safetensors(out)
    assert set(trained) - set(got) == {"lm_head.weight"}  # tied to the token embedding: saved once, as HF does
    assert_same(got, {k: v for k, v in trained.items() if k in got})
    vanilla = AutoModelForCausalLM.from_pretrained(out)
    assert_same(weights(vanilla), trained)
    assert tree_files(run) == before
    # The Trainer's snapshot in memory while it trains (a set of files, laid out as the Trainer writes them):
    # exported at step 3's end, before step 3's save, it is step 2's (train() ends by closing the engine).
    mem = str(tmp_path / "from-memory")
    assert seen["line"] and "step 2" in seen["line"] and "memory" in seen["line"], seen
    assert_same(read_safetensors(mem), {k: v for k, v in seen["step2"].items() if k in got})


# ------------------------------------------------------------------------------------------ FSDP / DCP
def fsdp_worker(ckpt_dir: str, full_path: str) -> dict:
    """2 ranks of FSDP2 (test_fsdp's model) train 2 steps and persist step 2 with FsdpShardCheckpointer
    (DCP files); rank 0 writes the unsharded model state of step 2 to ``full_path``."""
    import torch.distributed as dist
    from flashckpt.integrations.fsdp import FsdpShardCheckpointer, StorageType
    from test_fsdp import build, full_state, state, train_step

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(world)
    ckpt = FsdpShardCheckpointer(ckpt_dir)
    try:
        for step in (1, 2):
            train_step(model, opt, step, rank)
        ckpt.save_checkpoint(2, {**state(model, opt), "step": 2}, "step_2", storage_type=StorageType.DISK)
        ckpt.wait_latest_checkpoint(120)
        full = full_state(model, opt)
        if rank == 0:
            torch.save(full["model"], full_path)
        dist.barrier()
    finally:
        ckpt.close()
    return {}


def test_fsdp_dcp_step_to_torch_file_and_safetensors(tmp_path, runtime_dir):
    """A step FSDP2 persisted as DCP files by 2 ranks, consolidated by PyTorch's own reader: one torch file
    and safetensors, both equal to the unsharded model state the ranks gathered."""
    pytest.importorskip("torch.distributed.fsdp")
    from helpers import run_ranks

    ckpt, full = str(tmp_path / "ckpt"), str(tmp_path / "full.pt")
    run_ranks(fsdp_worker, 2, str(tmp_path / "work"), args={"ckpt_dir": ckpt, "full_path": full})
    want = torch.load(full, weights_only=True)
    assert sorted(n for n in os.listdir(os.path.join(ckpt, "step_2")) if n.endswith(".distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]
    pt = str(tmp_path / "model.pt")
    assert "step 2 (dcp, from storage)" in exported_ok(ckpt, pt, "--format", "torch")
    assert_same(torch.load(pt, weights_only=True), want)
    out = str(tmp_path / "st")
    exported_ok(ckpt, out)
    assert_same(read_safetensors(out), want)


# ------------------------------------------------------------------------------------------ DeepSpeed
def deepspeed_worker(ckpt_dir: str, fp32_path: str) -> dict:
    """1 rank of DeepSpeed ZeRO-2 on the CPU (test_deepspeed's model) trains 2 steps and persists
    ``global_step2`` with DeepSpeedCheckpointer; writes the engine's fp32 weights to ``fp32_path``."""
    from flashckpt.integrations.deepspeed import DeepSpeedCheckpointer
    from test_deepspeed import _engine, _train

    engine = _engine("zero2")
    with DeepSpeedCheckpointer(engine, ckpt_dir) as ck:
        _train(engine, 1, 2)
        ck.save_checkpoint(ckpt_dir)
        ck.wait(60)
    torch.save({k: v.detach().clone() for k, v in engine.module.state_dict().items()}, fp32_path)
    return {}


def test_deepspeed_zero_step_exports_the_fp32_weights(tmp_path, runtime_dir):
    """A ZeRO-2 tag exports the fp32 weights DeepSpeed's zero_to_fp32 puts together from its partitions:
    equal to the engine's weights."""
    pytest.importorskip("deepspeed")
    from helpers import run_ranks

    ckpt, fp32 = str(tmp_path / "ckpt"), str(tmp_path / "fp32.pt")
    os.makedirs(ckpt)
    run_ranks(deepspeed_worker, 1, str(tmp_path / "work"), args={"ckpt_dir": ckpt, "fp32_path": fp32},
              env={"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"})
    want = torch.load(fp32, weights_only=True)
    assert any(n.startswith("zero_pp_rank_0") for n in os.listdir(os.path.join(ckpt, "global_step2")))
    out = str(tmp_path / "st")
    assert "step 2 (deepspeed, from storage)" in exported_ok(ckpt, out)
    assert_same(read_safetensors(out), want)


# ------------------------------------------------------------------------------------------ megatron-core
def megatron_worker(root: str, ref: str) -> dict:
    """1 rank of megatron-core (test_megatron's GPT) saves iteration 5 through flashckpt's ``torch_dist``
    strategy (MegatronCheckpointer) and, for reference, with megatron-core's own save into ``ref``."""
    from flashckpt.patches.megatron.dist_ckpt import MegatronCheckpointer, iteration_dir
    from megatron.core import dist_checkpointing
    from test_megatron import _model, _setup, _state

    _setup()
    ck = MegatronCheckpointer(root)
    try:
        model = _model(5)
        path = iteration_dir(root, 5)
        os.makedirs(path)
        dist_checkpointing.save(_state(model, 5), path, sharded_strategy=ck.save_strategy())
        ck.wait(60)
        os.makedirs(ref)
        dist_checkpointing.save(_state(model, 5), ref)
    finally:
        ck.close()
    return {}


def test_megatron_core_torch_dist_iteration_exports_what_pytorchs_consolidation_gives(tmp_path, runtime_dir):
    """An iteration megatron-core saved in its ``torch_dist`` format through flashckpt exports, to one torch
    file and to safetensors, exactly the tensors PyTorch's own consolidation (``dcp_to_torch_save``) gives of
    megatron-core's vanilla save of the same state."""
    pytest.importorskip("megatron.core")
    from helpers import run_ranks
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt, ref = str(tmp_path / "ckpt"), str(tmp_path / "ref")
    run_ranks(megatron_worker, 1, str(tmp_path / "work"), args={"root": ckpt, "ref": ref})
    dcp_to_torch_save(ref, str(tmp_path / "ref.pt"))
    whole = torch.load(str(tmp_path / "ref.pt"), weights_only=False)
    want = {k: v for k, v in whole.items() if isinstance(v, torch.Tensor)}  # the model's weights, by megatron key
    assert len(want) > 10 and all(k.startswith(("decoder.", "embedding.", "output_layer.")) for k in want), sorted(whole)
    pt = str(tmp_path / "model.pt")
    exported_ok(ckpt, pt, "--format", "torch")
    got = torch.load(pt, weights_only=True)
    assert_same({k: v for k, v in got.items() if isinstance(v, torch.Tensor)}, want)
    out = str(tmp_path / "st")
    exported_ok(ckpt, out)
    st = read_safetensors(out)
    # every tensor of the state, flattened: the model's, and the test's per-rank object (a ShardedObject)
    assert {k for k in st if k not in want} == {"rank_state/shard_0_1.0.noise"}, sorted(st)
    assert_same({k: v for k, v in st.items() if k in want}, want)
