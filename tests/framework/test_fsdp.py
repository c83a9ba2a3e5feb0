"""FsdpShardCheckpointer and the DCP layer under it (flashckpt.integrations.dcp), with real FSDP2 (``fully_shard``
on a CPU device mesh, gloo) in real rank processes.

- In one process: the torch.save record split (dtype matrix), the writer's layout against
  ``FileSystemWriter``'s, the memory reader, and bad input.
- Ranks: save to memory and storage, restart the processes, resume from memory and train on bit for bit
  like an uninterrupted run; vanilla ``dcp.load`` / ``dcp_to_torch_save`` of the persisted checkpoint;
  resharding 4 -> 2 and 2 -> 4 (memory refused when the layout differs); one rank's persist failing
  leaves no ``.metadata`` and no commit.

The workers below run in the rank processes (see helpers.launch_ranks) and return JSON.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import warnings

import pytest
import torch
from helpers import run_ranks, tree_digest

pytest.importorskip("torch.distributed.fsdp")
pytest.importorskip("torch.distributed.checkpoint.state_dict")

pytestmark = pytest.mark.multiproc

IN, HIDDEN, OUT = 8, 24, 5  # 5 output rows on 4 ranks: shards of 2, 2, 1 and 0 rows (an empty shard)


# ------------------------------------------------------------------------------------------ the model
def build(world: int):
    """A small MLP, every Linear and the root sharded with fully_shard; AdamW. Same seed everywhere."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                          nn.Linear(HIDDEN, OUT))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model, opt, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(6, IN, generator=g), torch.randn(6, OUT, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def local_digest(model, opt) -> str:
    """SHA-256 over this rank's shards of the weights and optimizer state, and the plain values."""
    return tree_digest(state(model, opt))


def full_state(model, opt) -> dict:
    """The unsharded state on rank 0 (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def same_tree(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b, strict=True))
    return a == b


# ------------------------------------------------------------------------------------------ workers
def train_worker(ckpt_dir: str, out_dir: str, steps: int, *, memory_at=(), disk_at=(), resume: bool = False,
                 release: bool = True, full_at=(), compare_full=None, vanilla_at=None, vanilla_check=None) -> dict:
    """Trains ``steps`` steps with FSDP2, snapshotting at ``memory_at`` and persisting at ``disk_at``.

    resume: load with ``load_checkpoint`` first and go on from the step it holds.
    full_at: steps after which rank 0 writes the unsharded state to ``out_dir/full_<step>.pt``.
    compare_full: after resuming, compare the unsharded state with this file (rank 0).
    vanilla_at: a step after which every rank also saves the same state with DCP's own FileSystemWriter
        to ``out_dir/vanilla_<step>`` (the reference layout).
    vanilla_check: [path, digest step]: load ``path`` with plain ``dcp.load`` into a fresh model.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from flashckpt.integrations.fsdp import FsdpShardCheckpointer, StorageType
    from torch.distributed.checkpoint.state_dict import set_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(world)
    out: dict = {"digests": {}}
    ckpt = FsdpShardCheckpointer(ckpt_dir)
    try:
        start = 1
        if resume:
            out["memory_steps"] = ckpt.engine.memory_steps()
            from flashckpt import SnapshotReader

            with SnapshotReader(ckpt.engine, ckpt.engine.ranks.local_rank, rank=rank) as held:
                out["held"] = held.memory_steps()  # whatever this rank's snapshots on the node, any layout
            extra = ckpt.load_checkpoint(model, opt)
            info = ckpt.last_load
            out["resumed"] = [info.source, info.step, extra.get("step")]
            start = int(extra["step"]) + 1
            if compare_full:
                full = full_state(model, opt)
                if rank == 0:
                    out["full_matches"] = same_tree(torch.load(compare_full, weights_only=True), full)
        for step in range(start, steps + 1):
            train_step(model, opt, step, rank)
            sd = {**state(model, opt), "step": step}
            if step in disk_at:
                ckpt.save_checkpoint(step, sd, f"step_{step}", storage_type=StorageType.DISK)
            elif step in memory_at:
                ckpt.save_checkpoint(step, sd, f"step_{step}", storage_type=StorageType.MEMORY)
            out["digests"][step] = local_digest(model, opt)
            if step in full_at:
                full = full_state(model, opt)
                if rank == 0:
                    torch.save(full, os.path.join(out_dir, f"full_{step}.pt"))
            if step == vanilla_at:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    dcp.save(sd, checkpoint_id=os.path.join(out_dir, f"vanilla_{step}"))
        ckpt.wait_latest_checkpoint(120)
        out["committed"] = ckpt.engine.committed_steps()
        if vanilla_check:  # plain DCP, no flashckpt: FileSystemReader inferred from the path
            m2, o2 = build(world)
            sd2 = state(m2, o2)
            dcp.load(sd2, checkpoint_id=vanilla_check[0])
            set_state_dict(m2, o2, model_state_dict=sd2["model"], optim_state_dict=sd2["optim"])
            out["vanilla_digest"] = local_digest(m2, o2)
        dist.barrier()
    finally:
        ckpt.close(release=release)
    return out


