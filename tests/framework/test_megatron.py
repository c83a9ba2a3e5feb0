"""flashckpt.patches.megatron on megatron-core 0.16.1: a tiny ``GPTModel`` (local layer spec,
``use_cpu_initialization=True``, tensor/pipeline parallel 1) on 1 and 2 gloo ranks, in real rank processes.

- ``sharded_state_dict()`` (plus a per-rank ``ShardedObject`` and common values) saved to storage and to
  memory; the ranks exit keeping their snapshots; restarted ranks load from memory (2 ranks: rank 1's
  replicas come from rank 0's snapshot) and get identical weights; vanilla ``dist_checkpointing.load``
  reads the persisted iteration; Megatron-LM's tracker names only committed iterations.
- ``FlashCkptSaveStrategy`` as ``sharded_strategy`` of vanilla ``dist_checkpointing.save``: the files
  have the names, sizes and DCP metadata of vanilla megatron-core's own save of the same state.
- kill -9 after a memory-only iteration: the saver's last words commit it and only then move the tracker.
- Bad input is refused before anything is written.
- ``torch_save_parts`` (the legacy ``model_optim_rng.pt`` path) against ``torch.save``.
- megatron-core's distributed optimizer (``examples/megatron_train.py --distributed-optimizer``: its
  ``DistributedDataParallel`` and ``get_megatron_optimizer(use_distributed_optimizer=True)``, 2 ranks), its
  sharded state (``dp_reshardable``: each rank saves its own shard of Adam's state) through ``save``: the
  whole job killed with SIGKILL after a memory-only iteration; restarted ranks load it from memory with
  each rank's optimizer shard and the weights bit for bit, and train on to the weights of an uninterrupted
  run; vanilla ``dist_checkpointing.load`` of the persisted iteration (and of the last words' one) gives
  the same.
- Megatron-LM itself (not on PyPI, not installed): ``save_checkpoint``/``load_checkpoint`` raise a clear
  ImportError here; around a stand-in of Megatron-LM's checkpointing module (its legacy-format I/O calls,
  see ``_STANDIN``) they route the files, write the tracker at commit only and load from memory. With
  ``MEGATRON_LM_PATH`` pointing to a Megatron-LM checkout of core_v0.16.1, one more test runs the real
  module (torch_dist and legacy formats, 1 and 2 ranks) with stand-ins for what cannot run on a CPU (see
  ``lm_worker``); it is skipped otherwise.

Shims (tests only): megatron-core calls CUDA-only functions on its save path that a CPU cannot answer
(``torch.cuda.synchronize`` in ``preload_tensors`` and ``torch.cuda.current_device`` in its DCP
finalize, used by the vanilla saves compared against here); ``_shim_cuda`` makes them CPU no-ops in the
rank processes. flashckpt's own save and load paths call neither. The distributed optimizer's tests run
megatron-core's DDP and optimizer under the example's ``cuda_calls_on_cpu``: they allocate their buffers
on ``torch.cuda.current_device()``, make scalars with ``device='cuda'`` and check
``param.type() == 'torch.cuda.FloatTensor'``, CUDA calls with no CPU meaning here; the shims map them to
the CPU and leave the arithmetic and the collectives (gloo's reduce-scatter and all-gather) as they are.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import signal

import pytest
import torch
from helpers import launch_ranks, run_ranks, wait_for

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.multiproc

ENV = {"PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
# Ranks that exit keeping their snapshots for a restart: the saver keeps them this long (starting the
# restarted ranks, megatron-core's import included, takes a while on a busy machine).
KEEP_ENV = {**ENV, "FLASHCKPT_SAVER_GRACE_S": "180"}
TRACKER = "latest_checkpointed_iteration.txt"


# ------------------------------------------------------------------------------------------ rank side
def _shim_cuda() -> None:
    """megatron-core's CUDA-only calls on the vanilla save path, as CPU no-ops (tests only)."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def _setup() -> None:
    _shim_cuda()
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def _model(seed: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            pipeline_dtype=torch.float32)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                    max_sequence_length=16)


def _train(model, step: int) -> None:
    """A deterministic change of every weight (stands in for an optimizer step)."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=0.1)


def _digest(model) -> dict[str, str]:
    out = {}
    for k, v in model.state_dict().items():
        if isinstance(v, torch.Tensor):
            out[k] = hashlib.sha256(v.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def _state(model, step: int | None):
    """What a training loop saves: the model's shards, a per-rank object and common values."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import ShardedObject

    rank, world = dist.get_rank(), dist.get_world_size()
    obj = {"rank": rank, "step": step, "noise": torch.full((3,), float(rank))} if step is not None else None
    sd = {"model": model.sharded_state_dict(),
          "rank_state": ShardedObject("rank_state", obj, (world,), (rank,), replica_id=0)}
    if step is not None:
        sd.update(iteration=step, note=f"iteration {step}")
    return sd


def _tracker(root: str) -> str | None:
    try:
        with open(os.path.join(root, TRACKER)) as f:
            return f.read()
    except OSError:
        return None


