"""Where flashckpt keeps its commit records: beside the checkpoint dir (``<parent>/.flashckpt/<name>``),
so the dir holds exactly the user's files; inside it (``<dir>/.flashckpt``) for dirs an older version
wrote, mount points and parents this user may not write; bound to the dir they describe, so a dir
deleted and made again starts afresh; records of deleted dirs swept, those of renamed dirs kept."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
from _fault_helpers import FaultEnv, close_and_wait, fault_env_fixture, make_state, run_cli  # noqa: F401
from flashckpt import CheckpointEngine, StorageType
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.records_store import records_dir
from flashckpt.format.files import FileSet
from flashckpt.format.names import META
from flashckpt.storage.posix import PosixDiskStorage
from flashckpt.util.lease import Lease
from helpers import assert_same_tree, run_ranks, wait_savers_gone

DISK, MEMORY = StorageType.DISK, StorageType.MEMORY
MB = 0.25


def layout(ckpt: str) -> CommitLayout:
    return CommitLayout(ckpt, PosixDiskStorage())


def hf_style(step: int) -> FileSet:
    return (FileSet().add_raw("model.safetensors", f"weights-{step}".encode())
            .add_torch("optimizer.pt", {"step": step})
            .add_raw("trainer_state.json", json.dumps({"global_step": step}).encode(), kind="commit"))


def commit_steps(ckpt: str, steps: list[int], **kw: object) -> None:
    eng = CheckpointEngine(ckpt, max_to_keep=0, **kw)  # type: ignore[arg-type]
    try:
        for s in steps:
            eng.save(s, make_state(s, MB), storage_type=DISK)
            eng.wait(timeout=60)
    finally:
        close_and_wait(eng)


# ------------------------------------------------------------------------------------- the user's dir
def test_a_checkpoint_dir_holds_only_the_users_files(fault_env: FaultEnv) -> None:
    """Single files (DDP), directories of native files with a commit-time file (HF), a fixed name
    reused across steps (Lightning's last.ckpt, written staged): the dir lists only them; the records,
    bound to the dir, live beside it, and everything verifies and loads."""
    parent = os.path.join(fault_env.tmp, "runs")
    ckpt = os.path.join(parent, "ckpt")
    eng = CheckpointEngine(ckpt, max_to_keep=0, replicated=True)
    try:
        eng.save(1, make_state(1, MB), storage_type=DISK)  # step_1/rank_00000.pt
        eng.save(2, hf_style(2), path="checkpoint-2", storage_type=DISK)
        eng.save(3, make_state(3, MB), path="last.ckpt", storage_type=DISK)
        eng.wait(timeout=60)
        eng.save(4, make_state(4, MB), path="last.ckpt", storage_type=DISK)  # staged until its commit
        eng.wait(timeout=60)
        assert sorted(os.listdir(ckpt)) == ["checkpoint-2", "last.ckpt", "step_1"]
        assert sorted(os.listdir(os.path.join(ckpt, "checkpoint-2"))) == ["model.safetensors", "optimizer.pt",
                                                                         "trainer_state.json"]
        assert eng.layout.meta == records_dir(ckpt) == os.path.join(parent, META, "ckpt")
        assert sorted(os.listdir(parent)) == [META, "ckpt"]
        with open(os.path.join(eng.layout.meta, "dir.json")) as f:
            assert json.load(f)["ino"] == os.stat(ckpt).st_ino
        assert eng.committed_steps() == [1, 2, 4]  # 3 superseded: its file holds step 4 now
        assert_same_tree(make_state(4, MB), eng.load(resume_path="last.ckpt"))
    finally:
        close_and_wait(eng)
    r = run_cli(fault_env, "verify", ckpt)
    assert r.returncode == 0 and "step 2: ok (3 files)" in r.stdout, r.stdout
    assert sorted(os.listdir(ckpt)) == ["checkpoint-2", "last.ckpt", "step_1"]  # nothing left by the saver


def test_a_dir_written_by_an_older_version_keeps_its_records_inside(fault_env: FaultEnv) -> None:
    """Records in ``<dir>/.flashckpt`` (as every version before this one kept them) are found and kept
    there: steps load, new commits go there, nothing appears beside the dir."""
    parent = os.path.join(fault_env.tmp, "runs")
    ckpt = os.path.join(parent, "old")
    commit_steps(ckpt, [1, 2])
    # What an older version leaves: the same records, inside the dir, without dir.json.
    os.rename(layout(ckpt).meta, os.path.join(ckpt, META))
    os.unlink(os.path.join(ckpt, META, "dir.json"))
    os.rmdir(os.path.join(parent, META))
    assert records_dir(ckpt) == os.path.join(ckpt, META)

    eng = CheckpointEngine(ckpt, max_to_keep=2)
    try:
        assert eng.layout.meta == os.path.join(ckpt, META) and not eng.layout.beside
        assert eng.committed_steps() == [1, 2]
        assert_same_tree(make_state(2, MB), eng.load())
        eng.save(3, make_state(3, MB), storage_type=DISK)
        eng.wait(timeout=60)
        assert eng.committed_steps() == [2, 3]
    finally:
        close_and_wait(eng)
    assert sorted(os.listdir(ckpt)) == [META, "step_2", "step_3"]
    assert os.listdir(parent) == ["old"]
    assert run_cli(fault_env, "verify", ckpt).returncode == 0
    r = run_cli(fault_env, "ls", ckpt, "--json")
    assert [row["step"] for row in json.loads(r.stdout)] == [2, 3]


def test_a_dir_deleted_and_made_again_never_gets_the_old_runs_steps(fault_env: FaultEnv,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Old run commits steps 10 and 20; ``rm -rf`` of the dir; a new run finds no committed step, loads
    nothing of the old run, and its retention never deletes its own files."""
    parent = os.path.join(fault_env.tmp, "runs")
    ckpt = os.path.join(parent, "ckpt")
    commit_steps(ckpt, [10, 20])
    shutil.rmtree(ckpt)
    r = run_cli(fault_env, "ls", ckpt)
    assert r.returncode == 2 and "does not exist" in r.stderr

    eng = CheckpointEngine(ckpt, max_to_keep=2)
    try:
        assert eng.committed_steps() == [] and eng.load() == {} and eng.last_load.source == "none"
        logs = fault_env.saver_logs()  # removed when the new dir got the old inode number, else kept aside
        assert "were stale" in logs and ("removed" in logs or "kept aside until `flashckpt gc`" in logs), logs
        for s in (10, 15):  # step 10 again, at the old run's path
            eng.save(s, make_state(100 + s, MB), storage_type=DISK)
            eng.wait(timeout=60)
        assert eng.committed_steps() == [10, 15]
        assert sorted(os.listdir(ckpt)) == ["step_10", "step_15"]
        assert_same_tree(make_state(115, MB), eng.load())
        assert_same_tree(make_state(110, MB), eng.load(resume_path="step_10/rank_00000.pt"))
    finally:
        close_and_wait(eng)
    # The old records are not the new dir's: removed, or (when the old dir may live on elsewhere: its inode
    # number was not reused) set aside until `flashckpt gc`.
    assert [n for n in os.listdir(os.path.join(parent, META)) if not n.startswith(".flashckpt-retired-")] == ["ckpt"]


def test_records_of_a_dir_whose_files_are_all_gone_are_stale(fault_env: FaultEnv) -> None:
    """The same dir (same inode), but no file of any committed step is left (the user emptied it): the
    records describe nothing, and a new run starts afresh; ``ls`` says so before."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    commit_steps(ckpt, [1, 2])
    for name in os.listdir(ckpt):
        shutil.rmtree(os.path.join(ckpt, name))
    assert "no file of their committed steps [1, 2]" in (layout(ckpt).stale_reason() or "")
    r = run_cli(fault_env, "ls", ckpt)
    assert "are stale" in r.stderr and f"flashckpt gc {ckpt}" in r.stderr, r.stderr
    r = run_cli(fault_env, "gc", ckpt, "--dry-run")
    assert f"would remove {layout(ckpt).meta}: stale" in r.stdout, r.stdout
    assert layout(ckpt).committed_steps() == [1, 2]  # a dry run changes nothing
    r = run_cli(fault_env, "gc", ckpt)
    assert f"removed {layout(ckpt).meta}: stale" in r.stdout, r.stdout
    assert layout(ckpt).committed_steps() == [] and not os.path.exists(os.path.join(fault_env.tmp, META))


# ------------------------------------------------------------------------------------------- orphans
def test_orphans_are_kept_until_gc_unless_a_live_job_holds_them_and_renamed_dirs_keep_theirs(fault_env: FaultEnv) -> None:
    """Records of dirs gone from the parent are never removed by a claim (the dir may have been moved
    elsewhere: `flashckpt adopt`); records of a dir renamed in the parent follow it; `flashckpt gc` removes
    the orphans no live job holds."""
    parent = os.path.join(fault_env.tmp, "runs")
    dirs = {n: os.path.join(parent, n) for n in ("gone", "kept", "held", "moved")}
    for d in dirs.values():
        commit_steps(d, [1])
    top = os.path.join(parent, META)
    held = Lease(layout(dirs["held"]).home.job_lock_path("another-job"), shared=True)  # a live saver's lock
    assert held.try_acquire()
    try:
        for n in ("gone", "held"):
            shutil.rmtree(dirs[n])
        os.rename(dirs["moved"], os.path.join(parent, "renamed"))
        os.makedirs(os.path.join(top, "not-ours"))  # not flashckpt's records: no dir.json
        os.symlink(fault_env.tmp, os.path.join(top, "a-link"))

        r = run_cli(fault_env, "gc", dirs["kept"], "--dry-run")
        assert f"would remove {top}/gone:" in r.stdout and f"moved to {top}/renamed" in r.stdout, r.stdout
        assert sorted(os.listdir(top)) == ["a-link", "gone", "held", "kept", "moved", "not-ours"]

        commit_steps(os.path.join(parent, "new"), [1])  # creating records moves those of renamed dirs
        assert sorted(os.listdir(top)) == ["a-link", "gone", "held", "kept", "new", "not-ours", "renamed"]
        assert layout(dirs["kept"]).committed_steps() == [1]
        renamed = layout(os.path.join(parent, "renamed"))
        assert renamed.committed_steps() == [1] and renamed.verify(1) == [] and renamed.stale_reason() is None
    finally:
        held.release()
    r = run_cli(fault_env, "gc", dirs["kept"])
    assert f"removed {top}/held:" in r.stdout and f"removed {top}/gone:" in r.stdout, r.stdout
    assert f"--from {dirs['gone']}`" in r.stdout, r.stdout  # how to keep them, had the dir been moved
    os.unlink(os.path.join(top, "a-link"))
    os.rmdir(os.path.join(top, "not-ours"))
    for n in ("kept", "new", "renamed"):
        shutil.rmtree(os.path.join(parent, n))
    r = run_cli(fault_env, "gc", dirs["kept"], console=True)
    assert r.returncode == 0 and r.stdout.count("removed") == 3, r.stdout
    assert os.listdir(parent) == []  # .flashckpt itself goes once empty


# --------------------------------------------------------------------------------------- fall-backs
_NAMESPACE_SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys
    from flashckpt import CheckpointEngine, StorageType
    from flashckpt.commit.records_store import records_dir
    from flashckpt.format.files import FileSet

    base = sys.argv[1]
    ro_parent, real, tmpfs_parent, fs2 = (os.path.join(base, n) for n in ("ro", "real", "rw", "fs2"))
    ro_ckpt, tmpfs_ckpt, link_ckpt = (os.path.join(ro_parent, "ckpt"), os.path.join(tmpfs_parent, "ckpt"),
                                      os.path.join(base, "ln", "ckpt"))
    for d in (ro_ckpt, real, tmpfs_ckpt, fs2, os.path.dirname(link_ckpt)):
        os.makedirs(d)

    def sh(*cmd):
        subprocess.run(cmd, check=True, capture_output=True)

    # A parent this process may not write (a read-only bind mount of itself), the dir writable (a bind
    # mount from the same file system, so not a mount point to os.path.ismount).
    sh("mount", "--bind", ro_parent, ro_parent)
    sh("mount", "--bind", real, ro_ckpt)
    sh("mount", "-o", "remount,ro,bind", ro_parent)
    # A dir that is a mount point of another file system; a symbolic link to a dir on another one.
    sh("mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", tmpfs_ckpt)
    sh("mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", fs2)
    os.makedirs(os.path.join(fs2, "ckpt"))
    os.symlink(os.path.join(fs2, "ckpt"), link_ckpt)
    out = {}
    for name, ckpt in (("ro_parent", ro_ckpt), ("mount_point", tmpfs_ckpt), ("link_to_other_fs", link_ckpt)):
        eng = CheckpointEngine(ckpt, max_to_keep=0)
        try:
            # A commit-time file: written staged in the records, moved into the dir by rename at the commit.
            fs = FileSet().add_raw("a.bin", b"a").add_raw("meta.json", b"{}", kind="commit")
            eng.save(1, fs, path="set_1", storage_type=StorageType.DISK)
            eng.wait(timeout=60)
            out[name] = {"meta": eng.layout.meta, "rule": records_dir(ckpt), "ls": sorted(os.listdir(ckpt)),
                         "parent": sorted(os.listdir(os.path.dirname(ckpt))), "steps": eng.committed_steps()}
        finally:
            eng.close()
    print(json.dumps(out))
""")


