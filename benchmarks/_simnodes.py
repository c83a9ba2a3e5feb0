"""Simulated nodes for the multi-node benchmarks: each node a process tree in a mount namespace of its own.

A node is started as::

    unshare --mount --propagation private -- sh -c \
        'mount -t tmpfs -o size=S,mode=1777 tmpfs /dev/shm && mkdir -m 700 /dev/shm/fc /dev/shm/tmp && exec "$@"' \
        sh python -m flashckpt.launch.launcher --nnodes N --nproc_per_node 1 --rdzv_backend c10d \
        --rdzv_endpoint 127.0.0.1:PORT --rdzv_id ID --max_restarts K SCRIPT --checkpoint_dir CKPT ...

so it has a private, empty /dev/shm (its runtime dir ``/dev/shm/fc``: its savers and their snapshots, and
its ``TMPDIR``) that goes away with its last process, as a lost machine's memory does; the network, the pids
and the checkpoint dir are shared. Node 0 starts first and hosts the rendezvous store: it is never killed.

Killing a node (``SimCluster.kill_node``) SIGSTOPs then SIGKILLs every process whose ``/proc/<pid>/ns/mnt``
is the node's, until none is left. While a node may have processes, the cluster holds an open file of its
namespace (``/proc/<pid>/ns/mnt``): the namespace, and so its inode number, cannot be reused by someone
else's while it is held, so a scan never finds a stranger's process under a stale id. The file is closed
(the namespace forgotten, its tmpfs freed) as soon as a scan finds no process left in it.

The savers' logs live in the node's private /dev/shm: a thread copies them every half second through
``/proc/<pid>/root`` (root may read another mount namespace's files there), so they outlive the node.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from benchmarks._s3server import free_ports

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODE_SHM = "/dev/shm"
NODE_RUNTIME_DIR = f"{NODE_SHM}/fc"
NODE_TMP = f"{NODE_SHM}/tmp"


def mnt_ns(pid: int | str) -> str | None:
    """The mount namespace of ``pid`` (``mnt:[inode]``); None when it is gone (or a zombie)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def pids_in_ns(ns: str) -> list[int]:
    """Every live process of mount namespace ``ns`` (a scan of /proc, as pgrep would)."""
    me = os.getpid()
    return sorted(int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != me and mnt_ns(d) == ns)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def cmdline(pid: int) -> str:
    """``pid``'s command line (200 characters at most; "?" when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(a.decode(errors="replace") for a in f.read().split(b"\0") if a)[:200]
    except OSError:
        return "?"


def kill_namespace(ns: str, timeout: float = 30.0) -> None:
    """SIGSTOPs then SIGKILLs every process of ``ns`` until none is left (a process forked meanwhile is
    found by the next scan). Raises TimeoutError with the survivors when ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while pids := pids_in_ns(ns):
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes of {ns} still alive {timeout:.0f} s after SIGKILL: "
                               f"{[(p, cmdline(p)) for p in pids]}")
        signal_all(pids, signal.SIGSTOP)  # none of them forks while the others are killed
        signal_all(pids, signal.SIGKILL)
        time.sleep(0.02)


def node_shell(shm_size: str) -> list[str]:
    """The command prefix that runs a command as a node: a mount namespace with a private /dev/shm."""
    script = (f"mount -t tmpfs -o size={shm_size},mode=1777 tmpfs {NODE_SHM} && "
              f"mkdir -m 700 {NODE_RUNTIME_DIR} && mkdir -m 1777 {NODE_TMP} && exec \"$@\"")
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh"]


