"""The documented API as written (issue 16, sections 2 and 3), with real engines and savers:

- DLRover's custom ``CheckpointDeletionStrategy`` contract (``clean_up(step, delete_func)``, ``delete_func``
  taking a path) and its built-in strategies with their documented arguments; what ``delete_func`` refuses.
- Relative paths built as DLRover's guide builds them (``os.path.join(checkpoint_dir, ...)``) with a
  relative ``checkpoint_dir`` mean that path, never ``checkpoint_dir/checkpoint_dir/...``.
- URLs: a scheme no storage backend serves (``gs://``, ``hdfs://``) is refused by the engine and every
  adapter with a clear error, before anything is made; ``file://`` maps. (``s3://`` is served: the adapters on
  it are tests/multiproc/test_s3_engine.py's, tests/framework/test_s3_dist_adapters.py's, test_hf_s3.py's and test_lightning_s3.py's.)
- ``auto_save=True`` without failure rates uses (and logs) the published default.
- With ``weights_only=True`` a state dict that would not load back is refused at save time.
- The public package exports no half-match of DLRover's internal classes.
- Error messages: a file as the checkpoint dir, a missing or outside ``resume_path``, use after close.
"""

from __future__ import annotations

import logging
import math
import os

import flashckpt
import pytest
import torch
from flashckpt import (
    CheckpointDeletionStrategy,
    CheckpointDirError,
    CheckpointEngine,
    FileSet,
    FlashCheckpointError,
    InvalidStateDictError,
    KeepLatestStepStrategy,
    KeepStepIntervalStrategy,
    PersistError,
    StorageType,
)
from flashckpt.integrations.ddp import DdpCheckpointer
from helpers import assert_same_tree, hold_persist, release_persist, saver_pids, wait_for

DISK, MEMORY = StorageType.DISK, StorageType.MEMORY


def listing(d: str) -> list[str]:
    """The entries of ``d``, less flashckpt's commit records (which are moving out of the checkpoint dir)."""
    return sorted(n for n in os.listdir(d) if n != ".flashckpt")


def sd(step: int) -> dict:
    return {"w": torch.full((8,), float(step)), "step": step}


# ------------------------------------------------------------------------------------------ deletion strategies
class GuideStrategy(CheckpointDeletionStrategy):
    """Written as DLRover's guide shows: ``__init__`` and ``clean_up(self, step, delete_func)`` only."""

    def __init__(self, *args, **kwargs):
        self.checkpoint_dir = args[0]
        self.calls: list[int] = []

    def clean_up(self, step, delete_func):
        self.calls.append(step)
        if step % 20 != 0:  # keep every 20th, as KeepStepIntervalStrategy(20) would
            delete_func(os.path.join(self.checkpoint_dir, f"checkpoint-{step}.pt"))


