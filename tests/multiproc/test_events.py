"""The event stream in the training process (``CheckpointEngine.add_listener``, ``stats()``, the
``flashckpt.events`` log, FLASHCKPT_METRICS_FILE), end to end with real savers and persist workers: the
events of a save, its persist and commit, a load, the node-local tier's commit and upload, storage
retries under throttling (moto through the fault proxy), and a failure with what is still safe."""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import pytest
from _fault_helpers import (  # noqa: F401
    FaultEnv,
    close_and_wait,
    fault_env_fixture,
    make_state,
    run_cli,
)
from flashckpt import CheckpointEngine, InvalidArgumentError, StorageType
from flashckpt.engine.events import (
    Committed,
    Event,
    Failed,
    Loaded,
    Persisted,
    PersistStarted,
    Retried,
    SnapshotTaken,
    Uploaded,
)
from helpers import wait_for
from s3_fixtures import moto_server_fixture, s3_proxied_fixture  # noqa: F401
from s3_proxy import Fault

MB = 1.0
_SAMPLE = re.compile(r'^(flashckpt_[a-z_]+)\{([^}]*)\} (\S+)$')


def _samples(text: str) -> dict[tuple[str, str], float]:
    """Prometheus text format: every line a comment (# HELP / # TYPE) or a sample; (name, extra labels) ->
    value. Fails on any other line."""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        labels = ",".join(p for p in m.group(2).split(",") if not p.startswith(("rank=", "job=")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def test_a_save_its_persist_commit_and_a_load_are_events_stats_log_lines_and_metrics(
        fault_env: FaultEnv, tmp_path: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO, logger="flashckpt.events")
    metrics = str(tmp_path / "flashckpt-{rank}.prom")
    monkeypatch.setenv("FLASHCKPT_METRICS_FILE", metrics)
    ckpt = str(tmp_path / "ckpt")
    heard: list[Event] = []
    commits: list[Event] = []
    engine = CheckpointEngine(ckpt, max_to_keep=0)
    try:
        engine.add_listener(heard.append)
        engine.add_listener(commits.append, kinds=["commit"])

        def broken(ev: Event) -> None:
            raise RuntimeError("a listener's bug")
        remove = engine.add_listener(broken)
        with pytest.raises(InvalidArgumentError, match="unknown kind"):
            engine.add_listener(heard.append, kinds=["comit"])

        engine.save(1, make_state(1, MB), storage_type=StorageType.MEMORY)
        remove()
        engine.save(2, make_state(2, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        stats = engine.stats()
        engine.load()
    finally:
        close_and_wait(engine)

    kinds = [e.kind for e in heard]
    assert kinds == ["snapshot", "snapshot", "persist_start", "persist", "commit", "load"], kinds
    snap1, snap2, started, persisted, commit, load = heard
    assert isinstance(snap1, SnapshotTaken) and (snap1.step, snap1.storage, snap1.rank) == (1, "memory", 0)
    assert isinstance(snap2, SnapshotTaken) and snap2.storage == "disk" and snap2.bytes == snap1.bytes > 1_000_000
    assert 0 < snap1.pause_s < 30 and 0 < snap2.pause_s < 30
    file = os.path.join(ckpt, "step_2", "rank_00000.pt")
    assert isinstance(started, PersistStarted) and (started.step, started.rank, started.path) == (2, 0, file)
    assert isinstance(persisted, Persisted) and (persisted.step, persisted.tier) == (2, "durable")
    assert persisted.bytes == os.path.getsize(file) and persisted.seconds > 0 and persisted.mb_per_s
    assert isinstance(commit, Committed) and (commit.step, commit.tier, commit.bytes) == (2, "durable", persisted.bytes)
    assert commit.lag_s is not None and 0 < commit.lag_s < 60 and commits == [commit]
    assert isinstance(load, Loaded) and (load.step, load.source, load.bytes) == (2, "memory", snap2.bytes)

    assert (stats.snapshots, stats.persists, stats.persisted_bytes, stats.commits) == (2, 1, persisted.bytes,
                                                                                      {"durable": 1})
    assert (stats.durable_step, stats.memory_step, stats.lag_s, stats.failures) == (2, 2, 0.0, 0)
    assert stats.pause_s_total == pytest.approx(snap1.pause_s + snap2.pause_s)
    assert stats.pause_s_max == max(snap1.pause_s, snap2.pause_s) and stats.snapshot_bytes == snap2.bytes

    lines = [r.getMessage() for r in caplog.records if r.name == "flashckpt.events" and r.levelno == logging.INFO]
    assert "step 2: committed on the checkpoint dir" in "\n".join(lines), lines
    assert len(lines) == len(heard), lines  # one line per event
    raised = [r.getMessage() for r in caplog.records if "listener" in r.getMessage()]
    assert len(raised) == 1 and "a listener's bug" in raised[0], raised  # logged once, then removed

    with open(metrics.replace("{rank}", "0")) as f:
        text = f.read()
    got = _samples(text)
    assert got[("flashckpt_snapshots_total", "")] == 2
    assert got[("flashckpt_commits_total", 'tier="durable"')] == 1
    assert got[("flashckpt_step", 'tier="durable"')] == 2 and got[("flashckpt_step", 'tier="memory"')] == 2
    assert got[("flashckpt_persisted_bytes_total", "")] == persisted.bytes
    assert got[("flashckpt_loads_total", 'source="memory"')] == 1
    assert 'rank="0"' in text and "# TYPE flashckpt_lag_seconds gauge" in text


def test_the_local_tier_commit_and_the_upload_are_heard(fault_env: FaultEnv, tmp_path: Any) -> None:
    heard: list[Event] = []
    engine = CheckpointEngine(str(tmp_path / "ckpt"), max_to_keep=0, local_dir=str(tmp_path / "local"))
    try:
        engine.add_listener(heard.append, kinds=["commit", "upload"])
        engine.save(3, make_state(3, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        stats = engine.stats()
    finally:
        close_and_wait(engine)
    tiers = [(e.kind, getattr(e, "tier", None), e.step) for e in heard]
    assert tiers == [("commit", "local", 3), ("upload", None, 3), ("commit", "durable", 3)], tiers
    up = heard[1]
    assert isinstance(up, Uploaded) and up.bytes > 1_000_000 and up.attempts == 1
    assert (stats.local_step, stats.durable_step, stats.commits) == (3, 3, {"local": 1, "durable": 1})


def test_storage_retries_under_throttling_are_counted(s3_proxied: Any, fault_env: FaultEnv,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """SlowDown twice and two 500s on the saver's persist worker's uploads: the retries travel from the
    persist worker through the saver to the engine as ``retry`` events, by why."""
    for k, v in (("FLASHCKPT_S3_PART_SIZE_MB", "5"),):
        monkeypatch.setenv(k, v)
        fault_env.base_env[k] = v
    s3_proxied.proxy.set_faults([Fault("slowdown", op="UploadPart", times=2, retry_after_s=0.2),
                                 Fault("error500", op=("UploadPart", "PutObject"), times=2)])
    heard: list[Event] = []
    engine = CheckpointEngine(s3_proxied.url, max_to_keep=0)
    try:
        engine.add_listener(heard.append, kinds=["retry", "commit"])
        engine.save(1, make_state(1, 12.0), storage_type=StorageType.DISK)
        engine.wait(timeout=120)
        stats = engine.stats()
    finally:
        s3_proxied.proxy.set_faults([])
        close_and_wait(engine)
    applied = [r.fault for r in s3_proxied.proxy.records() if r.fault]
    assert sorted(applied) == ["error500", "error500", "slowdown", "slowdown"], applied
    retries = [e for e in heard if isinstance(e, Retried)]
    assert retries and sum(sum(e.counts.values()) for e in retries) == 4, (retries, [(r.op, r.fault) for r in s3_proxied.proxy.records() if r.fault])
    assert stats.retries == {"throttled": 2, "error": 2}, stats.retries
    assert [e.step for e in heard if isinstance(e, Committed)] == [1]


def test_a_failure_is_an_event_that_says_what_is_still_safe(s3_proxied: Any, fault_env: FaultEnv,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in (("FLASHCKPT_S3_DEADLINE_S", "2"), ("FLASHCKPT_S3_MAX_ATTEMPTS", "2")):
        monkeypatch.setenv(k, v)
        fault_env.base_env[k] = v
    heard: list[Event] = []
    engine = CheckpointEngine(s3_proxied.url, max_to_keep=0, on_persist_error="warn")
    try:
        engine.add_listener(heard.append, kinds=["failure", "persist_failed", "commit"])
        engine.save(1, make_state(1, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        s3_proxied.proxy.set_faults([Fault("error500", op=("UploadPart", "PutObject", "CreateMultipartUpload"),
                                           times=None)])
        engine.save(2, make_state(2, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        stats = engine.stats()
    finally:
        s3_proxied.proxy.set_faults([])
        close_and_wait(engine)
    failed = [e for e in heard if isinstance(e, Failed)]
    assert len(failed) == 1, heard
    f = failed[0]
    assert "step 2" in f.error and (f.durable_step, f.memory_step) == (1, 2), f
    assert [e.kind for e in heard if e.step == 2 and e.kind == "persist_failed"] == ["persist_failed"], heard
    assert stats.failures == 2 and stats.durable_step == 1, stats  # the rank's persist, then the engine's report


def test_flashckpt_status_shows_a_persist_in_flight_the_commits_memory_and_the_newest_events(
        s3_proxied: Any, fault_env: FaultEnv, tmp_path: Any) -> None:
    """A persist held mid-upload (the store stalls its parts until released): ``flashckpt status`` names the
    trainer, the persist running (its bytes; an object store does not tell the bytes written), the newest
    durable commit with its lag, the snapshots in memory and the newest events; ``--json`` carries numbers."""
    from flashckpt.transport.messages import InspectReply
    engine = CheckpointEngine(s3_proxied.url, max_to_keep=0)
    try:
        engine.save(1, make_state(1, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        s3_proxied.proxy.set_faults([Fault("stall", op=("UploadPart", "PutObject"), times=None)])
        engine.save(2, make_state(2, MB), storage_type=StorageType.DISK)
        wait_for(lambda: s3_proxied.proxy.stalled(), 60, "the persist's upload held by the store")
        text = run_cli(fault_env, "status", console=True)
        assert text.returncode == 0, text.stderr
        out = text.stdout
        assert "trainers: ranks [0]" in out, out
        assert "persisting step 2 rank 0 to the durable tier" in out and "not told by the store" in out, out
        assert "durable: step 1 committed" in out and "after its snapshot" in out, out
        assert "memory: step 2 (ranks [0]), step 1 (ranks [0])" in out, out
        assert "commit step=1 tier=durable" in out, out  # the newest events
        js = run_cli(fault_env, "status", "--json", "--events", "50", console=True)
        assert js.returncode == 0, js.stderr
        (job,) = json.loads(js.stdout)
        reply = InspectReply(**{k: v for k, v in job.items() if k != "job_dir"})
        (p,) = reply.persisting
        assert (p["step"], p["rank"], p["done"]) == (2, 0, None) and p["bytes"] > 1_000_000, p
        assert isinstance(p["seconds"], float) and reply.memory_bytes > 2_000_000, reply
        assert [c["step"] for c in reply.commits] == [1] and isinstance(reply.commits[0]["lag_s"], float)
        assert {"persist_start", "persist", "commit"} <= {e["kind"] for e in reply.events}, reply.events
        other = run_cli(fault_env, "status", str(tmp_path / "elsewhere"), console=True)
        assert other.returncode == 0 and "no saver runs on this node for" in other.stdout, other.stdout
        s3_proxied.proxy.set_faults([])
        s3_proxied.proxy.release()
        engine.wait(timeout=60)
    finally:
        s3_proxied.proxy.set_faults([])
        s3_proxied.proxy.release()
        close_and_wait(engine)


def test_bytes_written_so_far_of_a_file_on_a_posix_dir(tmp_path: Any) -> None:
    """What ``status`` reports as written for a persist to a POSIX dir: the file being written (the backend's
    temporary name), the finished file, or every file of a ``FileSet``'s directory; an object store: None."""
    from flashckpt.saver.report import _written
    from flashckpt.storage.posix import PosixDiskStorage
    st = PosixDiskStorage()
    f = tmp_path / "step_1" / "rank_00000.pt"
    f.parent.mkdir()
    assert _written(st, str(f)) == 0
    (tmp_path / "step_1" / ("rank_00000.pt" + st.temp_suffix)).write_bytes(b"x" * 1234)
    assert _written(st, str(f)) == 1234
    f.write_bytes(b"y" * 4321)
    (tmp_path / "step_1" / ("rank_00000.pt" + st.temp_suffix)).unlink()
    assert _written(st, str(f)) == 4321
    (tmp_path / "step_1" / "sub").mkdir()
    (tmp_path / "step_1" / "sub" / "a.bin").write_bytes(b"z" * 10)
    assert _written(st, str(tmp_path / "step_1")) == 4321 + 10


def test_last_words_are_in_the_savers_journal_for_flashckpt_status(fault_env: FaultEnv, tmp_path: Any) -> None:
    """An engine that ends with a snapshot newer than its last commit has the saver persist it (last words):
    the saver's journal says so, and ``flashckpt status`` shows it while the saver keeps the snapshots."""
    ckpt = str(tmp_path / "ckpt")
    engine = CheckpointEngine(ckpt, max_to_keep=0)
    engine.save(1, make_state(1, MB), storage_type=StorageType.DISK)
    engine.wait(timeout=60)
    engine.save(2, make_state(2, MB), storage_type=StorageType.MEMORY)
    engine.close(release=False)  # kept for a restart: the saver stays for its grace, persisting step 2

    def said() -> Any:
        js = run_cli(fault_env, "status", ckpt, "--json", "--events", "50")
        assert js.returncode == 0, js.stderr
        jobs = json.loads(js.stdout)
        events = [e for job in jobs for e in job["events"]]
        kinds = [(e["kind"], e.get("step")) for e in events]
        return kinds if ("last_words", 2) in kinds and ("commit", 2) in kinds else None
    kinds = wait_for(said, 30, "the saver's last words in its journal")
    assert kinds.index(("last_words", 2)) < kinds.index(("commit", 2)), kinds
