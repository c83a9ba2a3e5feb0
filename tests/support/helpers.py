"""Test helpers: bounded polling, finding saver daemons, and launching N gloo ranks as real subprocesses.

``run_ranks(fn, world_size, workdir, args=...)`` starts ``world_size`` fresh Python processes. Each one sets
the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), joins a gloo process group through
a ``file://`` rendezvous in ``workdir`` (unless ``dist=False``), calls ``fn(**args)`` and writes its
JSON-serializable return value to ``workdir/result_<rank>.json``. ``fn`` must be a module-level function of
a module in this directory; the child imports that module by name. A rank that fails or hangs never
leaves the others hanging: the rest are killed after a bounded grace and the error carries every rank's
output.

Run as a script (``python helpers.py SPEC``) this file is the child's entry point.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
from flashckpt.transport.spawn import SAVER_MODULE  # noqa: E402  (the daemon module, as on its command line)


# ---------------------------------------------------------------------------------------- polling
def wait_for(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    """Polls ``cond`` until it returns a truthy value (returned) or ``timeout`` seconds pass (TimeoutError).

    The short sleeps between checks pace the poll; they are never the synchronization itself."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


# ---------------------------------------------------------------------------------------- comparing trees
def storage_bytes(t: Any) -> Any:
    """The bytes of ``t``'s whole storage as a uint8 tensor (bit patterns, so NaN payloads compare equal)."""
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def assert_bit_identical(a: Any, b: Any, where: str = "") -> None:
    """``b`` is ``a``, bit for bit: same class, dtype, shape, strides, offset, grad flag and storage bytes."""
    import torch

    assert type(a) is type(b), f"{where}: {type(b).__name__} instead of {type(a).__name__}"
    assert a.dtype == b.dtype, f"{where}: dtype {b.dtype} instead of {a.dtype}"
    assert a.shape == b.shape, f"{where}: shape {tuple(b.shape)} instead of {tuple(a.shape)}"
    assert a.stride() == b.stride(), f"{where}: strides {b.stride()} instead of {a.stride()}"
    assert a.storage_offset() == b.storage_offset(), f"{where}: storage offset differs"
    assert a.requires_grad == b.requires_grad, f"{where}: requires_grad differs"
    assert (a.is_conj(), a.is_neg()) == (b.is_conj(), b.is_neg()), \
        f"{where}: conjugate/negative bits {(b.is_conj(), b.is_neg())} instead of {(a.is_conj(), a.is_neg())}"
    assert b.device.type == "cpu", f"{where}: restored on {b.device}"
    assert torch.equal(storage_bytes(a), storage_bytes(b)), f"{where}: the bytes differ"


def _float_bits(x: float) -> bytes:
    import struct

    return struct.pack("<d", x)


def short_repr(x: Any) -> str:
    """``repr(x)`` for messages, also for ints too long for Python to print."""
    try:
        return repr(x)
    except ValueError:
        return f"<{type(x).__name__} of {x.bit_length()} bits>"


def assert_same_tree(a: Any, b: Any, where: str = "<root>") -> None:
    """``b`` equals ``a`` with every container and leaf of the same type (dict key types and order too);
    tensors are compared bit for bit (with their conjugate and negative bits), floats and complex numbers
    by their bits (NaN payloads and the sign of zero included)."""
    from collections import OrderedDict

    import torch

    assert type(a) is type(b), f"{where}: {type(b).__name__} {short_repr(b):.80} instead of {type(a).__name__} {short_repr(a):.80}"
    if isinstance(a, torch.Tensor):
        assert_bit_identical(a, b, where)
    elif type(a) in (dict, OrderedDict):
        ka, kb = list(a), list(b)
        assert len(ka) == len(kb) and all(_same_key(x, y) for x, y in zip(ka, kb)), \
            f"{where}: keys {short_repr(kb):.300} instead of {short_repr(ka):.300}"
        for x, y in zip(ka, kb, strict=True):
            assert_same_tree(a[x], b[y], f"{where}[{short_repr(x)}]")
    elif type(a) in (list, tuple):
        assert len(a) == len(b), f"{where}: length {len(b)} instead of {len(a)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{where}[{i}]")
    elif type(a).__module__ == "numpy" and hasattr(a, "dtype") and hasattr(a, "shape"):
        import numpy as np

        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f"{where}: {b!r} instead of {a!r}"
    elif type(a) is float:
        assert _float_bits(a) == _float_bits(b), f"{where}: {b!r} ({_float_bits(b).hex()}) instead of {a!r} " \
            f"({_float_bits(a).hex()})"
    elif type(a) is complex:
        assert _float_bits(a.real) + _float_bits(a.imag) == _float_bits(b.real) + _float_bits(b.imag), \
            f"{where}: {b!r} instead of {a!r} (bits differ)"
    else:
        assert a == b, f"{where}: {short_repr(b):.200} instead of {short_repr(a):.200}"


