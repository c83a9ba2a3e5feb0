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