def _save_iterations(root: str):
    """Iteration 10 to storage, 20 to memory only (the model changes right after each save returns)."""
    import torch.distributed as dist
    from flashckpt.patches.megatron.dist_ckpt import MegatronCheckpointer, StorageType, iteration_dir, save

    _setup()
    ck = MegatronCheckpointer(root)
    model = _model(1)
    out: dict = {}
    _train(model, 10)
    save(_state(model, 10), iteration_dir(root, 10), checkpointer=ck, step=10, storage_type=StorageType.DISK,
         tracker=True)
    out["digest10"] = _digest(model)
    ck.wait(60)
    dist.barrier()
    out["tracker_after_10"] = _tracker(root)
    _train(model, 20)
    save(_state(model, 20), iteration_dir(root, 20), checkpointer=ck, step=20, storage_type=StorageType.MEMORY,
         tracker=True)
    out["digest20"] = _digest(model)
    _train(model, 21)  # the snapshot holds iteration 20, not what the model becomes after save returns
    ck.wait(60)
    dist.barrier()
    out["tracker_after_20"] = _tracker(root)
    out["iter20_on_disk"] = os.path.exists(iteration_dir(root, 20))
    return ck, out


def save_worker(root: str) -> dict:
    """Saves, then exits keeping the snapshots (a planned restart follows)."""
    ck, out = _save_iterations(root)
    ck.close(release=False)
    return out


def crash_worker(root: str, ready: str) -> None:
    """Saves, reports, and waits to be killed with SIGKILL."""
    import threading

    _, out = _save_iterations(root)
    with open(ready + ".tmp", "w") as f:
        json.dump(out, f)
    os.rename(ready + ".tmp", ready)
    threading.Event().wait(120)


def restart_worker(root: str) -> dict:
    """Fresh processes: load from memory (newest, iteration 20), then vanilla megatron-core loads of the
    persisted iteration 10."""
    import torch.distributed as dist
    from flashckpt.patches.megatron.dist_ckpt import MegatronCheckpointer, iteration_dir, load
    from megatron.core import dist_checkpointing

    _setup()
    rank = dist.get_rank()
    ck = MegatronCheckpointer(root)
    out: dict = {}
    try:
        model = _model(2)
        loaded = load(_state(model, None), checkpointer=ck)
        out["source"] = [ck.last_load.source, ck.last_load.step]
        model.load_state_dict(loaded["model"])
        out["digest_memory"] = _digest(model)
        obj = loaded["rank_state"]
        out["object"] = [obj["rank"] == rank, obj["step"], obj["noise"].tolist()]
        out["common"] = [loaded["iteration"], loaded["note"]]
        vanilla = _model(3)
        sd = dist_checkpointing.load(_state(vanilla, None), iteration_dir(root, 10))
        vanilla.load_state_dict(sd["model"])
        out["digest_vanilla10"] = _digest(vanilla)
        out["vanilla_common"] = [sd["iteration"], sd["rank_state"]["step"]]
        if os.path.exists(os.path.join(iteration_dir(root, 20), ".metadata")):
            vanilla = _model(4)
            vanilla.load_state_dict(dist_checkpointing.load(_state(vanilla, None), iteration_dir(root, 20))["model"])
            out["digest_vanilla20"] = _digest(vanilla)
    finally:
        ck.close(release=True)
    return out


def _check_saved(saved: list[dict], root: str, world: int) -> None:
    for r in saved:
        assert r["tracker_after_10"] == "10"
        assert r["tracker_after_20"] == "10", "the tracker moved to a memory-only (uncommitted) iteration"
        assert r["iter20_on_disk"] is False
    files = sorted(os.listdir(os.path.join(root, "iter_0000010")))
    data = [f"__{r}_{i}.distcp" for r in range(world) for i in range(2)]
    assert set(files) - set(data) == {".metadata", "common.pt", "metadata.json"}
    assert "__0_0.distcp" in files and "__0_1.distcp" in files
    with open(os.path.join(root, "iter_0000010", "metadata.json")) as f:
        assert json.load(f)["sharded_backend"] == "torch_dist"
    # (iter_0000020 may appear by now: the saver persists a vanished trainer's newest snapshot as last words)


def _check_loaded(saved: list[dict], loaded: list[dict]) -> None:
    for rank, (s, r) in enumerate(zip(saved, loaded)):
        assert r["source"] == ["memory", 20]
        assert r["digest_memory"] == s["digest20"]
        assert r["object"] == [True, 20, [float(rank)] * 3]
        assert r["common"] == [20, "iteration 20"]
        assert r["digest_vanilla10"] == s["digest10"]
        assert r["vanilla_common"] == [10, 10]
        assert r.get("digest_vanilla20", s["digest20"]) == s["digest20"]
    assert saved[0]["digest20"] == saved[-1]["digest20"]  # replicas: rank 1 got rank 0's shards


