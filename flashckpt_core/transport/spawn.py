"""Starting a node's saver from the trainer's side, without importing the saver package: ``ensure_saver``
connects to the job's saver, or starts ``python -m flashckpt.saver.daemon`` by its module name as a detached
daemon and waits for its start-up report. Also the names in a job's runtime dir that both sides use (the
socket, the spawn lock, the log) and the job's spawn lock (``lock_job``), which serializes a saver's start
with an exiting saver's clean-up.

It imports the layers below transport (config, storage's path helpers, the wire client); never
``flashckpt.saver``. Any number of trainers of a node may call ``ensure_saver`` at once: the spawn lock lets
one start the daemon, the others then connect to it."""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

from flashckpt import errors as E
from flashckpt.config import Knobs, make_private_dir, open_private_dir
from flashckpt.storage import locations
from flashckpt.storage.registry import OPTIONS_ENV
from flashckpt.transport.ipc import SharedLock
from flashckpt.transport.wire import Client
from flashckpt.util.lease import pid_running

__all__ = ["ensure_saver", "lock_job", "explain_os_error", "SAVER_MODULE", "SOCKET_NAME", "SPAWN_LOCK", "LOG_NAME"]

log = logging.getLogger(__name__)

#: The daemon's module, run as ``python -m`` it (``flashckpt.saver.daemon``); named, never imported, here.
SAVER_MODULE = "flashckpt.saver.daemon"
#: The saver's control socket in the job's runtime dir.
SOCKET_NAME = "saver.sock"
#: The job's spawn lock file (``lock_job``).
SPAWN_LOCK = "spawn.lock"
#: The saver daemon's log in the job's runtime dir.
LOG_NAME = "saver.log"


def lock_job(job_dir: str) -> SharedLock:
    """Takes the job's spawn lock, which serializes starting a saver with a saver's clean-up.

    Retries when an exiting saver removed the job dir after we made it (before we opened the lock file
    there), or unlinked the lock file while we waited on it."""
    path = os.path.join(job_dir, SPAWN_LOCK)
    while True:
        make_private_dir(job_dir)
        lock = SharedLock(path)
        try:
            lock.acquire()
        except FileNotFoundError:
            continue  # the dir is gone again: make it anew
        try:
            same = os.lstat(path).st_ino == os.fstat(lock.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return lock
        lock.release()


def ensure_saver(job_dir: str, checkpoint_dir: str, knobs: Knobs, *, storage: str = "",
                 storage_options: dict[str, Any] | None = None) -> Client:
    """Connects to the job's saver on this node, starting a detached daemon first when none runs.

    The runtime dirs are checked first (``open_private_dir``: ours, private, no symbolic link), and the
    client refuses a socket served by another uid, before anything is sent on it. The daemon reports
    over a pipe (``--ready-fd``) that it serves, or why it could not start: that report reaches the
    trainer even when the daemon's log cannot be written (a full /dev/shm). A daemon that does not come
    up in time is stopped, so a failed start leaves no process behind."""
    path = os.path.join(job_dir, SOCKET_NAME)
    try:
        make_private_dir(job_dir)
    except OSError as e:
        raise E.SaverError(f"cannot prepare the saver's runtime dir {job_dir}: {explain_os_error(e, job_dir)}") from e
    try:
        return Client(path, timeout=knobs.rpc_timeout_s)
    except (FileNotFoundError, ConnectionRefusedError):
        pass
    try:
        spawn_lock = lock_job(job_dir)
    except OSError as e:
        raise E.SaverError(f"cannot prepare the saver's runtime dir {job_dir}: {explain_os_error(e, job_dir)}") from e
    try:
        try:
            return Client(path, timeout=knobs.rpc_timeout_s)
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        return _spawn_saver(job_dir, checkpoint_dir, knobs, storage, storage_options or {})
    finally:
        spawn_lock.release()


def _spawn_saver(job_dir: str, checkpoint_dir: str, knobs: Knobs, storage: str,
                 storage_options: dict[str, Any]) -> Client:
    """Starts the daemon (the job's spawn lock is held) and connects to it."""
    path = os.path.join(job_dir, SOCKET_NAME)
    log_path = os.path.join(job_dir, LOG_NAME)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop(OPTIONS_ENV, None)
    if storage_options:  # in the environment, not on the command line (credentials may be among them)
        env[OPTIONS_ENV] = json.dumps(storage_options)
    try:
        dir_fd = open_private_dir(job_dir)
        try:
            logf: Any = os.open(LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                                0o600, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        no_log = ""
    except OSError as e:
        logf, no_log = subprocess.DEVNULL, f"its log {log_path} could not be created: {explain_os_error(e, job_dir)}"
    rfd, wfd = os.pipe()
    try:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", SAVER_MODULE, "--daemonize", "--job-dir", job_dir,
                 "--checkpoint-dir", locations.normpath(checkpoint_dir), "--storage", storage, "--ready-fd", str(wfd),
                 "--local-dir", knobs.local_dir, "--local-keep", str(knobs.local_keep)],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, close_fds=True, pass_fds=(wfd,),
                start_new_session=True, env=env, cwd="/")
        finally:
            os.close(wfd)
            if isinstance(logf, int) and logf >= 0:
                os.close(logf)
        deadline = time.monotonic() + knobs.spawn_timeout_s
        rc = proc.wait(timeout=knobs.spawn_timeout_s)
        report = _read_ready(rfd, deadline)
    finally:
        os.close(rfd)

    def failed(what: str) -> E.SaverError:
        tail = _tail(log_path).strip()
        where = no_log or (f"see {log_path}:\n{tail}" if tail else f"its log {log_path} is empty")
        return E.SaverError(f"{what}; {where}")

    pid = int(report.get("pid", 0))
    if "error" in report:
        raise failed(f"the saver could not start: {report['error']}")
    if not report.get("ready"):
        if pid and pid_running(pid):  # neither ready nor failed within the time: stop it, it would serve nobody
            os.kill(pid, signal.SIGTERM)
            raise failed(f"the saver did not come up within {knobs.spawn_timeout_s:.0f} s and was stopped")
        raise failed(f"the saver died while starting (exit {rc})" if rc else "the saver died while starting")
    try:
        return Client(path, timeout=knobs.rpc_timeout_s)
    except (FileNotFoundError, ConnectionRefusedError) as e:
        raise failed(f"the saver (pid {pid}) reported ready but its socket {path} refused: {e}") from None


def _read_ready(fd: int, deadline: float) -> dict[str, Any]:
    """The daemon's start-up report: one JSON object per line (``{"pid": N}``, then ``{"ready": true}``
    or ``{"error": "..."}``), merged; stops at ready/error, at end of file (every writer gone: the
    daemon died) or at ``deadline``."""
    buf = b""
    out: dict[str, Any] = {}
    while "ready" not in out and "error" not in out:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            try:
                out.update(json.loads(line))
            except ValueError:
                pass
    return out


def explain_os_error(e: BaseException, where: str) -> str:
    """``e`` in words; a full file system (ENOSPC/EDQUOT) says so and what to do."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"no space left in {where} (ENOSPC: {e.strerror}): the file system of the runtime dir "
                "(/dev/shm, or FLASHCKPT_RUNTIME_DIR) is full. Free space there (`flashckpt gc` removes the "
                "shared memory of dead jobs), enlarge it (docker run --shm-size=...) or set "
                "FLASHCKPT_RUNTIME_DIR to a larger RAM-backed file system")
    return f"{type(e).__name__}: {e}"


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
