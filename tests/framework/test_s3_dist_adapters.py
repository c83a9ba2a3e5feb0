"""The DDP, FSDP/DCP, DeepSpeed and Megatron adapters with an ``s3://`` checkpoint dir: real frameworks on
tiny models, 2 gloo ranks in real processes (tests/support/helpers.py), a real S3-compatible server on loopback (moto,
tests/support/s3_fixtures.py; the rank processes, their saver and its persist worker reach it through the AWS
environment the fixture sets). 5 MiB parts, so the larger rank files are multipart uploads and are read back
in several ranged reads.

For each adapter, in one pair of rank processes:

- saves to the store (two committed steps) and a memory-only step; resumes from memory, bit for bit;
- the checkpointer closed and its saver gone (the memory released; DDP, FSDP: the close committed the
  memory-only step, as every end of an engine does), loads the newest committed step from the store, bit for
  bit;
- the framework without flashckpt reads the persisted checkpoint after a plain download (boto3): ``torch.load``
  (DDP), ``dcp.load`` with a ``FileSystemReader`` (FSDP), DeepSpeed's own ``load_checkpoint``, megatron-core's
  ``dist_checkpointing.load``;
- one rank's file of the newest step overwritten with garbage through boto3: every rank falls back to the
  previous committed step.

DeepSpeed also loads with ZeRO-3 without optimizer states (DeepSpeed reads every rank's files itself, so the
tag's files are downloaded to a scratch dir), and Megatron-LM's own ``save_checkpoint``/``load_checkpoint``
run on the URL when ``MEGATRON_LM_PATH`` names a checkout. The workers run in the rank processes and return JSON.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pytest
from helpers import run_ranks
from s3_fixtures import moto_server_fixture, s3_fixture, s3_proxied_fixture  # noqa: F401
from test_fsdp import local_digest, state, train_step  # the FSDP tests' model steps and digests

pytestmark = pytest.mark.multiproc

# No last words: a memory-only step left to the saver by close(release=False) (a restart follows) stays out
# of the store, so the loads after it find exactly the steps the workers persisted.
DS_ENV = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "FLASHCKPT_LAST_WORDS": "0"}
MEGATRON_ENV = {"PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", "FLASHCKPT_LAST_WORDS": "0"}
LM_PATH = os.environ.get("MEGATRON_LM_PATH", "")


@pytest.fixture(autouse=True)
def _small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """5 MiB parts (S3's minimum), in the rank processes and in the savers and persist workers they start."""
    monkeypatch.setenv("FLASHCKPT_S3_PART_SIZE_MB", "5")


# ------------------------------------------------------------------------------------------ rank side
def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _released() -> None:
    """Every rank closed its checkpointer: wait until the node's saver exited (the snapshots are gone)."""
    from helpers import wait_savers_gone

    _barrier()
    wait_savers_gone(os.environ["FLASHCKPT_RUNTIME_DIR"], 60)
    _barrier()


def _client() -> Any:
    from s3_fixtures import make_client

    return make_client(os.environ["AWS_ENDPOINT_URL"])


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url[len("s3://"):].partition("/")
    return bucket, key


def _keys(url: str) -> list[str]:
    """The object keys below ``url`` (a prefix), relative to it."""
    bucket, prefix = _split(url)
    c = _client()
    try:
        pages = c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix.rstrip("/") + "/")
        return sorted(o["Key"][len(prefix) + 1:] for page in pages for o in page.get("Contents", []))
    finally:
        c.close()