def test_two_ranks_memory_and_storage_roundtrip(tmp_path):
    """2 ranks (data-parallel replicas: rank 0 holds the model's shards, rank 1 its own object): both
    exit keeping their snapshots; restarted, both load iteration 20 from memory."""
    root = str(tmp_path / "ckpt")
    saved = run_ranks(save_worker, 2, str(tmp_path / "save"), args={"root": root}, env=KEEP_ENV)
    _check_saved(saved, root, 2)
    loaded = run_ranks(restart_worker, 2, str(tmp_path / "restart"), args={"root": root}, env=ENV)
    _check_loaded(saved, loaded)


def vanilla_strategy_worker(root: str, ref: str) -> dict:
    """Vanilla ``dist_checkpointing.save`` with our strategy, against vanilla megatron-core's own save."""
    import pickle

    from flashckpt.patches.megatron.dist_ckpt import MegatronCheckpointer, iteration_dir, load
    from megatron.core import dist_checkpointing

    _setup()
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("megatron.core.dist_checkpointing").addHandler(Keep(logging.INFO))
    logging.getLogger("megatron.core.dist_checkpointing").setLevel(logging.INFO)
    ck = MegatronCheckpointer(root)
    out: dict = {"said": said}
    try:
        model = _model(5)
        path = iteration_dir(root, 5)
        os.makedirs(path)  # vanilla save needs the directory (and writes common.pt/metadata.json into it)
        dist_checkpointing.save(_state(model, 5), path, sharded_strategy=ck.save_strategy())
        ck.wait(60)
        os.makedirs(ref)
        dist_checkpointing.save(_state(model, 5), ref)
        ours = {f: os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)}
        theirs = {f: os.path.getsize(os.path.join(ref, f)) for f in os.listdir(ref)}
        out["same_files"] = sorted(ours) == sorted(theirs)
        out["same_sizes"] = {f: ours[f] == theirs[f] for f in ours if f.endswith(".distcp")}
        with open(os.path.join(path, ".metadata"), "rb") as f:
            a = pickle.load(f)
        with open(os.path.join(ref, ".metadata"), "rb") as f:
            b = pickle.load(f)
        out["same_metadata"] = [a.storage_data == b.storage_data, a.state_dict_metadata == b.state_dict_metadata]
        with open(os.path.join(path, "metadata.json"), "rb") as f, open(os.path.join(ref, "metadata.json"), "rb") as g:
            out["same_config"] = f.read() == g.read()
        check = _model(6)
        sd = dist_checkpointing.load(_state(check, None), path)
        check.load_state_dict(sd["model"])
        out["vanilla_load"] = _digest(check) == _digest(model)
        again = _model(7)
        sd = load(_state(again, None), checkpointer=ck)
        again.load_state_dict(sd["model"])
        out["memory_load"] = [ck.last_load.source, ck.last_load.step, _digest(again) == _digest(model), sd["iteration"]]
    finally:
        ck.close()
    return out


def test_strategy_in_vanilla_save_matches_megatron_layout(tmp_path):
    (r,) = run_ranks(vanilla_strategy_worker, 1, str(tmp_path / "w"),
                     args={"root": str(tmp_path / "ckpt"), "ref": str(tmp_path / "ref")}, env=ENV)
    assert r["same_files"] and all(r["same_sizes"].values()) and r["same_sizes"]
    assert r["same_metadata"] == [True, True]
    assert r["same_config"]
    assert r["vanilla_load"]
    assert r["memory_load"] == ["memory", 5, True, 5]
    assert [m for m in r["said"] if m.startswith("flashckpt: checkpoint of step 5:")], r["said"]  # Megatron's log


def test_one_rank_kill9_last_words_then_restart_from_memory(tmp_path):
    """1 rank, killed with SIGKILL after the memory-only iteration 20: the saver's last words persist and
    commit it, and only then move the tracker; the restarted rank loads iteration 20 from memory."""
    root = str(tmp_path / "ckpt")
    ready = str(tmp_path / "ready.json")
    group = launch_ranks(crash_worker, 1, str(tmp_path / "crash"), args={"root": root, "ready": ready},
                         env=KEEP_ENV)
    try:
        wait_for(lambda: os.path.exists(ready) or group.procs[0].poll() is not None, 180, "the trainer to save")
        assert os.path.exists(ready), group.logs()
    finally:
        group.kill()
    assert group.procs[0].returncode == -signal.SIGKILL
    with open(ready) as f:
        saved = [json.load(f)]
    _check_saved(saved, root, 1)
    wait_for(lambda: _tracker(root) == "20", 60, "the last-words commit of iteration 20 to move the tracker")
    assert os.path.exists(os.path.join(root, "iter_0000020", ".metadata"))
    loaded = run_ranks(restart_worker, 1, str(tmp_path / "restart"), args={"root": root}, env=ENV)
    assert "digest_vanilla20" in loaded[0]
    _check_loaded(saved, loaded)


# ------------------------------------------------------------------------------------------ distributed optimizer
DISTOPT_ITERS = 16  # iteration 10 persisted, 13 the newest snapshot when the job is killed