def failing_rank_worker(ckpt_dir: str) -> dict:
    """Step 1 commits. For step 2, rank 1's data file cannot be written (a directory sits at its path):
    its persist fails, so the step must not commit and ``.metadata`` must never appear. Then step 3
    persists normally."""
    import torch.distributed as dist
    from flashckpt import PersistError
    from flashckpt.integrations.fsdp import FsdpShardCheckpointer

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(world)
    out: dict = {}
    ckpt = FsdpShardCheckpointer(ckpt_dir)
    blocker = os.path.join(ckpt_dir, "step_2", "__1_0.distcp")
    try:
        train_step(model, opt, 1, rank)
        ckpt.save_checkpoint(1, {**state(model, opt), "step": 1}, "step_1")
        ckpt.wait_latest_checkpoint(120)
        if rank == 0:
            os.makedirs(blocker)
        dist.barrier()
        train_step(model, opt, 2, rank)
        ckpt.save_checkpoint(2, {**state(model, opt), "step": 2}, "step_2")
        out["digest_2"] = local_digest(model, opt)
        try:
            ckpt.wait_latest_checkpoint(120)
            out["error"] = None
        except PersistError as e:
            out["error"] = str(e)
        dist.barrier()
        out["metadata_2"] = os.path.exists(os.path.join(ckpt_dir, "step_2", ".metadata"))
        out["committed_after_failure"] = ckpt.engine.committed_steps()
        # Memory still holds a complete step 2: it loads from there.
        m2, o2 = build(world)
        extra = ckpt.load_checkpoint(m2, o2)
        out["memory_load"] = [ckpt.last_load.source, ckpt.last_load.step, extra.get("step"),
                              local_digest(m2, o2) == out["digest_2"]]
        dist.barrier()
        if rank == 0:
            os.rmdir(blocker)
        dist.barrier()
        train_step(model, opt, 3, rank)
        ckpt.save_checkpoint(3, {**state(model, opt), "step": 3}, "step_3")
        ckpt.wait_latest_checkpoint(120)
        out["committed_end"] = ckpt.engine.committed_steps()
        dist.barrier()
    finally:
        ckpt.close()
    return out


# ------------------------------------------------------------------------------------------ in one process
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_save_frame_around_the_data_is_a_torch_save_file(dtype):
    from flashckpt.format.files import tensor_view as _tensor_bytes
    from flashckpt.integrations.dcp import torch_save_frame

    for shape in [(), (0,), (7,), (3, 5), (2, 0, 4), (64, 33)]:
        t = (torch.rand(shape) > 0.5) if dtype == torch.bool else (torch.randn(shape) * 50).to(dtype)
        head, tail = torch_save_frame(dtype, shape)
        record = head + bytes(_tensor_bytes(t)) + tail
        ref = io.BytesIO()
        torch.save(t, ref)
        assert len(record) == len(ref.getvalue()), (dtype, shape)  # same offsets as FileSystemWriter's
        back = torch.load(io.BytesIO(record), weights_only=True)
        assert back.dtype == t.dtype and back.shape == t.shape
        assert bytes(_tensor_bytes(back)) == bytes(_tensor_bytes(t)), (dtype, shape)


def _mixed_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(6, 5, generator=g), "half": torch.randn(4, generator=g).to(torch.bfloat16),
            "ids": torch.arange(10), "flag": torch.tensor(True), "empty": torch.zeros(0, 3),
            "t": torch.randn(3, 4, generator=g).t(),  # non-contiguous
            "nested": {"lr": 0.1, "name": "adam", "betas": (0.9, 0.99)}, "step": 7}


