"""The ``flashckpt`` command: ``ls`` and ``verify`` on real checkpoint dirs, ``gc`` of a killed job's
runtime state next to a live job."""

from __future__ import annotations

import json
import os

import pytest
from _cli_helpers import save_steps
from _fault_helpers import (  # noqa: F401
    FaultEnv,
    close_and_wait,
    fault_env_fixture,
    kill9,
    make_state,
    run_cli,
    saver_pid,
    saver_pids,
    wait_for,
)
from flashckpt import CheckpointEngine, StorageType
from flashckpt.commit.layout import CommitLayout
from flashckpt.storage.posix import PosixDiskStorage


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"




def test_ls_lists_committed_and_uncommitted_steps_with_sizes(fault_env: FaultEnv) -> None:
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    save_steps(ckpt, [10], 1.5)
    save_steps(ckpt, [20], 3)
    # What a crash mid-persist leaves: an intent marker and a temporary file, no manifest.
    layout = CommitLayout(ckpt, PosixDiskStorage())
    partial = os.path.join(ckpt, "step_30", "rank_00000.pt")
    layout.write_intent(30, 0, [partial])
    os.makedirs(os.path.dirname(partial))
    with open(partial + ".flashckpt-tmp", "wb") as f:
        f.write(b"\0" * 1000)

    sizes = {s: sum(f.size for f in layout.read_manifest(s).all_files()) for s in (10, 20)}
    r = run_cli(fault_env, "ls", ckpt, "--json")
    assert r.returncode == 0, r.stderr
    rows = {row["step"]: row for row in json.loads(r.stdout)}
    assert sorted(rows) == [10, 20, 30]
    assert rows[10]["state"] == "committed" and rows[10]["bytes"] == sizes[10] and not rows[10]["latest"]
    assert rows[20]["state"] == "committed" and rows[20]["bytes"] == sizes[20] and rows[20]["latest"] is True
    assert _mib(sizes[10]) == "1.5 MiB" and _mib(sizes[20]) == "3.0 MiB"
    assert rows[10]["files"] == [os.path.join("step_10", "rank_00000.pt")]
    assert rows[30]["state"] == "not committed" and rows[30]["bytes"] is None and rows[30]["files"] == []
    # Numbers as numbers: bytes, the commit's epoch time, its age in seconds; no display strings.
    manifest_time = layout.read_manifest(10).time
    assert rows[10]["saved_at"] == manifest_time and isinstance(rows[10]["age_s"], float)
    assert 0 <= rows[10]["age_s"] < 600 and isinstance(rows[30]["saved_at"], float)
    assert rows[10]["memory"] == {"ranks": [], "backups_of_ranks": []} and rows[10]["tiers"] == "durable"
    assert rows[10]["training_step"] is None and rows[10]["epoch"] is None

    r = run_cli(fault_env, "ls", ckpt, console=True)  # the installed command, human-readable
    assert r.returncode == 0, r.stderr
    lines = {int(line.split()[0]): line for line in r.stdout.splitlines()[1:]}
    assert r.stdout.splitlines()[0].split()[:4] == ["STEP", "STATE", "SIZE", "AGE"]
    assert "committed" in lines[10] and "1.5 MiB" in lines[10] and "step_10/rank_00000.pt" in lines[10]
    assert "(latest)" in lines[20] and "3.0 MiB" in lines[20]
    assert "not committed" in lines[30]

    empty = os.path.join(fault_env.tmp, "empty")
    os.makedirs(empty)
    r = run_cli(fault_env, "ls", empty)
    assert r.returncode == 0 and "no flashckpt checkpoints" in r.stdout


def test_ls_and_verify_of_a_missing_dir_or_a_file_say_so(fault_env: FaultEnv) -> None:
    missing = os.path.join(fault_env.tmp, "no-such-dir")
    a_file = os.path.join(fault_env.tmp, "model.ckpt")
    with open(a_file, "wb") as f:
        f.write(b"not a dir")
    for cmd in ("ls", "verify"):
        r = run_cli(fault_env, cmd, missing, console=True)
        assert r.returncode == 2 and f"{missing} does not exist" in r.stderr, (cmd, r.stdout, r.stderr)
        assert "no flashckpt checkpoints" not in r.stdout and not os.path.exists(missing)
        r = run_cli(fault_env, cmd, a_file, console=True)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (cmd, r.stdout, r.stderr)
        assert f"{a_file} is a file, not a checkpoint dir" in r.stderr, r.stderr
    r = run_cli(fault_env, "gc", a_file)
    assert r.returncode == 2 and "is a file, not a checkpoint dir" in r.stderr