def _example():
    """examples/megatron_train.py as a module: the model, megatron-core's DDP + distributed optimizer, the
    training step and the state it saves, exactly as the example trains."""
    import importlib
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))
    return importlib.import_module("megatron_train")


def _distopt(mt):
    model = mt.build_model()
    ddp, opt = mt.build_distributed_optimizer(model)
    return model, ddp, opt


def _optim_digest(opt) -> str:
    """This rank's shard of the distributed optimizer: its main parameters and Adam's state, in order."""
    h = hashlib.sha256()
    for o in opt.chained_optimizers:
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                for k, v in [("param", p), *sorted(o.optimizer.state[p].items())]:  # (Adam's step: 0-dim)
                    h.update(k.encode() + v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _resume_distopt(mt, root: str, out: dict):
    """A fresh model with megatron-core's distributed optimizer, loaded through flashckpt (memory first):
    (model, ddp, optimizer, the iteration loaded); ``out["source"]`` says from where and which step."""
    from flashckpt.patches.megatron.dist_ckpt import MegatronCheckpointer, load

    ck = MegatronCheckpointer(root)
    try:
        model, ddp, opt = _distopt(mt)
        state = load(mt.training_state(model, opt, ddp, None), checkpointer=ck)
        out["source"] = [ck.last_load.source, ck.last_load.step]
        return model, ddp, opt, mt.load_training_state(model, opt, ddp, state)
    finally:
        ck.close(release=True)


def _train_to(mt, model, ddp, opt, start: int, end: int) -> None:
    import torch.distributed as dist

    for it in range(start, end + 1):
        mt.train_step(model, opt, ddp, it, dist.get_rank(), dist.get_world_size())


def distopt_crash_worker(root: str, ready: str) -> None:
    """Trains with the distributed optimizer: a memory snapshot every iteration, iteration 10 persisted;
    reports (``<ready>.<rank>``) after iteration 13 and waits to be killed."""
    import threading

    import torch.distributed as dist
    from flashckpt.patches.megatron.dist_ckpt import MegatronCheckpointer, StorageType, iteration_dir, save

    _setup()
    mt = _example()
    model, ddp, opt = _distopt(mt)
    ck = MegatronCheckpointer(root)
    out: dict = {}
    for it in range(1, 14):
        _train_to(mt, model, ddp, opt, it, it)
        save(mt.training_state(model, opt, ddp, it), iteration_dir(root, it), checkpointer=ck, step=it,
             storage_type=StorageType.DISK if it == 10 else StorageType.MEMORY, tracker=True)
        if it == 10:
            ck.wait(60)
            out["tracker10"] = _tracker(root)
    out["digest13"] = mt.digest(model)
    out["optim13"] = _optim_digest(opt)
    ready = f"{ready}.{dist.get_rank()}"
    with open(ready + ".tmp", "w") as f:
        json.dump(out, f)
    os.rename(ready + ".tmp", ready)
    threading.Event().wait(120)


def distopt_resume_worker(root: str) -> dict:
    """Fresh ranks: load from memory (iteration 13) and train on; vanilla megatron-core loads of the
    persisted iterations; an uninterrupted run of the same training."""
    from flashckpt.patches.megatron.dist_ckpt import iteration_dir
    from megatron.core import dist_checkpointing

    _setup()
    mt = _example()
    out: dict = {}
    model, ddp, opt, loaded = _resume_distopt(mt, root, out)
    out["loaded"] = [loaded, mt.digest(model), _optim_digest(opt)]
    _train_to(mt, model, ddp, opt, loaded + 1, DISTOPT_ITERS)
    out["resumed"] = mt.digest(model)
    for it in (13, 10):  # vanilla megatron-core, from the files (13: the last words' commit)
        model, ddp, opt = _distopt(mt)
        sd = dist_checkpointing.load(mt.training_state(model, opt, ddp, None), iteration_dir(root, it))
        assert mt.load_training_state(model, opt, ddp, sd) == it
        out[f"vanilla{it}"] = [mt.digest(model), _optim_digest(opt)]
        if it == 10:
            _train_to(mt, model, ddp, opt, 11, DISTOPT_ITERS)
            out["vanilla10_trained"] = mt.digest(model)
    model, ddp, opt = _distopt(mt)
    _train_to(mt, model, ddp, opt, 1, DISTOPT_ITERS)
    out["uninterrupted"] = mt.digest(model)
    return out


def test_distributed_optimizer_job_killed_resumes_from_memory_bit_exact(tmp_path):
    """megatron-core's distributed optimizer, 2 ranks: the whole job killed (SIGKILL) after the memory-only
    iteration 13; restarted, each rank gets its own optimizer shard back from memory, and the run ends with
    the weights of an uninterrupted one; vanilla loads of the persisted iterations agree."""
    root = str(tmp_path / "ckpt")
    ready = str(tmp_path / "ready")
    group = launch_ranks(distopt_crash_worker, 2, str(tmp_path / "crash"), args={"root": root, "ready": ready},
                         env=KEEP_ENV)
    try:
        group.wait_until(lambda: all(os.path.exists(f"{ready}.{r}") for r in range(2)), 240,
                         "both ranks to save iteration 13")
    finally:
        group.kill()
    assert [p.returncode for p in group.procs] == [-signal.SIGKILL] * 2
    saved = []
    for r in range(2):
        with open(f"{ready}.{r}") as f:
            saved.append(json.load(f))
    # each rank holds (and snapshots) its own part of Adam's state: rank 0 the first half of the buffer
    assert saved[0]["optim13"] != saved[1]["optim13"]
    assert saved[0]["digest13"] == saved[1]["digest13"] and saved[0]["tracker10"] == "10"
    files = os.listdir(os.path.join(root, "iter_0000010"))
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "common.pt", "metadata.json"} <= set(files)
    import pickle

    with open(os.path.join(root, "iter_0000010", ".metadata"), "rb") as f:
        meta = pickle.load(f)
    # the optimizer's state in megatron-core's dp_reshardable layout, each rank's shard in its own files
    writers = {info.relative_path.split("_")[2] for index, info in meta.storage_data.items()
               if index.fqn.startswith("optimizer.distributed.") and index.fqn.endswith(".exp_avg_sq")}
    assert writers == {"0", "1"}, sorted(meta.state_dict_metadata)
    wait_for(lambda: _tracker(root) == "13", 60, "the last-words commit of iteration 13 to move the tracker")

    loaded = run_ranks(distopt_resume_worker, 2, str(tmp_path / "resume"), args={"root": root}, env=ENV,
                       timeout=300)
    want = loaded[0]["uninterrupted"]
    for s, r in zip(saved, loaded):
        assert r["source"] == ["memory", 13]
        assert r["loaded"] == [13, s["digest13"], s["optim13"]], "the memory load gives this rank's shard back"
        assert r["vanilla13"] == [s["digest13"], s["optim13"]]
        assert r["uninterrupted"] == want
        assert r["resumed"] == want, "the resumed run ends with the weights of an uninterrupted one"
        assert r["vanilla10_trained"] == want


