"""Checkpoint dirs that move, vanish or are reached another way (issue #30, items 9 and 10), with real
processes: a trainer commits steps and exits (its saver with it), the dir is renamed, copied, moved,
reached through a symbolic link, or deleted under a live engine, and a new process loads.

The rule: the committed steps of a dir travel with it whatever it is called (a rename in its parent, a
link or its real path: one view); where its records did not come along (a copy, a move to another
parent), ``load()`` and ``flashckpt ls`` say what they found and why they will not use it, and
``flashckpt adopt`` makes the steps the dir's after checking every file; nothing is deleted for a name
change. A step reported committed is loadable, even when its dir was deleted and made again under the
live engine, while a new run in a deleted and remade dir still starts afresh."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from _fault_helpers import FaultEnv, fault_env_fixture, kill9, make_state, run_cli  # noqa: F401
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.protocol import commit_step
from flashckpt.errors import PersistError
from flashckpt.format.names import META
from flashckpt.storage.base import FileRecord, file_checksum
from flashckpt.storage.posix import PosixDiskStorage
from helpers import wait_for

MB = 0.25

# A new process: loads the newest checkpoint of a dir, checks it bit for bit against the state the
# trainer saved at that step, and prints what it found.
_LOADER = textwrap.dedent("""
    import json, sys
    from _fault_helpers import assert_state_of
    from flashckpt import CheckpointEngine

    eng = CheckpointEngine(sys.argv[1], max_to_keep=0)
    try:
        sd = eng.load()
        r = eng.last_load
        if r.step is not None:
            assert_state_of(sd, r.step, float(sys.argv[2]))
        print(json.dumps({"step": r.step, "source": r.source, "note": getattr(r, "note", ""), "steps": eng.committed_steps()}))
    finally:
        eng.close()
