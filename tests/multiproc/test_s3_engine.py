"""Checkpoints to ``s3://bucket/prefix`` end to end, with real savers, persist workers and trainers against a
real S3-compatible server on loopback (moto), directly and through our fault-injecting proxy: commits
without rename (data objects, then the manifest, then the tracker), retention, loads from memory and from
the store (checksums verified, falling back to the previous step on damage), the CLI on the URL, last
words after a crash, faults and throttling (nothing lost, no torn step visible, the previous checkpoint
intact, no upload left open), a saver killed mid-upload."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest
from _fault_helpers import (  # noqa: F401
    FaultEnv,
    assert_bit_equal,
    assert_state_of,
    close_and_wait,
    fault_env_fixture,
    make_state,
    saver_pid,
    wait_for,
)
from flashckpt import CheckpointEngine, PersistError, StorageType
from flashckpt.commit.layout import CommitLayout
from flashckpt.storage.registry import storage_for
from s3_fixtures import moto_server_fixture, s3_fixture, s3_proxied_fixture  # noqa: F401
from s3_proxy import Fault

MB = 7.0  # two 5 MiB parts per rank file


@pytest.fixture(autouse=True)
def _small_parts(monkeypatch: pytest.MonkeyPatch, fault_env: FaultEnv) -> None:
    """5 MiB parts (S3's minimum), so that a few MiB of state is a multipart upload; in this process and
    in every process the test starts."""
    monkeypatch.setenv("FLASHCKPT_S3_PART_SIZE_MB", "5")
    fault_env.base_env["FLASHCKPT_S3_PART_SIZE_MB"] = "5"


def _env(fe: FaultEnv, s3: Any) -> dict[str, str]:
    return fe.env(**s3.env)


def _layout(url: str) -> tuple[CommitLayout, Any]:
    st = storage_for(url)
    return CommitLayout(url, st), st


def _cli(fe: FaultEnv, s3: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flashckpt.cli", *args], capture_output=True, text=True,
                          timeout=120, env=_env(fe, s3))


def test_save_commit_retain_and_load_on_s3(s3: Any, fault_env: FaultEnv) -> None:
    engine = CheckpointEngine(s3.url, max_to_keep=2)
    try:
        states = {}
        for step in (1, 2, 3):
            states[step] = make_state(step, MB)
            engine.save(step, states[step], storage_type=StorageType.DISK)
            engine.wait(timeout=120)
        assert engine.committed_steps() == [2, 3]
        states[4] = make_state(4, MB)
        engine.save(4, states[4], storage_type=StorageType.MEMORY)  # committed by close()'s last words
        assert_state_of(engine.load(), 4, MB)
        assert engine.last_load is not None and engine.last_load.source == "memory"
    finally:
        close_and_wait(engine)
    keys = s3.keys("run/")
    assert "run/step_3/rank_00000.pt" in keys and not any(k.startswith("run/step_1/") for k in keys)
    assert "run/.flashckpt/tracker.json" in keys and not any("/jobs/" in k for k in keys)  # lease released
    assert s3.multipart_uploads() == []
    layout, st = _layout(s3.url)
    try:
        assert layout.committed_steps() == [2, 3, 4] and layout.tracker_step() == 4 and layout.verify(4) == []
    finally:
        st.close()
    again = CheckpointEngine(s3.url)
    try:
        assert_bit_equal(again.load(), states[4])
        assert again.last_load is not None and again.last_load.source == "storage"
    finally:
        close_and_wait(again)
    ls = _cli(fault_env, s3, "ls", s3.url)
    assert ls.returncode == 0 and "committed (latest)" in ls.stdout and "step_4/rank_00000.pt" in ls.stdout, ls
    ok = _cli(fault_env, s3, "verify", s3.url)
    assert ok.returncode == 0 and "step 4: ok" in ok.stdout, ok
    c = s3.client()
    c.put_object(Bucket=s3.bucket, Key="run/step_4/rank_00000.pt", Body=b"damaged")
    bad = _cli(fault_env, s3, "verify", s3.url)
    assert bad.returncode == 1 and "step 4: DAMAGED" in bad.stdout, bad
    fallback = CheckpointEngine(s3.url)
    try:
        assert_bit_equal(fallback.load(), states[3])  # the damaged step falls back to the previous one
    finally:
        close_and_wait(fallback)


def test_throttling_and_faults_during_persists_lose_nothing(s3_proxied: Any, fault_env: FaultEnv) -> None:
    """The saver's uploads go through the proxy: SlowDown with Retry-After, 500s, resets mid-body and a
    lost CompleteMultipartUpload reply; every step commits, every object verifies."""
    s3_proxied.proxy.set_faults([
        Fault("slowdown", op="UploadPart", times=2, retry_after_s=1),
        Fault("error500", op=("UploadPart", "PutObject"), times=2),
        Fault("reset_request", op="UploadPart", times=1),
        Fault("lost_reply", op="CompleteMultipartUpload", times=1),
        Fault("error_in_200", op="CompleteMultipartUpload", times=1),
    ])
    engine = CheckpointEngine(s3_proxied.url, max_to_keep=0)
    try:
        for step in (1, 2, 3):
            engine.save(step, make_state(step, MB), storage_type=StorageType.DISK)
            engine.wait(timeout=180)
    finally:
        close_and_wait(engine)
    applied = {r.fault for r in s3_proxied.proxy.records() if r.fault}
    assert applied == {"slowdown", "error500", "reset_request", "lost_reply", "error_in_200"}, applied
    layout, st = _layout(s3_proxied.url)
    try:
        assert layout.committed_steps() == [1, 2, 3] and all(layout.verify(s) == [] for s in (1, 2, 3))
    finally:
        st.close()
    assert s3_proxied.multipart_uploads() == []


def test_a_store_down_past_the_deadline_is_a_clear_error_and_the_last_checkpoint_stays(
        s3_proxied: Any, fault_env: FaultEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHCKPT_S3_DEADLINE_S", "4")
    engine = CheckpointEngine(s3_proxied.url, max_to_keep=1)
    try:
        engine.save(1, make_state(1, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=120)
        s3_proxied.proxy.set_faults([Fault("slowdown", op=("UploadPart", "PutObject", "CreateMultipartUpload"),
                                           times=None, retry_after_s=1)])
        engine.save(2, make_state(2, MB), storage_type=StorageType.DISK)
        with pytest.raises(PersistError, match="gave up after 4 s"):
            engine.wait(timeout=120)
        s3_proxied.proxy.set_faults([])
        assert engine.committed_steps() == [1]
    finally:
        close_and_wait(engine)
    keys = s3_proxied.keys("run/")
    assert not any(k.startswith("run/step_2/") for k in keys), keys  # nothing of the failed step
    assert s3_proxied.multipart_uploads() == []
    again = CheckpointEngine(s3_proxied.url)
    try:
        assert_state_of(again.load(), 1, MB)
    finally:
        close_and_wait(again)


def test_last_words_after_a_crash_persist_to_s3(s3: Any, fault_env: FaultEnv) -> None:
    proc = fault_env.trainer(s3.url, "--mb", str(MB), "--plan", "1:disk,2:memory,3:memory", "--wait", "--hold",
                             **s3.env)
    wait_for(lambda: "holding" in fault_env.log("trainer.log") or proc.poll() is not None, 120, "the trainer to save")
    assert proc.poll() is None, fault_env.log("trainer.log")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    layout, st = _layout(s3.url)
    try:
        wait_for(lambda: 3 in layout.committed_steps(), 90, f"last words to commit step 3\n{fault_env.saver_logs()}")
        assert layout.verify(3) == [] and layout.tracker_step() == 3
    finally:
        st.close()


def test_a_saver_killed_mid_upload_leaves_no_visible_step_and_gc_aborts_its_upload(
        s3_proxied: Any, fault_env: FaultEnv) -> None:
    """The saver is SIGKILLed while its persist worker uploads (the parts trickle through the proxy): no
    step appears; the next run sees the last committed step on the store (and the newer snapshot in
    memory), and its saver aborts the upload left open; ``flashckpt gc`` does it when no saver runs."""
    engine = CheckpointEngine(s3_proxied.url, max_to_keep=0)
    try:
        engine.save(1, make_state(1, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=120)
        s3_proxied.proxy.set_faults([Fault("slow_body", op="UploadPart", times=None, direction="request",
                                           rate=256 * 1024)])
        engine.save(2, make_state(2, MB), storage_type=StorageType.DISK)
        wait_for(lambda: s3_proxied.multipart_uploads(), 60, "the upload of step 2 to begin")
        pid = saver_pid(fault_env.runtime_dir, engine.job_dir)
        os.killpg(os.getpgid(pid), signal.SIGKILL)  # the saver and its persist worker
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 30, "the saver to die")
    finally:
        s3_proxied.proxy.set_faults([])
        engine.close()
    layout, st = _layout(s3_proxied.url)
    try:
        assert layout.committed_steps() == [1]
    finally:
        st.close()
    left = s3_proxied.multipart_uploads()
    assert left  # by the killed worker
    gc = _cli(fault_env, s3_proxied, "gc", "--dry-run", s3_proxied.url)
    assert gc.returncode == 0 and "unfinished upload" in gc.stdout and s3_proxied.multipart_uploads() == left, gc
    again = CheckpointEngine(s3_proxied.url)  # a new run: its saver aborts what the killed one left
    try:
        assert_state_of(again.load(), 2, MB)  # from memory: the new saver adopted the snapshots
        assert again.last_load is not None and again.last_load.source == "memory"
        assert again.committed_steps() == [1] and s3_proxied.multipart_uploads() == []
    finally:
        close_and_wait(again)
    s3_proxied.client().create_multipart_upload(Bucket=s3_proxied.bucket, Key="run/step_9/rank_00000.pt")
    gc = _cli(fault_env, s3_proxied, "gc", s3_proxied.url)  # with no saver running: gc does it
    assert gc.returncode == 0 and "unfinished upload" in gc.stdout and s3_proxied.multipart_uploads() == [], gc


def test_storage_options_reach_the_saver(s3: Any, fault_env: FaultEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """``storage_options`` given to the engine are the saver's and its persist worker's too: with
    ``part_size_mb=16`` a 7 MiB file goes in one PutObject (a single-part ETag), not in 5 MiB parts."""
    monkeypatch.delenv("FLASHCKPT_S3_PART_SIZE_MB")
    engine = CheckpointEngine(s3.url, max_to_keep=0, storage_options={"part_size_mb": 16})
    try:
        engine.save(1, make_state(1, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=120)
    finally:
        close_and_wait(engine)
    head = s3.client().head_object(Bucket=s3.bucket, Key="run/step_1/rank_00000.pt")
    assert "-" not in head["ETag"], head["ETag"]  # one PutObject: the saver used part_size_mb=16
    assert json.loads(s3.read("run/.flashckpt/tracker.json")) == {"step": 1}


# ------------------------------------------------------------------------------------------ several ranks
def _save_ranks(url: str, steps: list[int], replicated: bool) -> dict[str, Any]:
    """A rank's part: saves ``steps`` to the store, then releases its memory (the saver exits)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    engine = CheckpointEngine(url, max_to_keep=0, replicated=replicated)
    for step in steps:
        engine.save(step, make_state(step if replicated else 10 * step + rank, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=120)
    engine.close()
    return {"rank": rank}


def _load_ranks(url: str, replicated: bool) -> dict[str, Any]:
    """A rank's part: loads from the store (memory was released) and says what it got."""
    import torch.distributed as dist

    engine = CheckpointEngine(url, replicated=replicated)
    try:
        sd = engine.load()
        assert engine.last_load is not None
        return {"step": engine.last_load.step, "source": engine.last_load.source, "tag": sd["step"],
                "digest": _digest(sd), "rank": dist.get_rank()}
    finally:
        engine.close()


def _digest(sd: Any) -> str:
    from helpers import tree_digest

    return tree_digest(sd)


def _run(fe: FaultEnv, s3: Any, fn: Any, name: str, **args: Any) -> list[Any]:
    from helpers import run_ranks

    return run_ranks(fn, 2, os.path.join(fe.tmp, name), args=args, timeout=300,
                     env={**s3.env, "FLASHCKPT_S3_PART_SIZE_MB": "5", "MASTER_PORT": str(29500 + os.getpid() % 1000)})


def test_a_replicated_step_is_downloaded_once_per_node(s3_proxied: Any, fault_env: FaultEnv) -> None:
    """DDP: every rank loads rank 0's file. The node downloads it once (into the job's shared memory; the
    other rank maps it): the proxy sees one download's worth of ranged GETs of that object."""
    _run(fault_env, s3_proxied, _save_ranks, "save", url=s3_proxied.url, steps=[1], replicated=True)
    s3_proxied.proxy.clear()
    got = _run(fault_env, s3_proxied, _load_ranks, "load", url=s3_proxied.url, replicated=True)
    assert [(r["step"], r["source"], r["tag"]) for r in got] == [(1, "storage", 1)] * 2
    assert got[0]["digest"] == got[1]["digest"] == _digest(make_state(1, MB))
    gets = [r for r in s3_proxied.proxy.records("GetObject") if r.key.endswith("step_1/checkpoint.pt")]
    size = s3_proxied.client().head_object(Bucket=s3_proxied.bucket, Key="run/step_1/checkpoint.pt")["ContentLength"]
    assert len(gets) == -(-size // (5 << 20)), [r.query for r in gets]  # one download of ceil(size / part) ranges


def test_a_damaged_shard_makes_every_rank_fall_back(s3: Any, fault_env: FaultEnv) -> None:
    """Sharded: rank 1's file of the newest step is damaged on the store. Rank 1 finds it while reading
    (its checksum), and both ranks load the previous step, each its own shard."""
    _run(fault_env, s3, _save_ranks, "save", url=s3.url, steps=[1, 2], replicated=False)
    key = "run/step_2/rank_00001.pt"
    body = bytearray(s3.read(key))
    body[len(body) // 2] ^= 0xFF  # one flipped byte in the middle of a tensor
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=bytes(body))
    got = _run(fault_env, s3, _load_ranks, "load", url=s3.url, replicated=False)
    assert [(r["step"], r["source"], r["tag"]) for r in got] == [(1, "storage", 10), (1, "storage", 11)]
    assert [r["digest"] for r in got] == [_digest(make_state(10, MB)), _digest(make_state(11, MB))]


def test_a_bucket_that_cannot_be_written_is_a_clear_error_before_anything_starts(s3: Any, fault_env: FaultEnv) -> None:
    from _fault_helpers import saver_pids
    from flashckpt import CheckpointDirError

    with pytest.raises(CheckpointDirError, match="no-such-bucket.*NoSuchBucket.*bucket exists"):
        CheckpointEngine("s3://no-such-bucket/run")
    assert not saver_pids(fault_env.runtime_dir)
