"""CheckpointEngine behaviour in one process (plus real restarted processes): snapshot isolation, tied
weights, re-planning, restart from memory, interval decisions, resume paths, retention by count, and the
fall-backs from memory to storage and from a damaged step to the previous one."""

from __future__ import annotations

import logging
import math
import os
import signal

import pytest
import torch
from flashckpt import CheckpointCorruptError, CheckpointDirError, FlashCheckpointError, StorageType
from flashckpt.commit.layout import CommitLayout
from flashckpt.format.segment import segment_paths
from flashckpt.storage.posix import PosixDiskStorage
from helpers import (
    assert_same_tree,
    child_pids,
    launch_ranks,
    leftovers,
    run_ranks,
    saver_pids,
    wait_for,
    wait_savers_gone,
)

DISK, MEMORY = StorageType.DISK, StorageType.MEMORY


def rank_file(ckpt: str, step: int, rank: int = 0) -> str:
    return os.path.join(ckpt, f"step_{step}", f"rank_{rank:05d}.pt")


def committed(ckpt: str) -> list[int]:
    return CommitLayout(ckpt, PosixDiskStorage()).committed_steps()


def model_sd(seed: int, extra: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g), "step": seed,
          "nested": {"m": [torch.randn(3, generator=g)]}}
    if extra:
        sd["exp_avg"] = torch.randn(extra, generator=g)
    return sd


def clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: clone_tree(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clone_tree(v) for v in x]
    return x


# ---------------------------------------------------------------------------------------- workers
def restarted_trainer(ckpt_dir: str) -> dict:
    """A new process: loads what is in memory, then says its final goodbye."""
    from flashckpt import CheckpointEngine

    eng = CheckpointEngine(ckpt_dir, max_to_keep=0)
    try:
        sd = eng.load()
        return {"source": eng.last_load.source, "step": eng.last_load.step, "w": sd["w"].tolist(),
                "step_leaf": sd["step"]}
    finally:
        eng.close(release=True)


def crashing_trainer(ckpt_dir: str, ready_file: str) -> None:
    """Saves (DISK step 1, MEMORY step 2), reports ready and waits to be killed with SIGKILL."""
    import threading

    from flashckpt import CheckpointEngine

    eng = CheckpointEngine(ckpt_dir, max_to_keep=0)
    eng.save(1, model_sd(1), storage_type=DISK)
    eng.wait(60)
    eng.save(2, model_sd(2), storage_type=MEMORY)
    with open(ready_file, "w") as f:
        f.write("ready")
    threading.Event().wait(120)  # killed long before this
    raise RuntimeError("crashing_trainer was not killed")


# ---------------------------------------------------------------------------------------- tests
def test_mutation_after_save_does_not_change_the_snapshot(make_engine, ckpt_dir):
    eng = make_engine(max_to_keep=0)
    sd = model_sd(1)
    sd["big"] = torch.randn(1 << 20)  # 4 MiB: the multi-threaded copy path
    original = clone_tree(sd)
    assert eng.save(1, sd, storage_type=DISK)
    for t in (sd["w"], sd["b"], sd["big"], sd["nested"]["m"][0]):
        t.add_(1000.0)  # in place, right after save() returned and while the persist may still run
    sd["w"] = torch.zeros(1)
    assert_same_tree(original, eng.load(), "memory")
    assert eng.last_load.source == "memory"
    eng.wait(60)
    assert_same_tree(original, torch.load(rank_file(ckpt_dir, 1), weights_only=True), "persisted")

    eng.save(2, sd, storage_type=MEMORY)
    mem2 = clone_tree(sd)
    sd["b"].zero_()
    assert_same_tree(mem2, eng.load(), "memory step 2")
    eng.close()


