"""The README's promises, as a user reads them (issue #30, items 11-13), each against real savers and processes.

- ``load(into=...)`` fills the given tensors whatever the source: memory, a file system (also through
  ``resume_path``) or an object store, by one rule (same key path, dtype and shape; a plain, contiguous CPU
  or CUDA tensor); a tensor of ``into`` that the rule leaves alone keeps its values, the returned state
  holds the saved one at that key, and one warning names it. (A file system used to ignore ``into``: a
  resume from disk trained on from fresh weights.)
- ``close()``, a ``with`` block (ended either way), ``close(release=False)`` and an exit without
  ``close()`` keep the same thing: the newest snapshot, persisted when it is newer than the last commit.
  (``close()`` used to drop it: the README's loop resumed at step 200 with 249 in memory.)
- A memory snapshot never waits on the saver while shared memory can hold another slot: with persists
  queued (the persist worker frozen) snapshots go on, with a plain engine and with the HF Trainer; a
  snapshot that must wait says so once, at WARNING, with how long, its step and what held the slots.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import traceback
from typing import Any

import pytest
import torch
from flashckpt import CheckpointEngine, StorageType
from helpers import child_pids, saver_pids, wait_for
from s3_fixtures import moto_server_fixture, s3_fixture  # noqa: F401

MEMORY, DISK = StorageType.MEMORY, StorageType.DISK


# ------------------------------------------------------------------------------ 11: load(into=...)
def _saved_state() -> dict[str, Any]:
    """A state whose tensors cover the rule: plain and Parameter tensors, a non-contiguous (transposed)
    one, a view into a larger storage, two keys sharing one storage, and tensors that ``into`` will not
    match (another shape, another dtype)."""
    g = torch.Generator().manual_seed(11)
    base = torch.randn(10, generator=g)
    shared = torch.randn(6, generator=g)
    return {
        "model": {"w": torch.nn.Parameter(torch.randn(4, 8, generator=g)), "b": torch.randn(4, generator=g)},
        "transposed": torch.randn(8, 4, generator=g).t(),
        "view": base[2:6],
        "emb": shared, "head": shared,
        "shape": torch.randn(5, generator=g),
        "dtype": torch.randn(4, generator=g),
        "p": torch.randn(3, generator=g),
        "step": 7,
    }


def _into() -> dict[str, Any]:
    """Fresh tensors to load into, as a model's ``state_dict()`` (and a Parameter that requires grad) gives them."""
    return {
        "model": {"w": torch.zeros(4, 8), "b": torch.zeros(4)},
        "transposed": torch.zeros(4, 8),
        "view": torch.zeros(4),
        "emb": torch.zeros(6), "head": torch.zeros(6),
        "shape": torch.zeros(3),                      # another shape: left alone
        "dtype": torch.zeros(4, dtype=torch.float64),  # another dtype: left alone
        "p": torch.nn.Parameter(torch.zeros(3)),
        "missing": torch.zeros(2),                    # not in the checkpoint: left alone
    }


_FILLED = [("model", "w"), ("model", "b"), ("transposed",), ("view",), ("emb",), ("head",), ("p",)]
_LEFT_ALONE = [("shape",), ("dtype",), ("missing",)]


def _at(tree: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _check_filled(out: dict[str, Any], into: dict[str, Any], saved: dict[str, Any], caplog: Any, source: str) -> None:
    assert out["step"] == 7
    for path in _FILLED:
        got, given, want = _at(out, path), _at(into, path), _at(saved, path)
        assert got is given, f"{source}: {path} was not loaded into the given tensor"
        assert torch.equal(given.detach(), want.detach()), f"{source}: {path} holds other values"
    for path in _LEFT_ALONE[:2]:
        got, given, want = _at(out, path), _at(into, path), _at(saved, path)
        assert got is not given and torch.equal(given, torch.zeros_like(given)), f"{source}: {path} was changed"
        assert got.dtype == want.dtype and torch.equal(got, want), f"{source}: {path} is not the saved tensor"
    assert torch.equal(into["missing"], torch.zeros(2)) and "missing" not in out
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "into" in r.getMessage()]
    assert len(warned) == 1, f"{source}: expected one warning naming what was not filled, got {warned}"
    for name in ("shape", "dtype", "missing"):
        assert name in warned[0], f"{source}: the warning does not name {name!r}: {warned[0]}"


