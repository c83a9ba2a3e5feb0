"""Commit records that cannot be read are an error, never "no records" (issue #30, item 8's class, for the
records of a checkpoint dir).

Only an entry that is not there (ENOENT, ENOTDIR, and ELOOP where a symbolic link is not followed) counts
as missing, and a record of the wrong content as damaged; any other error (EMFILE, ENFILE, EACCES, EIO...)
is raised, naming the path, the errno and what to do, to the caller of ``load()``, ``committed_steps()``,
``flashckpt ls``/``verify``, and to the saver's claim of the records, which reports and retries it: never
"no checkpoints", an older step, or records set aside or removed as stale.

Real processes: a process whose file descriptors are used up but a few (RLIMIT_NOFILE lowered, the rest
held), and, for EACCES, a process that obeys permission bits (run as root, it drops CAP_DAC_OVERRIDE and
CAP_DAC_READ_SEARCH from its bounding set and executes itself again; its saver inherits that).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import torch
from flashckpt import StorageType
from helpers import saver_pids, wait_for

DISK = StorageType.DISK

# The starved calls: every number of free descriptors from none to enough, so each read of the records
# in turn is the one that fails.
_STARVE = f"""
import contextlib, os, sys
sys.path.insert(0, {os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")!r})
from _starve import starved_fds as starved
"""

_STARVED_READS = _STARVE + """
import io, json, sys
from flashckpt import cli
from flashckpt.commit.layout import CommitLayout
from flashckpt.storage.posix import PosixDiskStorage

ckpt = sys.argv[1]


def ls():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["ls", ckpt])
    return {"rc": rc, "out": out.getvalue(), "err": err.getvalue()}


def steps():
    return CommitLayout(ckpt, PosixDiskStorage()).committed_steps()


print(json.dumps({"free": -1, "call": "ls", "got": ls()}), flush=True)  # imports all it needs, unstarved
for free in range(9):
    for name, call in (("committed_steps", steps), ("ls", ls)):
        with starved(free):
            try:
                got = {"got": call()}
            except Exception as e:
                got = {"raised": f"{type(e).__name__}: {e}"}
        print(json.dumps({"free": free, "call": name, **got}), flush=True)
"""

_STARVED_CLAIMS = _STARVE + """
import json, shutil, sys
from flashckpt.commit import records_store as _records
from flashckpt.commit.layout import CommitLayout
from flashckpt.storage.posix import PosixDiskStorage

template, work = sys.argv[1], sys.argv[2]


def copy(n):
    # The tree with the checkpoint dir renamed (ckpt -> moved), its records still under the old name.
    tree = os.path.join(work, f"f{n}")
    shutil.copytree(template, tree, symlinks=True)
    _records.rebind(os.path.join(tree, ".flashckpt", "ckpt"), os.path.join(tree, "ckpt"))
    os.rename(os.path.join(tree, "ckpt"), os.path.join(tree, "moved"))
    return tree


def claim(tree):
    layout = CommitLayout(os.path.join(tree, "moved"), PosixDiskStorage(), job="starved")
    return layout, layout.claim()


for free in range(14):
    tree = copy(free)
    with starved(free):
        try:
            layout, held = claim(tree)
            got = {"got": layout.meta}
        except Exception as e:
            got, held = {"raised": f"{type(e).__name__}: {e}"}, None
    if held is not None:
        held.release()
    top = os.path.join(tree, ".flashckpt")
    records = {n: sorted(_records.committed_in(os.path.join(top, n))) for n in sorted(os.listdir(top))
               if n != _records.LOCK_NAME}
    print(json.dumps({"free": free, **got, "records": records}), flush=True)
layout, held = claim(tree)  # with descriptors again
print(json.dumps({"free": "all", "got": layout.meta, "steps": layout.committed_steps()}), flush=True)
held.release()
"""

# Runs the script given after it so that permission bits hold for it (and for the saver it starts): as
# root, without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (dropped from the bounding set, then exec).
_OBEYING_PERMISSIONS = """
import ctypes, os, sys
if os.geteuid() == 0:
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            print("SKIP: cannot drop capability", cap, os.strerror(ctypes.get_errno()), flush=True)
            sys.exit(0)
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
"""

_UNREADABLE = """
import contextlib, io, os, sys, tempfile, time
from flashckpt import CheckpointEngine, cli
from flashckpt.commit.layout import CommitLayout
from flashckpt.storage.posix import PosixDiskStorage

ckpt, case = sys.argv[1], sys.argv[2]
probe = tempfile.mkdtemp()
os.chmod(probe, 0)
try:
    os.listdir(probe)
    print("SKIP: this process reads a directory of mode 000 (it ignores permission bits)", flush=True)
    sys.exit(0)
except PermissionError:
    pass
finally:
    os.chmod(probe, 0o700)
    os.rmdir(probe)

parent = os.path.dirname(ckpt)
# "files": the checkpoint's files cannot be looked up; "records": the manifest of step 2 cannot be.
locked = ([os.path.join(ckpt, "step_1"), os.path.join(ckpt, "step_2")] if case == "files" else
          [os.path.join(parent, ".flashckpt", "ckpt", "steps", "000000000002")])


def cli_run(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return f"rc {rc} " + (out.getvalue() + err.getvalue()).replace(chr(10), " ")


def report(name, call):
    try:
        print(name, "returned", call(), flush=True)
    except Exception as e:
        print(name, "raised", type(e).__name__, str(e).replace(chr(10), " "), flush=True)


for d in locked:
    os.chmod(d, 0)
try:
    report("layout", lambda: CommitLayout(ckpt, PosixDiskStorage()).committed_steps())
    report("ls", lambda: cli_run("ls", ckpt))
    report("verify", lambda: cli_run("verify", ckpt))
    if case == "files":
        eng = CheckpointEngine(ckpt, max_to_keep=0)
        report("load", lambda: (eng.load(), (eng.last_load.step, eng.last_load.source))[1])
        report("committed_steps", eng.committed_steps)
finally:
    for d in locked:
        os.chmod(d, 0o755)
print("records", sorted(os.listdir(os.path.join(parent, ".flashckpt"))),
      sorted(os.listdir(os.path.join(parent, ".flashckpt", "ckpt", "steps"))), flush=True)
if case == "files":
    # The saver retries readying the records (up to every 30 s): the load works once it has.
    deadline = time.monotonic() + 120
    while True:
        try:
            got = eng.load()
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    print("relieved", eng.last_load.step, eng.last_load.source, float(got["w"][0]), flush=True)
    eng.close()
"""


def _commit_two(make_engine, root: str, runtime_dir: str) -> None:
    """Steps 1 and 2 committed in ``root`` (``step_N/rank_00000.pt``), the saver gone."""
    eng = make_engine(root, max_to_keep=0)
    for s in (1, 2):
        eng.save(s, {"w": torch.full((1024,), float(s)), "step": s}, storage_type=DISK)
        eng.wait(60)
    eng.close()
    wait_for(lambda: not saver_pids(runtime_dir), 60, "the saver to exit")


def _run(tmp_path, name: str, body: str, *args: str, prefix: tuple[str, ...] = ()) -> list[str]:
    script = tmp_path / f"{name}.py"
    script.write_text(body)
    out = subprocess.run([sys.executable, *prefix, str(script), *args], capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path))
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout.splitlines()


def _names_emfile(msg: str, parent: str) -> None:
    assert "CheckpointDirError" in msg and "EMFILE" in msg and parent in msg, msg
    assert "open-files limit" in msg, msg


def test_records_read_starved_of_fds_are_an_error_never_no_checkpoints(tmp_path, make_engine, runtime_dir):
    """Defect: a renamed checkpoint dir (its records still under the old name, found by its inode), read by a
    process with one or three free file descriptors: `committed_steps()` returned [] and `flashckpt ls` said
    "no flashckpt checkpoints" (exit 0), since the open of the records failed with EMFILE and was taken for
    "no records". Now each call returns the right steps or raises an error naming the path and EMFILE and
    saying to raise the open-files limit."""
    tree = tmp_path / "tree"
    _commit_two(make_engine, str(tree / "ckpt"), runtime_dir)
    os.rename(tree / "ckpt", tree / "moved")
    results = [json.loads(line) for line in _run(tmp_path, "reads", _STARVED_READS, str(tree / "moved"))]
    wrong = [r for r in results if "got" in r and r["got"] != [1, 2] and
             (r["call"] != "ls" or r["got"]["rc"] == 0 and [ln.split()[:2] for ln in r["got"]["out"].splitlines()[1:]]
              != [["1", "committed"], ["2", "committed"]])]
    assert not wrong, f"starved of fds, the records were taken for absent: {wrong}"
    errors = [r["raised"] for r in results if "raised" in r] + \
        [r["got"]["err"] for r in results if r["call"] == "ls" and r["got"]["rc"] != 0]
    assert errors, "no call was starved: the test did not reach the records' reads"
    for msg in errors:
        _names_emfile(msg, str(tree))
    assert sorted(os.listdir(tree / ".flashckpt")) == ["ckpt"]  # reads: nothing moved


def test_a_claim_starved_of_fds_never_loses_the_records(tmp_path, make_engine, runtime_dir):
    """Defect: a saver's claim of the records of a renamed checkpoint dir (what its housekeeping thread does
    at start), with five free file descriptors, created new, empty records for the new name beside the old
    ones (the search for records bound to the dir's inode failed with EMFILE and found none): the dir's
    committed steps were gone for every later load. Now a claim either brings the records to the new name
    whole or raises an error naming EMFILE (the saver reports it and retries), leaving them where they were;
    with descriptors again the claim brings them, steps 1 and 2."""
    template = tmp_path / "tree"
    _commit_two(make_engine, str(template / "ckpt"), runtime_dir)
    work = tmp_path / "work"
    work.mkdir()
    lines = _run(tmp_path, "claims", _STARVED_CLAIMS, str(template), str(work))
    results = [json.loads(line) for line in lines[:-1]]
    for r in results:  # leftovers of an interrupted creation are swept by the next claim
        r["records"] = {n: s for n, s in r["records"].items() if not n.startswith(".flashckpt-new-")}
    lost = [r for r in results if r["records"] != ({"ckpt": [1, 2]} if "raised" in r else {"moved": [1, 2]})]
    assert not lost, f"starved of fds, a claim lost (or left behind) the committed steps: {lost}"
    errors = [r for r in results if "raised" in r]
    assert errors, "no claim was starved: the test did not reach the records' reads"
    for r in errors:
        _names_emfile(r["raised"], str(work / f"f{r['free']}"))
    for r in results:
        if "got" in r:
            assert r["got"] == str(work / f"f{r['free']}" / ".flashckpt" / "moved"), r
    last = json.loads(lines[-1])
    assert last["steps"] == [1, 2] and last["got"].endswith("/.flashckpt/moved"), last


def _restore_modes(root) -> None:
    for top, dirs, _files in os.walk(root):
        for d in dirs:
            p = os.path.join(top, d)
            if not stat.S_IMODE(os.lstat(p).st_mode):
                os.chmod(p, 0o755)


def _unreadable(tmp_path, make_engine, runtime_dir, case: str) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """Steps 1 and 2 committed in ``tmp_path/tree/ckpt``, then ``_UNREADABLE`` run on it with ``case`` in a
    process that obeys permission bits (skipped where none can be made): (its run, its first word -> line)."""
    tree = tmp_path / "tree"
    _commit_two(make_engine, str(tree / "ckpt"), runtime_dir)
    wrapper, script = tmp_path / "obey.py", tmp_path / "unreadable.py"
    wrapper.write_text(_OBEYING_PERMISSIONS)
    script.write_text(_UNREADABLE)
    try:
        out = subprocess.run([sys.executable, str(wrapper), str(script), str(tree / "ckpt"), case], capture_output=True,
                             text=True, timeout=300, env={**os.environ, "FLASHCKPT_LAST_WORDS": "0"})
    finally:
        _restore_modes(tree)
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout.strip())
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out, {ln.split(" ", 1)[0]: ln for ln in out.stdout.splitlines()}


def test_checkpoint_files_that_cannot_be_looked_up_never_make_the_records_stale(tmp_path, make_engine,
                                                                                 runtime_dir):
    """Defect: with the checkpoint's files not searchable (EACCES on its step dirs), a saver starting on the
    dir took its records for stale ("no file of their committed steps exists") and removed them: `load()`
    returned {} and `committed_steps()` [], and after the permissions were fixed the steps were still gone.
    Now `load()`, `committed_steps()`, `flashckpt ls` raise an error naming the file and EACCES, the saver
    retries readying the records, and once the files can be read `load()` returns step 2."""
    tree = tmp_path / "tree"
    ckpt = tree / "ckpt"
    out, lines = _unreadable(tmp_path, make_engine, runtime_dir, "files")
    for name in ("layout", "ls", "verify", "load", "committed_steps"):
        line = lines[name]
        if name == "layout":  # reads the records only: they are readable
            assert line == "layout returned [1, 2]", line
            continue
        assert "EACCES" in line and str(ckpt / "step_") in line and "rc 0" not in line, f"{line}\n{out.stderr}"
        assert " raised CheckpointDirError" in line or "rc 2" in line, line
    assert lines["records"] == "records ['ckpt'] ['000000000001', '000000000002']", out.stdout
    assert lines["relieved"] == "relieved 2 storage 2.0", out.stdout + out.stderr


def test_a_manifest_that_cannot_be_looked_up_is_an_error_never_an_older_step(tmp_path, make_engine, runtime_dir):
    """Defect: with step 2's record dir not searchable (EACCES), `committed_steps()` returned [1] and
    `flashckpt verify` checked step 1 only and said ok: the newest step was silently not committed (a
    load took step 1). Now each raises an error naming the manifest and EACCES; nothing is removed."""
    tree = tmp_path / "tree"
    out, lines = _unreadable(tmp_path, make_engine, runtime_dir, "records")
    manifest = str(tree / ".flashckpt" / "ckpt" / "steps" / "000000000002")
    for name in ("layout", "ls", "verify"):
        line = lines[name]
        assert "EACCES" in line and manifest in line and "rc 0" not in line, f"{line}\n{out.stderr}"
    assert lines["records"] == "records ['ckpt'] ['000000000001', '000000000002']", out.stdout