""")


def load_in_new_process(fe: FaultEnv, ckpt: str, **env: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _LOADER, ckpt, str(MB)], env=fe.env(**env), cwd=fe.tmp,
                       capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr + fe.saver_logs()
    return json.loads(r.stdout.strip().splitlines()[-1])


def train(fe: FaultEnv, ckpt: str, plan: str) -> None:
    """A trainer process that saves ``plan`` (``step:disk,...``), waits for its persists, closes and exits."""
    p = fe.trainer(ckpt, "--mb", str(MB), "--plan", plan, "--wait", log_name="trainer.log")
    assert p.wait(timeout=180) == 0, fe.log("trainer.log") + fe.saver_logs()


def steps_of(ckpt: str) -> list[int]:
    return CommitLayout(ckpt, PosixDiskStorage()).committed_steps()


# ------------------------------------------------------------------------------------------- renamed
def test_a_dir_renamed_in_its_parent_keeps_its_steps(fault_env: FaultEnv) -> None:
    """``mv P/a P/b`` with no saver left: ``ls P/b`` and a new process's ``load()`` find a's steps; the
    records follow the dir (none deleted); a new dir made at the old name starts afresh and takes
    nothing from ``P/b``."""
    parent = os.path.join(fault_env.tmp, "P")
    a, b = os.path.join(parent, "a"), os.path.join(parent, "b")
    train(fault_env, a, "1:disk,2:disk")
    os.rename(a, b)

    r = run_cli(fault_env, "ls", b, "--json")
    assert [row["step"] for row in json.loads(r.stdout)] == [1, 2], r.stdout + r.stderr
    got = load_in_new_process(fault_env, b)
    assert (got["step"], got["source"], got["steps"]) == (2, "storage", [1, 2]), got
    assert sorted(os.listdir(os.path.join(parent, META))) == ["b"]  # moved to the dir's name, none deleted
    assert run_cli(fault_env, "verify", b).returncode == 0

    os.mkdir(a)  # the old name, a new dir
    got = load_in_new_process(fault_env, a)
    assert (got["step"], got["steps"], got["note"]) == (None, [], ""), got
    assert steps_of(b) == [1, 2]
    got = load_in_new_process(fault_env, b)
    assert (got["step"], got["steps"]) == (2, [1, 2]), got


def test_a_renamed_dir_whose_old_name_was_taken_first_gets_its_steps_back(fault_env: FaultEnv) -> None:
    """``mv P/a P/b; mkdir P/a``, then a run starts at ``P/a`` before anyone looks at ``P/b``: the records
    of a go to b (bound to its inode, b holds their files), never to the new a, and are not deleted."""
    parent = os.path.join(fault_env.tmp, "P")
    a, b = os.path.join(parent, "a"), os.path.join(parent, "b")
    train(fault_env, a, "1:disk,2:disk")
    os.rename(a, b)
    os.mkdir(a)
    train(fault_env, a, "5:disk")
    assert steps_of(a) == [5] and steps_of(b) == [1, 2]
    got = load_in_new_process(fault_env, b)
    assert (got["step"], got["steps"]) == (2, [1, 2]), got


# ---------------------------------------------------------------------------------------- symlinks
def test_a_dir_reached_through_a_link_or_its_real_path_has_one_view(fault_env: FaultEnv) -> None:
    """Steps committed through a symbolic link and through the real path are one set of steps, seen the
    same from both (``ls``, ``load``); a memory snapshot taken through the link is found through the
    real path by a new process after the trainer is killed."""
    real = os.path.join(fault_env.tmp, "data", "real")
    link = os.path.join(fault_env.tmp, "links", "ckpt")
    os.makedirs(real)
    os.makedirs(os.path.dirname(link))
    os.symlink(real, link)
    train(fault_env, link, "1:disk")
    train(fault_env, real, "2:disk")
    for d in (link, real):
        r = run_cli(fault_env, "ls", d, "--json")
        assert r.returncode == 0 and [row["step"] for row in json.loads(r.stdout)] == [1, 2], (d, r.stdout, r.stderr)
    got = load_in_new_process(fault_env, link)
    assert (got["step"], got["steps"]) == (2, [1, 2]), got
    assert os.listdir(os.path.dirname(link)) == ["ckpt"]  # no records beside the link: they are the real dir's

    # A snapshot in memory, taken through the link; the trainer killed, its saver keeps it.
    p = fault_env.trainer(link, "--mb", str(MB), "--plan", "3:disk,4:memory", "--wait", "--hold",
                          log_name="holder.log", FLASHCKPT_SAVER_GRACE_S="120")
    wait_for(lambda: "holding" in fault_env.log("holder.log"), 180, "the trainer to hold")
    kill9(p.pid)
    got = load_in_new_process(fault_env, real)
    assert (got["step"], got["source"]) == (4, "memory") and got["steps"][:3] == [1, 2, 3], got


# ------------------------------------------------------------------------------------------- copies
def test_a_copy_without_its_records_says_why_and_adopt_makes_its_intact_steps_loadable(fault_env: FaultEnv) -> None:
    """``cp -r`` of a dir whose records are beside it: the copy has no committed step; ``load()`` returns
    ``{}`` and says what it found and how to use it, so does ``ls`` (naming the original when the copy is in
    its parent); ``flashckpt adopt`` checks every file and takes only the intact steps; the original is
    untouched."""
    parent = os.path.join(fault_env.tmp, "P")
    a = os.path.join(parent, "a")
    train(fault_env, a, "1:disk,2:disk")
    away = os.path.join(fault_env.tmp, "Q", "copy")
    sibling = os.path.join(parent, "c")
    os.makedirs(os.path.dirname(away))
    for dst in (away, sibling):
        subprocess.run(["cp", "-r", a, dst], check=True)

    got = load_in_new_process(fault_env, away)
    assert (got["step"], got["source"]) == (None, "none"), got
    assert "step_2/rank_00000.pt" in got["note"] and f"flashckpt adopt {away} --from" in got["note"], got
    assert "load(resume_path=" in got["note"], got
    r = run_cli(fault_env, "ls", sibling)
    assert f"committed steps [1, 2] of {a}" in r.stderr and f"flashckpt adopt {sibling} --from {a}" in r.stderr, r.stderr

    with open(os.path.join(away, "step_2", "rank_00000.pt"), "r+b") as f:  # the copy of step 2 is damaged
        f.seek(100)
        f.write(b"\xff" * 8)
    r = run_cli(fault_env, "adopt", away, "--from", a, "--dry-run")
    assert r.returncode == 0 and "would adopt: step 1: adopted" in r.stdout and "step 2: " in r.stdout, r.stdout
    assert steps_of(away) == []
    r = run_cli(fault_env, "adopt", away, "--from", a)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step 2:" in r.stdout and "differs from the file committed" in r.stdout, r.stdout
    got = load_in_new_process(fault_env, away)
    assert (got["step"], got["steps"]) == (1, [1]), got
    assert steps_of(a) == [1, 2] and run_cli(fault_env, "verify", a).returncode == 0

    r = run_cli(fault_env, "adopt", away, "--from", a)  # twice: refused, nothing changed
    assert r.returncode == 2 and "already has committed steps [1]" in r.stderr, r.stderr
    r = run_cli(fault_env, "adopt", os.path.join(fault_env.tmp, "empty"), "--from", a)
    assert r.returncode == 2 and "not a directory" in r.stderr, r.stderr


def test_a_dir_moved_to_another_parent_keeps_its_records_until_adopted(fault_env: FaultEnv) -> None:
    """``mv P/a Q/a``: the records stay in ``P/.flashckpt`` (they cannot follow); runs on other dirs of P
    and a new dir that takes the name ``P/a`` never delete them (set aside, kept); ``adopt`` gives them to
    ``Q/a``; ``flashckpt gc`` removes what is left, saying how to keep it first."""
    parent = os.path.join(fault_env.tmp, "P")
    a = os.path.join(parent, "a")
    train(fault_env, a, "1:disk,2:disk")
    moved = os.path.join(fault_env.tmp, "Q", "a")
    os.makedirs(os.path.dirname(moved))
    os.rename(a, moved)
    train(fault_env, os.path.join(parent, "other"), "7:disk")  # creating records sweeps P/.flashckpt
    os.mkdir(a)
    train(fault_env, a, "9:disk")  # the name taken: a's old records are set aside, kept
    assert steps_of(a) == [9]
    kept = [n for n in os.listdir(os.path.join(parent, META)) if n not in ("a", "other")]
    assert len(kept) == 1 and kept[0].startswith(".flashckpt-retired-"), kept

    got = load_in_new_process(fault_env, moved)
    assert got["step"] is None and "flashckpt adopt" in got["note"], got
    r = run_cli(fault_env, "adopt", moved, "--from", a)
    assert r.returncode == 0 and "step 2: adopted" in r.stdout, r.stdout + r.stderr
    got = load_in_new_process(fault_env, moved)
    assert (got["step"], got["steps"]) == (2, [1, 2]), got

    r = run_cli(fault_env, "gc", a, "--dry-run")
    assert "which a new directory replaced" in r.stdout and f"--from {a}`" in r.stdout, r.stdout
    r = run_cli(fault_env, "gc", a)
    assert r.stdout.count("removed") == 1, r.stdout
    assert sorted(os.listdir(os.path.join(parent, META))) == ["a", "other"]
    assert steps_of(a) == [9] and steps_of(os.path.join(parent, "other")) == [7]


def test_records_kept_inside_the_dir_travel_with_it(fault_env: FaultEnv) -> None:
    """A dir that keeps its records inside (``<dir>/.flashckpt``: written by an older version, a mount
    point, a parent this user may not write) carries them: moved to another parent and copied, both load
    their steps."""
    parent = os.path.join(fault_env.tmp, "P")
    a = os.path.join(parent, "a")
    train(fault_env, a, "1:disk,2:disk")
    layout = CommitLayout(a, PosixDiskStorage())
    os.rename(layout.meta, os.path.join(a, META))  # what an older version left: the records inside
    os.unlink(os.path.join(a, META, "dir.json"))
    os.rmdir(os.path.join(parent, META))
    moved = os.path.join(fault_env.tmp, "Q", "b")
    os.makedirs(os.path.dirname(moved))
    os.rename(a, moved)
    copy = os.path.join(fault_env.tmp, "R", "c")
    os.makedirs(os.path.dirname(copy))
    subprocess.run(["cp", "-r", moved, copy], check=True)
    for d in (moved, copy):
        got = load_in_new_process(fault_env, d)
        assert (got["step"], got["steps"]) == (2, [1, 2]), (d, got)


# ----------------------------------------------------------------------------- deleted under a live engine
_LIVE = textwrap.dedent("""
    import json, sys
    from _fault_helpers import make_state
    from flashckpt import CheckpointEngine, StorageType

    eng = CheckpointEngine(sys.argv[1], max_to_keep=0)
    eng.save(1, make_state(1, float(sys.argv[2])), storage_type=StorageType.DISK)
    eng.wait(timeout=120)
    print("committed 1", flush=True)
    sys.stdin.readline()  # the test deletes the dir here
    eng.save(2, make_state(2, float(sys.argv[2])), storage_type=StorageType.DISK)
    eng.wait(timeout=120)
    print(json.dumps({"committed": eng.committed_steps()}), flush=True)
    sys.stdin.readline()  # the test reads the saver's log here
    eng.close()