def test_tied_weights_are_stored_once_and_restored_shared(make_engine, ckpt_dir):
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(100, 16)
            self.lm_head = torch.nn.Linear(16, 100, bias=False)
            self.lm_head.weight = self.emb.weight  # tied, as in most language models

    sd = Tiny().state_dict()
    sd["emb_rows"] = sd["emb.weight"][10:20]  # a view into the same storage, at an offset
    assert sd["emb.weight"].untyped_storage().data_ptr() == sd["lm_head.weight"].untyped_storage().data_ptr()
    eng = make_engine(max_to_keep=0)
    eng.save(3, sd, storage_type=DISK)
    eng.wait(60)

    def check_shared(out, where):
        assert_same_tree(sd, out, where)
        ptr = out["emb.weight"].untyped_storage().data_ptr()
        assert out["lm_head.weight"].untyped_storage().data_ptr() == ptr, f"{where}: tie lost"
        assert out["emb_rows"].untyped_storage().data_ptr() == ptr, f"{where}: view lost its base"
        out["emb.weight"][15].fill_(7.0)  # one write is seen through every alias
        assert torch.all(out["lm_head.weight"][15] == 7.0) and torch.all(out["emb_rows"][5] == 7.0), where

    mem = eng.load()
    assert eng.last_load.source == "memory"
    assert eng.last_load.nbytes < 2 * sd["emb.weight"].nbytes, "tied storage was copied more than once"
    check_shared(mem, "memory")
    check_shared(torch.load(rank_file(ckpt_dir, 3), weights_only=True), "torch.load")
    check_shared(eng.load(resume_path="step_3/rank_00000.pt"), "engine storage")
    eng.close()


def test_changed_structure_replans_and_round_trips(make_engine, ckpt_dir):
    eng = make_engine(max_to_keep=0)
    s1 = model_sd(1)
    eng.save(1, s1, storage_type=DISK)
    eng.wait(60)
    segs = segment_paths(eng.job_dir, 0)
    assert len(segs) == 1

    s2 = model_sd(2, extra=64)  # lazily created optimizer state that still fits the slot's slack
    eng.save(2, s2, storage_type=DISK)
    assert_same_tree(s2, eng.load(), "step 2 from memory")
    assert segment_paths(eng.job_dir, 0) == segs, "re-allocated although the new structure fit"

    s3 = model_sd(3, extra=1 << 20)  # 4 MiB more: no longer fits, a new segment is allocated
    eng.save(3, s3, storage_type=DISK)
    assert_same_tree(s3, eng.load(), "step 3 from memory")
    assert eng.last_load.step == 3 and eng.last_load.source == "memory"
    assert segment_paths(eng.job_dir, 0)[-1] != segs[-1]
    eng.wait(60)
    assert_same_tree(s2, torch.load(rank_file(ckpt_dir, 2), weights_only=True), "step 2 persisted")
    assert_same_tree(s3, torch.load(rank_file(ckpt_dir, 3), weights_only=True), "step 3 persisted")

    s4 = model_sd(4, extra=1 << 20)  # same structure again: reuses the new segment
    eng.save(4, s4, storage_type=MEMORY)
    assert_same_tree(s4, eng.load(), "step 4 from memory")
    # The outgrown segment is freed once the new one holds a complete snapshot (no persist reads it).
    wait_for(lambda: len(segment_paths(eng.job_dir, 0)) == 1, 10, "the outgrown segment to be freed")
    assert eng.memory_steps()[0] == 4
    eng.close()


@pytest.mark.multiproc
def test_new_process_loads_from_memory_after_release_false(make_engine, ckpt_dir, runtime_dir, tmp_path):
    eng = make_engine(max_to_keep=0)
    eng.save(1, model_sd(1), storage_type=DISK)
    eng.wait(60)
    s2 = model_sd(2)
    eng.save(2, s2, storage_type=MEMORY)
    job_dir = eng.job_dir
    eng.close(release=False)  # a planned restart: the saver keeps the snapshots for its grace period
    assert saver_pids(runtime_dir), "the saver exited although the trainer did not release its snapshots"

    (res,) = run_ranks(restarted_trainer, 1, str(tmp_path / "restart"), args={"ckpt_dir": ckpt_dir}, dist=False)
    assert (res["source"], res["step"]) == ("memory", 2)
    assert res["w"] == s2["w"].tolist() and res["step_leaf"] == 2
    # The new process said its final goodbye: the saver exits and leaves nothing behind.
    wait_savers_gone(runtime_dir)
    assert not os.path.exists(job_dir) and leftovers(runtime_dir) == []
    assert 1 in committed(ckpt_dir)  # (step 2 may be committed too: last words of a non-final close)


