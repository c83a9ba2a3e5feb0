"""Node-local IPC: SharedLock across processes, SharedQueue/SharedDict across clients of one saver, and a
control server that rejects malformed messages and keeps serving everybody else."""

from __future__ import annotations

import multiprocessing
import os
import socket
import struct

import pytest
import torch
from flashckpt import (
    CheckpointTimeoutError,
    FlashCheckpointError,
    ProtocolError,
    SaverError,
    StorageType,
)
from flashckpt.transport.ipc import SharedDict, SharedLock, SharedQueue
from flashckpt.transport.spawn import SOCKET_NAME, lock_job
from flashckpt.transport.wire import MAX_MESSAGE, Client, recv_msg, send_msg
from helpers import flock_waiters, saver_pids, wait_for

# fork: the children only use fcntl and files, and start in milliseconds (no second torch import).
_fork = multiprocessing.get_context("fork")


def _hold_lock(path: str, held, release) -> None:
    lock = SharedLock(path)
    lock.acquire()
    held.set()
    release.wait(60)
    lock.release()


def _count_under_lock(path: str, counter: str, n: int) -> None:
    lock = SharedLock(path)
    for _ in range(n):
        with lock:  # read-modify-write that loses updates unless the lock excludes the other process
            with open(counter) as f:
                v = int(f.read())
            with open(counter, "w") as f:
                f.write(str(v + 1))


def _join(procs) -> None:
    for p in procs:
        p.join(60)
        assert p.exitcode == 0, f"child exited with {p.exitcode}"


@pytest.mark.multiproc
def test_shared_lock_excludes_other_processes_and_times_out(tmp_path):
    path = str(tmp_path / "x.lock")
    held, release = _fork.Event(), _fork.Event()
    child = _fork.Process(target=_hold_lock, args=(path, held, release))
    child.start()
    try:
        assert held.wait(30)
        lock = SharedLock(path)
        assert not lock.acquire(blocking=False)
        assert not lock.acquire(timeout=0.2)
        assert not lock.locked()
        release.set()
        assert lock.acquire(timeout=30)
        assert lock.locked()
        lock.release()
    finally:
        release.set()
        _join([child])
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)


@pytest.mark.multiproc
def test_shared_lock_serializes_read_modify_write(tmp_path):
    path, counter = str(tmp_path / "c.lock"), str(tmp_path / "counter")
    with open(counter, "w") as f:
        f.write("0")
    procs = [_fork.Process(target=_count_under_lock, args=(path, counter, 300)) for _ in range(2)]
    for p in procs:
        p.start()
    _join(procs)
    with open(counter) as f:
        assert int(f.read()) == 600


def test_shared_lock_misuse_is_an_error(tmp_path):
    lock = SharedLock(str(tmp_path / "m.lock"))
    with pytest.raises(FlashCheckpointError, match="not held"):
        lock.release()
    with lock:
        assert lock.locked()
    assert not lock.locked()


def test_shared_queue_and_dict_across_two_clients(make_engine):
    eng = make_engine()
    other = Client(os.path.join(eng.job_dir, SOCKET_NAME), timeout=30)  # a second process's view
    try:
        qa, qb = SharedQueue("work", eng._link.client), SharedQueue("work", other)
        assert qb.empty()
        for item in (1, "two", {"three": [3]}, None):
            qa.put(item)
        assert qb.qsize() == 4
        assert [qb.get(timeout=5) for _ in range(4)] == [1, "two", {"three": [3]}, None]
        assert qa.empty()
        with pytest.raises(CheckpointTimeoutError):
            qb.get(timeout=0.1)
        assert SharedQueue("other", other).empty()  # queues are separate by name

        da, db = SharedDict("cfg", eng._link.client), SharedDict("cfg", other)
        da["lr"] = 0.5
        da.update({"steps": [1, 2], "name": "x"})
        assert db.to_dict() == {"lr": 0.5, "steps": [1, 2], "name": "x"}
        db.set("lr", 0.25)
        assert da["lr"] == 0.25 and da.get("missing", 7) == 7
        with pytest.raises(KeyError):
            da["missing"]
        assert SharedDict("another", other).to_dict() == {}
    finally:
        other.close()
    eng.close()


