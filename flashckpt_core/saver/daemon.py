"""Getting a saver: ``ensure_saver`` (connect, or start a detached daemon and wait for its report) and the
daemon's ``main``, run as ``python -m`` this module."""

from __future__ import annotations

# ruff: noqa: E402  (the daemon defers torch before the imports below)
if __name__ == "__main__":  # the daemon never loads torch: its persist worker does (_persist_worker)
    from flashckpt.util.lazy import defer

    defer("torch")

import argparse
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
from flashckpt.config import Knobs, knob, make_private_dir, open_private_dir
from flashckpt.saver._base import _LOG_NAME, SOCKET_NAME, lock_job, log
from flashckpt.saver.server import CheckpointSaver
from flashckpt.storage import locations
from flashckpt.storage.registry import OPTIONS_ENV, options_from_env, storage_from_spec
from flashckpt.transport.wire import Client
from flashckpt.util.lease import pid_running

__all__ = ["ensure_saver", "main", "SAVER_MODULE"]

SAVER_MODULE = __spec__.name  # the daemon runs as ``python -m`` this module (flashckpt.saver.daemon)


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
        raise E.SaverError(f"cannot prepare the saver's runtime dir {job_dir}: {_explain_os_error(e, job_dir)}") from e
    try:
        return Client(path, timeout=knobs.rpc_timeout_s)
    except (FileNotFoundError, ConnectionRefusedError):
        pass
    try:
        spawn_lock = lock_job(job_dir)
    except OSError as e:
        raise E.SaverError(f"cannot prepare the saver's runtime dir {job_dir}: {_explain_os_error(e, job_dir)}") from e
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
    log_path = os.path.join(job_dir, _LOG_NAME)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop(OPTIONS_ENV, None)
    if storage_options:  # in the environment, not on the command line (credentials may be among them)
        env[OPTIONS_ENV] = json.dumps(storage_options)
    try:
        dir_fd = open_private_dir(job_dir)
        try:
            logf: Any = os.open(_LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
                                0o600, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        no_log = ""
    except OSError as e:
        logf, no_log = subprocess.DEVNULL, f"its log {log_path} could not be created: {_explain_os_error(e, job_dir)}"
    rfd, wfd = os.pipe()
    try:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", SAVER_MODULE, "--daemonize", "--job-dir", job_dir,
                 "--checkpoint-dir", locations.normpath(checkpoint_dir), "--storage", storage, "--ready-fd", str(wfd)],
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


def _report(fd: int | None, msg: dict[str, Any]) -> None:
    """Writes one start-up report line to the spawner's pipe (see ``_read_ready``); never raises."""
    if fd is None:
        return
    try:
        os.write(fd, json.dumps(msg).encode() + b"\n")
    except OSError:
        pass



def _explain_os_error(e: BaseException, where: str) -> str:
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {SAVER_MODULE}", description="flashckpt node saver")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--storage", default="", help="the backend's class as module:qualname (default: by the URL)")
    p.add_argument("--daemonize", action="store_true", help="fork into the background and return at once")
    p.add_argument("--ready-fd", type=int, default=None,
                   help="a pipe to report on: a JSON line with the daemon's pid, then one saying it serves "
                        "(ready) or why it could not start (error)")
    args = p.parse_args(argv)
    if args.daemonize:
        child = os.fork()
        if child > 0:
            # The spawner reaps this parent; the daemon is re-parented and never a zombie of it. Its pid
            # lets the spawner stop it should it not come up.
            _report(args.ready_fd, {"pid": child})
            os._exit(0)
    logging.basicConfig(level=knob("saver_log_level"),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    saver = CheckpointSaver(args.job_dir, args.checkpoint_dir,
                            storage=storage_from_spec(args.storage, args.checkpoint_dir, options_from_env()))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: saver.request_stop(last_words=True))
    try:
        saver.start()
    except BaseException as e:
        # A saver that cannot serve exits and removes what it made; the spawner gets the reason over the
        # pipe (the log may be on the very file system that is full).
        log.exception("the saver could not start")
        _report(args.ready_fd, {"error": _explain_os_error(e, args.job_dir)})
        saver.shutdown(drain_timeout=0)
        return 1
    _report(args.ready_fd, {"ready": True, "pid": os.getpid()})
    if args.ready_fd is not None:
        os.close(args.ready_fd)
    saver.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())