def _same_key(x: Any, y: Any) -> bool:
    """Dict keys ``x`` and ``y`` are the same key: of one type, equal (floats by their bits)."""
    if type(x) is not type(y):
        return False
    if type(x) is float:
        return _float_bits(x) == _float_bits(y)
    if type(x) is tuple:
        return len(x) == len(y) and all(_same_key(p, q) for p, q in zip(x, y))
    return bool(x == y)


def tree_digest(*trees: Any) -> str:
    """SHA-256 over trees of tensors (dtype, shape, bytes; a DTensor's or ShardedTensor's local shard),
    containers (dict keys sorted) and plain values (their repr): equal digests mean bit-identical states."""
    import hashlib

    import torch

    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if hasattr(x, "to_local"):  # DTensor
            x = x.to_local()
        elif hasattr(x, "local_tensor"):  # ShardedTensor
            x = x.local_tensor()
        if isinstance(x, torch.Tensor):
            h.update(str((x.dtype, tuple(x.shape))).encode())
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    for t in trees:
        walk(t)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------- held persists
def hold_persist(target: str) -> str:
    """Makes the persist to file ``target`` block (its slot pinned) until ``release_persist``: its temp file
    is a FIFO with no reader, so the saver's persist blocks opening it. Returns the FIFO's path."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fifo = f"{target}.flashckpt-tmp"
    os.mkfifo(fifo, 0o600)
    return fifo


def release_persist(fifo: str) -> None:
    """Lets a held persist go on: opens the FIFO's other end until the persist wrote into it, then closes
    it, so the persist fails with a broken pipe."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)

    def wrote() -> bool:
        # b"": no writer yet, or one that left (the direct-I/O open fails on a FIFO; the buffered one follows).
        try:
            return bool(os.read(fd, 1 << 16))
        except BlockingIOError:
            return False

    try:
        wait_for(wrote, 60, "the held persist to write into its FIFO")
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------- processes
def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid`` from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split(" ")
    return fields[0], int(fields[1])


def _proc_state(pid: int) -> str | None:
    st = _proc_stat(pid)
    return st[0] if st else None


def saver_pids(runtime_dir: str) -> dict[int, list[str]]:
    """Live saver daemons whose ``--job-dir`` lies under ``runtime_dir``: pid -> argv (from /proc).

    A saver's child between fork and exec (its persist worker starting) still shows the saver's command
    line: a process whose parent is one of the savers found is not counted."""
    prefix = runtime_dir.rstrip("/") + "/"
    out: dict[int, list[str]] = {}
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if SAVER_MODULE not in argv or not any(a.startswith(prefix) for a in argv):
            continue
        st = _proc_stat(int(name))
        if st is None or st[0] in ("Z", "X"):
            continue
        out[int(name)] = argv
        parents[int(name)] = st[1]
    return {pid: argv for pid, argv in out.items() if parents[pid] not in out}


