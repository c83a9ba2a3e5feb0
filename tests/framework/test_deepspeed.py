"""DeepSpeedCheckpointer with real DeepSpeed engines (deepspeed 0.19.8, CPU accelerator, gloo), tiny
models built in code, real rank processes and real kill -9.

- ZeRO 0, 1, 2, 3 and bf16 (ZeRO-1 with DeepSpeed's BF16_Optimizer, and ZeRO-3 in bf16), on 1 and 2
  ranks, in one pair of rank processes per world size: save to storage and to memory, kill -9, restart,
  load from memory, train on, and match an uninterrupted run bit for bit; the saver's last words commit
  the memory checkpoint and move ``latest``; vanilla ``engine.load_checkpoint`` resumes from our files
  to the same result; the tag directory has exactly the file names and contents of vanilla DeepSpeed's
  save of the same state; ``zero_to_fp32`` reads it.
- A kill -9 of the trainers and the saver while a tag is being persisted: ``latest`` keeps naming the
  committed tag, vanilla DeepSpeed loads it, and the restarted job resumes from memory.
- Input errors are raised before anything is written and cost no checkpoint.

The workers below run in the rank processes (see helpers.launch_ranks) and return JSON. DeepSpeed
compiles a shared-memory op on its first CPU initialize (cached in ~/.cache/torch_extensions); the
optimizer is a torch AdamW so that no FusedAdam is built.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal

import pytest
from helpers import launch_ranks, run_ranks, wait_for

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.multiproc

DS_ENV = {"DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}

# name -> (ZeRO stage, bf16, grad_accum_dtype)
CONFIGS = {
    "zero0": (0, False, None),
    "zero1": (1, False, None),
    "zero2": (2, False, None),
    "zero3": (3, False, None),
    "bf16": (1, True, "fp32"),  # BF16_Optimizer: bf16_zero_pp_rank_* files
    "zero3_bf16": (3, True, None),
}
DISK_STEP, MEM_STEP, END_STEP = 2, 4, 6


# ------------------------------------------------------------------------------------------ rank side
def _ds_config(name: str, world: int) -> dict:
    stage, bf16, acc = CONFIGS[name]
    cfg: dict = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * world, "steps_per_print": 10**9,
                 "zero_optimization": {"stage": stage}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if acc:
        cfg["data_types"] = {"grad_accum_dtype": acc}
    return cfg


def _engine(name: str, width: int = 16):
    import deepspeed
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, width), torch.nn.ReLU()]
    if width > 16:  # a big model: width * width more parameters
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    world = torch.distributed.get_world_size()
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_ds_config(name, world))
    return engine


def _train(engine, first: int, last: int) -> list[float]:
    """Steps first..last (inclusive); the batch of step s on rank r is fixed by (s, r)."""
    import torch

    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    losses = []
    for s in range(first, last + 1):
        g = torch.Generator().manual_seed(1000 * s + torch.distributed.get_rank())
        x = torch.randn(2, 8, generator=g).to(dtype)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _digest(engine) -> str:
    """sha256 of every (gathered) parameter's bytes: equal digests mean bit-identical weights."""
    import deepspeed
    import torch

    h = hashlib.sha256()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        for p in params:
            h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _same_tree(a, b, where: str = "<root>") -> bool:
    """``b`` equals ``a``: containers and leaves of the same types, tensors bit for bit, and objects
    without ``__eq__`` (DeepSpeed's loss scaler) attribute by attribute."""
    import torch
    from helpers import assert_bit_identical

    assert type(a) is type(b), f"{where}: {type(b).__name__} instead of {type(a).__name__}"
    if isinstance(a, torch.Tensor):
        assert_bit_identical(a, b, where)
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(b)} instead of {list(a)}"
        for k in a:
            _same_tree(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(b)} instead of {len(a)}"
        for i, (x, y) in enumerate(zip(a, b)):
            _same_tree(x, y, f"{where}[{i}]")
    elif type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):
        _same_tree(vars(a), vars(b), f"{where}.__dict__")
    else:
        assert a == b, f"{where}: {b!r:.200} instead of {a!r:.200}"
    return True


