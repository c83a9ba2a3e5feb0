"""The node-local tier under a durable checkpoint dir, with real savers, persist workers and trainers: a
``save(DISK)`` commits on the local tier first and on the durable tier (a POSIX dir, or S3 on moto) once
its upload ends; a load takes the local tier, or the durable one once the local dir is gone; a saver killed
before the upload ends has the next saver upload the step, nothing partial visible meanwhile; per-tier
retention; ``flashckpt ls`` shows the tiers."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch
from _fault_helpers import (  # noqa: F401
    FaultEnv,
    assert_bit_equal,
    close_and_wait,
    fault_env_fixture,
    kill9,
    make_state,
    run_cli,
    saver_pid,
    wait_for,
)
from flashckpt import CheckpointEngine, InvalidArgumentError, PersistError, StorageType
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.tiers import local_layout
from flashckpt.storage.registry import storage_for
from s3_fixtures import moto_server_fixture, s3_fixture, s3_proxied_fixture  # noqa: F401
from s3_proxy import Fault

MB = 1.0


def _durable(url: str) -> CommitLayout:
    return CommitLayout(url, storage_for(url))


def _loads(durable: str, local: str, want: Any, source: str) -> None:
    """A new engine's load() gives ``want`` bit-exact from ``source``."""
    engine = CheckpointEngine(durable, local_dir=local)
    try:
        assert_bit_equal(engine.load(), want)
        assert engine.last_load is not None and engine.last_load.source == source, engine.last_load
    finally:
        close_and_wait(engine)


def test_save_commits_locally_then_durably_and_loads_from_the_fastest_tier(tmp_path: Any,
                                                                           fault_env: FaultEnv) -> None:
    durable, local = str(tmp_path / "durable"), str(tmp_path / "nvme" / "run")
    engine = CheckpointEngine(durable, max_to_keep=3, local_dir=local, local_max_to_keep=2)
    states = {}
    try:
        for step in (1, 2, 3):
            states[step] = make_state(step, MB)
            engine.save(step, states[step], storage_type=StorageType.DISK)
            engine.wait(timeout=120)
            assert step in local_layout(local).committed_steps()
            assert _durable(durable).committed_steps()[-1] == step
        logs = fault_env.saver_logs()
        assert "event=commit step=3 tier=local" in logs and "event=commit step=3 tier=durable" in logs, logs
        report = engine.durability()
        assert report.durable_step == 3 and report.pending == () and 3 in report.commit_lags, report
    finally:
        close_and_wait(engine)
    assert local_layout(local).committed_steps() == [2, 3]  # local retention: 2
    assert _durable(durable).committed_steps() == [1, 2, 3] and _durable(durable).verify(3) == []
    assert os.path.exists(os.path.join(local, "step_3", "rank_00000.pt"))
    ls = run_cli(fault_env, "ls", durable, "--local-dir", local, "--json")
    assert ls.returncode == 0, ls
    tiers = {r["step"]: r["tiers"] for r in json.loads(ls.stdout)}
    assert tiers == {1: "durable", 2: "local, durable", 3: "local, durable"}, ls.stdout
    _loads(durable, local, states[3], "local")
    shutil.rmtree(local)  # the node was replaced: its local disk is empty
    _loads(durable, local, states[3], "storage")


def test_local_dir_is_checked(tmp_path: Any, fault_env: FaultEnv) -> None:
    durable = str(tmp_path / "durable")
    with pytest.raises(InvalidArgumentError, match="not a URL"):
        CheckpointEngine(durable, local_dir="s3://bucket/x")
    with pytest.raises(InvalidArgumentError, match="overlaps"):
        CheckpointEngine(durable, local_dir=os.path.join(durable, "local"))
    with pytest.raises(InvalidArgumentError, match="overlaps"):
        CheckpointEngine(os.path.join(durable, "inner"), local_dir=durable)
    first = CheckpointEngine(durable, local_dir=str(tmp_path / "a"))
    try:
        with pytest.raises(InvalidArgumentError, match="same local_dir"):
            CheckpointEngine(durable, local_dir=str(tmp_path / "b"))
        first.save(1, {"w": torch.ones(3)}, storage_type=StorageType.DISK)
        first.wait()
    finally:
        close_and_wait(first)
    # The local dir of one checkpoint dir given to another: refused, naming both (never its steps as the other's).
    other = str(tmp_path / "other")
    with pytest.raises(InvalidArgumentError, match=r"holds the local tier of another checkpoint dir .*durable.*steps \[1\]"):
        CheckpointEngine(other, local_dir=str(tmp_path / "a"))
    assert not os.path.exists(os.path.join(other, "step_1"))