def _raw(job_dir: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(os.path.join(job_dir, SOCKET_NAME))
    return s


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


MALFORMED = {
    "garbage_bytes": b"\xde\xad\xbe\xef" + os.urandom(64),  # its "length" is far over the limit
    "oversize_length": struct.pack(">I", MAX_MESSAGE + 1),
    "not_json": struct.pack(">I", 9) + b"not json{",
    "not_utf8": struct.pack(">I", 4) + b"\xff\xfe\xfd\xfc",
    "json_not_object": struct.pack(">I", 7) + b"[1,2,3]",
    "deeply_nested": struct.pack(">I", 200_000) + b"[" * 200_000,
}


def test_malformed_messages_are_rejected_and_the_saver_keeps_serving(make_engine):
    eng = make_engine()
    eng.save(1, {"w": torch.arange(8.0)}, storage_type=StorageType.MEMORY)
    for name, payload in MALFORMED.items():
        s = _raw(eng.job_dir)
        try:
            s.sendall(payload)
            try:
                reply = recv_msg(s)
            except ConnectionError as e:
                raise AssertionError(f"{name}: the saver hung up without an error reply ({e})") from e
            assert reply["ok"] is False and reply["kind"] == "ProtocolError", (name, reply)
            assert _closed_by_peer(s), f"{name}: the connection stayed open after a framing error"
        finally:
            s.close()
    # A message cut short, then a hang-up.
    s = _raw(eng.job_dir)
    s.sendall(struct.pack(">I", 1000) + b'{"op":')
    s.close()

    # Well-framed requests that make no sense get an error reply and the connection stays usable.
    c = Client(os.path.join(eng.job_dir, SOCKET_NAME), timeout=30)
    try:
        for bad in ({"op": "no_such_op"}, {"op": "persist"}, {"op": "hello"}, {"op": "hello", "rank": "x"},
                    {"op": "alloc", "local_rank": -1, "meta_cap": 1, "data_cap": 1},
                    {"op": "d_update", "name": "d", "items": [1]},
                    {"op": "persist", "step": 1, "rank": 0, "local_rank": 0, "seg_path": "/etc/passwd",
                     "slot": 0, "generation": 1, "path": os.path.join(eng.checkpoint_dir, "x.pt")}):
            with pytest.raises(ProtocolError):
                c.call(bad.pop("op"), **bad)
        assert "committed" in c.call("status")
    finally:
        c.close()

    # Every other client is still served: the engine, and a new connection.
    assert torch.equal(eng.load()["w"], torch.arange(8.0))
    eng.save(2, {"w": torch.ones(8)}, storage_type=StorageType.DISK)
    eng.wait(60)
    assert torch.equal(eng.load()["w"], torch.ones(8))
    c2 = Client(os.path.join(eng.job_dir, SOCKET_NAME), timeout=30)
    assert c2.call("status")["committed"] == [2]
    c2.close()
    eng.close()


def test_an_exiting_saver_refuses_new_clients(make_engine, runtime_dir):
    eng = make_engine()
    eng.save(1, {"w": torch.zeros(4)}, storage_type=StorageType.MEMORY)
    job_dir = eng.job_dir
    (pid,) = saver_pids(runtime_dir)
    # Hold the job's spawn lock so the saver, once it decided to exit, stops in its clean-up step.
    spawn_lock = lock_job(job_dir)
    try:
        eng.close(release=True)
        wait_for(lambda: pid in flock_waiters(os.path.join(job_dir, "spawn.lock")), 30,
                 "the saver to start its clean-up")
        c = Client(os.path.join(job_dir, SOCKET_NAME), timeout=30)
        try:
            with pytest.raises(SaverError, match="shutting down"):
                c.call("hello", rank=0, local_rank=0, world_size=1, local_world_size=1, pid=os.getpid())
        finally:
            c.close()
    finally:
        spawn_lock.release()
    wait_for(lambda: not saver_pids(runtime_dir), 30, "the saver to exit")
    # The next engine starts a new saver; nothing of the old one is left in memory to confuse it (the old
    # one's last words committed the memory-only step 1, which loads from storage).
    again = make_engine()
    assert again.memory_steps() == []
    assert torch.equal(again.load()["w"], torch.zeros(4)) and again.last_load.source == "storage"
    again.close()


def test_the_spawn_lock_is_taken_when_an_exiting_saver_removes_the_job_dir_meanwhile(tmp_path, monkeypatch):
    """The interleaving a CI rehearsal hit: a restarted trainer makes the job dir, then the exiting saver
    of the killed one (holding the spawn lock) removes the lock file and the dir before the trainer opens
    the lock file there. The trainer must make the dir again and take the lock, not fail its start."""
    import flashckpt.transport.spawn as base

    job_dir = str(tmp_path / "rt" / "job")
    made = base.make_private_dir
    calls = []

    def make_then_lose(path: str) -> None:
        made(path)
        calls.append(path)
        if len(calls) == 1:  # the exiting saver's clean-up, right after the first make
            os.rmdir(path)

    monkeypatch.setattr(base, "make_private_dir", make_then_lose)
    lock = lock_job(job_dir)
    try:
        assert len(calls) == 2
        assert os.fstat(lock.fileno()).st_ino == os.lstat(os.path.join(job_dir, "spawn.lock")).st_ino
    finally:
        lock.release()


def test_send_msg_refuses_oversize_messages():
    a, b = socket.socketpair()
    try:
        with pytest.raises(ProtocolError):
            send_msg(a, {"op": "x", "blob": "x" * (MAX_MESSAGE + 1)})
        send_msg(a, {"op": "ping", "n": 1})
        assert recv_msg(b) == {"op": "ping", "n": 1}
        a.sendall(struct.pack(">I", 2) + b"{}")
        assert recv_msg(b) == {}
    finally:
        a.close()
        b.close()