def test_a_guide_style_clean_up_strategy_deletes_the_superseded_checkpoints(runtime_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checkpoint_dir = "work/s01"  # relative, as scripts often give it
    strategy = GuideStrategy(checkpoint_dir)
    ck = DdpCheckpointer(checkpoint_dir, deletion_strategy=strategy)
    try:
        for step in (10, 20, 30, 40):
            ckpt_path = os.path.join(checkpoint_dir, f"checkpoint-{step}.pt")
            ck.save_checkpoint(step, sd(step), ckpt_path, storage_type=DISK)
            ck.wait_latest_checkpoint(60)
        ck.wait_latest_checkpoint(60)  # the deletions the last commit scheduled
        # Called once per commit with the step it superseded, as DLRover does.
        assert strategy.calls == [10, 20, 30]
        assert listing(checkpoint_dir) == ["checkpoint-20.pt", "checkpoint-40.pt"]
        # The records follow: the deleted steps are no longer committed; the newest loads.
        assert ck.engine.committed_steps() == [20, 40]
        assert_same_tree(sd(40), ck.load_checkpoint())
    finally:
        ck.close()


class Recorder(CheckpointDeletionStrategy):
    def __init__(self):
        self.calls: list[int] = []

    def clean_up(self, step, delete_func):
        self.calls.append(step)
        raise RuntimeError("a broken strategy")


def test_an_exception_in_clean_up_is_logged_never_raised_into_training(make_engine, ckpt_dir, caplog):
    strategy = Recorder()
    eng = make_engine(deletion_strategy=strategy)
    with caplog.at_level(logging.ERROR, logger="flashckpt.engine"):
        for step in (1, 2):
            eng.save(step, sd(step), storage_type=DISK)
            eng.wait(60)
    assert strategy.calls == [1]
    assert "Recorder.clean_up(step=1)" in caplog.text and "a broken strategy" in caplog.text
    assert eng.committed_steps() == [1, 2]
    eng.close()


def test_delete_func_refuses_what_it_must_not_delete(make_engine, ckpt_dir, tmp_path):
    eng = make_engine(max_to_keep=0)
    eng.save(1, sd(1), path="one.pt", storage_type=DISK)
    fs = FileSet().add_raw("a.bin", b"a" * 10).add_raw("b.bin", b"b" * 10)
    eng.save(2, fs, path="two", storage_type=DISK)
    eng.save(3, sd(3), path="three.pt", storage_type=DISK)
    eng.wait(60)
    outside = tmp_path / "elsewhere.pt"
    outside.write_bytes(b"x")
    refused = {
        str(outside): "outside the checkpoint dir",
        ckpt_dir: "the checkpoint dir itself",
        "three.pt": "newest committed",
        "two/a.bin": "only part of committed step 2",
    }
    for path, why in refused.items():
        with pytest.raises(CheckpointDirError, match=why):
            eng.delete_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        eng.delete_checkpoint("nothing-here.pt")
    eng.wait(60)
    assert outside.read_bytes() == b"x"
    assert eng.committed_steps() == [1, 2, 3]
    assert listing(os.path.join(ckpt_dir, "two")) == ["a.bin", "b.bin"]

    # A whole step's directory (relative to the checkpoint dir) and a step number are deleted, records too.
    eng.delete_checkpoint("two")
    eng.delete_checkpoint(1)
    eng.wait(60)
    assert eng.committed_steps() == [3]
    assert not os.path.exists(os.path.join(ckpt_dir, "two"))
    assert not os.path.exists(os.path.join(ckpt_dir, "one.pt"))
    assert_same_tree(sd(3), eng.load())
    eng.close()


def test_delete_func_never_deletes_a_checkpoint_being_persisted(make_engine, ckpt_dir):
    eng = make_engine(max_to_keep=0)
    eng.save(1, sd(1), path="one.pt", storage_type=DISK)
    eng.wait(60)
    fifo = hold_persist(os.path.join(ckpt_dir, "two", "model.pt"))  # the persist of step 2 blocks
    eng.save(2, sd(2), path="two/model.pt", storage_type=DISK)
    for path in ("two", "two/model.pt"):
        with pytest.raises(CheckpointDirError, match="step 2 is being persisted"):
            eng.delete_checkpoint(path)
    release_persist(fifo)  # the persist fails with a broken pipe
    with pytest.raises(PersistError):
        eng.wait(60)
    assert eng.committed_steps() == [1]
    assert_same_tree(sd(2), eng.load())  # the snapshot is still in memory
    eng.close()


@pytest.mark.parametrize("strategy, kept", [
    (lambda d: KeepLatestStepStrategy(max_to_keep=2, checkpoint_dir=d), [3, 4]),
    (lambda d: KeepStepIntervalStrategy(keep_interval=2, checkpoint_dir=d), [2, 4]),
])
def test_built_in_strategies_with_their_documented_arguments(make_engine, ckpt_dir, strategy, kept):
    eng = make_engine(deletion_strategy=strategy(ckpt_dir))
    for step in (1, 2, 3, 4):
        eng.save(step, sd(step), storage_type=DISK)
        eng.wait(60)
    eng.wait(60)
    assert eng.committed_steps() == kept
    eng.close()


def test_a_strategy_must_implement_one_contract():
    class Nothing(CheckpointDeletionStrategy):
        pass

    for cls in (CheckpointDeletionStrategy, Nothing):
        with pytest.raises(TypeError, match="clean_up"):
            cls()


# ------------------------------------------------------------------------------------------ relative paths
def test_a_relative_path_from_the_cwd_with_an_absolute_checkpoint_dir(tmp_path, monkeypatch):
    from flashckpt.engine.engine import resolve_in

    monkeypatch.chdir(tmp_path)
    root = str(tmp_path / "work" / "s01")
    os.makedirs(os.path.join(root, "sub"))
    assert resolve_in(root, root, "work/s01/a.pt") == os.path.join(root, "a.pt")
    assert resolve_in(root, root, "a.pt") == os.path.join(root, "a.pt")
    monkeypatch.chdir(root)  # the checkpoint dir itself: every relative path is inside it
    assert resolve_in(root, root, "step_1/a.pt") == os.path.join(root, "step_1", "a.pt")
    monkeypatch.chdir(os.path.join(root, os.pardir))  # inside it: "s01/a.pt" from here
    assert resolve_in(root, root, "s01/a.pt") == os.path.join(root, "a.pt")
    monkeypatch.chdir(os.path.join(root, "sub"))  # below it: the rule does not apply
    assert resolve_in(root, root, "step_1/a.pt") == os.path.join(root, "step_1", "a.pt")


def test_a_path_joined_onto_a_relative_checkpoint_dir_is_never_doubled(runtime_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checkpoint_dir = "work/s01"
    ck = DdpCheckpointer(checkpoint_dir)
    try:
        ck.save_checkpoint(10, sd(10), os.path.join(checkpoint_dir, "checkpoint-10.pt"), storage_type=DISK)
        ck.save_checkpoint(20, sd(20), "checkpoint-20.pt", storage_type=DISK)  # bare: inside the dir
        ck.save_checkpoint(30, sd(30), "./work/s01/sub/checkpoint-30.pt", storage_type=DISK)
        ck.wait_latest_checkpoint(60)
        assert listing(checkpoint_dir) == ["checkpoint-10.pt", "checkpoint-20.pt", "sub"]
        assert not os.path.exists(os.path.join(checkpoint_dir, "work"))
        assert_same_tree(sd(10), ck.load_checkpoint(os.path.join(checkpoint_dir, "checkpoint-10.pt")))
        assert_same_tree(sd(20), ck.load_checkpoint("checkpoint-20.pt"))
        # The rule holds after a chdir: the path names what it named where the dir was given.
        os.chdir(tmp_path / "work")
        assert_same_tree(sd(30), ck.load_checkpoint("work/s01/sub/checkpoint-30.pt"))
    finally:
        ck.close()


def test_resolve_rule():
    from flashckpt.engine.engine import resolve_in

    root = "/cwd/work/s01"
    assert resolve_in(root, "work/s01", "work/s01/ckpt-10.pt") == "/cwd/work/s01/ckpt-10.pt"
    assert resolve_in(root, "./work/s01/", "work/s01") == root
    assert resolve_in(root, "work/s01", "ckpt-10.pt") == "/cwd/work/s01/ckpt-10.pt"
    assert resolve_in(root, "work/s01", "work/s01x/a.pt") == "/cwd/work/s01/work/s01x/a.pt"
    assert resolve_in(root, "/cwd/work/s01", "work/s01/a.pt") == "/cwd/work/s01/work/s01/a.pt"  # not seen from here
    assert resolve_in(root, "work/s01", "/abs/a.pt") == "/abs/a.pt"
    assert resolve_in(root, "work/s01", "file:///abs/a.pt") == "/abs/a.pt"


# ------------------------------------------------------------------------------------------ URLs
@pytest.mark.parametrize("url", ["gs://b/p", "GS://bucket", "hdfs://nn:8020/ckpt"])
def test_urls_no_backend_serves_are_refused_by_the_engine_and_the_adapters(runtime_dir, tmp_path, monkeypatch, url):
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # recorded (lightning's import sets it), then unset
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")
    from flashckpt.integrations.fsdp import FsdpShardCheckpointer
    from flashckpt.integrations.hf import FlashCkptConfig
    from flashckpt.integrations.lightning import FlashCheckpointIO, FlashMemorySnapshot
    from flashckpt.patches.megatron._lm import get_checkpointer
    from flashckpt.patches.megatron.dist_ckpt import MegatronCheckpointer

    monkeypatch.chdir(tmp_path)
    for make in (CheckpointEngine, DdpCheckpointer, FsdpShardCheckpointer, MegatronCheckpointer, get_checkpointer,
                 lambda u: FlashCkptConfig(checkpoint_dir=u), FlashCheckpointIO,
                 lambda u: FlashMemorySnapshot(dirpath=u)):
        with pytest.raises(CheckpointDirError, match="no storage backend serves") as ei:
            make(url)
        assert "s3" in str(ei.value) and "mount" in str(ei.value), ei.value  # the served schemes, and what to do
    assert os.listdir(tmp_path) == [], "a local directory was made for a URL"
    assert not saver_pids(runtime_dir)


def test_a_file_url_maps_to_its_local_path(make_engine, tmp_path):
    d = tmp_path / "via url"
    eng = make_engine(f"file://{str(d).replace(' ', '%20')}")
    assert eng.checkpoint_dir == str(d)
    eng.save(1, sd(1), storage_type=DISK)
    eng.wait(60)
    assert os.path.isfile(os.path.join(d, "step_1", "rank_00000.pt"))
    eng.close()
    with pytest.raises(CheckpointDirError, match="three slashes"):
        CheckpointEngine("file://host/ckpt")


# ------------------------------------------------------------------------------------------ auto_save
def test_auto_save_without_failure_rates_uses_the_published_default(make_engine, caplog):
    from flashckpt.engine.interval import default_failure_rates

    with caplog.at_level(logging.INFO, logger="flashckpt.engine"):
        eng = make_engine(auto_save=True, max_to_keep=0)
    assert "419 unexpected interruptions in 54 days on 16,384 GPUs" in caplog.text
    rates = default_failure_rates(1)
    assert f"process_mtbf_s={rates.process_mtbf_s:,.0f}" in caplog.text
    assert eng.save(1, sd(1)) is True  # the first decision measures: a memory snapshot
    assert eng.memory_steps() == [1]
    eng.close()


def test_default_failure_rates_follow_the_llama3_report():
    from flashckpt.engine.interval import GPU_MTBF_S, default_failure_rates

    assert GPU_MTBF_S == pytest.approx(16384 * 54 * 86400 / 419)
    one, many = default_failure_rates(1), default_failure_rates(16384)
    # 16,384 GPUs fail 419 times in 54 days; 78% of them are counted as node failures.
    job_failures_per_day = 86400 / many.process_mtbf_s + 86400 / many.node_mtbf_s
    assert job_failures_per_day == pytest.approx(419 / 54)
    assert 86400 / many.node_mtbf_s == pytest.approx(0.78 * 419 / 54)
    assert one.node_mtbf_s == pytest.approx(16384 * many.node_mtbf_s)
    with pytest.raises(ValueError):
        default_failure_rates(0)
    assert math.isfinite(one.process_mtbf_s)


# ------------------------------------------------------------------------------------------ weights_only at save
class RunConfig:
    """A training script's own config object (argparse.Namespace is one too, but importing megatron-core,
    as another test here does, adds that one to torch's safe globals for the whole process)."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunConfig) and other.lr == self.lr


def test_an_object_weights_only_loading_refuses_fails_at_save_and_costs_nothing(make_engine, ckpt_dir):
    eng = make_engine(max_to_keep=0)
    eng.save(1, sd(1), storage_type=DISK)
    eng.wait(60)
    bad = {"model": {"w": torch.ones(4)}, "cfg": {"args": RunConfig(0.1)}, "step": 2}
    for storage in (MEMORY, DISK):
        with pytest.raises(InvalidStateDictError) as ei:
            eng.save(2, bad, storage_type=storage)
        msg = str(ei.value)
        assert "['cfg']['args']" in msg and "RunConfig" in msg
        assert "weights_only=False" in msg and "add_safe_globals([test_documented_api.RunConfig])" in msg
    eng.wait(60)
    assert eng.memory_steps() == [1] and eng.committed_steps() == [1]
    assert not os.path.exists(os.path.join(ckpt_dir, "step_2"))
    assert_same_tree(sd(1), eng.load())
    # A state dict that passed once is not waved through when its object changes to one refused.
    ok = {"w": torch.ones(2), "opt": {"betas": (0.9, 0.99)}, "v": {1, 2}}
    eng.save(3, ok, storage_type=MEMORY)
    ok["v"] = frozenset([1])
    with pytest.raises(InvalidStateDictError, match=r"\['v'\].*add_safe_globals\(\[frozenset\]\)"):
        eng.save(4, ok, storage_type=MEMORY)
    eng.close()


def test_the_fixes_the_message_names_work(make_engine, ckpt_dir, tmp_path):
    bad = {"w": torch.ones(4), "args": RunConfig(0.1)}
    with torch.serialization.safe_globals([RunConfig]):
        eng = make_engine(max_to_keep=0)
        eng.save(1, bad, storage_type=DISK)
        eng.wait(60)
        assert eng.load()["args"] == bad["args"]
        eng.close()
    trusting = make_engine(str(tmp_path / "trusted"), max_to_keep=0, weights_only=False)
    trusting.save(1, bad, storage_type=DISK)
    trusting.wait(60)
    assert trusting.load("step_1/rank_00000.pt")["args"] == bad["args"]
    trusting.close()


def test_argparse_namespace_is_refused_at_save(tmp_path, runtime_dir):
    """The issue's own example, in a fresh interpreter (megatron-core, imported by other tests, allows it)."""
    import subprocess
    import sys

    code = ("import argparse, torch\n"
            "from flashckpt import CheckpointEngine, InvalidStateDictError, StorageType\n"
            f"e = CheckpointEngine({str(tmp_path / 'c')!r})\n"
            "try:\n"
            "    e.save(1, {'w': torch.ones(2), 'args': argparse.Namespace(lr=0.1)}, storage_type=StorageType.DISK)\n"
            "except InvalidStateDictError as x:\n"
            "    print('REFUSED', x)\n"
            "e.close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in out.stdout and "add_safe_globals([argparse.Namespace])" in out.stdout, out.stdout + out.stderr
    wait_for(lambda: not saver_pids(runtime_dir), 30, "the saver to exit")


# ------------------------------------------------------------------------------------------ exports
def test_the_public_package_exports_no_half_match_of_dlrovers_internal_classes():
    for name in ("TensorMeta", "SharedMemoryHandler", "SharedLock", "SharedQueue", "SharedDict"):
        assert name not in flashckpt.__all__ and name not in dir(flashckpt)
    for name in ("TensorMeta", "SharedMemoryHandler", "SharedLock", "SharedQueue", "SharedDict"):
        with pytest.raises(ImportError):
            exec(f"from flashckpt import {name}", {})
    for name in flashckpt.__all__:
        assert getattr(flashckpt, name) is not None


# ------------------------------------------------------------------------------------------ error messages
def test_a_file_given_as_the_checkpoint_dir_is_named_a_file(runtime_dir, tmp_path):
    f = tmp_path / "ckpt.pt"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointDirError, match="is a file, not a directory") as ei:
        CheckpointEngine(str(f))
    assert "Errno" not in str(ei.value)
    with pytest.raises(CheckpointDirError, match=f"lies under {f}, which is a file"):
        CheckpointEngine(str(f / "sub"))
    assert f.read_bytes() == b"x" and not saver_pids(runtime_dir)


def test_a_dir_another_rank_makes_between_the_checks_is_not_called_a_file(tmp_path, monkeypatch):
    """Ranks make a missing checkpoint dir at once: the one that saw it missing, then present, takes it as the
    directory it now is (CI saw a DDP rank refuse the dir its peer had just made as "a file")."""
    from flashckpt.commit.checkpoint_dir import prepare_dir
    from flashckpt.storage.posix import PosixDiskStorage

    root = tmp_path / "runs" / "s01"
    lexists = os.path.lexists

    def made_meanwhile(p):  # the other rank's makedirs lands right after this rank's isdir said "missing"
        if p == str(root):
            os.makedirs(root, exist_ok=True)
        return lexists(p)

    monkeypatch.setattr(os.path, "lexists", made_meanwhile)
    prepare_dir(PosixDiskStorage(), str(root), "runs/s01")
    assert root.is_dir()


def test_a_missing_resume_path_is_named_as_given_with_the_committed_steps(make_engine, ckpt_dir):
    eng = make_engine(max_to_keep=0)
    for step in (5, 6):
        eng.save(step, sd(step), storage_type=DISK)
    eng.wait(60)
    with pytest.raises(FileNotFoundError) as ei:
        eng.load(resume_path="step_7/rank_00000.pt")
    msg = str(ei.value)
    assert "load(resume_path='step_7/rank_00000.pt')" in msg
    assert f"step 5: {ckpt_dir}/step_5/rank_00000.pt" in msg and "step 6:" in msg
    eng.close()


def test_a_resume_path_outside_says_what_load_accepts(make_engine, ckpt_dir, tmp_path):
    eng = make_engine(max_to_keep=0)
    eng.save(5, sd(5), storage_type=DISK)
    eng.wait(60)
    other = tmp_path / "other.pt"
    torch.save(sd(1), other)
    with pytest.raises(CheckpointDirError) as ei:
        eng.load(resume_path=str(other))
    msg = str(ei.value)
    assert "persist paths" not in msg
    assert "load() reads this checkpoint dir only" in msg and "step 5:" in msg
    eng.close()


def test_use_after_close_says_the_checkpointer_is_closed(runtime_dir, ckpt_dir):
    ck = DdpCheckpointer(ckpt_dir)
    ck.close()
    for call in (lambda: ck.save_checkpoint(1, sd(1), storage_type=MEMORY), ck.load_checkpoint,
                 ck.wait_latest_checkpoint):
        with pytest.raises(FlashCheckpointError) as ei:
            call()
        msg = str(ei.value)
        assert "this checkpointer is closed" in msg and "create a new checkpointer" in msg
        assert "CheckpointEngine" not in msg
    wait_for(lambda: not saver_pids(runtime_dir), 30, "the saver to exit")


def test_the_package_exports_what_users_call_and_keeps_building_blocks_in_their_modules():
    import importlib

    from flashckpt import errors

    assert set(errors.__all__) <= set(flashckpt.__all__)  # every error a user may catch
    for name, module in {"CommitLayout": "commit.layout", "Manifest": "commit.manifest", "PosixDiskStorage": "storage",
                         "FileRecord": "storage", "CheckpointSaver": "saver", "Located": "engine.engine",
                         "FileEntry": "format.files"}.items():
        assert name not in flashckpt.__all__
        assert getattr(importlib.import_module(f"flashckpt.{module}"), name) is not None