def namespace_support() -> str | None:
    """Why simulated nodes cannot run here (None when they can)."""
    if os.geteuid() != 0:
        return "simulated nodes need root (a mount namespace and a tmpfs each)"
    if shutil.which("unshare") is None:
        return "simulated nodes need unshare (util-linux)"
    try:
        r = subprocess.run([*node_shell("4m"), "sh", "-c", f"test -d {NODE_RUNTIME_DIR}"], capture_output=True,
                           text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot make a mount namespace with a tmpfs: {e}"
    if r.returncode != 0:
        return f"cannot make a mount namespace with a tmpfs: {(r.stderr or r.stdout).strip()}"
    return None


def listening(port: int) -> bool:
    """Whether a socket listens on ``port`` (IPv4 or IPv6), from /proc/net (the network is shared)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":
                        return True
        except (OSError, StopIteration):
            continue
    return False


def tail_of(path: str, n: int = 4000) -> str:
    """The last ``n`` bytes of file ``path`` as text ("<no output>" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return "<no output>"


def read_events(path: str) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` (a line being written is skipped)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
    except FileNotFoundError:
        pass
    return out


@dataclass
class _Ns:
    """A namespace the cluster made, held open (not reusable) until no process is left in it."""

    name: str
    fd: int

    def pids(self) -> list[int]:
        return pids_in_ns(self.name)


@dataclass
class Node:
    index: int
    dir: str
    gen: int = 0
    proc: subprocess.Popen[bytes] | None = None
    ns: _Ns | None = None
    saver_logs: dict[str, str] = field(default_factory=dict)  # "<gen>/<job dir>" -> content

    @property
    def log(self) -> str:
        return os.path.join(self.dir, "node.log")

    @property
    def metrics(self) -> str:
        return os.path.join(self.dir, "metrics.jsonl")

    @property
    def agent_events(self) -> str:
        return os.path.join(self.dir, "agent-events.jsonl")


class SimCluster:
    """``nnodes`` simulated nodes of one job running ``script`` (1 rank each unless told), one checkpoint dir;
    ``nnodes_spec`` ("MIN:MAX"): an elastic job's ``--nnodes``. Use as a context manager: leaving it kills every
    node whole and forgets their namespaces."""

    def __init__(self, work: str, nnodes: int, script: str, script_args: list[str], *,
                 env: dict[str, str] | None = None, shm_size: str = "4g", rdzv_conf: str = "",
                 nproc_per_node: int = 1, max_restarts: int = 3, nnodes_spec: str = "") -> None:
        self.work = work
        self.ckpt_dir = os.path.join(work, "ckpt")
        os.makedirs(self.ckpt_dir, exist_ok=True)
        self.nnodes = nnodes
        self.shm_size = shm_size
        self.port = free_ports(1)[0]
        self.rdzv_id = f"bn-{uuid.uuid4().hex[:8]}"
        self.cmd = [sys.executable, "-m", "flashckpt.launch.launcher", "--nnodes", nnodes_spec or str(nnodes),
                    "--nproc_per_node",
                    str(nproc_per_node), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{self.port}",
                    "--rdzv_id", self.rdzv_id, "--max_restarts", str(max_restarts)]
        if rdzv_conf:
            self.cmd += ["--rdzv_conf", rdzv_conf]
        self.script = [script, "--checkpoint_dir", self.ckpt_dir, "--metrics_all_ranks", "--resume", *script_args]
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("TORCHELASTIC_", "PYTEST_"))
                    and k not in ("FLASHCKPT_JOB_ID", "FLASHCKPT_AGENT_PID", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                  "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
        self.env.update({
            "FLASHCKPT_RUNTIME_DIR": NODE_RUNTIME_DIR,
            "TMPDIR": NODE_TMP,
            "FLASHCKPT_SAVER_LOG_LEVEL": "INFO",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                    if p]),
            "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
        })
        self.env.update(env or {})
        self.nodes = [Node(i, os.path.join(work, f"node{i}")) for i in range(nnodes)]
        for n in self.nodes:
            os.makedirs(n.dir, exist_ok=True)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._mirror = threading.Thread(target=self._mirror_loop, name="simnodes-logs", daemon=True)

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> SimCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def launch(self, timeout: float = 90.0) -> None:
        """Starts every node: node 0 first, the others once it hosts the rendezvous store."""
        self.start_node(0, timeout)
        deadline = time.monotonic() + timeout
        while not listening(self.port):
            if self.exited(0) or time.monotonic() > deadline:
                raise RuntimeError(f"node 0 did not host the rendezvous store (exit code {self.nodes[0].proc.poll() if self.nodes[0].proc else None}"
                                   f"):\n{self.tail(0)}")
            time.sleep(0.1)
        for i in range(1, self.nnodes):
            self.start_node(i, timeout)
        if not self._mirror.is_alive():
            self._mirror.start()

    def start_node(self, i: int, timeout: float = 60.0) -> None:
        """Starts node ``i`` (again: a fresh machine, empty memory, joining the job's rendezvous)."""
        node = self.nodes[i]
        if node.ns is not None:
            raise RuntimeError(f"node {i} still runs")
        node.gen += 1
        env = dict(self.env, FLASHCKPT_LAUNCH_EVENTS=node.agent_events)
        argv = [*node_shell(self.shm_size), *self.cmd, *self.script, "--metrics", node.metrics]
        own = mnt_ns("self")
        with open(node.log, "ab") as log:
            log.write(f"\n==== node {i} start {node.gen} at {time.time():.3f}\n".encode())
            log.flush()
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, cwd=node.dir, start_new_session=True)
        node.proc = proc
        deadline = time.monotonic() + timeout
        while True:
            ns = mnt_ns(proc.pid)
            if ns is not None and ns != own:
                try:
                    fd = os.open(f"/proc/{proc.pid}/ns/mnt", os.O_RDONLY)
                except OSError:
                    fd = -1
                # the pid is ours (our child, not reaped): the file opened is its namespace, unless it died
                if fd >= 0 and os.readlink(f"/proc/self/fd/{fd}") == ns:
                    with self._lock:
                        node.ns = _Ns(ns, fd)
                    return
                if fd >= 0:
                    os.close(fd)
            if proc.poll() is not None:
                raise RuntimeError(f"node {i} exited at once (rc {proc.returncode}):\n{self.tail(i)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {i} did not enter its mount namespace")
            time.sleep(0.02)

    def kill_node(self, i: int, timeout: float = 30.0) -> float:
        """Kills node ``i`` whole; returns the wall-clock time of the kill (when its processes were stopped)."""
        if i == 0:
            raise ValueError("node 0 hosts the rendezvous store")
        node = self.nodes[i]
        self._copy_saver_logs(node)
        t = time.time()
        self._kill_ns(node, timeout)
        return t

    def _kill_ns(self, node: Node, timeout: float) -> None:
        with self._lock:
            ns = node.ns
        if ns is None:
            return
        try:
            kill_namespace(ns.name, timeout)
        except TimeoutError as e:
            raise RuntimeError(f"node {node.index}: {e}") from None
        self._forget(node)
        if node.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=10)

    def _forget(self, node: Node) -> None:
        with self._lock:
            if node.ns is not None:
                os.close(node.ns.fd)
                node.ns = None

    def close(self) -> None:
        """Kills every node still running (whole), stops the log mirror and writes the savers' logs out."""
        for node in self.nodes:
            self._copy_saver_logs(node)
        for node in self.nodes:
            with contextlib.suppress(RuntimeError):
                self._kill_ns(node, 30.0)
        self._stop.set()
        if self._mirror.is_alive():
            self._mirror.join(timeout=5)
        for node in self.nodes:  # beside the node's output: saver-<start>-<job dir>.log
            for key, text in node.saver_logs.items():
                with contextlib.suppress(OSError), open(os.path.join(node.dir, f"saver-{key.replace('/', '-')}.log"),
                                                        "w") as f:
                    f.write(text)

    # ---------------------------------------------------------------- observing
    def exited(self, i: int) -> bool:
        p = self.nodes[i].proc
        return p is None or p.poll() is not None

    def wait_exit(self, timeout: float) -> list[int | None]:
        """Waits (bounded) until every node's launcher exited; their exit codes (None: still running)."""
        deadline = time.monotonic() + timeout
        while not all(self.exited(i) for i in range(self.nnodes)) and time.monotonic() < deadline:
            time.sleep(0.2)
        return [n.proc.poll() if n.proc else None for n in self.nodes]

    def events(self, event: str | None = None, after: float = 0.0) -> list[dict[str, Any]]:
        """Every node's training events (all ranks, all starts), optionally of one kind and after ``after``."""
        return sorted((dict(e, node=n.index) for n in self.nodes for e in read_events(n.metrics)
                       if (event is None or e.get("event") == event) and e.get("t", 0) >= after),
                      key=lambda e: e["t"])

    def agent_events(self, i: int, after: float = 0.0) -> list[dict[str, Any]]:
        return [e for e in read_events(self.nodes[i].agent_events) if e.get("t", 0) >= after]

    def newest_step(self, before: float = float("inf")) -> int:
        """The newest step every rank saved (snapshot done) before ``before``: what the job holds of a sharded
        state (0: none)."""
        per_rank: dict[int, int] = {}
        for e in self.events("save"):
            if e["t"] < before:
                per_rank[e["rank"]] = max(per_rank.get(e["rank"], 0), int(e["step"]))
        return min(per_rank.values()) if len(per_rank) == self.nnodes else 0

    def saver_log_lines(self) -> list[tuple[int, str]]:
        """(node, line) of every saver log of every node (all starts)."""
        self.mirror_now()
        with self._lock:
            return [(n.index, ln) for n in self.nodes for text in n.saver_logs.values() for ln in text.splitlines()]

    def tail(self, i: int, n: int = 4000) -> str:
        return tail_of(self.nodes[i].log, n)

    # ---------------------------------------------------------------- saver logs
    def mirror_now(self) -> None:
        for node in self.nodes:
            self._copy_saver_logs(node)

    def _copy_saver_logs(self, node: Node) -> None:
        with self._lock:
            ns = node.ns
            if ns is None:
                return
            pids = ns.pids()
            if not pids:  # its last process is gone: forget the namespace now
                self._forget(node)
                return
            for pid in pids:
                texts = {}
                for path in glob.glob(f"/proc/{pid}/root{NODE_RUNTIME_DIR}/*/saver.log"):
                    try:
                        with open(path, errors="replace") as f:
                            texts[os.path.basename(os.path.dirname(path))] = f.read()
                    except OSError:
                        continue
                if mnt_ns(pid) != ns.name:  # it died meanwhile (its pid may be another's now): the next one
                    continue
                for job, text in texts.items():
                    key = f"{node.gen}/{job}"
                    if len(text) >= len(node.saver_logs.get(key, "")):
                        node.saver_logs[key] = text
                return

    def _mirror_loop(self) -> None:
        while not self._stop.wait(0.5):
            self.mirror_now()