# ------------------------------------------------------------------------------------------ in process
def test_bad_input_is_refused_before_anything_is_written(make_engine, ckpt_dir, tmp_path):
    from flashckpt.errors import FlashCheckpointError
    from flashckpt.patches.megatron.dist_ckpt import FlashCkptSaveStrategy, MegatronCheckpointer, StorageType, save

    ck = MegatronCheckpointer(ckpt_dir, engine=make_engine(max_to_keep=0))
    outside = str(tmp_path / "elsewhere" / "iter_0000001")
    with pytest.raises(FlashCheckpointError, match="inside the checkpointer's dir"):
        save({}, outside, checkpointer=ck, step=1)
    with pytest.raises(FlashCheckpointError, match="inside the checkpointer's dir"):
        save({}, ckpt_dir, checkpointer=ck, step=1)
    with pytest.raises(ValueError, match="integer >= 0"):
        save({}, os.path.join(ckpt_dir, "iter_0000001"), checkpointer=ck, step=-1)
    with pytest.raises(ValueError, match="StorageType"):
        save({}, os.path.join(ckpt_dir, "iter_0000001"), checkpointer=ck, step=1, storage_type="disk")
    with pytest.raises(FlashCheckpointError, match="torch_dist format only"):
        save({}, os.path.join(ckpt_dir, "iter_0000001"), ("zarr", 1), checkpointer=ck, step=1)
    with pytest.raises(FlashCheckpointError, match="pass step="):
        FlashCkptSaveStrategy(ck, storage_type=StorageType.MEMORY).save({}, os.path.join(ckpt_dir, "ckpt_a"))
    assert not os.path.exists(outside)
    assert os.listdir(ckpt_dir) == []
    assert ck.engine.memory_steps() == [] and ck.engine.committed_steps() == []
    ck.close()


def test_megatron_lm_missing_gives_a_clear_error():
    import importlib.util

    if importlib.util.find_spec("megatron.training") is not None:
        pytest.skip("Megatron-LM is importable here")
    from flashckpt.patches.megatron import load_checkpoint, save_checkpoint

    with pytest.raises(ImportError, match="Megatron-LM is not on PyPI"):
        save_checkpoint(1, [], None, None)
    with pytest.raises(ImportError, match="flashckpt.patches.megatron.dist_ckpt"):
        load_checkpoint([], None, None)