@pytest.mark.parametrize("source", ["memory", "file system", "resume_path"])
def test_load_into_fills_the_given_tensors_from_every_source(source, make_engine, ckpt_dir, runtime_dir, caplog):
    """One rule for every source: a resume from disk lands in the model's own tensors, as one from memory."""
    saved = _saved_state()
    eng = make_engine(max_to_keep=0)
    eng.save(7, saved, storage_type=MEMORY if source == "memory" else DISK)
    if source != "memory":
        eng.wait(60)
        eng.close()
        # A restarted process: memory is gone (the saver freed it as it exited), the step is on storage.
        wait_for(lambda: not saver_pids(runtime_dir), 60, "the saver to exit")
        eng = make_engine(max_to_keep=0)
    into = _into()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flashckpt"):
        if source == "resume_path":
            out = eng.load(os.path.join(ckpt_dir, "step_7", "rank_00000.pt"), into=into)
        else:
            out = eng.load(into=into)
    assert eng.last_load.source == ("memory" if source == "memory" else "storage")
    _check_filled(out, into, saved, caplog, source)
    eng.close()


def test_load_into_fills_the_given_tensors_from_an_object_store(s3, runtime_dir, caplog):
    """The object store's ranged reads follow the same rule: tied, transposed and view tensors are filled too."""
    saved = _saved_state()
    eng = CheckpointEngine(s3.url, max_to_keep=0)
    try:
        eng.save(7, saved, storage_type=DISK)
        eng.wait(120)
    finally:
        eng.close()
    eng = CheckpointEngine(s3.url, max_to_keep=0)
    try:
        into = _into()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="flashckpt"):
            out = eng.load(into=into)
        assert eng.last_load.source == "storage"
        _check_filled(out, into, saved, caplog, "object store")
    finally:
        eng.close()
        wait_for(lambda: not saver_pids(runtime_dir), 60, "the saver to exit")


def test_load_into_a_fileset_from_storage(make_engine, runtime_dir, caplog):
    """A FileSet's torch files are filled as ``{file name: tree}`` says, from storage as from memory."""
    from flashckpt import FileSet

    w = torch.randn(16)
    for source in ("memory", "storage"):
        eng = make_engine(max_to_keep=0)
        fs = FileSet()
        fs.add_torch("optimizer.pt", {"state": {0: w}})
        eng.save(3, fs, path="ckpt-3", storage_type=MEMORY if source == "memory" else DISK)
        if source == "storage":
            eng.wait(60)
            eng.close()
            wait_for(lambda: not saver_pids(runtime_dir), 60, "the saver to exit")  # its memory gone with it
            eng = make_engine(max_to_keep=0)
        target = torch.zeros(16)
        got = eng.load(into={"optimizer.pt": {"state": {0: target}}})
        assert eng.last_load.source == source
        assert got["optimizer.pt"].data["state"][0] is target and torch.equal(target, w), source
        eng.close()


# --------------------------------------------------------------------- 12: every end keeps the newest
_README_LOOP = """
import sys, torch
from flashckpt import CheckpointEngine, StorageType

end, ckpt = sys.argv[1], sys.argv[2]

def train(engine):
    for step in range(250):
        sd = {"model": {"w": torch.full((256,), float(step))}, "step": step}
        engine.save(step, sd, storage_type=StorageType.MEMORY)
        if step % 100 == 0:
            engine.save(step, sd, storage_type=StorageType.DISK)
    engine.wait()

if end in ("with", "with_exception"):
    with CheckpointEngine(ckpt, max_to_keep=3) as engine:
        train(engine)
        if end == "with_exception":
            raise RuntimeError("the training loop failed after step 249")
else:
    engine = CheckpointEngine(ckpt, max_to_keep=3)
    train(engine)
    if end == "close":
        engine.close()
    elif end == "close_keep":
        engine.close(release=False)
    # "exit": the script ends without close()
"""