@pytest.mark.multiproc
def test_new_process_loads_from_memory_after_a_crash(runtime_dir, ckpt_dir, tmp_path):
    ready = str(tmp_path / "ready")
    crashed = launch_ranks(crashing_trainer, 1, str(tmp_path / "crash"), dist=False,
                           args={"ckpt_dir": ckpt_dir, "ready_file": ready})
    try:
        wait_for(lambda: os.path.exists(ready) or crashed.procs[0].poll() is not None, 120, "the trainer to save")
        assert os.path.exists(ready), crashed.logs()
    finally:
        crashed.kill()  # SIGKILL: no goodbye, no clean-up in the trainer
    assert crashed.procs[0].returncode == -signal.SIGKILL
    assert saver_pids(runtime_dir), "the saver died with its trainer"
    # Last words: the saver persists and commits the newest snapshot, newer than the last commit.
    wait_for(lambda: committed(ckpt_dir) == [1, 2], 60, "the last-words commit of step 2")
    assert_same_tree(model_sd(2), torch.load(rank_file(ckpt_dir, 2), weights_only=True))

    (res,) = run_ranks(restarted_trainer, 1, str(tmp_path / "restart"), args={"ckpt_dir": ckpt_dir}, dist=False)
    assert (res["source"], res["step"]) == ("memory", 2)
    assert res["w"] == model_sd(2)["w"].tolist()
    wait_savers_gone(runtime_dir)
    assert leftovers(runtime_dir) == []


def test_save_without_storage_type_follows_the_intervals(make_engine, ckpt_dir):
    eng = make_engine(max_to_keep=0, save_mem_interval=2, save_storage_interval=3)
    assert eng.load() == {} and eng.last_load.source == "none" and eng.last_load.step is None
    taken = {step: eng.save(step, model_sd(step)) for step in range(1, 8)}
    assert taken == {1: False, 2: True, 3: True, 4: True, 5: False, 6: True, 7: False}
    eng.wait(60)
    assert committed(ckpt_dir) == [3, 6]  # storage interval wins when both match (6)
    assert not os.path.exists(os.path.join(ckpt_dir, "step_2")) and not os.path.exists(os.path.join(ckpt_dir, "step_4"))
    mem = eng.memory_steps()
    assert mem[0] == 6 and not {1, 5, 7} & set(mem)
    assert_same_tree(model_sd(6), eng.load())
    eng.close()


def test_save_without_storage_type_or_intervals_is_an_error(make_engine):
    eng = make_engine()
    with pytest.raises(ValueError, match="no interval is set"):
        eng.save(1, model_sd(1))
    assert eng.memory_steps() == []
    eng.close()


def test_load_resume_path(make_engine, ckpt_dir):
    eng = make_engine(max_to_keep=0)
    for step in (1, 2):
        eng.save(step, model_sd(step), storage_type=DISK)
    eng.save(5, model_sd(5), path="custom/named.pt", storage_type=DISK)
    eng.wait(60)
    assert committed(ckpt_dir) == [1, 2, 5]
    assert_same_tree(model_sd(1), eng.load(resume_path="step_1/rank_00000.pt"))
    assert eng.last_load.source == "storage"
    assert_same_tree(model_sd(5), eng.load(resume_path=os.path.join(ckpt_dir, "custom", "named.pt")))
    with pytest.raises(CheckpointDirError):
        eng.load(resume_path="/etc/passwd")
    with open(rank_file(ckpt_dir, 2), "r+b") as f:  # damage a committed file, same size
        f.seek(-100, os.SEEK_END)
        f.write(b"\x5a" * 8)
    with pytest.raises(CheckpointCorruptError, match="step_2"):
        eng.load(resume_path="step_2/rank_00000.pt")
    eng.close()


def test_max_to_keep_deletes_older_committed_steps(make_engine, ckpt_dir):
    eng = make_engine(max_to_keep=2)
    for step in range(1, 6):
        eng.save(step, model_sd(step), storage_type=DISK)
        eng.wait(60)
    assert committed(ckpt_dir) == [4, 5]
    assert sorted(os.listdir(ckpt_dir)) == ["step_4", "step_5"]  # the records live beside it
    assert_same_tree(model_sd(4), eng.load(resume_path="step_4/rank_00000.pt"))
    eng.close()


def test_load_falls_back_to_storage_when_memory_is_empty(make_engine, ckpt_dir, runtime_dir):
    first = make_engine(max_to_keep=0)
    first.save(1, model_sd(1), storage_type=DISK)
    first.save(2, model_sd(2), storage_type=DISK)
    first.save(3, model_sd(3), storage_type=MEMORY)  # memory only: persisted by the saver's last words
    first.close(release=True)  # no wait(): scheduled persists still complete before the saver exits
    wait_savers_gone(runtime_dir)
    assert leftovers(runtime_dir) == [], "the snapshots outlived a final close"
    assert committed(ckpt_dir) == [1, 2, 3]  # close() keeps the newest snapshot, as an exit does

    second = make_engine(max_to_keep=0)
    assert second.memory_steps() == []
    assert_same_tree(model_sd(3), second.load())
    assert (second.last_load.source, second.last_load.step) == ("storage", 3)
    second.close()


