"""Security and hygiene of a job's runtime state: modes, other users, malformed control messages, and
the stale state of a killed saver."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _fault_helpers import (  # noqa: F401
    FaultEnv,
    assert_state_of,
    close_and_wait,
    fault_env_fixture,
    kill9,
    make_state,
    saver_pid,
    saver_pids,
    wait_for,
)
from flashckpt import (
    CheckpointDirError,
    CheckpointEngine,
    ProtocolError,
    SaverError,
    SharedMemoryError,
    StorageType,
)
from flashckpt.config import job_key
from flashckpt.format.segment import segment_paths
from flashckpt.transport.wire import MAX_MESSAGE, Client

NOBODY = 65534

_PROBE = r"""
import json, os, socket, sys
sock_path, seg_path = sys.argv[1], sys.argv[2]
out = {"uid": os.getuid()}
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(20)
try:
    s.connect(sock_path)
    out["connect"] = "connected"
except OSError as e:
    out["connect"] = type(e).__name__
if out["connect"] == "connected":
    body = json.dumps({"op": "hello", "rank": 0, "local_rank": 0, "pid": os.getpid()}).encode()
    try:
        s.sendall(len(body).to_bytes(4, "big") + body)
        out["reply"] = s.recv(1 << 16).decode(errors="replace")
    except OSError as e:  # the saver hung up on us
        out["reply"] = type(e).__name__
s.close()
try:
    with open(seg_path, "rb") as f:
        f.read(8)
    out["open_segment"] = "opened"
except OSError as e:
    out["open_segment"] = type(e).__name__
print(json.dumps(out))
"""


def _as_nobody(*args: str) -> dict[str, Any]:
    """Runs ``_PROBE`` as uid/gid nobody (with no supplementary groups) and returns what it saw."""
    def drop() -> None:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)

    # The venv's interpreter may live under /root (0700); use one that nobody may execute.
    candidates = [sys.executable, os.path.realpath(sys.executable), shutil.which("python3"), "/usr/bin/python3"]
    for exe in dict.fromkeys(c for c in candidates if c):
        try:
            r = subprocess.run([exe, "-I", "-S", "-c", _PROBE, *args], preexec_fn=drop, capture_output=True,
                               text=True, timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin"})
        except PermissionError:
            continue
        if r.returncode == 0:
            return json.loads(r.stdout)
    pytest.skip("no Python interpreter that uid nobody may execute")


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)




def test_runtime_dir_is_private(fault_env: FaultEnv) -> None:
    """Runtime dirs 0700; segments, socket, locks and log 0600, all owned by this user."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    engine = CheckpointEngine(ckpt)
    try:
        engine.save(1, make_state(1, 1), storage_type=StorageType.MEMORY)
        job_dir = engine.job_dir
        assert _mode(fault_env.runtime_dir) == 0o700 and _mode(job_dir) == 0o700
        names = sorted(os.listdir(job_dir))
        kinds = {"segment": [n for n in names if n.endswith(".shm")], "lock": [n for n in names if n.endswith(".lock")],
                 "socket": [n for n in names if n == "saver.sock"]}
        assert all(kinds.values()), names
        for name in names:
            path = os.path.join(job_dir, name)
            st = os.lstat(path)
            assert st.st_uid == os.getuid(), name
            assert stat.S_ISREG(st.st_mode) or stat.S_ISSOCK(st.st_mode), f"{name}: unexpected file type"
            assert _mode(path) == 0o600, f"{name}: mode {_mode(path):o}"
    finally:
        close_and_wait(engine)