@pytest.mark.parametrize("end", ["close", "with", "with_exception", "exit", "close_keep"])
def test_every_end_of_an_engine_keeps_the_newest_snapshot(end, ckpt_dir, runtime_dir, tmp_path, make_engine):
    """The README's loop (a memory snapshot every step, DISK every 100) in a process of its own, ended each
    way a script ends: the next run resumes at 249, never at 200. Ends that release the memory (all but
    close(release=False)) have the saver commit 249 and exit; close(release=False) keeps it in memory too."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_README_LOOP))
    proc = subprocess.run([sys.executable, str(script), end, ckpt_dir], capture_output=True, text=True, timeout=180)
    assert proc.returncode == (1 if end == "with_exception" else 0), proc.stderr
    if end != "close_keep":  # released: the saver persists what is newer than the last commit, then exits
        wait_for(lambda: not saver_pids(runtime_dir), 120, "the saver to persist its last words and exit")
    eng = make_engine(max_to_keep=3)
    sd = eng.load()
    assert (eng.last_load.step, sd["step"]) == (249, 249), f"{end}: resumed at {eng.last_load.step}"
    assert torch.equal(sd["model"]["w"], torch.full((256,), 249.0))
    assert eng.last_load.source == ("memory" if end == "close_keep" else "storage")
    wait_for(lambda: 249 in eng.committed_steps(), 120, f"{end}: step 249 to be committed")
    assert eng.committed_steps()[-1] == 249
    eng.close()


# ------------------------------------------------------------------ 13: snapshots never wait on the saver
def _persist_worker(runtime_dir: str) -> int:
    (saver,) = saver_pids(runtime_dir)
    (worker,) = wait_for(lambda: child_pids(saver), 60, "the saver's persist worker")
    return worker


class _Saves(threading.Thread):
    """Runs ``engine.save`` for each (step, storage type) on a thread of its own; ``error`` keeps its failure."""

    def __init__(self, engine: CheckpointEngine, plan: list[tuple[int, StorageType]]) -> None:
        super().__init__(name="test-saves")
        self.engine, self.plan = engine, plan
        self.done: list[int] = []
        self.error = ""
        self.starting = threading.Event()

    def run(self) -> None:
        try:
            for step, kind in self.plan:
                if step == self.plan[-1][0]:
                    self.starting.set()
                self.engine.save(step, {"w": torch.full((64 << 10,), float(step)), "step": step}, storage_type=kind)
                self.done.append(step)
        except Exception:
            self.error = traceback.format_exc()


def _in_slot_wait(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside the writer's wait for a free slot (its innermost Python frame)."""
    frame = sys._current_frames().get(thread.ident or -1)
    return frame is not None and frame.f_code.co_name == "_wait_for_slot"