def test_damaged_newest_committed_step_falls_back_to_the_previous_one(make_engine, ckpt_dir, runtime_dir, caplog):
    first = make_engine(max_to_keep=0)
    first.save(1, model_sd(1), storage_type=DISK)
    first.save(2, model_sd(2), storage_type=DISK)
    first.wait(60)
    first.close()
    wait_savers_gone(runtime_dir)
    path = rank_file(ckpt_dir, 2)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # flip bytes in the middle of the tensor data, keeping the size
        f.seek(size // 2)
        chunk = f.read(16)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))

    second = make_engine(max_to_keep=0)
    with caplog.at_level(logging.WARNING, logger="flashckpt.engine"):
        sd = second.load()
    assert (second.last_load.source, second.last_load.step) == ("storage", 1)
    assert_same_tree(model_sd(1), sd)
    assert any("step 2 is damaged" in r.getMessage() for r in caplog.records)
    second.close()


def test_reopening_right_after_a_final_close_works(make_engine, ckpt_dir):
    # The saver exits when its last client said a final goodbye; an engine created at that instant must
    # reach a live saver (the old one refuses it while exiting, so it starts or waits for the next one).
    # Before that was fixed, about one reopen in eight joined the exiting saver and failed at its first
    # save (SaverError, or "alloc: No such file or directory" as the runtime dir was removed under it).
    # test_ipc.py::test_an_exiting_saver_refuses_new_clients pins the saver's side deterministically.
    for step in range(1, 4):
        eng = make_engine(max_to_keep=0)
        eng.save(step, model_sd(step), storage_type=DISK)
        eng.wait(60)
        assert_same_tree(model_sd(step), eng.load())
        eng.close(release=True)
    assert committed(ckpt_dir) == [1, 2, 3]


def test_closed_engine_and_bad_arguments(make_engine, ckpt_dir):
    with pytest.raises(ValueError, match="max_to_keep"):
        make_engine(max_to_keep=-1)
    with pytest.raises(ValueError, match="failure rate"):
        make_engine(auto_save=True, process_mtbf_s=math.inf, node_mtbf_s=math.inf)  # no failures: nothing to place
    eng = make_engine()
    with pytest.raises(ValueError, match="step"):
        eng.save(-1, model_sd(1), storage_type=MEMORY)
    with pytest.raises(ValueError, match="storage_type"):
        eng.save(1, model_sd(1), storage_type="disk")
    eng.close()
    eng.close()  # idempotent
    with pytest.raises(FlashCheckpointError, match="closed"):
        eng.save(1, model_sd(1), storage_type=MEMORY)
    with pytest.raises(FlashCheckpointError, match="closed"):
        eng.load()


def test_a_zero_grace_saver_still_serves_its_first_client(make_engine, ckpt_dir, monkeypatch):
    # Regression: with FLASHCKPT_SAVER_GRACE_S=0 a freshly spawned saver used to exit before the first
    # trainer's hello arrived, and every engine start failed after retrying.
    monkeypatch.setenv("FLASHCKPT_SAVER_GRACE_S", "0")
    eng = make_engine(max_to_keep=0)
    eng.save(1, model_sd(1), storage_type=StorageType.DISK)
    eng.wait(60)
    assert committed(ckpt_dir) == [1]
    eng.close()


def test_auto_save_measures_then_checkpoints_by_the_optimum(make_engine, ckpt_dir):
    # Failures so rare that the optimum interval is hours: after the first memory snapshot (to measure)
    # and the first persist, every later step is skipped.
    eng = make_engine(max_to_keep=0, auto_save=True, process_mtbf_s=1e9, node_mtbf_s=1e10)
    taken = [eng.save(step, model_sd(step)) for step in range(1, 8)]
    assert taken == [True, True, False, False, False, False, False]
    eng.wait(60)
    assert committed(ckpt_dir) == [2]
    assert eng.memory_steps()[0] == 2
    assert eng._policy.auto.choice is not None and eng._policy.auto.choice.memory_steps > 100
    eng.close()