def _same_fp32(ours: str, vanilla: str) -> str:
    """zero_to_fp32 on our checkpoint gives what it gives on vanilla DeepSpeed's ("same"), including its
    refusal of a BF16_Optimizer checkpoint, which it does not support."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as fp32

    try:
        b = fp32(vanilla)
    except ValueError as e:
        try:
            fp32(ours)
        except ValueError as e2:
            return "same" if str(e2).replace(ours, vanilla) == str(e) else f"{e2} instead of {e}"
        return f"no error instead of {e}"
    a = fp32(ours)
    return "same" if list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a) else "different"


def phase1_worker(root: str, names: list[str], ready: str) -> dict:
    """Per config: a storage checkpoint at step 2, a memory checkpoint at step 4; then wait to be killed."""
    import torch.distributed as dist
    from flashckpt.integrations.deepspeed import DeepSpeedCheckpointer, StorageType

    out: dict = {}
    keep = []
    for name in names:
        ckpt = os.path.join(root, name)
        engine = _engine(name)
        ck = DeepSpeedCheckpointer(engine, ckpt)
        keep.append((engine, ck))
        assert ck.load_checkpoint(ckpt) == (None, None) and ck.last_load.source == "none"
        _train(engine, 1, DISK_STEP)
        ck.save_checkpoint(ckpt, client_state={"marker": DISK_STEP})
        _train(engine, DISK_STEP + 1, MEM_STEP)
        ck.save_checkpoint(ckpt, client_state={"marker": MEM_STEP}, storage_type=StorageType.MEMORY)
        ck.wait(60)
        dist.barrier()
        out[name] = {"latest": _read(os.path.join(ckpt, "latest")),
                     "mem_tag_on_storage": os.path.exists(os.path.join(ckpt, f"global_step{MEM_STEP}"))}
    if len(names) and dist.get_world_size() == 1:
        out["errors"] = _input_errors(keep[0][0], keep[0][1], os.path.join(root, names[0]))
    with open(f"{ready}.{dist.get_rank()}.tmp", "w") as f:
        json.dump(out, f)
    os.rename(f"{ready}.{dist.get_rank()}.tmp", f"{ready}.{dist.get_rank()}")  # results, and "ready to die"
    wait_for(lambda: False, 300, "the test to kill this rank")  # never returns: the test kills us
    return out


def _input_errors(engine, ck, ckpt: str) -> dict:
    """Bad input is refused before anything is written; the checkpoints already there stay intact."""
    from flashckpt.integrations.deepspeed import StorageType

    before = sorted(os.listdir(ckpt))
    errs = {}
    for label, call in {
        "outside": lambda: ck.save_checkpoint(os.path.dirname(ckpt)),
        "dotdot_tag": lambda: ck.save_checkpoint(ckpt, tag="../x"),
        "storage_type": lambda: ck.save_checkpoint(ckpt, storage_type="disk"),
        # step 4 (engine.global_steps) was saved as global_step4: another tag for it is refused
        "step_retagged": lambda: ck.save_checkpoint(ckpt, tag="other", storage_type=StorageType.MEMORY),
        "missing_tag": lambda: ck.load_checkpoint(ckpt, tag="nope"),
    }.items():
        try:
            call()
            errs[label] = "no error"
        except (ValueError, FileNotFoundError) as e:
            errs[label] = "/".join(c.__name__ for c in type(e).__mro__[:-2]) + ": " + str(e)  # its classes: msg
    # a committed tag directory is not rewritten with another step
    _train(engine, MEM_STEP + 1, MEM_STEP + 1)
    try:
        ck.save_checkpoint(ckpt, tag=f"global_step{DISK_STEP}")
        errs["reused_dir"] = "no error"
    except ValueError as e:
        errs["reused_dir"] = str(e)
    errs["unchanged"] = sorted(os.listdir(ckpt)) == before
    return errs


def phase2_worker(root: str, names: list[str], vanilla_root: str) -> dict:
    """Per config: resume from memory and train on; an uninterrupted run; vanilla DeepSpeed resuming
    from our persisted files; our tag directory against vanilla DeepSpeed's save of the same state."""
    import torch
    import torch.distributed as dist
    from flashckpt.integrations.deepspeed import DeepSpeedCheckpointer

    rank = dist.get_rank()
    out: dict = {}
    for name in names:
        ckpt = os.path.join(root, name)
        res: dict = {}
        engine = _engine(name)
        with DeepSpeedCheckpointer(engine, ckpt) as ck:
            load_path, client = ck.load_checkpoint(ckpt)
            res["source"], res["step"] = ck.last_load.source, ck.last_load.step
            res["load_path"] = os.path.relpath(load_path, ckpt)
            res["marker"] = client["marker"]
            res["global_steps"] = engine.global_steps
            res["losses"] = _train(engine, MEM_STEP + 1, END_STEP)
            res["digest"] = _digest(engine)
        ref = _engine(name)
        res["ref_losses"] = _train(ref, 1, END_STEP)[MEM_STEP:]
        res["ref_digest"] = _digest(ref)

        # The saver's last words commit the memory checkpoint; then `latest` names it.
        tag = f"global_step{MEM_STEP}"
        latest = os.path.join(ckpt, "latest")
        wait_for(lambda p=latest: _read(p) == f"global_step{MEM_STEP}", 60, "latest to name the last words")
        if name == names[0]:  # an older tag, by name: from storage
            with DeepSpeedCheckpointer(_engine(name), ckpt) as ck:
                path, client = ck.load_checkpoint(ckpt, tag=f"global_step{DISK_STEP}")
                res["older_tag"] = [os.path.relpath(path, ckpt), client["marker"], ck.engine.global_steps,
                                    ck.last_load.source]
        if CONFIGS[name][0] == 3:  # DeepSpeed reads every rank's files itself here: from storage
            with DeepSpeedCheckpointer(_engine(name), ckpt) as ck:
                path, client = ck.load_checkpoint(ckpt, load_optimizer_states=False)
                res["module_only"] = [os.path.relpath(path, ckpt), ck.last_load.source]
        van = _engine(name)
        vpath, vclient = van.load_checkpoint(ckpt)  # vanilla DeepSpeed, our files
        res["vanilla_load_path"] = os.path.relpath(vpath, ckpt)
        res["vanilla_marker"] = vclient["marker"]
        # Vanilla DeepSpeed's own save of the same state, file by file against ours.
        vdir = os.path.join(vanilla_root, name)
        van.save_checkpoint(vdir, client_state={"marker": MEM_STEP})
        res["vanilla_losses"] = _train(van, MEM_STEP + 1, END_STEP)
        res["vanilla_digest"] = _digest(van)
        if rank == 0:
            ours, theirs = sorted(os.listdir(os.path.join(ckpt, tag))), sorted(os.listdir(os.path.join(vdir, tag)))
            res["files"], res["vanilla_files"] = ours, theirs
            res["same_contents"] = all(
                _same_tree(torch.load(os.path.join(vdir, tag, f), weights_only=False),
                           torch.load(os.path.join(ckpt, tag, f), weights_only=False)) for f in theirs)
            if CONFIGS[name][0] > 0:
                res["zero_to_fp32"] = _same_fp32(ckpt, vdir)
        dist.barrier()
        out[name] = res
    return out


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("world,names", [(1, ["zero2", "zero3_bf16"]),
                                         (2, ["zero0", "zero1", "zero2", "zero3", "bf16"])],
                         ids=["1rank", "2ranks"])
