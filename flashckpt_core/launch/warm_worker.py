"""A warm worker: a Python process that ``flashckpt-run`` starts ahead of a restart, with torch and the
training script's library imports done, and that becomes a restarted worker when handed one.

Run as ``python <the worker's interpreter options> -m flashckpt.launch.warm_worker <control fd> <padding>`` with the
environment of the worker it stands in for (see ``flashckpt.launch.warm``). Protocol on the control socket
(an AF_UNIX stream socketpair; messages are the saver's frames, ``_protocol.write_frame``):

1. the agent sends ``{"preload": [module, ...], "local_dir": dir}``; the process imports them, except
   those that ``dir`` (the script's directory, or the working directory with ``-m``) provides: the user's
   own code, imported by the script in its turn. Failures are ignored: a module that cannot be imported
   here fails the same way in the script, where its error is shown;
2. the agent sends ``{"argv": [...], "interp_opts": [...], "env": {...}}``, then one byte carrying two
   file descriptors (SCM_RIGHTS): the worker's stdout and stderr. The process makes them its fd 1 and 2, replaces its
   environment with ``env``, and runs ``argv`` as ``python`` would (a script path or ``-m module``,
   then the script's arguments) as ``__main__``, its ``/proc/<pid>/cmdline`` rewritten to the worker's
   command (the padding argument leaves room for it).

The agent hands a worker over only when its interpreter, interpreter options and environment equal the
warm worker's, except the variables that name the rendezvous endpoint and the attempt (see
``flashckpt.launch.warm.ATTEMPT_KEYS``), which nothing reads before ``init_process_group``. If the agent goes away
before a hand-over, the process exits.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys

from flashckpt.launch.warm import launch_event
from flashckpt.transport.wire import read_frame
from flashckpt.util.procfs import proc_stat


def _take_streams(fds: list[int]) -> None:
    """Makes the worker's stdout and stderr this process's fd 1 and 2 (Python's objects stay on them)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    for target, fd in zip((1, 2), fds):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)


def _set_cmdline(argv: list[str]) -> None:
    """Makes ``/proc/self/cmdline`` (what ``ps`` and tools that look for a worker by its command show)
    read ``argv``: the agent started this process with a padding argument, so its argument area has room;
    Python has copied its arguments, so nothing reads that memory any more (setproctitle does the same)."""
    import ctypes

    try:
        fields = proc_stat("self")
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49)
    except (OSError, IndexError, ValueError):
        return
    if not 0 < start < end:
        return
    data = b"\0".join(os.fsencode(a) for a in argv)[: end - start - 1]
    ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)


def _can_restore_priority(nice: int) -> bool:
    """Whether this process may set its threads back to ``nice`` after raising it (CAP_SYS_NICE, or an
    RLIMIT_NICE that allows it): only then do the imports run at a lower priority."""
    import resource

    try:
        with open("/proc/self/status") as f:
            cap_eff = int(next(ln.split()[1] for ln in f if ln.startswith("CapEff:")), 16)
    except (OSError, StopIteration, ValueError):
        cap_eff = 0
    return bool(cap_eff >> 23 & 1) or 20 - nice <= resource.getrlimit(resource.RLIMIT_NICE)[0]


def _set_priority(nice: int) -> None:
    """Sets every thread of this process to ``nice`` (on Linux a thread's own property)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        except OSError:
            pass


def _run(argv: list[str]) -> None:
    """Runs ``argv`` (``script args...`` or ``-m module args...``) as ``__main__``, as python does."""
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # replaced by the module's file, as python -m does
        runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]  # what -m runs
        return
    from importlib.machinery import SourceFileLoader

    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    if not sys.flags.safe_path and sys.path:
        # python puts the script's real directory first on sys.path (-m put the working directory there)
        sys.path[0] = os.path.dirname(os.path.realpath(script))
    main = type(sys)("__main__")
    main.__file__ = script
    main.__dict__["__cached__"] = None
    main.__loader__ = SourceFileLoader("__main__", script)
    sys.modules["__main__"] = main  # for good, as in python: pickling and spawned children find it
    with open(script, "rb") as f:
        code = compile(f.read(), script, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    msg = read_frame(sock.fileno())
    if msg is None:
        sys.exit(0)
    from importlib.machinery import PathFinder

    # The imports are background work beside the training processes: at a lower priority, where the
    # worker's own is restored at the hand-over (else at the worker's priority).
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    lowered = nice < 19 and _can_restore_priority(nice)
    if lowered:
        _set_priority(min(19, nice + 10))
    local = [msg["local_dir"]] if msg.get("local_dir") else []
    for name in msg.get("preload", []):
        if local and PathFinder.find_spec(name.partition(".")[0], local) is not None:
            continue  # the user's own module (or one it shadows): imported by the script, in its turn
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the script shows this error where it imports the module
            pass
    launch_event("warm_worker_ready")
    msg = read_frame(sock.fileno())
    if msg is None:  # the agent went away or dropped this warm worker
        sys.exit(0)
    _, fds, _, _ = socket.recv_fds(sock, 1, 2)  # the worker's stdout and stderr, sent after the frame
    sock.close()
    if lowered:
        _set_priority(nice)
    _set_cmdline([sys.orig_argv[0], *msg["interp_opts"], *msg["argv"]])
    _take_streams(fds)
    os.environ.clear()
    os.environ.update(msg["env"])
    launch_event("warm_worker_run")
    _run(msg["argv"])


if __name__ == "__main__":
    main()