def test_load_into_existing_tensors_copies_in_place(make_engine, ckpt_dir):
    src = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    sd = {"model": src.state_dict(), "step": 3, "extra": torch.arange(5)}
    eng = make_engine(max_to_keep=0)
    eng.save(3, sd, storage_type=MEMORY)

    dst = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    target = {"model": dst.state_dict(), "extra": torch.zeros(3)}  # "extra" has another shape
    out = eng.load(into=target)
    assert eng.last_load.source == "memory" and out["step"] == 3
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k          # the model itself is loaded
        assert out["model"][k].data_ptr() == target["model"][k].data_ptr()
    assert torch.equal(out["extra"], torch.arange(5))             # shape mismatch: a new tensor
    assert out["extra"].data_ptr() != target["extra"].data_ptr() and torch.equal(target["extra"], torch.zeros(3))
    eng.close()


def _nices(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out.append(int(fields[16]))  # field 19 of stat: nice (fields counted after the command name)
    return out


def test_persisting_runs_at_a_lower_priority_than_training(make_engine, ckpt_dir, runtime_dir, monkeypatch):
    """The saver's persist worker (the process that writes the files) runs FLASHCKPT_PERSIST_NICE (here
    7) below the saver, whose threads keep the trainer's priority."""
    monkeypatch.setenv("FLASHCKPT_PERSIST_NICE", "7")
    engine = make_engine()
    engine.save(1, {"w": torch.randn(1000)}, storage_type=StorageType.DISK)
    engine.wait(timeout=60)
    (pid,) = saver_pids(runtime_dir)
    (worker,) = child_pids(pid)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert set(_nices(pid)) == {base}, _nices(pid)
    assert set(_nices(worker)) == {base + 7}, _nices(worker)
    engine.close()


def test_memory_snapshots_skip_the_round_trip_to_the_saver(make_engine, monkeypatch):
    """A memory snapshot only asks the saver for news when its segment is new or the last ask is older
    than half a second, and does not wait for the answer; persists and wait() always ask."""
    import time as _time

    engine = make_engine()
    calls = []
    real, real_send = engine._client_call, engine._link.client.send

    def counting(req, **kw):  # the engine's calls carry typed requests (flashckpt.transport.messages)
        calls.append(req.OP)
        return real(req, **kw)

    def counting_send(op, **kw):
        calls.append(op)
        return real_send(op, **kw)

    monkeypatch.setattr(engine, "_client_call", counting)
    monkeypatch.setattr(engine._link.client, "send", counting_send)
    sd = {"w": torch.randn(1000)}
    for step in range(1, 11):
        engine.save(step, sd, storage_type=StorageType.MEMORY)
    assert calls.count("status") == 1, calls  # the first snapshot into the new segment
    _time.sleep(0.6)
    engine.save(11, sd, storage_type=StorageType.MEMORY)
    assert calls.count("status") == 2, calls
    engine.save(12, {"w": torch.randn(100_000)}, storage_type=StorageType.MEMORY)  # outgrows its segment
    assert calls.count("status") == 3, calls
    engine.save(13, sd, storage_type=StorageType.DISK)
    engine.wait(timeout=60)
    assert "persist" in calls and "wait" in calls
    engine.close()


def test_saver_cpu_seconds_counts_the_persist_work(make_engine, runtime_dir, monkeypatch):
    """saver_cpu_seconds() reads the CPU time of the saver daemon and its children: it is the saver's pid,
    and a persist of 64 MB (xxh3 + CRC-32 + copy of every byte, in the saver's persist worker) makes it
    grow, still counted once that worker exited (and was reaped)."""
    from flashckpt.util.procfs import process_cpu_seconds

    monkeypatch.setenv("FLASHCKPT_PERSIST_WORKER_IDLE_S", "1")
    engine = make_engine()
    sd = {"w": torch.randn(16 << 20)}
    engine.save(1, sd, storage_type=StorageType.MEMORY)
    (pid,) = saver_pids(runtime_dir)
    before = engine.saver_cpu_seconds()
    assert before is not None and before == pytest.approx(process_cpu_seconds(pid), abs=0.05)
    engine.save(2, sd, storage_type=StorageType.DISK)
    engine.wait(timeout=60)
    after = engine.saver_cpu_seconds()
    (worker,) = child_pids(pid)
    assert after is not None and after >= before + process_cpu_seconds(worker) - 0.05
    assert process_cpu_seconds(worker) > 0.2  # it imported torch and wrote 64 MB
    wait_for(lambda: not child_pids(pid), 20, "the idle persist worker to exit")
    assert engine.saver_cpu_seconds() >= after - 0.05  # its time now counts as the saver's reaped children's
    engine.close()
    wait_for(lambda: engine.saver_cpu_seconds() is None, 30, "the saver to exit")  # nothing left to read