def test_local_tier_over_s3(s3: Any, tmp_path: Any, fault_env: FaultEnv) -> None:
    local = str(tmp_path / "nvme")
    engine = CheckpointEngine(s3.url, max_to_keep=2, local_dir=local)
    state = make_state(1, MB)
    try:
        engine.save(1, state, storage_type=StorageType.DISK)
        engine.wait(timeout=120)
    finally:
        close_and_wait(engine)
    assert local_layout(local).committed_steps() == [1]
    layout = _durable(s3.url)
    try:
        assert layout.committed_steps() == [1] and layout.verify(1) == []
    finally:
        layout.storage.close()
    assert s3.multipart_uploads() == []
    _loads(s3.url, local, state, "local")
    shutil.rmtree(local)
    _loads(s3.url, local, state, "storage")


def test_a_saver_killed_before_its_upload_ends_has_the_next_saver_upload_the_step(
        s3_proxied: Any, tmp_path: Any, fault_env: FaultEnv) -> None:
    """The store holds every upload of step 1's file unanswered; the saver is SIGKILLed once the step is
    committed locally. Nothing of step 1 is visible on the store; the next saver on the node uploads it."""
    s3, local = s3_proxied, str(tmp_path / "nvme")
    s3.proxy.set_faults([Fault("stall", op=("PutObject", "CreateMultipartUpload", "UploadPart"), key="step_1/",
                               times=None, stall_s=None)])
    engine = CheckpointEngine(s3.url, local_dir=local)
    state = make_state(1, MB)
    try:
        engine.save(1, state, storage_type=StorageType.DISK)
        wait_for(lambda: 1 in local_layout(local).committed_steps(), 60, "the local commit of step 1")
        wait_for(lambda: s3.proxy.stalled() > 0, 60, "the upload of step 1 under way")
        kill9(saver_pid(fault_env.runtime_dir, engine.job_dir))
        assert not any("step_1/" in k for k in s3.keys()), s3.keys()  # nothing partial is visible
        layout = _durable(s3.url)
        try:
            assert layout.committed_steps() == []
        finally:
            layout.storage.close()
        s3.proxy.set_faults([])
        s3.proxy.release()
        try:  # the engine's next call starts the next saver, which finds step 1 committed locally only
            engine.wait(timeout=120)
        except PersistError:
            pass  # the persist in flight with the killed saver is reported lost; step 1 is safe locally

        def durable_has_1() -> bool:
            lay = _durable(s3.url)
            try:
                return lay.committed_steps() == [1] and lay.verify(1) == []
            finally:
                lay.storage.close()

        wait_for(durable_has_1, 120, "step 1 uploaded and committed by the next saver")
        assert "event=catch_up tier=durable step=1" in fault_env.saver_logs()
    finally:
        close_and_wait(engine)
    shutil.rmtree(local)
    _loads(s3.url, local, state, "storage")


def test_retention_per_tier_keeps_each_tiers_newest_and_every_step_not_yet_uploaded(
        s3_proxied: Any, tmp_path: Any, fault_env: FaultEnv) -> None:
    """Keep 1 locally, 2 on the store. While step 1's upload is held by the store, steps 2 and 3 wait behind
    it (the durable tier commits in order) and the local tier keeps all three; once the store answers, every
    step reaches it, and the local tier goes back to its newest step alone."""
    s3, local = s3_proxied, str(tmp_path / "nvme")
    s3.proxy.set_faults([Fault("stall", op=("PutObject", "CreateMultipartUpload", "UploadPart"), key="step_1/",
                               times=None, stall_s=None)])
    engine = CheckpointEngine(s3.url, max_to_keep=2, local_dir=local, local_max_to_keep=1)
    states = {}
    try:
        for step in (1, 2, 3):
            states[step] = make_state(step, MB)
            engine.save(step, states[step], storage_type=StorageType.DISK)
            wait_for(lambda s=step: s in local_layout(local).committed_steps(), 60, f"the local commit of step {step}")
        assert local_layout(local).committed_steps() == [1, 2, 3]  # none uploaded yet: all kept
        ls = run_cli(fault_env, "ls", s3.url, "--local-dir", local)
        assert ls.returncode == 0 and "committed locally, not yet on" in ls.stdout, ls
        s3.proxy.set_faults([])
        s3.proxy.release()
        engine.wait(timeout=120)
        states[4] = make_state(4, MB)
        engine.save(4, states[4], storage_type=StorageType.DISK)
        engine.wait(timeout=120)
        assert local_layout(local).committed_steps() == [4]
        layout = _durable(s3.url)
        try:
            assert layout.committed_steps()[-1] == 4 and 3 in layout.committed_steps()
        finally:
            layout.storage.close()
    finally:
        close_and_wait(engine)
    _loads(s3.url, local, states[4], "local")