def test_writer_layout_matches_file_system_writer_and_memory_reader_loads_it(tmp_path):
    """Single process (no process group): the staged data file has FileSystemWriter's layout (same
    offsets and lengths for every item), vanilla ``dcp.load`` reads it once written out, and the memory
    reader serves it back."""
    import torch.distributed.checkpoint as dcp
    from flashckpt.integrations.dcp import CachingSavePlanner, FileSetStorageWriter, open_memory_reader

    sd = _mixed_state()
    ours, ref = str(tmp_path / "ours"), str(tmp_path / "ref")
    writer, planner = FileSetStorageWriter(), CachingSavePlanner()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        for _ in range(2):  # the second save reuses the cached plan
            dcp.save(sd, checkpoint_id=ours, storage_writer=writer, planner=planner)
            fs = writer.take_fileset()
        dcp.save(sd, checkpoint_id=ref)
    planner.forget()
    assert sorted(fs) == [".metadata", "__0_0.distcp"] and fs[".metadata"].kind == "commit"
    os.makedirs(ours)
    for name in fs:
        with open(os.path.join(ours, name), "wb") as f:
            f.write(fs.raw_bytes(name))
    with open(os.path.join(ours, ".metadata"), "rb") as f:
        mine = pickle.load(f)
    with open(os.path.join(ref, ".metadata"), "rb") as f:
        theirs = pickle.load(f)
    assert {k: (v.relative_path, v.offset, v.length) for k, v in mine.storage_data.items()} == \
           {k: (v.relative_path, v.offset, v.length) for k, v in theirs.storage_data.items()}
    assert os.path.getsize(os.path.join(ours, "__0_0.distcp")) == os.path.getsize(os.path.join(ref, "__0_0.distcp"))
    assert mine.state_dict_metadata.keys() == theirs.state_dict_metadata.keys()

    def target():
        return {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()} | \
            {"nested": {"lr": None, "name": None, "betas": None}}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vanilla = target()
        dcp.load(vanilla, checkpoint_id=ours)  # FileSystemReader, no flashckpt
        reader = open_memory_reader(fs, ours)
        assert reader is not None
        from_memory = target()
        dcp.load(from_memory, storage_reader=reader)
    for got in (vanilla, from_memory):
        assert same_tree(sd, got)


def test_cached_plan_is_replaced_when_the_structure_or_a_dtype_changes():
    """A new key, and a tensor that keeps its shape but changes dtype (DCP's own plan comparison looks at
    keys, offsets and sizes only), both re-plan: the metadata and the data describe the new state."""
    import torch.distributed.checkpoint as dcp
    from flashckpt.integrations.dcp import CachingSavePlanner, FileSetStorageWriter, open_memory_reader

    writer, planner = FileSetStorageWriter(), CachingSavePlanner()
    states = [{"w": torch.randn(4, 3), "step": 1}, {"w": torch.randn(4, 3), "step": 2},
              {"w": torch.randn(4, 3).double(), "step": 3}, {"w": torch.randn(4, 3).double(), "step": 4,
                                                            "extra": torch.arange(5)}]
    try:
        for sd in states:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(sd, checkpoint_id="/nonexistent/dcp", storage_writer=writer, planner=planner)
            fs = writer.take_fileset()
            md = pickle.loads(fs.raw_bytes(".metadata"))
            assert md.state_dict_metadata["w"].properties.dtype == sd["w"].dtype
            assert set(md.state_dict_metadata) == set(sd)
            target = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(target, storage_reader=open_memory_reader(fs, "/nonexistent/dcp"))
            assert same_tree(sd, target)
    finally:
        planner.forget()


def test_bad_input_is_refused_before_anything_is_written(ckpt_dir):
    from flashckpt import CheckpointCorruptError
    from flashckpt.integrations.fsdp import FsdpShardCheckpointer

    ckpt = FsdpShardCheckpointer(ckpt_dir)
    try:
        sd = {"w": torch.ones(3)}
        with pytest.raises(ValueError, match="step must be an integer"):
            ckpt.save_checkpoint(-1, sd)
        with pytest.raises(ValueError, match="StorageType.MEMORY or"):
            ckpt.save_checkpoint(1, sd, storage_type="disk")
        with pytest.raises(ValueError, match="outside the checkpoint dir"):
            ckpt.save_checkpoint(1, sd, "../elsewhere")
        with pytest.raises(ValueError, match="a dict is needed"):
            ckpt.save_checkpoint(1, [torch.ones(1)])
        with pytest.raises(CheckpointCorruptError, match="no .metadata"):
            ckpt.get_storage_reader(resume_path="step_1")
        assert ckpt.get_storage_reader() is None and ckpt.last_load.source == "none"
        assert os.listdir(ckpt_dir) == []
    finally:
        ckpt.close()