def _download(url: str, dest: str, names: list[str] | None = None) -> list[str]:
    """Rank 0 downloads the objects below ``url`` (or ``names`` of them) into ``dest`` with plain boto3,
    as a user would; every rank waits for it. Returns the names."""
    names = _keys(url) if names is None else names
    if _rank() == 0:
        bucket, prefix = _split(url)
        c = _client()
        try:
            for name in names:
                path = os.path.join(dest, *name.split("/"))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(c.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"].read())
        finally:
            c.close()
    _barrier()
    return names


def _damage(url: str) -> None:
    """Rank 0 overwrites the object ``url`` with garbage through boto3; every rank waits for it."""
    if _rank() == 0:
        bucket, key = _split(url)
        c = _client()
        try:
            c.head_object(Bucket=bucket, Key=key)  # it exists: the damage hits a real file of the step
            c.put_object(Bucket=bucket, Key=key, Body=b"garbage" * 1000)
        finally:
            c.close()
    _barrier()


def _source(ck: Any) -> list[Any]:
    info = ck.last_load
    return [info.source, info.step]


# ------------------------------------------------------------------------------------------ DDP
def _ddp_state(step: int) -> dict:
    """6 MiB of weights (a multipart upload with 5 MiB parts) and some plain values."""
    import torch

    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(1536, 1024, generator=g), "b": torch.randn(7, generator=g).to(torch.bfloat16)},
            "optimizer": {"lr": 0.1 * step, "betas": (0.9, 0.99)}, "step": step}


def ddp_worker(url: str, out_dir: str) -> dict:
    import torch
    from flashckpt.integrations.ddp import DdpCheckpointer, StorageType
    from helpers import tree_digest

    out: dict = {}
    want = {s: tree_digest(_ddp_state(s)) for s in (1, 2, 3)}
    ck = DdpCheckpointer(url)
    try:
        assert ck.load_checkpoint() == {} and _source(ck) == ["none", None]
        for step in (1, 2):
            ck.save_checkpoint(step, _ddp_state(step), storage_type=StorageType.DISK)
        ck.wait_latest_checkpoint(120)
        ck.save_checkpoint(3, _ddp_state(3), storage_type=StorageType.MEMORY)
        _barrier()  # (replicated: rank 0 snapshots and persists for both; rank 1 loads what rank 0 holds)
        out["memory"] = _source_after(ck, ck.load_checkpoint(), want[3])
    finally:
        ck.close()
    _released()
    with DdpCheckpointer(url) as ck:  # step 3, memory only, was committed by close()'s last words
        out["storage"] = _source_after(ck, ck.load_checkpoint(), want[3])
        out["committed"] = ck.engine.committed_steps()
    local = os.path.join(out_dir, "ddp")
    out["listed"] = _download(f"{url}/step_2", local)
    out["vanilla"] = tree_digest(torch.load(os.path.join(local, "checkpoint.pt"), weights_only=True)) == want[2]
    _damage(f"{url}/step_3/checkpoint.pt")
    with DdpCheckpointer(url) as ck:
        out["fallback"] = _source_after(ck, ck.load_checkpoint(), want[2])
    return out


def _source_after(ck: Any, loaded: Any, want: str) -> list[Any]:
    """[source, step, whether ``loaded`` is bit for bit the state whose digest is ``want``]."""
    from helpers import tree_digest

    return [*_source(ck), tree_digest(loaded) == want]


def test_ddp_on_s3(s3: Any, tmp_path: Any) -> None:
    results = run_ranks(ddp_worker, 2, str(tmp_path / "ranks"), args={"url": s3.url, "out_dir": str(tmp_path)})
    for r in results:
        assert r["memory"] == ["memory", 3, True]
        assert r["storage"] == ["storage", 3, True] and r["committed"] == [1, 2, 3]
        assert r["listed"] == ["checkpoint.pt"] and r["vanilla"] is True
        assert r["fallback"] == ["storage", 2, True]
    assert "run/step_3/checkpoint.pt" in s3.keys("run/"), "close() dropped the memory-only step"
    assert s3.multipart_uploads() == []