def test_torch_save_parts_is_torch_save():
    """The legacy format's files: ``torch.save`` bytes with the tensors' storages left in place."""
    import zipfile
    from argparse import Namespace

    from flashckpt.format.torchfile import load_parts, parts_size, torch_save_parts

    w = torch.randn(10, 4)
    state = {"model": {"w": w, "w_t": w.t(), "rows": w[2:4], "b": torch.arange(3).to(torch.bfloat16),
                       "empty": torch.empty(0), "mask": torch.tensor([True, False])},
             "args": Namespace(lr=0.1), "iteration": 7, "tied": [w, w[1]]}
    parts = torch_save_parts(state)
    tensors = [p for p in parts if isinstance(p, torch.Tensor)]
    assert len(tensors) == 3  # one per non-empty storage: w (and its views), b, mask
    assert any(p.data_ptr() == w.data_ptr() for p in tensors)  # no copy: the model's own storage
    raw = b"".join(p if isinstance(p, bytes) else p.numpy().tobytes() for p in parts)
    buf = io.BytesIO()
    torch.save(state, buf)
    ref = buf.getvalue()
    assert parts_size(parts) == len(raw) == len(ref)
    ours, theirs = zipfile.ZipFile(io.BytesIO(raw)), zipfile.ZipFile(io.BytesIO(ref))
    assert [(i.filename, i.header_offset, i.file_size) for i in ours.infolist()] == \
        [(i.filename, i.header_offset, i.file_size) for i in theirs.infolist()]
    for got in (torch.load(io.BytesIO(raw), weights_only=False), load_parts(parts, weights_only=False)):
        assert torch.equal(got["model"]["w_t"], w.t()) and got["model"]["w_t"].data_ptr() == got["model"]["w"].data_ptr()
        assert torch.equal(got["model"]["rows"], w[2:4]) and torch.equal(got["tied"][1], w[1])
        assert got["model"]["b"].dtype == torch.bfloat16 and got["args"] == Namespace(lr=0.1)
        assert got["iteration"] == 7 and got["model"]["empty"].numel() == 0


# ------------------------------------------------------------------------------------------ Megatron-LM
# A stand-in for Megatron-LM's checkpointing module (Megatron-LM is not installed here): the I/O calls of
# its legacy (--ckpt-format torch) path, as megatron/training/checkpointing.py of core_v0.16.1 makes them
# (names, arguments and the tracker write), around a plain model. It exercises the patch's routing in
# every run; test_megatron_lm_save_and_load_checkpoint runs the real module when a checkout is given.
_STANDIN = """
import os
import torch
from megatron.core import dist_checkpointing

ARGS = None

def get_args():
    return ARGS

def get_checkpoint_tracker_filename(checkpoints_path):
    return os.path.join(checkpoints_path, 'latest_checkpointed_iteration.txt')

def get_checkpoint_name(checkpoints_path, iteration, release=False, return_base_dir=False):
    directory = os.path.join(checkpoints_path, 'release' if release else 'iter_{:07d}'.format(iteration))
    return directory if return_base_dir else os.path.join(directory, 'mp_rank_00', 'model_optim_rng.pt')

def ensure_directory_exists(filename, check_parent=True):
    os.makedirs(os.path.dirname(filename) if check_parent else filename, exist_ok=True)

def open_file(path, mode='r'):
    return open(path, mode)

def read_metadata(tracker_filename):
    with open_file(tracker_filename, 'r') as f:
        return int(f.read().strip()), False

def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
                    checkpointing_context=None, release=False):
    args = get_args()
    checkpoint_name = get_checkpoint_name(args.save, iteration)
    ensure_directory_exists(checkpoint_name)
    torch.save({'args': args, 'iteration': iteration, 'model': model[0].state_dict(),
                'num_floating_point_operations_so_far': num_floating_point_operations_so_far}, checkpoint_name)
    with open_file(get_checkpoint_tracker_filename(args.save), 'w') as f:
        f.write(str(iteration))

def _load_base_checkpoint(load_dir, args, rank0=False, sharded_state_dict=None, checkpointing_context=None):
    tracker_filename = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker_filename):
        return None, '', False
    iteration, release = read_metadata(tracker_filename)
    checkpoint_name = get_checkpoint_name(load_dir, iteration, release)
    return torch.load(checkpoint_name, map_location='cpu'), checkpoint_name, release

def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg='load', strict=True, checkpointing_context=None):
    args = get_args()
    state_dict, checkpoint_name, release = _load_base_checkpoint(getattr(args, load_arg), args)
    if state_dict is None:
        return 0, 0
    model[0].load_state_dict(state_dict['model'], strict=strict)
    return state_dict['iteration'], state_dict['num_floating_point_operations_so_far']
"""


