"""The durability lag and the failure policy (``on_persist_error``, ``max_lag_s``), end to end: real savers
and persist workers against moto on loopback through the fault proxy, the store failing every upload for a
while. With ``"warn"`` training goes on, each failure is logged once with what is still safe, the lag grows
and is reported, and storage catches up when it answers again; with ``"raise"`` the failure and the lag bound
raise, the snapshot stays in memory and the previous durable step stays loadable."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from _fault_helpers import (  # noqa: F401
    FaultEnv,
    assert_state_of,
    close_and_wait,
    fault_env_fixture,
    make_state,
)
from flashckpt import CheckpointEngine, DurabilityLagError, PersistError, StorageType
from s3_fixtures import moto_server_fixture, s3_proxied_fixture  # noqa: F401
from s3_proxy import Fault

MB = 1.0
BOUND_S = 1.5
_STORE_DOWN = [Fault("error500", op=("UploadPart", "PutObject", "CreateMultipartUpload"), times=None)]


@pytest.fixture(autouse=True)
def _fast_failures(monkeypatch: pytest.MonkeyPatch, fault_env: FaultEnv) -> None:
    """A persist to a store that fails every upload gives up within seconds, here and in the saver."""
    for k, v in (("FLASHCKPT_S3_DEADLINE_S", "2"), ("FLASHCKPT_S3_MAX_ATTEMPTS", "2")):
        monkeypatch.setenv(k, v)
        fault_env.base_env[k] = v


def _wait_past(seconds: float) -> None:
    time.sleep(seconds)


def test_warn_keeps_training_reports_the_lag_and_catches_up(s3_proxied: Any, fault_env: FaultEnv,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="flashckpt.engine")
    engine = CheckpointEngine(s3_proxied.url, max_to_keep=0, on_persist_error="warn", max_lag_s=BOUND_S)
    try:
        engine.save(1, make_state(1, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        d = engine.durability()
        assert (d.durable_step, d.memory_step, d.pending, d.lag_s, d.failures) == (1, 1, (), 0.0, 0), d
        assert 0.0 < d.commit_lags[1] < 60, d  # from the snapshot to the commit, measured by the saver

        s3_proxied.proxy.set_faults(_STORE_DOWN)  # the store fails every upload from now on
        engine.save(2, make_state(2, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=60)  # the failure is logged, not raised
        failures = [r.getMessage() for r in caplog.records if "persist(s) failed" in r.getMessage()]
        assert len(failures) == 1, failures
        assert "step 2" in failures[0] and "still safe: step 1 committed in" in failures[0], failures[0]
        assert "step 2 in the node's memory" in failures[0], failures[0]
        d = engine.durability()
        assert d.durable_step == 1 and d.pending == (2,) and d.failures == 1 and d.lag_s > 0, d

        _wait_past(BOUND_S)
        engine.save(3, make_state(3, MB), storage_type=StorageType.MEMORY)  # over the bound: a warning, once
        engine.save(4, make_state(4, MB), storage_type=StorageType.MEMORY)
        behind = [r.getMessage() for r in caplog.records if "behind (bound max_lag_s" in r.getMessage()]
        assert len(behind) == 1 and "steps [2]" in behind[0], behind
        assert engine.durability().lag_s > BOUND_S

        s3_proxied.proxy.set_faults([])  # the store answers again: the next storage save catches up
        engine.save(5, make_state(5, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        d = engine.durability()
        assert (d.durable_step, d.pending, d.lag_s) == (5, (), 0.0), d
        engine.save(6, make_state(6, MB), storage_type=StorageType.MEMORY)
        assert any("has caught up (durable step 5)" in r.getMessage() for r in caplog.records)
        assert engine.committed_steps() == [1, 5]
    finally:
        s3_proxied.proxy.set_faults([])
        close_and_wait(engine)
    again = CheckpointEngine(s3_proxied.url, on_persist_error="warn")
    try:
        assert_state_of(again.load(), 6, MB)  # the newest snapshot (memory, or its last words)
        assert 5 in again.committed_steps()
    finally:
        close_and_wait(again)


def test_raise_reports_the_failure_and_the_lag_bound_and_keeps_the_last_durable_step(
        s3_proxied: Any, fault_env: FaultEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHCKPT_LAST_WORDS", "0")  # the close leaves storage as the failures left it
    engine = CheckpointEngine(s3_proxied.url, max_to_keep=1, max_lag_s=BOUND_S)
    try:
        engine.save(1, make_state(1, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        s3_proxied.proxy.set_faults(_STORE_DOWN)
        engine.save(2, make_state(2, MB), storage_type=StorageType.DISK)
        with pytest.raises(PersistError, match="persisting step 2") as info:
            engine.wait(timeout=60)
        assert not isinstance(info.value, DurabilityLagError)
        _wait_past(BOUND_S)
        with pytest.raises(DurabilityLagError, match=r"is \d+ s behind \(bound max_lag_s=1.5\): steps \[2\].*"
                                                     r"still safe: step 1 committed in .*step 3 in the node's memory"):
            engine.save(3, make_state(3, MB), storage_type=StorageType.MEMORY)
        assert 3 in engine.memory_steps()  # the snapshot was taken before the error
        assert engine.durability().failures == 1
    finally:
        s3_proxied.proxy.set_faults([])
        close_and_wait(engine)
    again = CheckpointEngine(s3_proxied.url)
    try:
        assert_state_of(again.load(), 1, MB)  # the last durable step, from the store
        assert again.last_load is not None and again.last_load.source == "storage"
    finally:
        close_and_wait(again)


def test_warn_with_the_store_down_for_every_request_keeps_training(s3_proxied: Any, fault_env: FaultEnv,
                                                                   caplog: pytest.LogCaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request fails, lists and reads too: a storage save cannot even check its target; with "warn" it
    is a memory snapshot, the step owed to storage and logged; the saves of the next
    FLASHCKPT_UNREADABLE_BACKOFF_S are memory snapshots at once (the store's deadline is not waited out on
    the training path again: the goodput benchmark found every save of an outage paused training ~20 s);
    after it a save asks the store again, and storage catches up once the store answers."""
    caplog.set_level(logging.WARNING, logger="flashckpt.engine")
    monkeypatch.setenv("FLASHCKPT_UNREADABLE_BACKOFF_S", "8")
    engine = CheckpointEngine(s3_proxied.url, max_to_keep=0, on_persist_error="warn")
    try:
        engine.save(1, make_state(1, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        s3_proxied.proxy.set_faults([Fault("error500", times=None)])
        s3_proxied.proxy.clear()
        engine.save(2, make_state(2, MB), storage_type=StorageType.DISK)  # no exception: training goes on
        asked = time.monotonic()
        assert s3_proxied.proxy.records("ListObjectsV2"), "the save did not ask the store"
        d = engine.durability()
        assert (d.memory_step, d.durable_step, d.pending) == (2, 1, (2,)) and d.failures == 1, d
        assert any("save(step=2) is not persisted" in r.getMessage() and "still safe: step 1 committed" in r.getMessage()
                   for r in caplog.records)
        s3_proxied.proxy.clear()
        engine.save(3, make_state(3, MB), storage_type=StorageType.DISK)  # within the back-off: not asked
        assert not s3_proxied.proxy.records("ListObjectsV2"), "the save asked the store again"
        d = engine.durability()
        assert (d.memory_step, d.pending, d.failures) == (3, (2, 3), 2), d
        s3_proxied.proxy.set_faults([])
        time.sleep(max(0.0, asked + 8.5 - time.monotonic()))  # the back-off ran out: the next save asks again
        engine.save(4, make_state(4, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        d = engine.durability()
        assert (d.durable_step, d.pending) == (4, ()), d
        assert any("can be read again" in r.getMessage() for r in caplog.records)
    finally:
        s3_proxied.proxy.set_faults([])
        close_and_wait(engine)