# ------------------------------------------------------------------------------------------ FSDP / DCP
def _fsdp_build():
    """An MLP of 1 M parameters (4 MiB, AdamW's state twice that: each rank's shard file is ~6 MiB), every
    Linear and the root sharded with fully_shard on a CPU mesh. Same seed everywhere."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(8, 1024), nn.GELU(), nn.Linear(1024, 1000), nn.GELU(), nn.Linear(1000, 5))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def fsdp_worker(url: str, out_dir: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from flashckpt.integrations.dcp import BackendStorageReader
    from flashckpt.integrations.fsdp import FsdpShardCheckpointer, StorageType
    from torch.distributed.checkpoint.state_dict import set_state_dict

    out: dict = {}
    digests: dict[int, str] = {}
    model, opt = _fsdp_build()

    def resumed(ck: Any) -> list[Any]:
        m, o = _fsdp_build()
        extra = ck.load_checkpoint(m, o)
        step = ck.last_load.step
        return [*_source(ck), extra.get("step"), step is not None and local_digest(m, o) == digests[step]]

    with FsdpShardCheckpointer(url) as ck:
        for step, kind in ((1, StorageType.DISK), (2, StorageType.DISK), (3, StorageType.MEMORY)):
            train_step(model, opt, step, _rank())
            ck.save_checkpoint(step, {**state(model, opt), "step": step}, f"step_{step}", storage_type=kind)
            digests[step] = local_digest(model, opt)
            if step == 2:
                ck.wait_latest_checkpoint(120)
        out["memory"] = resumed(ck)
    _released()
    with FsdpShardCheckpointer(url) as ck:  # step 3, memory only, was committed by the `with` block's end
        out["storage"] = resumed(ck)
        out["reader"] = type(ck.get_storage_reader()).__name__
        out["committed"] = ck.engine.committed_steps()
        # DCP's own load through our reader, straight from the store
        m, o = _fsdp_build()
        sd = {**state(m, o), "step": None}
        dcp.load(sd, storage_reader=BackendStorageReader(ck.engine.storage, f"{url}/step_1"))
        set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        out["dcp_reader"] = [sd["step"], local_digest(m, o) == digests[1]]
    local = os.path.join(out_dir, "fsdp", "step_2")
    out["listed"] = _download(f"{url}/step_2", local)
    m, o = _fsdp_build()
    sd = {**state(m, o), "step": None}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(local))  # vanilla DCP on the downloaded copy
    set_state_dict(m, o, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    out["vanilla"] = [sd["step"], local_digest(m, o) == digests[2]]
    _damage(f"{url}/step_3/__1_0.distcp")  # rank 1's file only: rank 0's verifies, yet both fall back
    with FsdpShardCheckpointer(url) as ck:
        out["fallback"] = resumed(ck)
    return out


def test_fsdp_on_s3(s3: Any, tmp_path: Any) -> None:
    results = run_ranks(fsdp_worker, 2, str(tmp_path / "ranks"), args={"url": s3.url, "out_dir": str(tmp_path)},
                        timeout=300)
    for r in results:
        assert r["memory"] == ["memory", 3, 3, True]
        assert r["storage"] == ["storage", 3, 3, True] and r["committed"] == [1, 2, 3]
        assert r["reader"] == "BackendStorageReader"
        assert r["dcp_reader"] == [1, True]
        assert r["listed"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        assert r["vanilla"] == [2, True]
        assert r["fallback"] == ["storage", 2, 2, True]
    sizes = {k: len(s3.read(k)) for k in ("run/step_1/__0_0.distcp", "run/step_1/__1_0.distcp")}
    assert all(n > 5 << 20 for n in sizes.values()), f"each rank's file should span two parts: {sizes}"
    assert s3.multipart_uploads() == []


def test_backend_storage_reader_loads_a_vanilla_dcp_checkpoint_in_few_ranged_reads(s3_proxied: Any, tmp_path: Any,
                                                                                     monkeypatch: Any) -> None:
    """In one process: DCP's own ``FileSystemWriter`` output (a hundred small records, a 6 MiB tensor, plain
    values), uploaded with boto3, loads through ``BackendStorageReader`` bit for bit, in a handful of GETs
    (records merged into ranges); with merging off, one range per record, still bit for bit; a directory
    without ``.metadata`` is a clear error."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from flashckpt.errors import CheckpointCorruptError
    from flashckpt.integrations import _dcp_store
    from flashckpt.integrations.dcp import BackendStorageReader
    from flashckpt.storage.registry import storage_for
    from helpers import assert_same_tree

    g = torch.Generator().manual_seed(7)
    sd: dict[str, Any] = {f"small.{i}": torch.randn(256, generator=g) for i in range(100)}
    sd.update(big=torch.randn(3 << 19, generator=g), half=torch.randn(64, 3, generator=g).to(torch.bfloat16),
              ids=torch.arange(1000), extra={"name": "adamw", "betas": (0.9, 0.99), "step": 12})
    local = str(tmp_path / "vanilla")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.save(sd, checkpoint_id=local)
    c = s3_proxied.client(direct=True)
    for name in os.listdir(local):
        with open(os.path.join(local, name), "rb") as f:
            c.put_object(Bucket=s3_proxied.bucket, Key=f"run/ref/{name}", Body=f.read())

    def target() -> dict[str, Any]:
        t: dict[str, Any] = {k: torch.empty_like(v) for k, v in sd.items() if isinstance(v, torch.Tensor)}
        t["extra"] = {"name": None, "betas": None, "step": None}
        return t

    storage = storage_for(s3_proxied.url)
    try:
        for merged in (True, False):
            if not merged:
                monkeypatch.setattr(_dcp_store, "MERGE_GAP", -1)
            s3_proxied.proxy.clear()
            got = target()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(got, storage_reader=BackendStorageReader(storage, f"{s3_proxied.url}/ref"))
            assert_same_tree(sd, got)
            gets = s3_proxied.proxy.counts()["GetObject"]
            if merged:  # .metadata, then the data file's ~6 MiB in 5 MiB ranges (the records of one rank)
                assert gets <= 4, s3_proxied.proxy.counts()
            else:
                assert gets > 100, gets
        with pytest.raises(CheckpointCorruptError, match="not a committed DCP checkpoint"):
            BackendStorageReader(storage, f"{s3_proxied.url}/nothing").read_metadata()
    finally:
        storage.close()