def test_megatron_lm_legacy_flow_through_a_stand_in(monkeypatch, tmp_path):
    """save_checkpoint/load_checkpoint around a stand-in of Megatron-LM's module (legacy format, 1 rank):
    files in Megatron-LM's layout, readable by torch.load; the tracker only for committed iterations; a
    memory-only iteration loaded back from memory through the module's _load_base_checkpoint."""
    import sys
    import types
    from argparse import Namespace

    import flashckpt.patches.megatron._lm as lm
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()  # Megatron-LM does this: its checkpoints hold an argparse.Namespace
    mod = types.ModuleType("megatron.training.checkpointing")
    exec(compile(_STANDIN, "<Megatron-LM stand-in>", "exec"), mod.__dict__)
    monkeypatch.setitem(sys.modules, "megatron.training", types.ModuleType("megatron.training"))
    monkeypatch.setitem(sys.modules, "megatron.training.checkpointing", mod)
    monkeypatch.setattr(lm, "_CHECKPOINTERS", {})
    root = str(tmp_path / "ckpt")
    mod.ARGS = Namespace(save=root, load=root, async_save=False)
    model = torch.nn.Linear(4, 3)
    try:
        with torch.no_grad():
            model.weight.fill_(1.0)
        lm.save_checkpoint(10, [model], None, None, 111, storage_type=lm.StorageType.DISK)
        lm.get_checkpointer(root).wait(60)
        name = os.path.join(root, "iter_0000010", "mp_rank_00", "model_optim_rng.pt")
        on_disk = torch.load(name, weights_only=True)
        assert torch.equal(on_disk["model"]["weight"], torch.ones(3, 4)) and on_disk["iteration"] == 10
        assert on_disk["args"].save == root
        assert _tracker(root) == "10"
        with torch.no_grad():
            model.weight.fill_(2.0)
        lm.save_checkpoint(20, [model], None, None, 222, storage_type=lm.StorageType.MEMORY)
        with torch.no_grad():
            model.weight.fill_(3.0)
        lm.get_checkpointer(root).wait(60)
        assert _tracker(root) == "10" and not os.path.exists(os.path.join(root, "iter_0000020"))
        assert "open" not in mod.__dict__ and mod.torch is torch  # the swaps are undone
        assert lm.load_checkpoint([model], None, None) == (20, 222)
        assert lm.get_checkpointer(root).engine.last_load.source == "memory"
        assert torch.equal(model.weight, torch.full((3, 4), 2.0))
        lm.save_checkpoint(30, [model], None, None, 333, storage_type=lm.StorageType.DISK)
        lm.get_checkpointer(root).wait(60)
        assert _tracker(root) == "30"
    finally:
        lm.finalize()
    assert mod.load_checkpoint([model], None, None) == (30, 333)  # Megatron-LM itself, from the files


LM_PATH = os.environ.get("MEGATRON_LM_PATH", "")


