"""Stalls and refusals on S3, per request (issue #32): a request that makes no progress is abandoned within
its bound (metadata requests within ``meta_timeout_s``, a part within ``meta_timeout_s + part_size_mb /
min_mbps``) and retried, never after botocore's 120 s read timeout; a refused endpoint is logged at the first
retry, once per outage, and its end once. Against moto on loopback through the fault proxy, whose ``stall``
holds a request unanswered far longer than the bound (until the test releases it)."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import xxhash
from _fault_helpers import FaultEnv, assert_bit_equal, close_and_wait, fault_env_fixture, make_state  # noqa: F401
from flashckpt import CheckpointEngine, PersistError, StorageType
from flashckpt.storage.s3.backend import S3Storage
from flashckpt.storage.s3.options import S3Options
from s3_fixtures import moto_server_fixture, s3_fixture, s3_proxied_fixture  # noqa: F401
from s3_proxy import Fault

MIB = 1 << 20
LOGGER = "flashckpt.storage.s3.backend"
HELD_S = 60.0  # how long the proxy holds a stalled request: far past every bound here


@pytest.fixture
def quick(s3_proxied: Any) -> Iterator[S3Storage]:
    """A backend through the proxy with bounds of 1 s (metadata) and 2 s (a 5 MiB part at 5 MB/s + 1 s);
    the stalled requests are let go at the end (their late answers change nothing)."""
    st = S3Storage(S3Options.from_env(part_size_mb=5, concurrency=2, meta_timeout_s=1, min_mbps=5))
    assert st.options.timeout_s("meta") == 1 and st.options.timeout_s("data") == 2
    try:
        yield st
    finally:
        s3_proxied.proxy.release()
        st.close()


def test_the_bounds_follow_the_options_and_the_read_timeout_caps_them() -> None:
    o = S3Options.from_env(part_size_mb=64, meta_timeout_s=5, min_mbps=8)
    assert (o.timeout_s("meta"), o.timeout_s("data")) == (5, 13)
    capped = S3Options.from_env(read_timeout_s=3, meta_timeout_s=5)
    assert (capped.timeout_s("meta"), capped.timeout_s("data")) == (3, 3)
    with pytest.raises(ValueError, match="meta_timeout_s and min_mbps > 0"):
        S3Options.from_env(min_mbps=0)


@pytest.mark.parametrize("op", ["HeadObject", "PutObject", "GetObject", "ListObjectsV2", "DeleteObject"])
def test_a_stalled_metadata_request_is_retried_within_its_bound(s3_proxied: Any, quick: S3Storage, op: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    url = f"{s3_proxied.url}/rec.json"
    quick.write_bytes(url, b"{}")
    s3_proxied.proxy.set_faults([Fault("stall", op=op, times=1, stall_s=HELD_S)])
    call = {"HeadObject": lambda: quick.exists(url), "PutObject": lambda: quick.write_bytes(url, b'{"a": 1}'),
            "GetObject": lambda: quick.read_bytes(url), "ListObjectsV2": lambda: quick.listdir(s3_proxied.url),
            "DeleteObject": lambda: quick.remove(url)}[op]
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        call()
    took = time.monotonic() - t0
    assert s3_proxied.proxy.stalled() == 1, "the request was not held"
    assert 1.0 <= took < 4.0, f"{op} took {took:.1f} s: not abandoned at its 1 s bound"
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2, caplog.text  # the stall once, then that the store answers again
    assert "made no progress" in warned[0].getMessage() and op in warned[0].getMessage()
    assert "answers again" in warned[1].getMessage()


def test_a_stalled_part_is_retried_within_its_bound_and_the_file_is_exact(s3_proxied: Any, quick: S3Storage) -> None:
    s3_proxied.proxy.set_faults([Fault("stall", op="UploadPart", times=1, stall_s=HELD_S),
                                 Fault("stall", op="CompleteMultipartUpload", times=1, stall_s=HELD_S)])
    data = os.urandom(12 * MIB)
    t0 = time.monotonic()
    rec = quick.write_parts(f"{s3_proxied.url}/big.bin", [data])
    took = time.monotonic() - t0
    assert s3_proxied.proxy.stalled() == 2
    assert took < 10.0, f"the upload took {took:.1f} s with two 2 s stalls"
    assert s3_proxied.read("run/big.bin") == data and rec.xxh3 == xxhash.xxh3_64_hexdigest(data)
    assert s3_proxied.multipart_uploads() == []


def test_a_stalled_ranged_read_is_retried(s3_proxied: Any, quick: S3Storage) -> None:
    data = os.urandom(11 * MIB)
    quick.write_parts(f"{s3_proxied.url}/r.bin", [data])
    s3_proxied.proxy.set_faults([Fault("stall", op="GetObject", ranged=True, times=1, stall_s=HELD_S)])
    out = bytearray(len(data))
    t0 = time.monotonic()
    quick.read_into(f"{s3_proxied.url}/r.bin", 0, memoryview(out))
    assert bytes(out) == data and time.monotonic() - t0 < 8.0
    assert s3_proxied.proxy.stalled() == 1


def _refused_port() -> int:
    """A loopback port nothing listens on (bound, then closed: connecting to it is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_refused_endpoint_is_logged_at_the_first_retry_once(s3: Any, caplog: pytest.LogCaptureFixture) -> None:
    endpoint = f"http://127.0.0.1:{_refused_port()}"
    st = S3Storage(S3Options.from_env(endpoint_url=endpoint, max_attempts=4, meta_timeout_s=1))
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER), pytest.raises(PersistError, match="failed 4 time"):
            st.write_bytes(f"{s3.url}/x", b"1")
        with caplog.at_level(logging.INFO, logger=LOGGER), pytest.raises(PersistError, match="failed 4 time"):
            st.read_bytes(f"{s3.url}/x")  # the same outage: not warned again
    finally:
        st.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, warned
    assert endpoint in warned[0] and "cannot connect" in warned[0] and "retrying PutObject of" in warned[0], warned
    assert "logged once per outage" in warned[0]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert sum("still unreachable" in m for m in infos) == 5, infos  # 3 + 2 later retries, at INFO