# ------------------------------------------------------------------------------------------ DeepSpeed
def _ds_engine(stage: int = 1, width: int = 1024):
    """A small MLP (``width`` 1024: 1 M parameters; ZeRO-1 optimizer files of ~6 MiB per rank), AdamW from
    torch (no FusedAdam to build)."""
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    world = torch.distributed.get_world_size()
    cfg = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * world, "steps_per_print": 10**9,
           "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _ds_train(engine, step: int) -> None:
    import torch

    g = torch.Generator().manual_seed(1000 * step + _rank())
    loss = engine(torch.randn(2, 8, generator=g)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def _ds_digest(engine, *, optimizer: bool = True) -> str:
    """sha256 of every (gathered) parameter, the step counter and (``optimizer``) every tensor of the
    optimizer's state dict: equal digests mean a bit-identical training state."""
    import deepspeed
    import torch

    h = hashlib.sha256(str(engine.global_steps).encode())
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        for p in params:
            h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    todo = [engine.optimizer.state_dict()] if optimizer else []
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            todo.extend(x[k] for k in sorted(x, key=str))
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return h.hexdigest()


def ds_worker(url: str, out_dir: str) -> dict:
    from flashckpt.integrations.deepspeed import DeepSpeedCheckpointer, StorageType

    out: dict = {}
    digests: dict[int, str] = {}

    def resumed(ck: Any, engine: Any) -> list[Any]:
        path, client = ck.load_checkpoint(url)
        step = ck.last_load.step
        return [*_source(ck), path, client["marker"], step is not None and _ds_digest(engine) == digests[step]]

    engine = _ds_engine()
    ck = DeepSpeedCheckpointer(engine, url)
    try:
        assert ck.load_checkpoint(url) == (None, None) and _source(ck) == ["none", None]
        for step, kind in ((1, StorageType.DISK), (2, StorageType.DISK), (3, StorageType.MEMORY)):
            _ds_train(engine, step)
            ck.save_checkpoint(url, client_state={"marker": step}, storage_type=kind)
            digests[step] = _ds_digest(engine)
            if step == 2:
                ck.wait(120)
    finally:
        ck.close(release=False)  # a restart follows: the saver keeps the snapshots
    fresh = _ds_engine()
    with DeepSpeedCheckpointer(fresh, url) as ck:
        out["memory"] = resumed(ck, fresh)
    _released()
    fresh = _ds_engine()
    with DeepSpeedCheckpointer(fresh, url) as ck:
        out["storage"] = resumed(ck, fresh)
        out["committed"] = ck._core.committed_steps()
    older = _ds_engine()
    with DeepSpeedCheckpointer(older, url) as ck:  # an older tag, by name
        path, client = ck.load_checkpoint(url, tag="global_step1")
        out["older"] = [*_source(ck), path, client["marker"], _ds_digest(older) == digests[1]]
    local = os.path.join(out_dir, "ds")
    names = _download(url, local, [n for n in _keys(url) if n.startswith("global_step2/") or n == "latest"])
    out["listed"] = names
    vanilla = _ds_engine()
    path, client = vanilla.load_checkpoint(local)  # DeepSpeed alone, `latest` and the tag downloaded
    out["vanilla"] = [os.path.relpath(path, local), client["marker"], _ds_digest(vanilla) == digests[2]]
    _damage(f"{url}/global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt")
    fresh = _ds_engine()
    with DeepSpeedCheckpointer(fresh, url) as ck:
        out["fallback"] = resumed(ck, fresh)
    return out


def test_deepspeed_on_s3(s3: Any, tmp_path: Any) -> None:
    results = run_ranks(ds_worker, 2, str(tmp_path / "ranks"), args={"url": s3.url, "out_dir": str(tmp_path)},
                        env=DS_ENV, timeout=420)
    model = "mp_rank_00_model_states.pt"
    for r in results:
        assert r["memory"] == ["memory", 3, f"{s3.url}/global_step3/{model}", 3, True]
        assert r["storage"] == ["storage", 2, f"{s3.url}/global_step2/{model}", 2, True]
        assert r["committed"] == [1, 2]
        assert r["older"] == ["storage", 1, f"{s3.url}/global_step1/{model}", 1, True]
        assert r["listed"] == ["global_step2/mp_rank_00_model_states.pt",
                               "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                               "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt", "latest"]
        assert r["vanilla"] == [f"global_step2/{model}", 2, True]
        assert r["fallback"] == ["storage", 1, f"{s3.url}/global_step1/{model}", 1, True]
    assert s3.read("run/latest") == b"global_step2"
    assert {"run/zero_to_fp32.py", "run/zero_to_torch.py"} <= set(s3.keys("run/"))  # DeepSpeed's scripts, as locally
    assert not any(k.startswith("run/global_step3/") for k in s3.keys("run/"))
    assert s3.multipart_uploads() == []


def ds_zero3_worker(url: str, out_dir: str) -> dict:
    """ZeRO-3: a load without optimizer states has DeepSpeed read every rank's files itself
    (``zero_to_fp32``): the tag's files are downloaded to a scratch dir, which is removed afterwards."""
    import glob
    import tempfile

    from flashckpt.integrations.deepspeed import DeepSpeedCheckpointer

    out: dict = {}
    engine = _ds_engine(stage=3, width=64)
    with DeepSpeedCheckpointer(engine, url) as ck:
        _ds_train(engine, 1)
        ck.save_checkpoint(url, client_state={"marker": 1})
        want = _ds_digest(engine, optimizer=False)
        ck.wait(120)
    _released()
    fresh = _ds_engine(stage=3, width=64)
    scratch = [tempfile.gettempdir(), "/dev/shm"]
    before = {p for d in scratch for p in glob.glob(os.path.join(d, "flashckpt-ds-*"))}
    with DeepSpeedCheckpointer(fresh, url) as ck:
        path, client = ck.load_checkpoint(url, load_optimizer_states=False)
        out["module_only"] = [*_source(ck), path, client["marker"], _ds_digest(fresh, optimizer=False) == want]
    _barrier()  # both ranks are past their loads: a scratch dir of the other rank's still in use is not counted
    after = {p for d in scratch for p in glob.glob(os.path.join(d, "flashckpt-ds-*"))}
    out["scratch_left"] = sorted(after - before)
    return out


def test_deepspeed_zero3_module_only_load_downloads_the_tag(s3: Any, tmp_path: Any) -> None:
    results = run_ranks(ds_zero3_worker, 2, str(tmp_path / "ranks"), args={"url": s3.url, "out_dir": str(tmp_path)},
                        env=DS_ENV, timeout=300)
    for rank, r in enumerate(results):
        model = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        assert r["module_only"] == ["storage", 1, f"{s3.url}/global_step1/{model}", 1, True]
        assert r["scratch_left"] == []


# ------------------------------------------------------------------------------------------ Megatron
def megatron_worker(url: str, out_dir: str) -> dict:
    """megatron-core's dist checkpointing through ``patches.megatron.dist_ckpt``: iterations 10 and 20 to
    the store (with Megatron-LM's tracker), 30 to memory."""
    from flashckpt.patches.megatron.dist_ckpt import MegatronCheckpointer, StorageType, iteration_dir, load, save
    from megatron.core import dist_checkpointing
    from test_megatron import _digest, _model, _setup, _state, _train

    _setup()
    rank = _rank()
    out: dict = {}
    digests: dict[int, dict] = {}

    def resumed(ck: Any, seed: int, checkpoint_dir: str | None = None) -> list[Any]:
        model = _model(seed)
        loaded = load(_state(model, None), checkpoint_dir, checkpointer=ck)
        model.load_state_dict(loaded["model"])
        step = ck.last_load.step if checkpoint_dir is None else loaded["iteration"]
        obj = loaded["rank_state"]
        return [*_source(ck), loaded["iteration"], obj["rank"] == rank and obj["step"] == step,
                _digest(model) == digests[step]]

    model = _model(1)
    with MegatronCheckpointer(url) as ck:
        for step, kind in ((10, StorageType.DISK), (20, StorageType.DISK), (30, StorageType.MEMORY)):
            _train(model, step)
            save(_state(model, step), iteration_dir(url, step), checkpointer=ck, step=step, storage_type=kind,
                 tracker=True)
            digests[step] = _digest(model)
            if step == 20:
                ck.wait(120)
        out["memory"] = resumed(ck, 2)
    _released()
    with MegatronCheckpointer(url) as ck:
        out["storage"] = resumed(ck, 3)
        out["by_dir"] = resumed(ck, 4, iteration_dir(url, 10))[2:]
        out["committed"] = ck.engine.committed_steps()
    local = os.path.join(out_dir, "megatron", "iter_0000020")
    out["listed"] = _download(iteration_dir(url, 20), local)
    vanilla = _model(5)
    sd = dist_checkpointing.load(_state(vanilla, None), local)  # megatron-core alone, on the download
    vanilla.load_state_dict(sd["model"])
    out["vanilla"] = [sd["iteration"], sd["rank_state"]["step"], _digest(vanilla) == digests[20]]
    theirs = [n for n in out["listed"] if n.startswith("__1_")]
    _damage(f"{iteration_dir(url, 20)}/{theirs[0]}")  # a file rank 1 wrote
    with MegatronCheckpointer(url) as ck:
        out["fallback"] = resumed(ck, 6)
    return out


def test_megatron_dist_ckpt_on_s3(s3: Any, tmp_path: Any) -> None:
    pytest.importorskip("megatron.core")
    results = run_ranks(megatron_worker, 2, str(tmp_path / "ranks"), args={"url": s3.url, "out_dir": str(tmp_path)},
                        env=MEGATRON_ENV, timeout=300)
    for r in results:
        assert r["memory"] == ["memory", 30, 30, True, True]
        assert r["storage"] == ["storage", 20, 20, True, True]
        assert r["by_dir"] == [10, True, True]
        assert r["committed"] == [10, 20]
        assert {".metadata", "common.pt", "metadata.json", "__0_0.distcp", "__1_0.distcp"} <= set(r["listed"])
        assert r["vanilla"] == [20, 20, True]
        assert r["fallback"] == ["storage", 10, 10, True, True]
    assert s3.read("run/latest_checkpointed_iteration.txt") == b"20"
    assert not any(k.startswith("run/iter_0000030/") for k in s3.keys("run/"))


def megatron_lm_worker(lm_path: str, url: str, fmt: str) -> dict:
    """Megatron-LM's own ``save_checkpoint``/``load_checkpoint`` through the patch, ``--save``/``--load`` the
    URL: iterations 10 and 20 to the store, 30 to memory; loads from memory, from the store, and after
    damage, from the previous iteration."""
    from flashckpt.patches.megatron import StorageType, finalize, get_checkpointer, load_checkpoint, save_checkpoint
    from test_megatron import _digest, _model, _train, lm_setup

    lm_setup(lm_path, url, fmt)
    out: dict = {}
    digests: dict[int, dict] = {}

    def resumed(seed: int) -> list[Any]:
        model = _model(seed)
        iteration, flops = load_checkpoint([model], None, None)
        ck = get_checkpointer(url)
        # a memory load is the engine's (Megatron-LM reads the snapshot through it); a store load the patch's
        info = ck.engine.last_load if ck.engine.last_load is not None else ck.last_load
        out_ = [info.source if info else None, iteration, flops, _digest(model) == digests.get(iteration)]
        finalize(release=True)
        _released()
        return out_

    model = _model(1)
    for step, kind in ((10, StorageType.DISK), (20, StorageType.DISK), (30, StorageType.MEMORY)):
        _train(model, step)
        save_checkpoint(step, [model], None, None, step * 10, storage_type=kind)
        digests[step] = _digest(model)
        get_checkpointer(url).wait(120)
    finalize(release=False)  # a restart follows: the saver keeps the snapshots
    out["memory"] = resumed(2)
    out["storage"] = resumed(3)
    ours = _keys(f"{url}/iter_0000020")
    out["files"] = ours
    _damage(f"{url}/iter_0000020/{([n for n in ours if n.startswith('__1_')] or ours)[0]}")  # rank 1's, if any
    out["fallback"] = resumed(4)
    return out


@pytest.mark.skipif(not LM_PATH, reason="set MEGATRON_LM_PATH to a Megatron-LM checkout (core_v0.16.1) to run")
@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_megatron_lm_on_s3(s3: Any, tmp_path: Any, fmt: str) -> None:
    results = run_ranks(megatron_lm_worker, 2, str(tmp_path / "ranks"), args={"lm_path": LM_PATH, "url": s3.url,
                                                                               "fmt": fmt},
                        env=MEGATRON_ENV, timeout=420)
    for r in results:
        assert r["memory"] == ["memory", 30, 300, True]
        assert r["storage"] == ["storage", 20, 200, True]
        assert r["fallback"] == ["storage", 10, 100, True]
    if fmt == "torch":
        assert results[0]["files"] == ["mp_rank_00/model_optim_rng.pt"]
    assert s3.read("run/latest_checkpointed_iteration.txt") == b"20"


# ------------------------------------------------------------------------------------------ URLs
def test_every_adapter_takes_an_s3_url_and_makes_no_local_dir(s3: Any, tmp_path: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """In one process: the checkpointers take the URL as their checkpoint dir (normalized), nothing local is
    made for it; the Megatron-LM patch keys its checkpointer by the URL."""
    from flashckpt.integrations.ddp import DdpCheckpointer
    from flashckpt.integrations.fsdp import FsdpShardCheckpointer

    monkeypatch.chdir(tmp_path)
    dirs = []
    for make in (DdpCheckpointer, FsdpShardCheckpointer):
        ck = make(s3.url + "/")
        dirs.append(ck.checkpoint_dir)
        ck.close()
    pytest.importorskip("megatron.core")
    import flashckpt.patches.megatron._lm as lm
    from flashckpt.patches.megatron.dist_ckpt import MegatronCheckpointer

    mc = MegatronCheckpointer(s3.url + "/./")
    dirs.append(mc.checkpoint_dir)
    mc.close()
    monkeypatch.setattr(lm, "_CHECKPOINTERS", {})
    try:
        got = lm.get_checkpointer(s3.url)
        assert lm.get_checkpointer(s3.url + "/") is got
        dirs.append(got.checkpoint_dir)
    finally:
        lm.finalize()
    assert dirs == [s3.url] * 4
    assert os.listdir(tmp_path) == ["aws"], "a local directory was made for the URL"
