"""The node-local tier under a durable checkpoint dir, with real savers, persist workers and trainers: a
``save(DISK)`` commits on the local tier first and on the durable tier (a POSIX dir, or S3 on moto) once
its upload ends; a load takes the local tier, or the durable one once the local dir is gone; a saver killed
before the upload ends has the next saver upload the step, nothing partial visible meanwhile; per-tier
retention; ``flashckpt ls`` shows the tiers."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
from _fault_helpers import (  # noqa: F401
    FaultEnv,
    assert_bit_equal,
    close_and_wait,
    fault_env_fixture,
    make_state,
    run_cli,
    saver_pid,
    wait_for,
)
from flashckpt import CheckpointEngine, InvalidArgumentError, StorageType
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.tiers import local_layout
from flashckpt.storage.registry import storage_for
from s3_fixtures import moto_server_fixture, s3_fixture  # noqa: F401

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
    finally:
        close_and_wait(engine)
    assert local_layout(local).committed_steps() == [2, 3]  # local retention: 2
    assert _durable(durable).committed_steps() == [1, 2, 3] and _durable(durable).verify(3) == []
    assert os.path.exists(os.path.join(local, "step_3", "rank_00000.pt"))
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
    finally:
        close_and_wait(first)


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