def test_kill9_restart_from_memory_matches_uninterrupted_run(tmp_path, world, names):
    root, ready = str(tmp_path / "ckpt"), str(tmp_path / "ready")
    # The savers these ranks start keep the snapshots of killed trainers for FLASHCKPT_SAVER_GRACE_S: long
    # enough for the restarted ranks to import DeepSpeed on a busy machine.
    group = launch_ranks(phase1_worker, world, str(tmp_path / "p1"), env={**DS_ENV, "FLASHCKPT_SAVER_GRACE_S": "120"},
                         args={"root": root, "names": names, "ready": ready})
    try:
        group.wait_until(lambda: all(os.path.exists(f"{ready}.{r}") for r in range(world)), 240,
                         "every rank to save its checkpoints")
    finally:
        group.kill()  # SIGKILL: no goodbye, no cleanup
    assert all(p.returncode == -signal.SIGKILL for p in group.procs)
    with open(f"{ready}.0") as f:
        before = json.load(f)
    for name in names:
        # Before the kill: the storage checkpoint was committed and `latest` named it; the memory
        # checkpoint was not persisted.
        assert before[name] == {"latest": f"global_step{DISK_STEP}", "mem_tag_on_storage": False}, before

    results = launch_ranks(phase2_worker, world, str(tmp_path / "p2"), env=DS_ENV,
                           args={"root": root, "names": names, "vanilla_root": str(tmp_path / "vanilla")}).wait(240)
    tag = f"global_step{MEM_STEP}"
    for rank, out in enumerate(results):
        for name in names:
            r = out[name]
            assert (r["source"], r["step"], r["global_steps"], r["marker"]) == ("memory", MEM_STEP, MEM_STEP, MEM_STEP), (name, r)
            assert r["load_path"] == os.path.join(tag, _model_file(name, rank)), (name, r)
            assert r["losses"] == r["ref_losses"] and r["digest"] == r["ref_digest"], f"{name}: resumed run differs"
            assert r["vanilla_load_path"] == r["load_path"] and r["vanilla_marker"] == MEM_STEP
            if name == names[0]:
                older = [os.path.join(f"global_step{DISK_STEP}", _model_file(name, rank)), DISK_STEP, DISK_STEP]
                assert r["older_tag"] == [*older, "storage"], r["older_tag"]
            if CONFIGS[name][0] == 3:
                assert r["module_only"] == [r["load_path"], "storage"], r["module_only"]
            assert r["vanilla_losses"] == r["ref_losses"] and r["vanilla_digest"] == r["ref_digest"], name
            if rank == 0:
                assert r["files"] == r["vanilla_files"], (name, r["files"], r["vanilla_files"])
                assert r["same_contents"] is True
                assert r.get("zero_to_fp32", "same") == "same", (name, r["zero_to_fp32"])
    if world == 1:
        errs = before["errors"]
        assert errs["unchanged"] is True, errs
        for label in ("outside", "dotdot_tag", "storage_type", "step_retagged", "reused_dir"):
            classes = errs[label].split(":")[0].split("/")
            assert {"ValueError", "FlashCheckpointError"} <= set(classes) or "holds the checkpoint of step" in errs[label], (label, errs)
        assert {"FileNotFoundError", "FlashCheckpointError"} <= set(errs["missing_tag"].split(":")[0].split("/")), errs