# ------------------------------------------------------------------------------------------ ranks
def test_resume_from_memory_bit_identical_vanilla_dcp_loads_and_resharding(ckpt_dir, tmp_path):
    """One job's life: 2 ranks save, restart and resume from memory; 4 ranks resume the 2-rank step from memory,
    resharded (grow); 2 ranks resume the 4-rank snapshot from memory, resharded (shrink); with memory gone, 2
    ranks load the 4-rank checkpoint from storage, resharded. Each resharded state equals the saved one."""
    out = str(tmp_path / "out")
    os.makedirs(out)
    # No last words, so the snapshots a run leaves behind stay uncommitted (only memory holds them), and a
    # long grace so they outlive the run however slowly the next one starts (the saver still exits at once
    # when a run ends with final goodbyes).
    env = {"FLASHCKPT_LAST_WORDS": "0", "FLASHCKPT_SAVER_GRACE_S": "300"}

    # Run 1 (2 ranks): persist step 2, snapshot 3 and 4, train on to step 6 (the uninterrupted reference),
    # and leave the snapshots to the saver (close(release=False), as a restarting job does).
    a = run_ranks(train_worker, 2, str(tmp_path / "run1"), env=env, args={
        "ckpt_dir": ckpt_dir, "out_dir": out, "steps": 6, "disk_at": [2], "memory_at": [3, 4],
        "full_at": [2], "vanilla_at": 2, "release": False})
    # Run 2 (2 new processes): resume from memory at step 4 and train on to step 6; snapshot step 5, persist
    # step 6, and leave the snapshots in memory.
    b = run_ranks(train_worker, 2, str(tmp_path / "run2"), env=env, args={
        "ckpt_dir": ckpt_dir, "out_dir": out, "steps": 6, "resume": True, "memory_at": [5], "disk_at": [6],
        "full_at": [6], "vanilla_check": [os.path.join(ckpt_dir, "step_2"), 2], "release": False})
    for rank in range(2):
        assert b[rank]["memory_steps"][0] == 4, rank
        assert b[rank]["resumed"] == ["memory", 4, 4], rank
        assert b[rank]["digests"]["6"] == a[rank]["digests"]["6"], f"rank {rank}: the resumed run diverged"
        assert b[rank]["vanilla_digest"] == a[rank]["digests"]["2"], f"rank {rank}: vanilla dcp.load differs"
        assert b[rank]["committed"] == [2, 6], rank
    step2 = os.path.join(ckpt_dir, "step_2")
    assert sorted(os.listdir(step2)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    # Run 3 (4 ranks, grow): memory holds step 6 of the 2-rank layout; ranks 2 and 3 have no snapshot of their
    # own, every rank reads the items it needs from the old ranks' snapshots, resharded. Persist step 8,
    # snapshot step 9, leave it in memory.
    c = run_ranks(train_worker, 4, str(tmp_path / "run3"), env=env, timeout=240, args={
        "ckpt_dir": ckpt_dir, "out_dir": out, "steps": 9, "resume": True, "disk_at": [8], "memory_at": [9],
        "full_at": [8, 9], "compare_full": os.path.join(out, "full_6.pt"), "release": False})
    assert [r["resumed"] for r in c] == [["memory", 6, 6]] * 4
    assert c[0]["full_matches"] is True, "2 -> 4 from memory: the loaded state differs from the saved one"
    # Run 4 (2 ranks, shrink): ranks 0 and 1 hold step 9 in memory with the 4-rank layout; the engine does not
    # hand a rank a snapshot of 4 ranks as its own (memory_steps() leaves them out), but the FSDP adapter reads
    # step 9 from the four old ranks' snapshots, resharded.
    d = run_ranks(train_worker, 2, str(tmp_path / "run4"), env=env, args={
        "ckpt_dir": ckpt_dir, "out_dir": out, "steps": 9, "resume": True,
        "compare_full": os.path.join(out, "full_9.pt")})
    assert all(r["held"][0] == 9 for r in d), "run 4 did not see run 3's snapshots"
    assert all(9 not in r["memory_steps"] for r in d), "the engine offers snapshots of 4 ranks to a job of 2 as its own"
    assert [r["resumed"] for r in d] == [["memory", 9, 9]] * 2
    assert d[0]["full_matches"] is True, "4 -> 2 from memory: the loaded state differs from the saved one"
    # Run 5 (2 ranks): memory released by run 4's close; the 4-rank checkpoint of step 8 loads from storage,
    # resharded.
    e = run_ranks(train_worker, 2, str(tmp_path / "run5"), env=env, args={
        "ckpt_dir": ckpt_dir, "out_dir": out, "steps": 8, "resume": True,
        "compare_full": os.path.join(out, "full_8.pt")})
    assert [r["resumed"] for r in e] == [["storage", 8, 8]] * 2
    assert e[0]["full_matches"] is True, "4 -> 2 from storage: the loaded state differs from the saved one"
    assert sorted(os.listdir(os.path.join(ckpt_dir, "step_8"))) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]

    # Step 2 holds the same items at the same offsets as DCP's own FileSystemWriter wrote for that state.
    ref = os.path.join(out, "vanilla_2")
    with open(os.path.join(step2, ".metadata"), "rb") as f:
        mine = pickle.load(f)
    with open(os.path.join(ref, ".metadata"), "rb") as f:
        theirs = pickle.load(f)
    assert {k: (v.relative_path, v.offset, v.length) for k, v in mine.storage_data.items()} == \
           {k: (v.relative_path, v.offset, v.length) for k, v in theirs.storage_data.items()}
    for name in ("__0_0.distcp", "__1_0.distcp"):
        assert os.path.getsize(os.path.join(step2, name)) == os.path.getsize(os.path.join(ref, name))

    # A single process without flashckpt or a process group turns it into one torch.save file.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    converted = str(tmp_path / "converted.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(step2, converted)
    got = torch.load(converted, weights_only=True)
    want = torch.load(os.path.join(out, "full_2.pt"), weights_only=True)
    assert got["step"] == 2
    assert same_tree(want["model"], got["model"])
    assert same_tree(want["optim"]["state"], got["optim"]["state"])