def lm_setup(lm_path: str, root: str, fmt: str) -> None:
    """Megatron-LM's arguments and parallel state in a rank process (``--save``/``--load`` ``root``), on a CPU.

    Stand-ins for what cannot run here (tests only): the triton kernels module Megatron-LM's
    ``initialize`` imports; ``torch.cuda`` RNG/cache calls; ``device='cuda'`` tensors in its
    ``read_metadata`` (made on the CPU); no optimizer (megatron-core's optimizers allocate on CUDA), so
    ``--no-save-optim``/``--no-load-optim``; no RNG state (``--no-save-rng``/``--no-load-rng``)."""
    import sys
    import types

    import torch.distributed as dist

    sys.path.insert(0, lm_path)
    kernels = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")
    kernels.enable_batch_invariant_mode = lambda *a, **k: None
    kernels.is_batch_invariant_mode_enabled = lambda: False
    sys.modules.setdefault(kernels.__name__, kernels)
    _shim_cuda()
    torch.cuda.get_rng_state = lambda *a, **k: torch.zeros(8, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    make = torch.tensor
    torch.tensor = lambda *a, device=None, **k: make(*a, device=None if device == "cuda" else device, **k)
    world = dist.get_world_size()
    sys.argv = ["train", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", str(world),
                "--save", root, "--load", root, "--ckpt-format", fmt, "--no-load-rng", "--no-save-rng",
                "--no-save-optim", "--no-load-optim", "--transformer-impl", "local", "--use-cpu-initialization",
                "--vocab-size", "64", "--lr", "1e-3", "--train-iters", "10", "--save-interval", "10",
                "--tokenizer-type", "NullTokenizer", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
                "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion"]
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_args

    args = parse_args(ignore_unknown_args=True)
    validate_args(args, {})
    set_args(args)
    init_num_microbatches_calculator(dist.get_rank(), None, args.global_batch_size, args.micro_batch_size, world)
    _setup()


def lm_worker(lm_path: str, root: str, fmt: str, phase: str) -> dict:
    """Real Megatron-LM ``save_checkpoint``/``load_checkpoint`` through the patch, on a CPU (see ``lm_setup``)."""
    import torch.distributed as dist

    lm_setup(lm_path, root, fmt)
    from flashckpt.patches.megatron import StorageType, finalize, get_checkpointer, load_checkpoint, save_checkpoint

    model = _model(1 if phase == "save" else 9)
    out: dict = {}
    if phase == "save":
        _train(model, 10)
        save_checkpoint(10, [model], None, None, 100, storage_type=StorageType.DISK)
        out["digest10"] = _digest(model)
        get_checkpointer(root).wait(60)
        dist.barrier()
        out["tracker10"] = _tracker(root)
        _train(model, 20)
        save_checkpoint(20, [model], None, None, 200, storage_type=StorageType.MEMORY)
        out["digest20"] = _digest(model)
        get_checkpointer(root).wait(60)
        dist.barrier()
        out["tracker20"] = _tracker(root)
        files = []
        for d, _, names in os.walk(os.path.join(root, "iter_0000010")):
            files += [os.path.relpath(os.path.join(d, n), root) for n in names]
        out["files"] = sorted(files)
        finalize(release=False)
    else:
        out["loaded"] = list(load_checkpoint([model], None, None))
        out["digest"] = _digest(model)
        out["source"] = get_checkpointer(root).engine.last_load.source
        finalize(release=True)
    return out


@pytest.mark.skipif(not LM_PATH, reason="set MEGATRON_LM_PATH to a Megatron-LM checkout (core_v0.16.1) to run")
@pytest.mark.parametrize("fmt,world", [("torch_dist", 2), ("torch", 2), ("torch_dist", 1)])
def test_megatron_lm_save_and_load_checkpoint(fmt, world, tmp_path):
    root = str(tmp_path / "ckpt")
    args = {"lm_path": LM_PATH, "root": root, "fmt": fmt}
    saved = run_ranks(lm_worker, world, str(tmp_path / "save"), args={**args, "phase": "save"}, env=KEEP_ENV)
    for s in saved:
        assert s["tracker10"] == "10" and s["tracker20"] == "10"
    if fmt == "torch":
        assert saved[0]["files"] == ["iter_0000010/mp_rank_00/model_optim_rng.pt"]
    else:
        assert {".metadata", "common.pt", "metadata.json", "__0_0.distcp"} <= {os.path.basename(f)
                                                                                for f in saved[0]["files"]}
    loaded = run_ranks(lm_worker, world, str(tmp_path / "load"), args={**args, "phase": "load"}, env=ENV)
    for s, r in zip(saved, loaded):
        assert r["loaded"] == [20, 200] and r["source"] == "memory"
        assert r["digest"] == s["digest20"]


# ------------------------------------------------------------------------------------------ a changed DP size
def dp_save_worker(root: str) -> dict:
    """4 ranks (data-parallel size 4) with the distributed optimizer: iterations 1-5, iteration 5 persisted
    (DISK: also the memory snapshot); the snapshots stay for the next job (close(release=False))."""
    from flashckpt.patches.megatron.dist_ckpt import MegatronCheckpointer, StorageType, iteration_dir, save

    _setup()
    mt = _example()
    model, ddp, opt = _distopt(mt)
    ck = MegatronCheckpointer(root)
    for it in range(1, 6):
        _train_to(mt, model, ddp, opt, it, it)
        save(mt.training_state(model, opt, ddp, it), iteration_dir(root, it), checkpointer=ck, step=it,
             storage_type=StorageType.DISK if it == 5 else StorageType.MEMORY, tracker=True)
    ck.wait(120)
    ck.close(release=False)
    return {"digest5": mt.digest(model)}


def dp_resume_worker(root: str) -> dict:
    """2 ranks (data-parallel size 2): the 4-rank iteration 5 through flashckpt (memory, resharded by
    megatron-core's own planner over the old ranks' snapshots), then the same iteration through vanilla
    megatron-core from storage; this rank's model and optimizer shard after each."""
    from flashckpt.patches.megatron.dist_ckpt import iteration_dir
    from megatron.core import dist_checkpointing

    _setup()
    mt = _example()
    out: dict = {}
    model, ddp, opt, loaded = _resume_distopt(mt, root, out)
    out["memory"] = [loaded, mt.digest(model), _optim_digest(opt)]
    model, ddp, opt = _distopt(mt)
    sd = dist_checkpointing.load(mt.training_state(model, opt, ddp, None), iteration_dir(root, 5))
    out["storage"] = [mt.load_training_state(model, opt, ddp, sd), mt.digest(model), _optim_digest(opt)]
    return out


def test_distributed_optimizer_data_parallel_4_to_2_resumes_from_memory_as_megatron_reshards_storage(tmp_path):
    """megatron-core's distributed optimizer (``dp_reshardable``), data-parallel size 4 -> 2 on one node: the
    2-rank job resumes iteration 5 from the 4 ranks' snapshots in memory, and gets exactly what megatron-core's
    own resharding load of the persisted iteration 5 gives each rank (model and optimizer shard)."""
    root = str(tmp_path / "ckpt")
    saved = run_ranks(dp_save_worker, 4, str(tmp_path / "save"), args={"root": root}, env=KEEP_ENV, timeout=300)
    loaded = run_ranks(dp_resume_worker, 2, str(tmp_path / "resume"), args={"root": root}, env=ENV, timeout=300)
    for r in loaded:
        assert r["source"] == ["memory", 5], r["source"]
        assert r["memory"] == r["storage"], "the memory load differs from megatron-core's load from storage"
        assert r["memory"][1] == saved[0]["digest5"]
    assert loaded[0]["memory"][2] != loaded[1]["memory"][2], "each rank holds its own optimizer shard"