def child_pids(pid: int | None = None) -> list[int]:
    """Live (non-zombie) children of ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2:].split(" ")
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            out.append(int(name))
    return out


def wait_savers_gone(runtime_dir: str, timeout: float = 30.0) -> None:
    """Waits for every saver daemon of ``runtime_dir`` to exit (they exit once all clients said goodbye)."""
    wait_for(lambda: not saver_pids(runtime_dir), timeout, f"the saver daemons of {runtime_dir} to exit")


def leftovers(runtime_dir: str) -> list[str]:
    """Every path left under ``runtime_dir`` (which the last saver may have removed itself)."""
    out = []
    for root, dirs, files in os.walk(runtime_dir):
        out += [os.path.join(root, n) for n in dirs + files]
    return sorted(out)


# ---------------------------------------------------------------------------------------- ranks
class RankGroup:
    """The processes of one ``launch_ranks`` call."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], workdir: str) -> None:
        self.procs = procs
        self.workdir = workdir

    def result_path(self, rank: int) -> str:
        return os.path.join(self.workdir, f"result_{rank}.json")

    def log_path(self, rank: int) -> str:
        return os.path.join(self.workdir, f"rank_{rank}.log")

    def logs(self) -> str:
        parts = []
        for r in range(len(self.procs)):
            try:
                with open(self.log_path(r), "rb") as f:
                    tail = f.read()[-6000:].decode(errors="replace")
            except OSError:
                tail = "<no output>"
            parts.append(f"---- rank {r} (exit {self.procs[r].returncode}) ----\n{tail}")
        return "\n".join(parts)

    def kill(self) -> None:
        """SIGKILLs the ranks still running (only these processes, by pid) and reaps them."""
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=30)

    def wait_until(self, cond: Callable[[], Any], timeout: float, what: str) -> Any:
        """``wait_for`` while the ranks run: an AssertionError with every rank's output when a rank exits first
        or ``timeout`` passes (a bare timeout says nothing about why the ranks did not get there)."""
        def check() -> Any:
            if any(p.poll() is not None for p in self.procs):
                raise AssertionError(f"a rank exited while waiting for {what}\n{self.logs()}")
            return cond()

        try:
            return wait_for(check, timeout, what)
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{self.logs()}") from None

    def wait(self, timeout: float = 180.0, fail_grace: float = 15.0) -> list[Any]:
        """Waits for every rank and returns their results in rank order.

        Raises AssertionError (with every rank's output) when a rank fails or ``timeout`` passes; once one
        rank failed the others get ``fail_grace`` seconds before they are killed."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                codes = [p.poll() for p in self.procs]
                if all(c is not None for c in codes):
                    break
                if any(c not in (None, 0) for c in codes):
                    deadline = min(deadline, time.monotonic() + fail_grace)
                if time.monotonic() >= deadline:
                    self.kill()
                    raise AssertionError(f"ranks did not finish within the time limit\n{self.logs()}")
                time.sleep(0.02)
        finally:
            if any(p.poll() is None for p in self.procs):
                self.kill()
        results = []
        for r, p in enumerate(self.procs):
            try:
                with open(self.result_path(r)) as f:
                    res = json.load(f)
            except (OSError, ValueError):
                res = {"error": "no result written"}
            if p.returncode != 0 or "error" in res:
                raise AssertionError(f"rank {r} failed: {res.get('error')}\n{self.logs()}")
            results.append(res["value"])
        return results


def launch_ranks(fn: Callable[..., Any], world_size: int, workdir: str, *, args: dict[str, Any] | None = None,
                 dist: bool = True, pg_timeout_s: float = 90.0, env: dict[str, str] | None = None) -> RankGroup:
    """Starts ``world_size`` ranks running ``fn(**args)`` (see the module docstring); returns at once."""
    os.makedirs(workdir, exist_ok=True)
    module = fn.__module__
    if module == "__main__" or "." in fn.__qualname__:
        raise ValueError("launch_ranks: fn must be a module-level function of a test module")
    spec = {"module": module, "module_dir": os.path.dirname(os.path.abspath(sys.modules[module].__file__ or "")),
            "func": fn.__name__, "args": args or {}, "dist": dist,
            "init_file": os.path.join(workdir, "rendezvous"), "pg_timeout_s": pg_timeout_s,
            "workdir": workdir}
    spec_path = os.path.join(workdir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    procs = []
    for rank in range(world_size):
        child_env = dict(os.environ)
        child_env.update(env or {})
        child_env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                         LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", OMP_NUM_THREADS="1",
                         GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
        child_env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p])
        with open(os.path.join(workdir, f"rank_{rank}.log"), "wb") as log:
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), spec_path],
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=child_env, cwd=workdir))
    return RankGroup(procs, workdir)


def run_ranks(fn: Callable[..., Any], world_size: int, workdir: str, *, timeout: float = 180.0,
              **kw: Any) -> list[Any]:
    """``launch_ranks`` and wait: the results of every rank, in rank order."""
    return launch_ranks(fn, world_size, workdir, **kw).wait(timeout)


def _child_main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    result: dict[str, Any] = {"rank": rank}
    rc = 0
    try:
        sys.path[:0] = [spec["module_dir"], TESTS_DIR]  # the test's tier folder, the support code
        fn = getattr(importlib.import_module(spec["module"]), spec["func"])
        import torch.distributed as dist

        if spec["dist"]:
            dist.init_process_group("gloo", init_method="file://" + spec["init_file"], rank=rank,
                                    world_size=world, timeout=datetime.timedelta(seconds=spec["pg_timeout_s"]))
        try:
            result["value"] = fn(**spec["args"])
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:
        result["error"] = traceback.format_exc()
        rc = 1
    path = os.path.join(spec["workdir"], f"result_{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.rename(path + ".tmp", path)
    return rc


if __name__ == "__main__":
    code = _child_main(sys.argv[1])
    # The result is written. Exit handlers run (an engine left open says goodbye to its saver), then the
    # process ends without the interpreter's finalization: CI once saw both ranks of a DeepSpeed run abort
    # there ("terminate called without an active exception": a framework's C++ thread or static object torn
    # down at exit), after every check of the test had passed. The tests judge what the ranks did, not how
    # a framework's globals are destroyed.
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def flock_waiters(path: str) -> set[int]:
    """Pids blocked waiting for the flock on ``path`` (from /proc/locks)."""
    ino = os.stat(path).st_ino
    pids = set()
    with open("/proc/locks") as f:
        for line in f:
            fields = line.split()
            if "->" in fields and "FLOCK" in fields:
                i = fields.index("FLOCK")
                if int(fields[i + 4].rsplit(":", 1)[1]) == ino:
                    pids.add(int(fields[i + 3]))
    return pids