def test_a_rank_whose_persist_fails_leaves_no_metadata_and_no_commit(ckpt_dir, tmp_path):
    r0, r1 = run_ranks(failing_rank_worker, 2, str(tmp_path / "ranks"), args={"ckpt_dir": ckpt_dir})
    assert r1["error"] is not None and "__1_0.distcp" in r1["error"], r1["error"]
    for r in (r0, r1):
        assert r["metadata_2"] is False
        assert r["committed_after_failure"] == [1]
        assert r["memory_load"] == ["memory", 2, 2, True]
        assert r["committed_end"] == [1, 3]
    assert not os.path.exists(os.path.join(ckpt_dir, "step_2", ".metadata"))
    assert os.path.exists(os.path.join(ckpt_dir, "step_3", ".metadata"))


def test_a_reshard_never_mixes_steps_when_the_old_ranks_hold_different_steps(ckpt_dir, tmp_path):
    """2 ranks snapshot steps 3 and 4; rank 1's snapshot of step 4 is then gone (its node lost it before its
    backup reached a partner: its slot emptied here). A job of 1 rank must resume step 3, the newest step every
    old rank holds, whole: the loaded state equals step 3's for every item (rank 0's items from its step-4
    snapshot would differ), never a mix."""
    from flashckpt import SnapshotReader
    from flashckpt.format.segment import EMPTY, Segment, local_ranks, segment_paths

    out = str(tmp_path / "out")
    os.makedirs(out)
    env = {"FLASHCKPT_LAST_WORDS": "0", "FLASHCKPT_SAVER_GRACE_S": "300"}
    run_ranks(train_worker, 2, str(tmp_path / "run1"), env=env, args={
        "ckpt_dir": ckpt_dir, "out_dir": out, "steps": 4, "memory_at": [3, 4], "full_at": [3, 4], "release": False})
    with SnapshotReader(ckpt_dir) as reader:
        job_dir = reader.job_dir
    emptied = 0
    for lr in local_ranks(job_dir):
        for _epoch, path in segment_paths(job_dir, lr):
            seg = Segment(path, populate=False)
            try:
                for i in range(seg.nslots):
                    h = seg.header(i)
                    if h.rank == 1 and h.step == 4:
                        seg.write_header(i, dataclasses.replace(h, state=EMPTY))
                        emptied += 1
            finally:
                seg.close()
    assert emptied == 1, "rank 1's snapshot of step 4 was not found in memory"
    (r,) = run_ranks(train_worker, 1, str(tmp_path / "run2"), env=env, args={
        "ckpt_dir": ckpt_dir, "out_dir": out, "steps": 4, "resume": True, "compare_full": os.path.join(out, "full_3.pt")})
    assert r["resumed"] == ["memory", 3, 3], r["resumed"]
    assert r["full_matches"] is True, "the 1-rank job's state is not step 3's: steps were mixed"