def _model_file(name: str, rank: int) -> str:
    """The model-states file DeepSpeed reads on ``rank``."""
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if CONFIGS[name][0] == 3 else "mp_rank_00_model_states.pt"


# ------------------------------------------------------------------------------------------ kill during persist
def persist_kill_worker(ckpt: str, width: int) -> dict:
    """Commits global_step1, then starts persisting global_step2 (big enough to take a while) and waits
    to be killed."""
    engine = _engine("zero1", width)
    from flashckpt.integrations.deepspeed import DeepSpeedCheckpointer

    ck = DeepSpeedCheckpointer(engine, ckpt)
    _train(engine, 1, 1)
    ck.save_checkpoint(ckpt)
    ck.wait(60)
    _train(engine, 2, 2)
    ck.save_checkpoint(ckpt)
    wait_for(lambda: False, 300, "the test to kill this rank")
    return {}


def resume_after_persist_kill_worker(ckpt: str, width: int) -> dict:
    """Vanilla DeepSpeed loads what `latest` names; then the checkpointer resumes from memory."""
    from flashckpt.integrations.deepspeed import DeepSpeedCheckpointer

    out: dict = {}
    van = _engine("zero1", width)
    path, _client = van.load_checkpoint(ckpt)
    out["vanilla"] = [os.path.relpath(path, ckpt), van.global_steps]
    engine = _engine("zero1", width)
    with DeepSpeedCheckpointer(engine, ckpt) as ck:  # its saver removes the half-written global_step2
        path, _client = ck.load_checkpoint(ckpt)
        out["flash"] = [os.path.relpath(path, ckpt), engine.global_steps, ck.last_load.source]
        ck.save_checkpoint(ckpt)  # global_step2 again, persisted this time
        ck.wait(60)
    out["latest"] = _read(os.path.join(ckpt, "latest"))
    return out