""")


@pytest.mark.parametrize("remade", ["by_the_persist", "by_mkdir"])
def test_a_dir_deleted_under_a_live_engine_commits_steps_the_next_load_accepts(fault_env: FaultEnv,
                                                                              remade: str) -> None:
    """``rm -rf`` of the dir between two persists of a live engine (and ``mkdir`` right after, where
    inode numbers may be reused): the step the engine then reports committed is loadable by a new
    process, ``ls`` and ``verify`` agree, the steps whose files went with the dir no longer count; and a
    new run after another ``rm -rf`` starts afresh."""
    parent = os.path.join(fault_env.tmp, "P")
    ckpt = os.path.join(parent, "ckpt")
    p = subprocess.Popen([sys.executable, "-c", _LIVE, ckpt, str(MB)], env=fault_env.env(), cwd=fault_env.tmp,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fault_env.procs.append(p)  # type: ignore[arg-type]
    assert p.stdout is not None and p.stdin is not None
    assert p.stdout.readline().strip() == "committed 1", p.stderr.read() if p.stderr else ""
    shutil.rmtree(ckpt)
    if remade == "by_mkdir":
        os.mkdir(ckpt)
    p.stdin.write("go\n")
    p.stdin.flush()
    line = p.stdout.readline()
    assert line.startswith("{"), line + (p.stderr.read() if p.stderr else "") + fault_env.saver_logs()
    assert json.loads(line) == {"committed": [2]}, line
    assert "was deleted and made again while this job saved to it" in fault_env.saver_logs()  # the saver lives
    out, err = p.communicate("go\n", timeout=180)
    assert p.returncode == 0, out + err + fault_env.saver_logs()

    got = load_in_new_process(fault_env, ckpt)
    assert (got["step"], got["source"], got["steps"]) == (2, "storage", [2]), got
    r = run_cli(fault_env, "ls", ckpt, "--json")
    assert [row["step"] for row in json.loads(r.stdout)] == [2] and not r.stderr, r.stdout + r.stderr
    assert run_cli(fault_env, "verify", ckpt).returncode == 0

    shutil.rmtree(ckpt)  # the user starts over: a new run gets nothing of the old one
    got = load_in_new_process(fault_env, ckpt)
    assert (got["step"], got["steps"], got["note"]) == (None, [], ""), got


def test_a_commit_whose_files_vanished_fails_clearly(tmp_path) -> None:
    """A rank's file removed between its done marker and the commit (its dir deleted meanwhile): the
    commit is a ``PersistError`` naming the file, and no manifest is written."""
    ckpt = str(tmp_path / "ckpt")
    layout = CommitLayout(ckpt, PosixDiskStorage(), job="j")
    layout.claim().release()  # type: ignore[union-attr]
    path = os.path.join(ckpt, "step_3", "rank_00000.pt")
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(b"x" * 64)
    size, digest = file_checksum(path)
    layout.write_intent(3, 0, [path])
    layout.write_done(3, 0, [FileRecord(path, size, digest)])
    shutil.rmtree(os.path.dirname(path))
    with pytest.raises(PersistError, match=r"step 3: 1 of its files are gone from .*step_3/rank_00000.pt"):
        commit_step(layout, 3, [0], 1, replicated=False, extra={}, timeout=10)
    assert layout.committed_steps() == []