@pytest.mark.multiproc
@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
def test_another_uid_cannot_reach_the_saver_or_the_segments(fault_env: FaultEnv,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # The runtime dir's parent is world-searchable (on /dev/shm), so only flashckpt's own modes protect it.
    parent = tempfile.mkdtemp(prefix="fct-sec-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.chmod(parent, 0o711)
    if not _searchable_by_others(parent):
        shutil.rmtree(parent)
        pytest.skip(f"{parent} is not reachable by other users on this machine")
    runtime_dir = os.path.join(parent, "rt")
    monkeypatch.setenv("FLASHCKPT_RUNTIME_DIR", runtime_dir)
    try:
        _another_uid_probe(fault_env, runtime_dir)
    finally:
        wait_for(lambda: not saver_pids(runtime_dir), 60, "the saver to exit")
        left = [os.path.join(r, n) for r, ds, fs in os.walk(runtime_dir) for n in ds + fs]
        shutil.rmtree(parent, ignore_errors=True)
        assert not left, f"runtime state left behind: {left}"


def _another_uid_probe(fault_env: FaultEnv, runtime_dir: str) -> None:
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    engine = CheckpointEngine(ckpt)
    try:
        engine.save(1, make_state(1, 1), storage_type=StorageType.MEMORY)
        job_dir = engine.job_dir
        sock = os.path.join(job_dir, "saver.sock")
        seg = segment_paths(job_dir, 0)[-1][1]
        seen = _as_nobody(sock, seg)
        assert seen["uid"] == NOBODY
        assert seen["connect"] == "PermissionError" and seen["open_segment"] == "PermissionError", seen

        # Defence in depth: even with the directories opened up, the 0600 segment stays closed and the
        # saver refuses a peer of another uid (SO_PEERCRED) without answering.
        os.chmod(runtime_dir, 0o711)
        os.chmod(job_dir, 0o711)
        os.chmod(sock, 0o666)
        try:
            seen = _as_nobody(sock, seg)
        finally:
            os.chmod(sock, 0o600)
            os.chmod(job_dir, 0o700)
            os.chmod(runtime_dir, 0o700)
        assert seen["connect"] == "connected" and seen["reply"] in ("", "BrokenPipeError", "ConnectionResetError"), seen
        assert seen["open_segment"] == "PermissionError", seen
        with open(os.path.join(job_dir, "saver.log")) as f:
            assert "refused a connection from another uid" in f.read()
        # The saver still serves its own user.
        engine.save(2, make_state(2, 1), storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        assert_state_of(engine.load(), 2, 1)
    finally:
        close_and_wait(engine)


def _searchable_by_others(path: str) -> bool:
    while path not in ("/", ""):
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        path = os.path.dirname(path)
    return True


def _raw(sock_path: str, payload: bytes) -> bytes:
    """Sends raw bytes on a fresh connection and returns everything the saver answers before closing."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    try:
        s.connect(sock_path)
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while True:
            chunk = s.recv(1 << 16)
            if not chunk:
                return data
            data += chunk
    finally:
        s.close()


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _replies(data: bytes) -> list[dict[str, Any]]:
    out = []
    while data:
        (n,) = struct.unpack(">I", data[:4])
        out.append(json.loads(data[4:4 + n]))
        data = data[4 + n:]
    return out


def test_malformed_control_messages_are_rejected_and_the_saver_keeps_serving(fault_env: FaultEnv) -> None:
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    engine = CheckpointEngine(ckpt, max_to_keep=0)
    try:
        engine.save(1, make_state(1, 1), storage_type=StorageType.MEMORY)
        sock = os.path.join(engine.job_dir, "saver.sock")
        pid = saver_pid(fault_env.runtime_dir, engine.job_dir)
        seg = segment_paths(engine.job_dir, 0)[-1][1]

        # Garbage, non-JSON, a JSON non-object, invalid UTF-8, absurd nesting, an oversize length prefix:
        # each gets one ProtocolError reply, then the connection is closed.
        for payload in (_frame(b"\x00garbage\xff"), _frame(b"not json"), _frame(b"[1, 2, 3]"),
                        _frame(b'{"op": "\xff\xfe"}'), _frame(b"[" * 100000),
                        struct.pack(">I", 0xFFFFFFFF), struct.pack(">I", MAX_MESSAGE + 1)):
            replies = _replies(_raw(sock, payload))
            assert len(replies) == 1 and replies[0]["ok"] is False and replies[0]["kind"] == "ProtocolError", \
                (payload[:20], replies)
        # A truncated message (the peer hangs up half-way) is dropped silently.
        assert _raw(sock, struct.pack(">I", 1000) + b'{"op": "st') == b""

        # Well-formed frames with bad requests: an error reply each, and the connection stays usable.
        client = Client(sock, timeout=30)
        try:
            good = {"step": 1, "rank": 0, "local_rank": 0, "slot": 0, "generation": 1,
                    "path": os.path.join(ckpt, "step_1", "rank_00000.pt")}
            outside_seg = os.path.join(os.path.dirname(engine.job_dir), "elsewhere", os.path.basename(seg))
            bad_requests = [
                ({"op": "persist", **good, "seg_path": "/etc/passwd"}, ProtocolError),
                ({"op": "persist", **good, "seg_path": outside_seg}, ProtocolError),
                ({"op": "persist", **good, "seg_path": os.path.join(engine.job_dir, "..", "x", "seg.shm")},
                 ProtocolError),
                ({"op": "persist", **good, "seg_path": seg, "path": "/etc/flashckpt-evil.pt"}, CheckpointDirError),
                ({"op": "persist", **good, "seg_path": seg, "path": os.path.join(ckpt, "..", "evil.pt")},
                 CheckpointDirError),
                ({"op": "persist", "step": "one", "seg_path": seg}, ProtocolError),
                ({"op": "hello"}, ProtocolError),
                ({"op": "alloc", "local_rank": -1, "meta_cap": 1, "data_cap": 1}, ProtocolError),
                ({"op": "alloc", "local_rank": 0, "meta_cap": 1, "data_cap": 1 << 62}, SharedMemoryError),
                ({"op": "d_update", "name": "x", "items": [1, 2]}, ProtocolError),
                ({"op": "no-such-op"}, ProtocolError),
                ({"op": None}, ProtocolError),
            ]
            for req, err in bad_requests:
                op = req.pop("op")
                with pytest.raises(err):
                    client.call(op, **req)
            assert client.call("status")["ok"] is True  # same connection, still served
        finally:
            client.close()
        assert not os.path.exists(os.path.join(fault_env.tmp, "evil.pt"))
        assert not os.path.exists("/etc/flashckpt-evil.pt")

        # The same saver keeps serving the trainer: snapshots, persists, loads.
        assert saver_pids(fault_env.runtime_dir, engine.job_dir) == [pid]
        engine.save(2, make_state(2, 1), storage_type=StorageType.DISK)
        engine.wait(timeout=60)
        assert_state_of(engine.load(), 2, 1)
        assert_state_of(torch.load(os.path.join(ckpt, "step_2", "rank_00000.pt"), weights_only=True), 2, 1)
    finally:
        close_and_wait(engine)


@pytest.mark.multiproc
def test_stale_state_of_a_killed_saver_is_reclaimed_by_the_next_run(fault_env: FaultEnv) -> None:
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    job_dir = fault_env.job_dir(ckpt)
    first = CheckpointEngine(ckpt)
    try:
        first.save(1, make_state(1, 4), storage_type=StorageType.MEMORY)
        old = saver_pid(fault_env.runtime_dir, job_dir)
        kill9(old)
    finally:
        first.close()
    stale = sorted(os.listdir(job_dir))
    assert "saver.sock" in stale and any(n.endswith(".shm") for n in stale), stale
    with pytest.raises(ConnectionRefusedError):
        Client(os.path.join(job_dir, "saver.sock"), timeout=5)

    second = CheckpointEngine(ckpt)  # same job id, same dir
    try:
        new = saver_pid(fault_env.runtime_dir, job_dir)
        assert new != old
        assert _mode(job_dir) == 0o700 and _mode(os.path.join(job_dir, "saver.sock")) == 0o600
        got = second.load()  # the snapshot in the dead saver's segment was adopted
        assert (second.last_load.source, second.last_load.step) == ("memory", 1)
        assert_state_of(got, 1, 4)
        second.save(2, make_state(2, 4), storage_type=StorageType.DISK)
        second.wait(timeout=60)
    finally:
        close_and_wait(second)
    # Everything of the job, the dead saver's state included, is gone after the clean exit.
    assert not os.path.exists(job_dir)


# ------------------------------------------------------------------ another local user, as a real process
_ATTACK = r"""
import json, os, sys
for op, *args in json.loads(sys.argv[1]):
    if op == "mkdir":
        os.mkdir(args[0])
        os.chmod(args[0], args[1])
    elif op == "symlink":
        os.symlink(args[0], args[1])
    elif op == "rename":
        os.rename(args[0], args[1])
print(json.dumps({"uid": os.getuid()}))
"""

# Listens on a socket the victim's runtime dir holds (bound there, handed over as an fd: listen() is
# what makes the kernel report this process's uid to a client) and records what each client sends.
_SERVE = r"""
import json, os, select, socket, sys
srv = socket.socket(fileno=int(sys.argv[1]))
srv.listen(8)
print("listening", flush=True)
got = []
while True:
    ready, _, _ = select.select([srv, sys.stdin], [], [], 60)
    if srv not in ready:  # told to stop (stdin closed) once no connection is pending, or timed out
        break
    conn, _ = srv.accept()
    conn.settimeout(2)
    data = b""
    try:
        while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    conn.close()
    got.append(data.decode(errors="replace"))
print(json.dumps({"uid": os.getuid(), "got": got}), flush=True)
"""


@pytest.fixture(scope="module")
def attacker() -> Iterator[tuple[int, int]]:
    """A second local user (uid, gid), created for these tests and removed after them."""
    if os.geteuid() != 0:
        pytest.skip("creating a second user needs root")
    if not (shutil.which("useradd") and shutil.which("userdel")):
        pytest.skip("useradd/userdel are not installed")
    name = f"fct-attacker-{os.getpid()}"
    r = subprocess.run(["useradd", "-M", "-r", "-U", "-s", "/usr/sbin/nologin", name], capture_output=True,
                       text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"useradd failed: {r.stderr.strip()}")
    try:
        pw = pwd.getpwnam(name)
        yield pw.pw_uid, pw.pw_gid
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=60)


def _python_for_others() -> str:
    """An interpreter another user may execute (the venv's may live under /root, 0700)."""
    for exe in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if not exe:
            continue
        real = os.path.realpath(exe)
        if os.path.isfile(real) and os.stat(real).st_mode & stat.S_IXOTH and _searchable_by_others(
                os.path.dirname(real)):
            return real
    pytest.skip("no Python interpreter that another user may execute")


def _attacker_popen(user: tuple[int, int], script: str, *args: str, pass_fds: tuple[int, ...] = ()
                    ) -> subprocess.Popen[str]:
    return subprocess.Popen([_python_for_others(), "-I", "-S", "-c", script, *args], user=user[0], group=user[1],
                            extra_groups=[], pass_fds=pass_fds, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/", env={"PATH": "/usr/bin:/bin"})


def _as_attacker(user: tuple[int, int], ops: list[list[Any]]) -> None:
    """Runs ``ops`` (mkdir/symlink/rename) as ``user``, in a process of that uid."""
    proc = _attacker_popen(user, _ATTACK, json.dumps(ops))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert json.loads(out)["uid"] == user[0]


def _plant_files(root: str, key: str) -> dict[str, bytes]:
    """Files of the victim's own (``root`` and ``root/key``), which no saver may ever delete."""
    files = {os.path.join(root, "top.txt"): b"keep me", os.path.join(root, key, "model.pt"): b"weights",
             os.path.join(root, key, "notes.txt"): b"notes"}
    os.makedirs(os.path.join(root, key))
    for path, data in files.items():
        with open(path, "wb") as f:
            f.write(data)
    return files


def _intact(files: dict[str, bytes]) -> dict[str, bool]:
    out = {}
    for path, data in files.items():
        try:
            with open(path, "rb") as f:
                out[path] = f.read() == data
        except OSError:
            out[path] = False
    return out


def _shared_dir(mode: int, owner: tuple[int, int] | None = None) -> str:
    """A fresh dir on /dev/shm (``mode``; root's unless ``owner``), reachable by other users."""
    d = tempfile.mkdtemp(prefix="fct-sec-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    if owner:
        os.chown(d, *owner)
    os.chmod(d, mode)
    if not _searchable_by_others(d):
        shutil.rmtree(d)
        pytest.skip(f"{d} is not reachable by other users on this machine")
    return d


@pytest.mark.multiproc
@pytest.mark.parametrize("planted", ["dir", "symlink"])
def test_a_runtime_dir_another_user_planted_is_refused_and_nothing_is_deleted(
        fault_env: FaultEnv, monkeypatch: pytest.MonkeyPatch, attacker: tuple[int, int], planted: str) -> None:
    """Another user creates the victim's runtime dir first in a shared sticky dir (like /dev/shm): their
    own dir with the job dir a link into the victim's files, or a link to a dir of the victim's. The
    engine refuses with a clear error; no saver starts, and none deletes the victim's files."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    key = job_key(ckpt)
    victim = os.path.join(fault_env.tmp, "precious")
    files = _plant_files(victim, key)
    shared = _shared_dir(0o1777)
    try:
        runtime = os.path.join(shared, f"flashckpt-{os.getuid()}")
        if planted == "dir":
            _as_attacker(attacker, [["mkdir", runtime, 0o777], ["symlink", os.path.join(victim, key),
                                                                os.path.join(runtime, key)]])
        else:
            _as_attacker(attacker, [["symlink", victim, runtime]])
        monkeypatch.setenv("FLASHCKPT_RUNTIME_DIR", runtime)
        with pytest.raises(SaverError) as err:
            engine = CheckpointEngine(ckpt)
            close_and_wait(engine)  # (the old code) its saver shuts down, emptying the dir the link leads to
        msg = str(err.value)
        assert runtime in msg and "FLASHCKPT_RUNTIME_DIR" in msg, msg
        assert (f"belongs to uid {attacker[0]}" if planted == "dir" else "is a symbolic link") in msg, msg
        assert not saver_pids(runtime)
    finally:
        intact = _intact(files)
        shutil.rmtree(shared)
    assert all(intact.values()), f"the victim's files were deleted: {intact}"


@pytest.mark.multiproc
def test_a_job_dir_swapped_for_a_link_under_a_running_saver_never_leads_its_cleanup_elsewhere(
        fault_env: FaultEnv, monkeypatch: pytest.MonkeyPatch, attacker: tuple[int, int]) -> None:
    """The runtime dir lies in a dir another user owns; while the saver runs, that user moves it away and
    puts a link to a dir of the victim's files in its place. The saver's shutdown removes only its own
    files, through the job dir it checked at start, and never follows the link."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    key = job_key(ckpt)
    victim = os.path.join(fault_env.tmp, "precious")
    files = _plant_files(victim, key)
    shared = _shared_dir(0o755, owner=attacker)
    try:
        runtime = os.path.join(shared, "rt")
        monkeypatch.setenv("FLASHCKPT_RUNTIME_DIR", runtime)
        engine = CheckpointEngine(ckpt)
        try:
            engine.save(1, make_state(1, 1), storage_type=StorageType.MEMORY)
            saver_pid(runtime, engine.job_dir)
            _as_attacker(attacker, [["rename", runtime, runtime + "-moved"], ["symlink", victim, runtime]])
        finally:
            close_and_wait(engine)
        moved = os.path.join(runtime + "-moved", key)
        left = os.listdir(moved) if os.path.isdir(moved) else []
    finally:
        intact = _intact(files)
        shutil.rmtree(shared)
    assert all(intact.values()), f"the victim's files were deleted: {intact}"
    assert left == [], f"the saver left its own files behind: {left}"


@pytest.mark.multiproc
def test_a_socket_another_user_serves_is_refused_before_anything_is_sent(
        fault_env: FaultEnv, monkeypatch: pytest.MonkeyPatch, attacker: tuple[int, int]) -> None:
    """The socket in the victim's job dir is served by another user's process: the engine (and a bare
    Client) refuse it with a clear error (SO_PEERCRED) and send it nothing, not even the hello."""
    monkeypatch.setenv("FLASHCKPT_SPAWN_TIMEOUT_S", "5")  # bounds the old code's retries
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    job_dir = fault_env.job_dir(ckpt)
    os.makedirs(job_dir, mode=0o700)
    sock_path = os.path.join(job_dir, "saver.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(sock_path)
        proc = _attacker_popen(attacker, _SERVE, str(srv.fileno()), pass_fds=(srv.fileno(),))
    finally:
        srv.close()
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "listening", proc.stderr
        with pytest.raises(SaverError) as err:
            engine = CheckpointEngine(ckpt)
            close_and_wait(engine)
        assert "another user owns that socket" in str(err.value) and "FLASHCKPT_RUNTIME_DIR" in str(err.value)
        with pytest.raises(SaverError, match="another user owns that socket"):
            Client(sock_path, timeout=5)
    finally:
        out, errs = proc.communicate(input="", timeout=60)
        os.unlink(sock_path)
        os.rmdir(job_dir)
    seen = json.loads(out.splitlines()[-1])
    assert seen["uid"] == attacker[0]
    assert seen["got"] and all(g == "" for g in seen["got"]), f"the other user's process was sent {seen['got']}"