def test_gc_dry_run_with_nothing_to_do_says_so(fault_env: FaultEnv) -> None:
    r = run_cli(fault_env, "gc", "--dry-run", console=True)
    assert r.returncode == 0 and "nothing to clean (dry run: nothing would be removed)" in r.stdout, r.stdout
    r = run_cli(fault_env, "gc", "--dry-run", os.path.join(fault_env.tmp, "ckpt"))
    assert r.returncode == 0 and "nothing would be removed" in r.stdout, r.stdout


def test_verify_reports_missing_files_and_uncommitted_steps(fault_env: FaultEnv) -> None:
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    save_steps(ckpt, [1, 2], 1)
    r = run_cli(fault_env, "verify", ckpt)
    assert r.returncode == 0 and "step 1: ok" in r.stdout and "step 2: ok" in r.stdout, r.stdout

    gone = os.path.join(ckpt, "step_1", "rank_00000.pt")
    os.unlink(gone)
    r = run_cli(fault_env, "verify", ckpt)
    assert r.returncode == 1 and f"{gone}: missing" in r.stdout and "step 2: ok" in r.stdout, r.stdout
    assert run_cli(fault_env, "verify", ckpt, "--step", "2").returncode == 0
    r = run_cli(fault_env, "verify", ckpt, "--step", "7")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "step 7 is not committed" in r.stderr, r


@pytest.mark.multiproc
def test_gc_removes_the_runtime_dir_of_a_killed_saver_and_leaves_a_live_one(fault_env: FaultEnv,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    dead_ckpt = os.path.join(fault_env.tmp, "dead")
    live_ckpt = os.path.join(fault_env.tmp, "live")
    dead_job, live_job = fault_env.job_id + "-dead", fault_env.job_id + "-live"
    dead_dir, live_dir = fault_env.job_dir(dead_ckpt, dead_job), fault_env.job_dir(live_ckpt, live_job)

    monkeypatch.setenv("FLASHCKPT_JOB_ID", dead_job)
    dead = CheckpointEngine(dead_ckpt)
    try:
        dead.save(1, make_state(1, 4), storage_type=StorageType.MEMORY)
        kill9(saver_pid(fault_env.runtime_dir, dead_dir))
    finally:
        dead.close()  # the goodbye fails: its saver is gone
    stale = sorted(os.listdir(dead_dir))
    assert "saver.sock" in stale and any(n.endswith(".shm") for n in stale), stale

    monkeypatch.setenv("FLASHCKPT_JOB_ID", live_job)
    live = CheckpointEngine(live_ckpt)
    try:
        live.save(1, make_state(1, 1), storage_type=StorageType.MEMORY)
        live_pid = saver_pid(fault_env.runtime_dir, live_dir)

        r = run_cli(fault_env, "gc", "--dry-run")
        assert r.returncode == 0 and f"would remove {dead_dir}" in r.stdout and live_dir not in r.stdout, r.stdout
        assert sorted(os.listdir(dead_dir)) == stale

        r = run_cli(fault_env, "gc", console=True)
        assert r.returncode == 0, r.stderr
        assert f"removed {dead_dir}" in r.stdout and live_dir not in r.stdout, r.stdout
        assert not os.path.exists(dead_dir)
        # The live job is untouched and keeps working.
        assert os.path.exists(os.path.join(live_dir, "saver.sock"))
        assert saver_pids(fault_env.runtime_dir) == [live_pid]
        live.save(2, make_state(2, 1), storage_type=StorageType.DISK)
        live.wait(timeout=60)
        assert live.load()["step"] == 2

        r = run_cli(fault_env, "gc")
        assert r.returncode == 0 and "nothing to clean" in r.stdout
    finally:
        close_and_wait(live)


def test_ls_passes_over_a_marker_gone_since_the_listing(tmp_path, monkeypatch):
    """A step being written: its temp marker is renamed away between ls's listing of the step's records and
    its look at the file's time (seen under four nodes): ls goes on, never FileNotFoundError."""
    from flashckpt import cli

    d = tmp_path / "steps" / "000000000010"
    d.mkdir(parents=True)
    (d / "intent_rank_0.json").write_text("{}")
    (d / "intent_rank_0.json.flashckpt-tmp").write_text("{}")
    real = os.path.getmtime

    def getmtime(path):
        if str(path).endswith(".flashckpt-tmp"):
            raise FileNotFoundError(path)
        return real(path)

    monkeypatch.setattr(cli.os.path, "getmtime", getmtime)
    layout = CommitLayout(str(tmp_path / "ckpt"), PosixDiskStorage())
    assert cli._mtime(layout, str(d)) == real(str(d / "intent_rank_0.json"))