# ------------------------------------------------------------------------------------------ the engine
def _engine_start(url: str) -> tuple[Any, float]:
    t0 = time.monotonic()
    engine = CheckpointEngine(url, max_to_keep=0)
    return engine, time.monotonic() - t0


def _persist(engine: Any, step: int, state: Any) -> float:
    t0 = time.monotonic()
    engine.save(step, state, storage_type=StorageType.DISK)
    engine.wait(timeout=90)
    return time.monotonic() - t0


def test_stalls_during_the_start_a_commit_and_an_upload_cost_seconds_and_lose_nothing(
        s3_proxied: Any, fault_env: FaultEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests held unanswered (far past botocore's read timeout) in the engine's start (the dir's probe,
    the records' first listing, the lease), in the commit (a done marker, the manifest) and in the upload
    (a part): the engine starts within its normal time plus the bounds, the step commits, bit-exact."""
    for name, value in {"FLASHCKPT_S3_PART_SIZE_MB": "5", "FLASHCKPT_S3_META_TIMEOUT_S": "1",
                        "FLASHCKPT_S3_MIN_MBPS": "5"}.items():
        monkeypatch.setenv(name, value)
        fault_env.base_env[name] = value
    engine, normal = _engine_start(s3_proxied.url)
    try:
        normal_persist = _persist(engine, 1, make_state(1, 7.0))
    finally:
        close_and_wait(engine)
    s3_proxied.proxy.set_faults([
        Fault("stall", op="PutObject", key=".flashckpt-probe", times=1, stall_s=HELD_S),
        Fault("stall", op="ListObjectsV2", times=1, stall_s=HELD_S),
        Fault("stall", op="PutObject", key=".lease", times=1, stall_s=HELD_S),
        Fault("stall", op="PutObject", key="done_rank", times=1, stall_s=HELD_S),
        Fault("stall", op="PutObject", key="manifest", times=1, stall_s=HELD_S),
        Fault("stall", op="UploadPart", times=1, stall_s=HELD_S),
    ])
    try:
        engine, stalled_start = _engine_start(s3_proxied.url)
        held_at_start = s3_proxied.proxy.stalled()
        try:
            state = make_state(2, 7.0)
            persist_s = _persist(engine, 2, state)
            assert engine.committed_steps() == [1, 2]
        finally:
            close_and_wait(engine)
        left = [f for f, n in s3_proxied.proxy.pending() if n]
        assert held_at_start >= 2 and not left, (held_at_start, left)  # every stall fired
        assert stalled_start < normal + 6.0, f"the start took {stalled_start:.1f} s, {normal:.1f} s without stalls"
        assert persist_s < normal_persist + 15.0, \
            f"the persist took {persist_s:.1f} s with three stalls of 1-2 s, {normal_persist:.1f} s without"
        s3_proxied.proxy.set_faults([])
        again, _ = _engine_start(s3_proxied.url)
        try:
            assert_bit_equal(again.load(), state)
        finally:
            close_and_wait(again)
    finally:
        s3_proxied.proxy.release()


# ------------------------------------------------------------------------------------------ a failed persist
def _save_and_report(url: str) -> dict[str, Any]:
    """A rank's part: saves step 1 to the store and returns the error its wait raised (None: none)."""
    import torch.distributed as dist

    engine = CheckpointEngine(url, max_to_keep=0)
    try:
        engine.save(1, make_state(dist.get_rank() + 1, 7.0), storage_type=StorageType.DISK)
        try:
            engine.wait(timeout=60)
            engine.wait(timeout=60)  # the other rank's failure, reported after this rank's own persist
        except PersistError as e:
            return {"error": str(e), "committed": engine.committed_steps()}
        return {"error": None, "committed": engine.committed_steps()}
    finally:
        engine.close()


def test_a_persist_past_its_deadline_names_the_rank_file_and_object_to_every_rank(
        s3_proxied: Any, fault_env: FaultEnv) -> None:
    """Rank 1's parts are throttled past its file's deadline and its failed marker is refused too: both
    ranks' trainers get an error naming rank 1, its file and the S3 object and request that failed, at
    once (not a timeout waiting for rank 1's marker)."""
    from helpers import run_ranks

    s3_proxied.proxy.set_faults([  # the store refuses rank 1's failed marker too: the node tells its committer
        Fault("error500", op="PutObject", key="failed_rank_1", times=None),
        Fault("slowdown", op="UploadPart", key="rank_00001", times=None, retry_after_s=1)])
    env = {**s3_proxied.env, "FLASHCKPT_S3_PART_SIZE_MB": "5", "FLASHCKPT_S3_DEADLINE_S": "3",
           "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    out = run_ranks(_save_and_report, 2, os.path.join(fault_env.tmp, "deadline"), timeout=180, env=env,
                     args={"url": s3_proxied.url})
    obj = f"s3://{s3_proxied.bucket}/run/step_1/rank_00001.pt"
    for r in out:
        got = r
        assert got["committed"] == [] and got["error"] is not None, got
        assert "rank 1" in got["error"] and obj in got["error"], got["error"]
        assert "S3 UploadPart" in got["error"] and "gave up after 3 s" in got["error"], got["error"]
        assert "did not finish persisting" not in got["error"], got["error"]  # not a timeout at the barrier
    assert any(r.op == "PutObject" and "failed_rank_1" in r.key and r.fault for r in s3_proxied.proxy.records())


def test_a_store_that_never_answers_fails_the_dirs_probe_within_the_first_contact_bound(
        s3_proxied: Any, quick: S3Storage) -> None:
    """Every PutObject held: ``prepare_dir`` (before a saver starts) gives up after three metadata bounds
    (3 s here), not after a file's deadline, with the dir's error; the store answering again, it passes."""
    from flashckpt.commit.checkpoint_dir import prepare_dir
    from flashckpt.errors import CheckpointDirError

    assert quick.options.first_contact_s == 3
    s3_proxied.proxy.set_faults([Fault("stall", op="PutObject", times=None, stall_s=HELD_S)])
    t0 = time.monotonic()
    with pytest.raises(CheckpointDirError, match=r"gave up after 3 s \(a first contact with the store"):
        prepare_dir(quick, s3_proxied.url, s3_proxied.url)
    assert time.monotonic() - t0 < 6.0
    s3_proxied.proxy.set_faults([])
    prepare_dir(quick, s3_proxied.url, s3_proxied.url)
    quick.write_parts(f"{s3_proxied.url}/after.bin", [b"x" * 100])  # later requests: a file's deadline again