def test_a_read_only_parent_or_another_file_system_keeps_the_records_inside(fault_env: FaultEnv) -> None:
    """In a private mount namespace: a parent on a read-only mount with a writable dir in it, a dir that
    is a tmpfs mount point: both keep their records inside. A symbolic link to a dir on a tmpfs has the
    records of its real path, beside it on that tmpfs (nothing beside the link). All save and commit a set
    with a commit-time file (moved from the records by rename) as before."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1) for a private mount namespace")
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a mount namespace here")
    base = os.path.join(fault_env.tmp, "ns")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", _NAMESPACE_SCRIPT,
                        base], env=fault_env.env(), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr + fault_env.saver_logs()
    wait_savers_gone(fault_env.runtime_dir)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for name, parent in (("ro_parent", "ro"), ("mount_point", "rw")):
        ckpt = os.path.join(base, parent, "ckpt")
        got = out[name]
        assert got["meta"] == got["rule"] == os.path.join(ckpt, META), got
        assert got["ls"] == [META, "set_1"] and got["parent"] == ["ckpt"] and got["steps"] == [1], got
    got = out["link_to_other_fs"]
    assert got["meta"] == got["rule"] == os.path.join(base, "fs2", META, "ckpt"), got
    assert got["ls"] == ["set_1"] and got["parent"] == ["ckpt"] and got["steps"] == [1], got
    assert sorted(os.listdir(os.path.join(base, "real"))) == [META, "set_1"]  # what the ro parent's dir held


def test_a_parent_flashckpt_that_is_a_link_or_not_ours_is_never_used(fault_env: FaultEnv,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    parent = os.path.join(fault_env.tmp, "shared")
    elsewhere = os.path.join(fault_env.tmp, "elsewhere")
    os.makedirs(elsewhere)
    os.makedirs(parent)
    os.symlink(elsewhere, os.path.join(parent, META))
    ckpt = os.path.join(parent, "ckpt")
    with caplog.at_level(logging.INFO, logger="flashckpt.commit.records_store"):
        assert records_dir(ckpt) == os.path.join(ckpt, META)
    assert "symbolic link" in caplog.text
    commit_steps(ckpt, [1])
    assert os.listdir(elsewhere) == [] and sorted(os.listdir(ckpt)) == [META, "step_1"]
    assert layout(ckpt).committed_steps() == [1]


# ------------------------------------------------------------------------------------------- ranks
def two_nodes_worker(ckpt_dir: str, runtime_root: str) -> dict:
    """Each rank is a node of its own (its own runtime dir, so its own saver): both savers claim the
    records at once; the commit needs both ranks' files."""
    import torch.distributed as dist

    rank = dist.get_rank()
    os.environ.update(FLASHCKPT_RUNTIME_DIR=os.path.join(runtime_root, f"node{rank}"), LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
    before = records_dir(ckpt_dir)
    eng = CheckpointEngine(ckpt_dir, max_to_keep=0)
    try:
        eng.save(1, {"w": torch.full((8,), float(rank))}, storage_type=DISK)
        eng.wait(timeout=60)
        dist.barrier()
        m = eng.layout.read_manifest(1)
        return {"before": before, "meta": eng.layout.meta, "ranks": sorted(m.files), "ls": sorted(os.listdir(ckpt_dir))}
    finally:
        eng.close()
        wait_savers_gone(os.environ["FLASHCKPT_RUNTIME_DIR"])


@pytest.mark.multiproc
def test_two_nodes_agree_on_the_records_dir(tmp_path) -> None:
    ckpt = str(tmp_path / "runs" / "ckpt")
    os.makedirs(ckpt)
    nodes = tempfile.mkdtemp(prefix="fct-nodes-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        res = run_ranks(two_nodes_worker, 2, str(tmp_path / "work"), args={"ckpt_dir": ckpt, "runtime_root": nodes})
    finally:
        wait_savers_gone(nodes)
        shutil.rmtree(nodes)
    want = str(tmp_path / "runs" / META / "ckpt")
    assert [r["before"] for r in res] == [r["meta"] for r in res] == [want, want], res
    assert res[0]["ranks"] == [0, 1] and res[0]["ls"] == ["step_1"], res
    assert layout(ckpt).verify(1) == []


def test_records_made_meanwhile_by_a_lockless_writer_are_bound_not_refused(tmp_path, monkeypatch) -> None:
    """Another node's saver may put the job's peer book into the records (no parent lock needed) between a
    claim's look for them and its rename of the new records into place: the claim binds those records
    (their content kept) instead of failing on the rename (ENOTEMPTY), and leaves no temporary dir."""
    from flashckpt.commit import records_store as _records

    root = tmp_path / "ckpt"
    root.mkdir()
    top, name = os.path.split(_records.home(str(root)))
    real_open = _records._open_dir_at
    raced = []

    def open_dir_at(top_fd: int, n: str):  # the other writer makes them right after the claim looked
        if not raced:
            raced.append(n)
            os.makedirs(os.path.join(top, n, "peers", "job"))
            with open(os.path.join(top, n, "peers", "job", "secret"), "wb") as f:
                f.write(b"s")
            return None
        return real_open(top_fd, n)

    monkeypatch.setattr(_records, "_open_dir_at", open_dir_at)
    with _records.locked_parent(top) as top_fd:
        assert _records.bind(top_fd, name, str(root)) is False
    assert raced == [name]
    records = os.path.join(top, name)
    assert _records.read_binding(records) == os.stat(root).st_ino
    assert open(os.path.join(records, "peers", "job", "secret"), "rb").read() == b"s"
    assert not [n for n in os.listdir(top) if n.startswith(_records.NEW)]
