"""Warm workers for ``flashckpt-run``: restarted workers that skip the interpreter start and the imports.

After the agent starts a worker, it starts a warm worker for the same local rank: the same interpreter
with the same options and the same environment, which (after ``FLASHCKPT_WARM_DELAY_S``, so that it does
not compete with the worker's own start) imports torch, flashckpt and the libraries the training script
imports at its top level, and then waits. Its process starts with the worker, from the agent's main thread,
so that it dies with the launcher (``flashckpt.util.pdeathsig``), before and after it is handed a worker. When the agent restarts its workers, each local
rank's new worker is handed to its warm worker instead of a new process, if

- the command is ``<that interpreter> <the same options> script.py ...`` or ``... -m module ...``
  (``--no-python``, ``-c``, ``-I``/``-P`` and NUMA binding get a new process), and
- the new worker's environment equals the warm worker's except ``ATTEMPT_KEYS`` (the rendezvous endpoint
  and the attempt counter, which nothing reads before ``init_process_group``): a worker whose rank or
  world size changed gets a new process, so no module imported ahead of time saw other values.

The warm worker then takes the worker's stdout and stderr (torchrun's redirects and log files), its
environment and its arguments, and runs the script as ``__main__`` the way ``python`` does (``sys.argv``,
``sys.path[0]``, ``__file__``). Modules that the script's own directory (or, with ``-m``, the working
directory) provides are never imported ahead: they are the user's code and must see the worker's start.
What differs from a new process: the modules imported ahead were imported before the worker's stdout was
attached (a warning they printed once is not printed again), and ``sys.orig_argv`` names
``flashckpt.launch.warm_worker`` (``sys.argv`` and ``/proc/<pid>/cmdline`` are the worker's). ``FLASHCKPT_WARM_WORKERS=0`` (or ``flashckpt-run --no-warm-workers``) turns
warm workers off.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from flashckpt.config import WARM_MODULES_DIR_ENV, knob
from flashckpt.transport.wire import write_frame
from flashckpt.util.module_record import modules_file
from flashckpt.util.owned_dirs import owned_dir, sweep
from flashckpt.util.pdeathsig import die_with_parent

__all__ = ["ATTEMPT_KEYS", "WarmPool", "split_command", "script_imports", "launch_event"]

log = logging.getLogger(__name__)

# Set by the agent per attempt; read by torch.distributed at init_process_group / by the error handler.
ATTEMPT_KEYS = frozenset({"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
                          "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE"})
_FLAGS = frozenset({"-u", "-O", "-OO", "-B", "-s", "-E", "-b", "-bb", "-q", "-R", "-d", "-v"})
_WITH_ARG = frozenset({"-W", "-X"})
ALWAYS = ("torch", "torch.distributed", "flashckpt")


def launch_event(name: str, **fields: Any) -> None:
    """Appends an event of ``flashckpt-run`` (its agent's, its warm workers') to FLASHCKPT_LAUNCH_EVENTS,
    when set (best effort)."""
    path = knob("launch_events")
    if not path:
        return
    try:
        with open(path, "a") as f:
            f.write(json.dumps({"event": name, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")
    except OSError:
        pass


def split_command(args: Sequence[str]) -> tuple[str, tuple[str, ...], list[str]] | None:
    """``(interpreter, interpreter options, [script | -m module, *script args])`` of a worker command
    ``python [options] script.py ...`` / ``python [options] -m module ...``; None for anything else."""
    if not args or not os.path.basename(args[0]).startswith("python"):
        return None
    opts: list[str] = []
    i = 1
    while i < len(args):
        a = args[i]
        if a in _FLAGS:
            opts.append(a)
            i += 1
        elif a in _WITH_ARG and i + 1 < len(args):
            opts += [a, args[i + 1]]
            i += 2
        elif a == "-m" and i + 1 < len(args):
            return args[0], tuple(opts), list(args[i:])
        elif a.startswith("-"):
            return None  # -c, -I, -P, -S, -i, joined flags: a new process
        else:
            return args[0], tuple(opts), list(args[i:])
    return None


def script_imports(target: Sequence[str]) -> list[str]:
    """The modules a script (or ``-m`` module) imports at its top level (absolute imports only)."""
    path = target[0]
    if path == "-m":
        import importlib.util

        try:
            spec = importlib.util.find_spec(target[1])
        except (ImportError, ValueError):
            return []
        path = spec.origin if spec is not None and spec.origin else ""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    body = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Try):  # try: import x / except ImportError: ...
            body[:0] = node.body
    return list(dict.fromkeys(names))


MODULES_DIR_ENV = WARM_MODULES_DIR_ENV


def make_modules_dir() -> str:
    """A private directory for the workers' module records (``util.module_record.record_modules``), named after this agent
    (``_owned_dirs``). A launcher that is SIGKILLed cannot remove its own: the directories of agents that
    are gone are removed here first (``sweep_modules_dirs``)."""
    sweep_modules_dirs()
    return owned_dir(None, "flashckpt-warm-")


def sweep_modules_dirs() -> None:
    """Removes this user's directories in the system temp dir of processes that are gone (module records
    of killed launchers among them)."""
    sweep(None)


def _recorded_modules(directory: str | None, local_rank: int) -> list[str] | None:
    if not directory:
        return None
    try:
        with open(modules_file(directory, local_rank)) as f:
            names = json.load(f)
    except (OSError, ValueError):
        return None
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else None


class _Warm:
    """One warm worker process and the agent's end of its control socket. The process starts at once and
    waits; ``begin`` has it import ahead (after the pool's delay), and only then may it be handed a worker.
    Started with ``die_with_parent``: it never outlives the launcher, before or after a hand-over."""

    def __init__(self, interp: str, opts: tuple[str, ...], target: Sequence[str], env: dict[str, str]) -> None:
        self.interp, self.opts, self.env = interp, opts, env
        self.begun = False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # the padding: room to rewrite the command line into the worker's (``ps`` shows the script),
            # with 1 KiB to spare for a later attempt's longer arguments
            pad = " " * (sum(len(a) + 1 for a in (interp, *opts, *target)) + 1024)
            self.proc = subprocess.Popen([interp, *opts, "-m", "flashckpt.launch.warm_worker", str(theirs.fileno()), pad],
                                         env=env, pass_fds=(theirs.fileno(),), start_new_session=True,
                                         stdout=subprocess.DEVNULL, preexec_fn=die_with_parent())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours

    def begin(self, preload: list[str], local_dir: str) -> None:
        """Has the process import ``preload`` (except what ``local_dir`` provides); it may then be handed over."""
        write_frame(self.sock.fileno(), {"preload": preload, "local_dir": local_dir})
        self.begun = True

    def fits(self, interp: str, opts: tuple[str, ...], env: dict[str, str]) -> bool:
        if (interp, opts) != (self.interp, self.opts):
            return False
        keys = (set(env) | set(self.env)) - ATTEMPT_KEYS
        return all(env.get(k) == self.env.get(k) for k in keys)

    def hand_over(self, target: list[str], env: dict[str, str], stdout: int, stderr: int) -> subprocess.Popen:
        write_frame(self.sock.fileno(), {"argv": target, "interp_opts": list(self.opts), "env": env})
        socket.send_fds(self.sock, [b"\0"], [stdout, stderr])  # after the frame: its reader stops before
        self.sock.close()
        return self.proc

    def drop(self) -> None:
        self.sock.close()  # the warm worker exits at EOF; kill it too if it is busy importing
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("warm worker %d did not exit", self.proc.pid)


class WarmPool:
    """The agent's warm workers, one per local rank at most."""

    def __init__(self, delay_s: float, modules_dir: str | None = None, modules_wait_s: float = 60.0) -> None:
        self.delay_s = delay_s
        self.modules_dir, self.modules_wait_s = modules_dir, modules_wait_s
        self._lock = threading.Lock()
        self._warm: dict[int, _Warm] = {}
        self._timers: dict[int, threading.Timer] = {}
        self._closed = False

    def take(self, local_rank: int, args: Sequence[str], env: dict[str, str], stdout: IO | None,
             stderr: IO | None) -> subprocess.Popen | None:
        """The warm worker of ``local_rank`` running the worker ``args``/``env``, or None (start a new process)."""
        with self._lock:
            timer = self._timers.pop(local_rank, None)
            warm = self._warm.pop(local_rank, None)
        if timer is not None:
            timer.cancel()
        if warm is None:
            return None
        cmd = split_command(args)
        if not warm.begun:
            log.info("local rank %d: a new process (its warm worker had not begun its imports)", local_rank)
            warm.drop()
            return None
        if cmd is None or not warm.fits(cmd[0], cmd[1], env) or warm.proc.poll() is not None:
            log.info("local rank %d: a new process (the warm worker does not fit this command/environment)",
                     local_rank)
            warm.drop()
            return None
        try:
            proc = warm.hand_over(cmd[2], env, stdout.fileno() if stdout else 1, stderr.fileno() if stderr else 2)
        except OSError as e:
            log.warning("local rank %d: hand-over to the warm worker failed (%s); a new process", local_rank, e)
            warm.drop()
            return None
        launch_event("warm_worker_used", local_rank=local_rank, pid=proc.pid)
        return proc

    def prepare(self, local_rank: int, args: Sequence[str], env: dict[str, str]) -> None:
        """Starts a warm worker for the next start of ``local_rank`` (replacing any): its process at once, on
        the calling thread (torch's agent starts workers on its main thread: the warm worker then dies with
        the launcher, see ``_pdeathsig``), its imports after the delay."""
        cmd = split_command(args)
        if cmd is None or self._closed:
            return
        interp, opts, target = cmd
        local_dir = os.getcwd() if target[0] == "-m" else os.path.dirname(os.path.realpath(target[0]))
        static = [*ALWAYS, *script_imports(target)]
        try:
            warm = _Warm(interp, opts, target, dict(env))
        except OSError as e:
            log.warning("could not start a warm worker: %s", e)
            return
        with self._lock:
            closed = self._closed
            old = None if closed else self._warm.get(local_rank)
            if not closed:
                self._warm[local_rank] = warm
        if closed:  # close() ran meanwhile
            warm.drop()
            return
        if old is not None:
            old.drop()

        def start() -> None:
            # what the worker imported by its first snapshot, once it recorded that (the last worker's)
            deadline = time.monotonic() + self.modules_wait_s
            while (recorded := _recorded_modules(self.modules_dir, local_rank)) is None and self.modules_dir \
                    and time.monotonic() < deadline and not self._closed and self._warm.get(local_rank) is warm:
                time.sleep(0.5)
            preload = list(dict.fromkeys([*static, *(recorded or [])]))
            with self._lock:
                if self._timers.get(local_rank) is timer:
                    del self._timers[local_rank]
                if self._closed or self._warm.get(local_rank) is not warm:
                    return
                try:
                    warm.begin(preload, local_dir)
                    return
                except OSError as e:
                    log.warning("could not start the imports of a warm worker: %s", e)
                    del self._warm[local_rank]
            warm.drop()

        timer = threading.Timer(self.delay_s, start)
        timer.daemon = True
        with self._lock:
            old_timer, self._timers[local_rank] = self._timers.get(local_rank), timer
        if old_timer is not None:
            old_timer.cancel()
        timer.start()

    def close(self) -> None:
        """Stops every warm worker (the launcher is exiting)."""
        with self._lock:
            self._closed = True
            timers, self._timers = list(self._timers.values()), {}
            warm, self._warm = list(self._warm.values()), {}
        for t in timers:
            t.cancel()
        for w in warm:
            w.drop()


def handler_factory(pool: WarmPool | None) -> Callable[..., Any]:
    """A drop-in for torchelastic's ``get_subprocess_handler`` whose workers die with the launcher
    (``_pdeathsig``: a launcher killed with SIGKILL leaves no orphan) and, with a ``pool``, start warm."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    class LauncherSubprocessHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]) -> subprocess.Popen:
            proc = pool.take(self.local_rank_id, args, env, self._stdout, self._stderr) if pool else None
            if proc is None:  # as torch's SubprocessHandler._popen, dying with the launcher
                proc = subprocess.Popen(args=args, env=env, stdout=self._stdout, stderr=self._stderr,
                                        start_new_session=True, preexec_fn=die_with_parent())
            if pool is not None:
                pool.prepare(self.local_rank_id, args, env)
            return proc

    def get_subprocess_handler(entrypoint: str, args: tuple, env: dict[str, str], stdout: str, stderr: str,
                               local_rank_id: int, numa_options: Any = None) -> SubprocessHandler:
        return LauncherSubprocessHandler(entrypoint=entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                                         local_rank_id=local_rank_id, numa_options=numa_options)

    return get_subprocess_handler