def test_latest_never_names_a_tag_killed_while_persisting(tmp_path, runtime_dir):
    from _fault_helpers import files_named, kill9, saver_pids, stop
    from flashckpt.commit.layout import CommitLayout
    from flashckpt.storage.posix import PosixDiskStorage

    ckpt, width = str(tmp_path / "ckpt"), 3072  # 9.5 M parameters: ~110 MB of files for rank 0, ~70 MB for rank 1
    layout = CommitLayout(ckpt, PosixDiskStorage())
    group = launch_ranks(persist_kill_worker, 2, str(tmp_path / "p1"), env=DS_ENV, args={"ckpt": ckpt, "width": width})
    try:
        # The saver's intent to write each rank's files (so both ranks hold step 2 in memory).
        group.wait_until(lambda: all(os.path.exists(os.path.join(layout.step_dir(2), f"intent_rank_{r}.json"))
                                     for r in (0, 1)), 240, "the saver to start persisting global_step2 of both ranks")
        savers = saver_pids(runtime_dir)
        for pid in savers:
            stop(pid)  # frozen mid-write
        try:
            assert layout.committed_steps() == [1], "global_step2 was committed before the test could stop it"
            assert _read(os.path.join(ckpt, "latest")) == "global_step1"
        finally:
            group.kill()
            for pid in savers:
                kill9(pid)
    finally:
        group.kill()
    assert _read(os.path.join(ckpt, "latest")) == "global_step1" and layout.committed_steps() == [1]

    out = launch_ranks(resume_after_persist_kill_worker, 2, str(tmp_path / "p2"), env=DS_ENV,
                       args={"ckpt": ckpt, "width": width}).wait(240)
    for r in out:
        assert r["vanilla"] == [os.path.join("global_step1", "mp_rank_00_model_states.pt"), 1], r
        assert r["flash"] == [os.path.join("global_step2", "mp_rank_00_model_states.pt"), 2, "memory"], r
        assert r["latest"] == "global_step2"
    assert layout.committed_steps() == [1, 2] and files_named(ckpt, ".flashckpt-tmp") == []


# ------------------------------------------------------------------------------------------ another number of ranks
def two_ranks_worker(ckpt: str) -> dict:
    """ZeRO-1 on 2 ranks: global_step1 committed, global_step2 a memory snapshot left for the next job. What
    DeepSpeed's own logger said of flashckpt's figures is returned (rank 0 says them)."""
    import logging

    from deepspeed.utils import logger as ds_logger
    from flashckpt.integrations.deepspeed import DeepSpeedCheckpointer, StorageType

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    ds_logger.addHandler(Keep(logging.INFO))
    ds_logger.setLevel(logging.INFO)  # DeepSpeed logs its own checkpoint lines at INFO too (hidden by default)
    engine = _engine("zero1")
    ck = DeepSpeedCheckpointer(engine, ckpt)
    _train(engine, 1, 1)
    ck.save_checkpoint(ckpt)
    ck.wait(60)
    _train(engine, 2, 2)
    ck.save_checkpoint(ckpt, storage_type=StorageType.MEMORY)
    ck.close(release=False)
    return {"said": [m for m in said if m.startswith("flashckpt:")]}


def one_rank_worker(ckpt: str) -> dict:
    """The same job on 1 rank: DeepSpeed cannot reshard the 2-rank ZeRO partitions held in memory."""
    import logging

    from flashckpt.integrations.deepspeed import DeepSpeedCheckpointer

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("flashckpt.integrations.deepspeed").addHandler(Keep(logging.WARNING))
    engine = _engine("zero1")
    with DeepSpeedCheckpointer(engine, ckpt) as ck:
        try:
            ck.load_checkpoint(ckpt)
        except Exception as e:  # DeepSpeed's own refusal of the 2-rank partitions, from storage as today
            said.append(f"raised {type(e).__name__}")
        return {"source": ck.last_load.source if ck.last_load else None, "said": said}


def test_zero_partitions_of_another_number_of_ranks_say_why_memory_is_not_used(tmp_path):
    """A DeepSpeed job that comes back with 1 rank instead of 2: memory holds ZeRO-1 partitions of 2 ranks,
    which DeepSpeed cannot reshard without a universal checkpoint; one warning says so, and the load is
    DeepSpeed's own from storage, as before (which refuses the 2-rank files of global_step1 itself)."""
    ckpt = str(tmp_path / "ckpt")
    r0, r1 = run_ranks(two_ranks_worker, 2, str(tmp_path / "two"), env={**DS_ENV, "FLASHCKPT_SAVER_GRACE_S": "120"},
                       args={"ckpt": ckpt})
    # flashckpt's figures of each checkpoint in DeepSpeed's own log, on rank 0 (the second one knows step 1 durable)
    assert len(r0["said"]) == 2 and r1["said"] == [], (r0, r1)
    assert "checkpoint of step 2" in r0["said"][1] and "durable: step 1" in r0["said"][1], r0["said"]
    (r,) = run_ranks(one_rank_worker, 1, str(tmp_path / "one"), env=DS_ENV, args={"ckpt": ckpt})
    assert r["source"] != "memory", r  # (None: DeepSpeed's own load refused the 2-rank files, as without us)
    assert any("cannot reshard ZeRO partitions" in m and "saved by 2 ranks" in m for m in r["said"]), r["said"]