def test_a_store_that_fails_uploads_loses_no_step_and_training_goes_on_with_warn(
        s3_proxied: Any, tmp_path: Any, fault_env: FaultEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store fails every request (500: lists, reads, records, uploads) while steps 1 and 2 are saved with
    on_persist_error="warn": the saves go on and commit locally (nothing in the training process or the
    saver's persist asks the store); once it answers again both reach it, in order."""
    monkeypatch.setenv("FLASHCKPT_S3_MAX_ATTEMPTS", "1")
    fault_env.base_env["FLASHCKPT_S3_MAX_ATTEMPTS"] = "1"
    s3, local = s3_proxied, str(tmp_path / "nvme")
    engine = CheckpointEngine(s3.url, max_to_keep=0, local_dir=local, on_persist_error="warn")
    s3.proxy.set_faults([Fault("error500", times=None)])  # the store is down from now on
    states = {}
    try:
        for step in (1, 2):
            states[step] = make_state(step, MB)
            engine.save(step, states[step], storage_type=StorageType.DISK)
            wait_for(lambda s=step: s in local_layout(local).committed_steps(), 60, f"the local commit of step {step}")
        wait_for(lambda: "event=upload tier=durable step=1 attempt=2 failed" in fault_env.saver_logs(), 60,
                 "a retried upload")
        states[3] = make_state(3, MB)
        engine.save(3, states[3], storage_type=StorageType.MEMORY)  # training goes on (warn)
        s3.proxy.set_faults([])
        engine.wait(timeout=120)
        assert engine.durability().durable_step == 2
    finally:
        close_and_wait(engine)
    layout = _durable(s3.url)
    try:
        assert layout.committed_steps()[:2] == [1, 2] and layout.verify(2) == []
    finally:
        layout.storage.close()


def test_after_an_outage_only_the_steps_the_store_keeps_are_uploaded(
        s3_proxied: Any, tmp_path: Any, fault_env: FaultEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps 2-6 are committed locally while the store fails every request; the checkpoint dir keeps 2. Once
    it answers, the backlog's older steps are not uploaded (retention would delete them at once): the store
    gets the newest two, in order, and loads the newest bit for bit."""
    monkeypatch.setenv("FLASHCKPT_S3_MAX_ATTEMPTS", "1")
    fault_env.base_env["FLASHCKPT_S3_MAX_ATTEMPTS"] = "1"
    s3, local = s3_proxied, str(tmp_path / "nvme")
    engine = CheckpointEngine(s3.url, max_to_keep=2, local_dir=local, on_persist_error="warn")
    states = {}
    try:
        states[1] = make_state(1, MB)
        engine.save(1, states[1], storage_type=StorageType.DISK)
        engine.wait(timeout=120)
        s3.proxy.set_faults([Fault("error500", times=None)])
        for step in range(2, 7):
            states[step] = make_state(step, MB)
            engine.save(step, states[step], storage_type=StorageType.DISK)
            wait_for(lambda s=step: s in local_layout(local).committed_steps(), 60, f"the local commit of step {step}")
        s3.proxy.set_faults([])
        engine.wait(timeout=120)
        logs = fault_env.saver_logs()  # before the saver exits with its log
    finally:
        s3.proxy.set_faults([])
        close_and_wait(engine)
    skipped = {s for s in range(2, 7) if f"event=upload tier=durable step={s} skipped" in logs}
    assert {3, 4} <= skipped and not skipped & {5, 6}, "\n".join(ln for ln in logs.splitlines() if "event=" in ln)[-6000:]
    layout = _durable(s3.url)
    try:
        assert layout.committed_steps() == [5, 6] and layout.verify(6) == []
    finally:
        layout.storage.close()
    shutil.rmtree(local)
    _loads(s3.url, local, states[6], "storage")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs as the local disk: needs root")
def test_a_full_local_disk_is_named_and_the_newest_snapshot_reaches_the_checkpoint_dir_at_close(
        tmp_path: Any, fault_env: FaultEnv, caplog: pytest.LogCaptureFixture) -> None:
    """The local dir on a 3 MB file system and 2 MB states, on_persist_error="warn": step 1 commits on both
    tiers; steps 2 and 3 cannot be written locally, and the failure names the local tier's file (not the
    checkpoint dir's, whose disk is fine); at close, the last words persist the newest snapshot, step 3, straight
    to the checkpoint dir (its failed local persist does not count as done), and a new engine loads it."""
    import subprocess

    disk, durable = str(tmp_path / "nvme"), str(tmp_path / "durable")
    os.makedirs(disk)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3M", "tmpfs", disk], check=True)
    try:
        local = os.path.join(disk, "run")
        engine = CheckpointEngine(durable, max_to_keep=0, local_dir=local, on_persist_error="warn")
        states = {s: make_state(s, 2 * MB) for s in (1, 2, 3)}
        try:
            for step in (1, 2, 3):
                engine.save(step, states[step], storage_type=StorageType.DISK)
                engine.wait(60)
            d = engine.durability()
            assert (d.local_step, d.durable_step, d.pending, d.failures) == (1, 1, (2, 3), 2), d
            said = f"persisting step 3 of rank 0 to the node's local tier ({os.path.join(local, 'step_3')}"
            assert said in caplog.text, caplog.text  # the trainer's warning (on_persist_error="warn")
        finally:
            close_and_wait(engine)
        assert _durable(durable).committed_steps() == [1, 3]
        _loads(durable, local, states[3], "storage")
    finally:
        subprocess.run(["umount", "-l", disk], check=False)