def test_memory_snapshots_never_wait_while_persists_hold_slots(make_engine, runtime_dir, monkeypatch):
    """Step 1's persist is stuck (its worker frozen, slot pinned) and step 2's queued behind it (slot
    pending): the memory snapshots after them all complete while both still hold their slots. (With two
    slots and one spare, the second snapshot waited for the persist.)"""
    monkeypatch.setenv("FLASHCKPT_PERSIST_WORKER_IDLE_S", "600")
    eng = make_engine(max_to_keep=0)
    eng.save(0, {"w": torch.zeros(64 << 10), "step": 0}, storage_type=DISK)
    eng.wait(60)  # the persist worker is there to freeze
    worker = _persist_worker(runtime_dir)
    os.kill(worker, signal.SIGSTOP)
    saves = _Saves(eng, [(1, DISK), (2, DISK)] + [(s, MEMORY) for s in range(3, 10)])
    try:
        saves.start()
        wait_for(lambda: not saves.is_alive(), 60, "the snapshots to complete while the persists of steps 1 and 2 "
                 "hold their slots")
        assert not saves.error, saves.error
        assert saves.done == list(range(1, 10))
    finally:
        os.kill(worker, signal.SIGCONT)
        saves.join(120)
    eng.wait(120)
    assert eng.committed_steps() == [0, 1, 2] and eng.memory_steps()[0] == 9
    assert eng.load()["step"] == 9
    eng.close()


def test_a_snapshot_that_must_wait_logs_how_long_and_what_held_the_slots(make_engine, runtime_dir, monkeypatch,
                                                                         caplog):
    """With one spare slot (FLASHCKPT_SPARE_SLOTS=1), two persists held and the newest snapshot fill every
    slot: the next snapshot waits, and says so once, at WARNING, with its step, how long it waited and what
    held the slots; it is taken, never skipped."""
    monkeypatch.setenv("FLASHCKPT_PERSIST_WORKER_IDLE_S", "600")
    monkeypatch.setenv("FLASHCKPT_SPARE_SLOTS", "1")
    eng = make_engine(max_to_keep=0)
    eng.save(0, {"w": torch.zeros(64 << 10), "step": 0}, storage_type=DISK)
    eng.wait(60)
    worker = _persist_worker(runtime_dir)
    os.kill(worker, signal.SIGSTOP)
    saves = _Saves(eng, [(1, DISK), (2, DISK), (3, MEMORY), (4, MEMORY)])
    caplog.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="flashckpt.memory.writer"):
            saves.start()
            wait_for(lambda: saves.starting.is_set() and _in_slot_wait(saves), 60, "the snapshot of step 4 to wait")
            os.kill(worker, signal.SIGCONT)
            saves.join(120)
    finally:
        os.kill(worker, signal.SIGCONT)
        saves.join(120)
    assert not saves.error, saves.error
    assert saves.done == [1, 2, 3, 4]
    waits = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(waits) == 1, waits
    msg = waits[0]
    assert "step 4" in msg and " s " in msg and "step 1" in msg and "step 2" in msg and "step 3" in msg, msg
    eng.wait(120)
    assert eng.committed_steps() == [0, 1, 2]
    eng.close()


@pytest.mark.framework
def test_hf_trainer_snapshots_every_step_never_wait_for_its_disk_saves(tmp_path, runtime_dir, monkeypatch):
    """The HF Trainer snapshotting every step (``memory_snapshot_steps=1``) with a disk save every 2 steps, its
    persists stuck from step 4 on (the persist worker frozen until the end of training): the saves of steps
    4-8 go on while the persists of 4, 6 and 8 hold their slots. (Unfixed, the save of step 8 waited for a
    slot until the fallback timer let the worker go; with fast steps the same wait came behind a persist
    worker's start, 0.8-1.5 s each time.)"""
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # recorded: Accelerate's CUDA probe may set it
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")
    monkeypatch.setenv("FLASHCKPT_PERSIST_WORKER_IDLE_S", "600")  # the worker is there to freeze at step 4
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "framework"))
    from test_hf import _hold_last_persist, make_trainer
    from test_hf import committed as hf_committed

    hold = _hold_last_persist(runtime_dir, 4, 30.0)
    out = str(tmp_path / "out")
    t = hold.trainer = make_trainer(out, callbacks=[hold], save_steps=2)
    try:
        t.train()
    finally:
        hold.close()
    assert hold.released_by == "on_train_end", "a save waited for a slot until the persist worker was let go"
    assert hf_committed(out) == [2, 4, 6, 8]
