"""The saver's end of its persist worker: starts it on demand (``python -m`` the worker module, a subprocess,
never a fork of the multi-threaded saver), sends it persist requests, stops it when idle, and fails what
was in flight when it dies. Torch-free: the worker (``flashckpt.saver.persist_worker``, which describes the
protocol) is the process that imports torch."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from flashckpt import errors as E
from flashckpt.storage.base import CheckpointStorage, FileRecord, count_retry
from flashckpt.storage.registry import storage_spec
from flashckpt.transport.wire import read_frame, write_frame

__all__ = ["PersistWorker", "WORKER_MODULE"]

log = logging.getLogger("flashckpt.saver")

# The worker runs as ``python -m`` this module: resolved from this package's name, without importing it.
WORKER_MODULE = importlib.util.resolve_name(".persist_worker", __package__)


@dataclasses.dataclass
class _Pending:
    proc: subprocess.Popen[bytes]
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    reply: dict[str, Any] | None = None
    lost: str = ""


class PersistWorker:
    """The saver's handle of its persist worker: starts it on demand, sends requests, stops it when idle.

    Thread-safe: the saver's persist threads (one per local rank) call ``persist`` at the same time.

    Args:
        checkpoint_dir: the checkpoint dir (the worker's ``CommitLayout``).
        job: the job key (markers carry it).
        storage: the saver's storage; the worker builds one of the same class for the checkpoint dir
            (``from_url``), so a backend registered in code only reaches it too.
        nice: how much lower than the saver the worker runs (Linux nice increment).
        idle_s: the worker exits once no persist was in flight for this long.
        options: whether the worker builds its storage with the saver's ``storage_options`` (not for the
            local tier's POSIX dir).
    """

    def __init__(self, checkpoint_dir: str, job: str, storage: CheckpointStorage, *, nice: int, idle_s: float,
                 options: bool = True) -> None:
        self._argv = [sys.executable, "-m", WORKER_MODULE, "--checkpoint-dir", checkpoint_dir, "--job", job,
                      "--storage", storage_spec(storage), "--nice", str(nice)] + ([] if options else ["--no-options"])
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._timer: threading.Timer | None = None
        self._closed = False

    @property
    def pid(self) -> int:
        """The running worker's pid; 0 when none runs."""
        proc = self._proc
        return proc.pid if proc is not None else 0

    def persist(self, *, seg_path: str, slot: int, generation: int, step: int, rank: int,
                path: str) -> tuple[list[FileRecord], bool]:
        """Has the worker write the files of the pinned ``slot``: returns their records, and whether the
        snapshot is a ``FileSet`` (else one ``torch.save`` file at ``path``). Raises what the worker
        raised (an ``OSError`` as such), or ``PersistError`` when the worker died meanwhile."""
        req = {"seg_path": seg_path, "slot": slot, "generation": generation, "step": step, "rank": rank,
               "path": path}
        with self._lock:
            if self._closed:
                raise E.PersistError("the saver is shutting down: no persist worker is started any more")
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
            self._next_id += 1
            rid = self._next_id
            p = self._pending[rid] = _Pending(proc)
            try:
                assert proc.stdin is not None
                write_frame(proc.stdin.fileno(), {**req, "id": rid})
            except OSError:
                p.lost = "its request pipe is closed"  # it died; its reader reports how, below
        p.done.wait()
        if p.reply is None:
            raise E.PersistError(f"the persist worker (pid {proc.pid}) {p.lost} while it wrote step {step} of "
                                 f"rank {rank}; its files were removed, see the saver's log; the next persist "
                                 "starts a new worker")
        if p.reply.get("ok"):
            fields = {f.name for f in dataclasses.fields(FileRecord)}
            recs = [FileRecord(**{k: v for k, v in r.items() if k in fields}) for r in p.reply["records"]]
            return recs, bool(p.reply.get("fileset"))
        raise _error_from(p.reply)

    def _start(self) -> subprocess.Popen[bytes]:
        """Starts a worker (holds ``_lock``); its stderr is the saver's (the saver's log)."""
        t0 = time.perf_counter()
        proc = subprocess.Popen(self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
                                cwd="/")
        self._proc = proc
        threading.Thread(target=self._read_loop, args=(proc, t0), name=f"flashckpt-saver-worker{proc.pid}",
                         daemon=True).start()
        log.info("started the persist worker (pid %d)", proc.pid)
        return proc

    def _read_loop(self, proc: subprocess.Popen[bytes], t0: float) -> None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        first = True
        while True:
            try:
                msg = read_frame(fd)
            except (OSError, ValueError, E.ProtocolError) as e:
                log.error("bad reply from the persist worker (pid %d): %s; stopping it", proc.pid, e)
                proc.kill()
                msg = None
            if msg is None:
                break
            if first and msg.get("ready"):
                first = False
                log.info("the persist worker (pid %d) is ready after %.2f s", proc.pid, time.perf_counter() - t0)
                continue
            for kind, n in dict(msg.get("retries") or {}).items():  # the worker's retried requests
                count_retry(str(kind), int(n))
            with self._lock:
                p = self._pending.pop(msg.get("id", -1), None)
                if p is not None:
                    p.reply = msg
                    p.done.set()
                self._idle_later(proc)
        # The worker exited (idle, stopped, or killed): reap it (its CPU time then counts in the saver's
        # cutime/cstime) and fail what it had in flight.
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        proc.stdout.close()
        how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with status {rc}"
        with self._lock:
            if self._proc is proc:
                self._proc = None
            lost = [rid for rid, p in self._pending.items() if p.proc is proc]
            for rid in lost:
                p = self._pending.pop(rid)
                p.lost = how
                p.done.set()
        if lost:
            log.error("the persist worker (pid %d) %s with %d persist(s) in flight", proc.pid, how, len(lost))
        else:
            log.info("the persist worker (pid %d) %s", proc.pid, how)

    def _idle_later(self, proc: subprocess.Popen[bytes]) -> None:
        """Once nothing is in flight, stops the worker after ``idle_s`` unless a persist comes (holds ``_lock``)."""
        if self._pending or self._proc is not proc:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = threading.Timer(self.idle_s, self._stop_if_idle, args=(proc,))
        self._timer.daemon = True
        self._timer.start()

    def _stop_if_idle(self, proc: subprocess.Popen[bytes]) -> None:
        with self._lock:
            if self._proc is not proc or self._pending:
                return
            self._timer = None
            self._proc = None
            log.info("the persist worker (pid %d) was idle for %.0f s: stopping it", proc.pid, self.idle_s)
            self._close_stdin(proc)

    @staticmethod
    def _close_stdin(proc: subprocess.Popen[bytes]) -> None:
        try:
            if proc.stdin is not None:
                proc.stdin.close()  # the worker exits at the end of its stdin
        except OSError:
            pass

    def close(self, timeout: float = 10.0) -> None:
        """Stops the worker (what is still in flight fails) and starts no other."""
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            proc, self._proc = self._proc, None
            if proc is not None:
                self._close_stdin(proc)
        if proc is None:
            return
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.error("the persist worker (pid %d) did not exit within %.0f s: killing it", proc.pid, timeout)
            proc.kill()
            proc.wait()


def _error_from(reply: dict[str, Any]) -> Exception:
    """The exception the worker's error reply describes: an ``OSError`` with its errno (its subclass, as
    Python picks it), a flashckpt error of its class, else a ``PersistError`` naming the type."""
    kind, message = str(reply.get("type", "Exception")), str(reply.get("message", ""))
    if reply.get("errno") is not None:
        args: list[Any] = [int(reply["errno"]), str(reply.get("strerror") or os.strerror(int(reply["errno"])))]
        if reply.get("filename") is not None:
            args.append(str(reply["filename"]))
        return OSError(*args)
    cls = getattr(E, kind, None)
    if isinstance(cls, type) and issubclass(cls, E.FlashCheckpointError):
        return cls(message)
    return E.PersistError(f"{kind}: {message}")
