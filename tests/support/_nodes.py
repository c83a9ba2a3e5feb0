"""Simulated nodes for multi-node tests: each node is a process tree in a mount namespace of its own.

A node is started as::

    unshare --mount --propagation private -- sh -c \
        'mount -t tmpfs -o size=S,mode=1777 tmpfs /dev/shm && mkdir -m 700 /dev/shm/fc /dev/shm/tmp && exec "$@"' \
        sh python -m flashckpt.launch.launcher --nnodes N --nproc_per_node P --rdzv_backend c10d \
        --rdzv_endpoint 127.0.0.1:PORT --rdzv_id ID --max_restarts K SCRIPT --checkpoint_dir CKPT ...

so it has a private, empty /dev/shm (its runtime dir ``/dev/shm/fc``: its savers and their snapshots; its
``TMPDIR``) that goes away with its last process, as a lost machine's memory does; network, pids, the
checkpoint dir and the rest of the file system are shared. ``unshare`` and ``sh`` exec, so the process
``Popen`` started is the node's launcher (its agent). Node 0 is started first and hosts the c10d store of
the rendezvous: the tests never kill it (losing the rendezvous host is out of scope), unless the store is
hosted outside the nodes (``launch(external_store=True)``, as a production job's store or etcd is).

The ``cluster`` fixture gives a ``Cluster`` (see its methods): ``launch`` starts N nodes running an
example script (``--checkpoint_dir`` shared, ``--metrics`` one file per node with every rank's events,
``--resume``); ``kill_node(i)`` SIGSTOPs then SIGKILLs every process of node i's mount namespace (found
by ``/proc/<pid>/ns/mnt``) until none is left (the harness holds an open fd of every node's namespace
until a scan finds it empty, so its inode number cannot be reused meanwhile by another namespace, e.g.
another test's node, whose processes a scan would then kill); ``term_agent(i)`` SIGTERMs its launcher only;
``start_node(i)`` after a kill is a fresh node joining with empty memory. Every wait is bounded and a
timeout fails the test with the end of every node's output and every saver log (``Cluster.fail``); the
fixture's teardown prints them too (pytest shows them when the test failed), kills every node whole and
fails when a process of any node's namespace is left. The savers' logs live in the nodes' private
/dev/shm: a thread copies them every half second through ``/proc/<pid>/root`` (root may read another
mount namespace's files there), so they outlive the node, and once more when a node ended (``wait_exit``,
``kill_nodes``, ``start_node``: through the namespace the harness still holds, whose tmpfs lives on until it
is released, with ``nsenter``), so that what a killed saver logged last is kept too (a saver that ends
normally removes its job dir, its log with it: ``wait_settled`` copies them until the node's last process
ended). Skips without root, without ``unshare`` or where a mount namespace with a tmpfs cannot be made.

``reference_digest`` runs the same training uninterrupted (one launcher, all ranks on it) and returns
rank 0's final weights digest, cached per arguments for the session.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import pytest
from _fault_helpers import read_events, run_cli
from helpers import wait_for

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(TESTS_DIR))
if REPO not in sys.path:  # for benchmarks (the repository root is not on pytest's path)
    sys.path.insert(0, REPO)
from benchmarks._s3server import free_ports  # noqa: E402
from benchmarks._simnodes import (  # noqa: E402  (the namespace primitives the benchmarks' nodes use too)
    NODE_RUNTIME_DIR,
    NODE_TMP,
    cmdline,
    kill_namespace,
    listening,
    mnt_ns,
    namespace_support,
    node_shell,
    pids_in_ns,
    signal_all,
    tail_of,
)

VENV_BIN = os.path.dirname(sys.executable)
DDP_TRAIN = os.path.join(REPO, "examples", "ddp_train.py")
FSDP_TRAIN = os.path.join(REPO, "examples", "fsdp_train.py")
DS_TRAIN = os.path.join(REPO, "examples", "ds_train.py")
MEGATRON_TRAIN = os.path.join(REPO, "examples", "megatron_train.py")

KILL_TIMEOUT_S = 30.0
LOG_TAIL = 6000
# The rendezvous store outside every node (``launch(external_store=True)``), as a production job's
# TCPStore host or etcd is: then node 0, with global rank 0, may be lost too.
STORE_HOST = ("import sys, time\nimport torch.distributed as dist\n"
              "store = dist.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, wait_for_workers=False)\n"
              "while True:\n    time.sleep(3600)\n")


def events(path: str) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` (a line being written may be cut: read again)."""
    for _ in range(20):
        try:
            return read_events(path)
        except ValueError:
            time.sleep(0.05)
    return read_events(path)


def _tail(path: str, n: int = LOG_TAIL) -> str:
    return tail_of(path, n)


def ls_checkpoints(ckpt_dir: str) -> list[dict[str, Any]]:
    """``flashckpt ls --json ckpt_dir``: rows of step, state ("committed", "committed (latest)", ...)."""
    r = run_cli(None, "ls", "--json", ckpt_dir)  # type: ignore[arg-type]  # in-process: no environment needed
    assert r.returncode == 0, f"flashckpt ls failed: {r.stdout}{r.stderr}"
    return json.loads(r.stdout) if r.stdout.strip().startswith("[") else []


def committed_steps(ckpt_dir: str) -> list[int]:
    return sorted(row["step"] for row in ls_checkpoints(ckpt_dir) if str(row["state"]).startswith("committed"))


# ------------------------------------------------------------------------------------------ the cluster
@dataclass
class Node:
    """One simulated node; ``gen`` counts its starts (a restarted node is a fresh machine)."""

    index: int
    dir: str
    gen: int = 0
    proc: subprocess.Popen[bytes] | None = None
    ns: str | None = None
    # namespace -> an open fd of it, while it may have processes: a held namespace (and its inode number)
    # cannot be freed and reused by someone else's, so a scan by inode never finds a stranger's process
    held: dict[str, int] = field(default_factory=dict)

    @property
    def log(self) -> str:
        return os.path.join(self.dir, "node.log")

    @property
    def metrics(self) -> str:
        return os.path.join(self.dir, "metrics.jsonl")

    @property
    def agent_events(self) -> str:
        return os.path.join(self.dir, "agent-events.jsonl")


class Cluster:
    """N simulated nodes of one training job (see the module docstring)."""

    def __init__(self, tmp_path: str) -> None:
        self.tmp = str(tmp_path)
        self.ckpt_dir = os.path.join(self.tmp, "ckpt")
        os.makedirs(self.ckpt_dir, exist_ok=True)
        self.nodes: list[Node] = []
        self.saver_logs: dict[tuple[int, int, str], str] = {}  # (node, gen, job dir name) -> content
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._mirror: threading.Thread | None = None
        self.cmd: list[str] = []
        self.env: dict[str, str] = {}
        self.shm_size = "256m"
        self.logs_shown = False  # a failure message carried them already
        self.store: subprocess.Popen[bytes] | None = None  # the rendezvous store's host, when outside the nodes

    # ---------------------------------------------------------------- starting
    def launch(self, script: str, nnodes: int, script_args: list[str], *, nproc_per_node: int = 1,
               max_restarts: int = 3, env: dict[str, str] | None = None, warm_workers: bool = False,
               rdzv_conf: str = "", shm_size: str = "256m", node_args: dict[int, list[str]] | None = None,
               agent_args: dict[int, list[str]] | None = None, start_timeout: float = 60.0,
               external_store: bool = False, nnodes_spec: str = "") -> None:
        """Starts ``nnodes`` nodes of one job running ``script`` (node 0 first; the others once it hosts
        the rendezvous store; with ``external_store``, a process outside the nodes hosts it and every node
        may be lost). The script gets ``--checkpoint_dir`` (shared), ``--metrics`` (its node's
        file), ``--metrics_all_ranks`` and ``--resume`` before ``script_args``; ``node_args[i]`` is added
        on node i only, ``agent_args[i]`` to node i's ``flashckpt-run`` (before the script: e.g. its own
        ``--local-dir``). Warm workers are off unless asked for (2 cores: their imports slow the others).
        ``nnodes_spec`` (``"MIN:MAX"``): an elastic job's ``--nnodes``, which goes on with fewer nodes after a
        loss (``nnodes`` nodes are started)."""
        port = free_ports(1)[0]
        self.rdzv_id = f"mn-{uuid.uuid4().hex[:8]}"
        self.nnodes = nnodes
        self.port = port
        self.shm_size = shm_size
        self.cmd = [sys.executable, "-m", "flashckpt.launch.launcher", "--nnodes", nnodes_spec or str(nnodes),
                    "--nproc_per_node", str(nproc_per_node), "--rdzv_backend", "c10d",
                    "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", self.rdzv_id,
                    "--max_restarts", str(max_restarts)]
        if external_store:
            self.store = subprocess.Popen([sys.executable, "-c", STORE_HOST, str(port)], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.wait_for(lambda: listening(port) or self.store.poll() is not None,  # type: ignore[union-attr]
                          start_timeout, "the rendezvous store to listen")
            if self.store.poll() is not None:
                self.fail(f"the rendezvous store's host exited (rc {self.store.returncode})")
            rdzv_conf = ",".join(c for c in [rdzv_conf, "is_host=false"] if c)
        if rdzv_conf:
            self.cmd += ["--rdzv_conf", rdzv_conf]
        self.script = [script, "--checkpoint_dir", self.ckpt_dir, "--metrics_all_ranks", "--resume", *script_args]
        self.node_args = node_args or {}
        self.agent_args = agent_args or {}
        self.env = self._base_env(env or {}, warm_workers)
        self.nodes = []
        for i in range(nnodes):
            d = os.path.join(self.tmp, f"node{i}")
            os.makedirs(d, exist_ok=True)
            self.nodes.append(Node(i, d))
        self.start_node(0, timeout=start_timeout)
        self.wait_for(lambda: listening(port) or self._exited(0), start_timeout,
                      "node 0 to host the rendezvous store")
        if self._exited(0):
            self.fail("node 0 exited before hosting the rendezvous store")
        for i in range(1, nnodes):
            self.start_node(i, timeout=start_timeout)
        if self._mirror is None:
            self._mirror = threading.Thread(target=self._mirror_saver_logs, name="cluster-saver-logs", daemon=True)
            self._mirror.start()

    def _base_env(self, extra: dict[str, str], warm_workers: bool) -> dict[str, str]:
        # the suite's knobs pass (FLASHCKPT_NATIVE=0...); the job id is the rendezvous id (flashckpt-run's)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TORCHELASTIC_", "PYTEST_"))
               and k not in ("FLASHCKPT_JOB_ID", "FLASHCKPT_AGENT_PID", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                             "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env.update({
            "FLASHCKPT_RUNTIME_DIR": NODE_RUNTIME_DIR,
            "TMPDIR": NODE_TMP,
            "FLASHCKPT_SAVER_GRACE_S": "10",
            "FLASHCKPT_RPC_TIMEOUT_S": "60",
            "FLASHCKPT_SPAWN_TIMEOUT_S": "60",
            # a commit that waits for a rank's file that never comes gives up within the test's time
            "FLASHCKPT_COMMIT_TIMEOUT_S": "60",
            "FLASHCKPT_COPY_THREADS": "2",
            "FLASHCKPT_SAVER_LOG_LEVEL": "INFO",
            "FLASHCKPT_WARM_WORKERS": "1" if warm_workers else "0",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
            "PATH": os.pathsep.join([VENV_BIN, os.environ.get("PATH", "")]),
        })
        env.update(extra)
        return env

    def start_node(self, i: int, timeout: float = 60.0) -> None:
        """Starts node ``i`` (again: a fresh machine, empty memory, joining the job's rendezvous)."""
        node = self.nodes[i]
        assert node.proc is None or node.proc.poll() is not None, f"node {i} is running"
        if node.ns is not None and node.ns in node.held:
            assert not pids_in_ns(node.ns), f"node {i}'s previous namespace still has processes"
            self._copy_saver_logs(node, final=True)
            self._release(node)
        node.gen += 1
        env = dict(self.env, FLASHCKPT_LAUNCH_EVENTS=node.agent_events)
        argv = [*node_shell(self.shm_size), *self.cmd, *self.agent_args.get(i, []), *self.script,
                "--metrics", node.metrics, *self.node_args.get(i, [])]
        with open(node.log, "ab") as log:
            log.write(f"\n==== node {i} start {node.gen} at {time.time():.3f}: {' '.join(argv)}\n".encode())
            log.flush()
            node.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, cwd=node.dir, start_new_session=True)
        own = mnt_ns("self")
        proc = node.proc

        def entered() -> str | None:
            ns = mnt_ns(proc.pid)
            if proc.poll() is not None:
                return "exited"
            return ns if ns is not None and ns != own else None

        ns = self.wait_for(entered, timeout, f"node {i} to enter its mount namespace")
        if ns == "exited":
            self.fail(f"node {i} exited at once (rc {proc.returncode}): its namespace or tmpfs failed")
        try:
            fd = os.open(f"/proc/{proc.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            self.fail(f"node {i}'s namespace could not be held ({e}): did it exit at once? rc {proc.poll()}")
        if f"mnt:[{os.fstat(fd).st_ino}]" != ns:
            os.close(fd)
            self.fail(f"node {i}'s process left its namespace {ns} before it was held")
        node.ns = ns
        node.held[ns] = fd

    # ---------------------------------------------------------------- faults
    def kill_node(self, i: int) -> float:
        """Kills node ``i`` whole (every process of its mount namespace; its memory goes with the last
        one). Returns the wall-clock time of the kill."""
        return self.kill_nodes([i])

    def kill_nodes(self, idx: list[int]) -> float:
        """Kills the nodes ``idx`` whole at once: every process of their namespaces is stopped before any
        is killed. Returns the wall-clock time of the kill."""
        assert 0 not in idx or self.store is not None, "node 0 hosts the rendezvous store: losing it is out of scope"
        nodes = [self.nodes[i] for i in idx]
        for n in nodes:
            assert n.ns is not None and n.ns in n.held, f"node {n.index} is not running"
            self._copy_saver_logs(n)
        t = time.time()
        signal_all([p for n in nodes for p in pids_in_ns(n.ns or "")], signal.SIGSTOP)
        for n in nodes:
            kill_namespace(n.ns or "")
        for n in nodes:
            self._reap(n)
            self._copy_saver_logs(n, final=True)
            self._release(n)
        return t

    def term_agent(self, i: int) -> float:
        """SIGTERM to node ``i``'s launcher only. Returns the wall-clock time it was sent."""
        node = self.nodes[i]
        assert node.proc is not None and node.proc.poll() is None, f"node {i}'s launcher is not running"
        assert "flashckpt.launch.launcher" in cmdline(node.proc.pid), cmdline(node.proc.pid)
        t = time.time()
        os.kill(node.proc.pid, signal.SIGTERM)
        return t

    # ---------------------------------------------------------------- observing
    def _exited(self, i: int) -> bool:
        p = self.nodes[i].proc
        return p is None or p.poll() is not None

    def returncode(self, i: int) -> int | None:
        p = self.nodes[i].proc
        return None if p is None else p.poll()

    def wait_exit(self, nodes: list[int] | None = None, timeout: float = 120.0) -> list[int | None]:
        """Waits until the launchers of ``nodes`` (default all) exited; their exit codes."""
        idx = list(range(len(self.nodes))) if nodes is None else nodes
        self.wait_for(lambda: all(self._exited(i) for i in idx), timeout,
                      f"the launchers of nodes {idx} to exit")
        for i in idx:
            self._copy_saver_logs(self.nodes[i], final=True)
        return [self.returncode(i) for i in idx]

    def wait_settled(self, nodes: list[int] | None = None, timeout: float = 60.0) -> None:
        """Waits until no process is left in the namespaces of ``nodes`` (default all), whose launchers
        exited (a saver may go on after its launcher, e.g. uploading to the durable tier), copying their saver
        logs meanwhile."""
        idx = list(range(len(self.nodes))) if nodes is None else nodes
        ended = [self.nodes[i] for i in idx if self._exited(i) and self.nodes[i].ns in self.nodes[i].held]

        def settled() -> bool:
            for n in ended:  # copied while they run: a saver that ends removes its job dir, its log with it
                self._copy_saver_logs(n, final=True)
            return not any(pids_in_ns(n.ns or "") for n in ended)

        self.wait_for(settled, timeout, f"every process of nodes {[n.index for n in ended]} to end")

    def events(self, i: int, event: str | None = None, after: float = 0.0) -> list[dict[str, Any]]:
        """Node ``i``'s training events (every rank of it, every start), optionally of one kind and after ``t``."""
        return [e for e in events(self.nodes[i].metrics)
                if (event is None or e.get("event") == event) and e.get("t", 0) >= after]

    def all_events(self, event: str | None = None, after: float = 0.0) -> list[dict[str, Any]]:
        return [dict(e, node=n.index) for n in self.nodes for e in self.events(n.index, event, after)]

    def agent_events(self, i: int, event: str | None = None, after: float = 0.0) -> list[dict[str, Any]]:
        """Node ``i``'s launcher events (FLASHCKPT_LAUNCH_EVENTS: failure_noticed, workers_stopped, ...)."""
        return [e for e in events(self.nodes[i].agent_events)
                if (event is None or e.get("event") == event) and e.get("t", 0) >= after]

    def saved_step(self, i: int, before: float = float("inf")) -> int:
        """The newest step every rank of node ``i`` saved (snapshot done) before ``before`` (0: none)."""
        per_rank: dict[int, int] = {}
        for e in self.events(i, "save"):
            if e["t"] < before:
                per_rank[e["rank"]] = max(per_rank.get(e["rank"], 0), int(e["step"]))
        return min(per_rank.values()) if per_rank else 0

    def newest_step(self, nodes: list[int] | None = None, before: float = float("inf"), *,
                    replicated: bool = False) -> int:
        """The newest snapshot the job holds, from the ranks of ``nodes`` (default all) saved before
        ``before``: the newest step every rank saved (sharded state: each rank holds its part), or with
        ``replicated`` the newest step any rank saved (DDP: every rank's snapshot is the whole state). A
        rank is at most one step ahead of another (collectives), e.g. one that completed the all-reduce of
        the step its peer was killed in."""
        idx = list(range(len(self.nodes))) if nodes is None else nodes
        steps = [self.saved_step(i, before) for i in idx]
        return max(steps) if replicated else min(steps)

    def wait_saved(self, nodes: list[int], step: int, timeout: float = 90.0) -> int:
        """Waits until every rank of ``nodes`` saved ``step`` (or a later one); returns the step seen."""
        return self.wait_for(lambda: self.newest_step(nodes) >= step and self.newest_step(nodes), timeout,
                             f"nodes {nodes} to save step {step}")

    def wait_backed_up(self, nodes: list[int], step: int, timeout: float = 90.0) -> None:
        """Waits until every rank of ``nodes`` saved ``step`` or a later one and the backup of its newest
        snapshot reached a partner (its saver logged ``event=backup_sent`` for it), so that a node lost right
        then holds no snapshot its partner lacks (one lost between a snapshot and its backup leaves that step
        to nobody: the job then resumes from the one before, rightly, but not at the step the test saw saved).
        Sharded state only: replicated state sends no backups."""
        def backed_up() -> bool:
            for i in nodes:
                node = self.nodes[i]
                newest: dict[int, int] = {}
                for e in self.events(i, "save"):
                    newest[e["rank"]] = max(newest.get(e["rank"], 0), int(e["step"]))
                if not newest or min(newest.values()) < step:
                    return False
                self._copy_saver_logs(node)
                with self._lock:
                    text = "\n".join(v for k, v in self.saver_logs.items() if k[:2] == (i, node.gen))
                if any(f"event=backup_sent rank={r} step={s} " not in text for r, s in newest.items()):
                    return False
            return True

        self.wait_for(backed_up, timeout, f"nodes {nodes} to save step {step} and back up their newest snapshot")

    def resumes(self, after: float) -> dict[int, dict[str, Any]]:
        """Rank -> the last ``resume`` event of that rank after ``after`` (every node's)."""
        out: dict[int, dict[str, Any]] = {}
        for e in sorted(self.all_events("resume", after), key=lambda e: e["t"]):
            out[e["rank"]] = e
        return out

    def final_digest(self) -> str | None:
        """Rank 0's weights digest at the end of training (None when it did not end)."""
        ends = sorted((e for e in self.all_events("end") if e.get("rank") == 0), key=lambda e: e["t"])
        return ends[-1].get("digest") if ends else None

    def log(self, i: int) -> str:
        with open(self.nodes[i].log, "rb") as f:
            return f.read().decode(errors="replace")

    def all_text(self) -> str:
        """Every node's output and every saver log copied so far (for loose searches)."""
        with self._lock:
            savers = "\n".join(self.saver_logs.values())
        return "\n".join(self.log(n.index) for n in self.nodes) + "\n" + savers

    def logs(self) -> str:
        """The end of every node's output and of every saver log."""
        for n in self.nodes:
            self._copy_saver_logs(n, final=True)
        out = []
        for n in self.nodes:
            rc = self.returncode(n.index)
            out.append(f"======== node {n.index} (start {n.gen}, launcher {'running' if rc is None else f'exited {rc}'}, "
                       f"{n.log})\n{_tail(n.log)}")
        with self._lock:
            for (i, gen, job), text in sorted(self.saver_logs.items()):
                out.append(f"======== saver log of node {i} (start {gen}), {job}\n{text[-LOG_TAIL:]}")
        return "\n".join(out)

    def fail(self, msg: str) -> NoReturn:
        """Fails the test with ``msg`` and the end of every log."""
        self.logs_shown = True
        pytest.fail(f"{msg}\n{self.logs()}", pytrace=False)

    def wait_for(self, cond: Callable[[], Any], timeout: float, what: str) -> Any:
        """``helpers.wait_for``, failing the test with every log on timeout."""
        try:
            return wait_for(cond, timeout, what)
        except TimeoutError as e:
            self.fail(str(e))

    def check(self, ok: Any, msg: str) -> None:
        """An assertion that fails with every log."""
        if not ok:
            self.fail(f"assertion failed: {msg}")

    # ---------------------------------------------------------------- saver logs
    def _copy_saver_logs(self, node: Node, *, final: bool = False) -> None:
        """Copies node's saver logs out of its private /dev/shm, via /proc/<pid>/root of one of its processes;
        ``final`` (the test's thread, never the copier's): where none is left, through the namespace the
        harness holds (its tmpfs lives on until released), so that what a saver logged just before the node
        ended is kept too."""
        if node.ns is None or node.ns not in node.held:
            return
        pids = []
        if node.proc is not None and node.proc.poll() is None:
            pids.append(node.proc.pid)
        for pid in pids or pids_in_ns(node.ns)[:3]:
            if mnt_ns(pid) != node.ns:
                continue
            root = f"/proc/{pid}/root{NODE_RUNTIME_DIR}"
            texts = {}
            for path in glob.glob(f"{root}/*/saver.log"):
                try:
                    with open(path, "rb") as f:
                        texts[os.path.basename(os.path.dirname(path))] = f.read().decode(errors="replace")
                except OSError:
                    continue
            if texts or os.path.isdir(root):
                self._keep_saver_logs(node, texts)
                return
        if final:
            self._keep_saver_logs(node, self._saver_logs_in_held_ns(node))

    def _saver_logs_in_held_ns(self, node: Node) -> dict[str, str]:
        """Job dir name -> saver log, read in node's namespace (held, with no process left) by ``nsenter``."""
        fd = node.held[node.ns or ""]
        script = (f'for f in {NODE_RUNTIME_DIR}/*/saver.log; do '
                  '[ -f "$f" ] && printf "%s\\0" "$f" && cat "$f" && printf "\\0"; done')
        try:
            r = subprocess.run(["nsenter", f"--mount=/proc/{os.getpid()}/fd/{fd}", "sh", "-c", script],
                               capture_output=True, timeout=KILL_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return {}
        parts = r.stdout.split(b"\0")
        return {os.path.basename(os.path.dirname(parts[i].decode(errors="replace"))):
                parts[i + 1].decode(errors="replace") for i in range(0, len(parts) - 1, 2)}

    def _keep_saver_logs(self, node: Node, texts: dict[str, str]) -> None:
        for job, text in texts.items():
            key = (node.index, node.gen, job)
            with self._lock:
                # A log that does not continue the one copied before is a new saver's (the job dir was made
                # again): kept beside the old one, under the next free key.
                while key in self.saver_logs and not text.startswith(self.saver_logs[key][:200]):
                    key = (key[0], key[1], key[2] + "+")
                if len(text) >= len(self.saver_logs.get(key, "")):
                    self.saver_logs[key] = text

    def _mirror_saver_logs(self) -> None:
        while not self._stop.wait(0.5):
            for n in list(self.nodes):
                with contextlib.suppress(Exception):  # a node going away mid-read
                    self._copy_saver_logs(n)

    # ---------------------------------------------------------------- teardown
    @staticmethod
    def _release(node: Node) -> None:
        """Forgets node's namespaces (found empty): closing the last fd frees them, and their tmpfs."""
        for ns in list(node.held):
            os.close(node.held.pop(ns))

    def _reap(self, node: Node) -> None:
        if node.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=KILL_TIMEOUT_S)

    def kill_all(self) -> list[str]:
        """Kills every node whole (node 0 too), waits for their processes to go, and returns what is left:
        a launcher not reaped, or any process still found in any node's namespace (a scan of /proc)."""
        problems = []
        for n in self.nodes:
            with contextlib.suppress(Exception):
                self._copy_saver_logs(n)
        for n in reversed(self.nodes):
            for ns in list(n.held):
                try:
                    kill_namespace(ns)
                except TimeoutError as e:
                    problems.append(str(e))
            self._reap(n)
            if n.proc is not None and n.proc.poll() is None:
                problems.append(f"node {n.index}'s launcher (pid {n.proc.pid}) did not exit")
        for n in self.nodes:  # the pgrep-style check, while the namespaces are still held
            for ns in list(n.held):
                left = pids_in_ns(ns)
                if left:
                    problems.append(f"node {n.index}: processes left in {ns}: {[(p, cmdline(p)) for p in left]}")
        if not problems:
            for n in self.nodes:
                self._release(n)
        return problems

    def shutdown(self) -> list[str]:
        """Stops the saver-log copier and kills every node (``kill_all``); returns what could not be cleaned."""
        for n in self.nodes:
            with contextlib.suppress(Exception):
                self._copy_saver_logs(n)
        self._stop.set()
        problems = []
        if self._mirror is not None:
            self._mirror.join(timeout=30)
            if self._mirror.is_alive():
                problems.append("the saver-log copier thread did not end")
        problems += self.kill_all()
        if self.store is not None:
            self.store.kill()
            self.store.wait(timeout=KILL_TIMEOUT_S)
        return problems


@pytest.fixture
def cluster(tmp_path: Any) -> Iterator[Cluster]:
    """A ``Cluster`` of simulated nodes (skips where they cannot run); every node killed on teardown."""
    why = namespace_support()
    if why:
        pytest.skip(why)
    c = Cluster(str(tmp_path))
    try:
        yield c
    finally:
        text = c.logs() if c.nodes and not c.logs_shown else ""
        problems = c.shutdown()
        if text:
            print(text)  # pytest shows it with a failure's report (captured output of the teardown)
        if problems:
            pytest.fail("cluster teardown: " + "; ".join(problems))


# ------------------------------------------------------------------------------------------ reference runs
_REFERENCES: dict[tuple[str, ...], str] = {}


def reference_digest(tmp_path: Any, script: str, world_size: int, script_args: list[str],
                     timeout: float = 240.0) -> str:
    """Rank 0's final weights digest of an uninterrupted run of ``script`` on ``world_size`` ranks (one
    launcher with every rank, this namespace, a checkpoint dir of its own): the same ranks and data as a
    multi-node run, so the same bits. Cached per arguments for the session."""
    key = (script, str(world_size), *script_args)
    if key in _REFERENCES:
        return _REFERENCES[key]
    d = os.path.join(str(tmp_path), f"reference-{len(_REFERENCES)}-{uuid.uuid4().hex[:6]}")
    os.makedirs(d)
    metrics = os.path.join(d, "metrics.jsonl")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "PYTEST_"))}
    os.makedirs(os.path.join(d, "tmp"))  # torchrun leaves a log dir in TMPDIR: keep it under tmp_path
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "FLASHCKPT_WARM_WORKERS": "0",
                "TMPDIR": os.path.join(d, "tmp"),
                "FLASHCKPT_JOB_ID": f"ref-{uuid.uuid4().hex[:8]}",
                "PYTHONPATH": os.pathsep.join([REPO, env.get("PYTHONPATH", "")])})
    argv = [sys.executable, "-m", "flashckpt.launch.launcher", "--standalone", "--nproc_per_node", str(world_size),
            script, "--checkpoint_dir", os.path.join(d, "ckpt"), "--metrics", metrics,
            *_without_step_sleep(script_args)]
    with open(os.path.join(d, "log"), "wb") as log:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=d)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = -9
    ends = [e for e in events(metrics) if e.get("event") == "end" and e.get("rank") == 0]
    if rc != 0 or not ends:
        pytest.fail(f"the reference run failed (rc {rc}):\n{_tail(os.path.join(d, 'log'))}", pytrace=False)
    _REFERENCES[key] = ends[-1]["digest"]
    return _REFERENCES[key]


def _without_step_sleep(argv: list[str]) -> list[str]:
    """``argv`` less ``--step_sleep S`` (a reference run need not wait between steps)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--step_sleep":
            skip = True
        elif not a.startswith("--step_sleep="):
            out.append(a)
    return out


# ------------------------------------------------------------------------------------------ reading the run
def first_step_after(c: Cluster, t: float) -> float:
    """When the last rank finished its first step after ``t`` (wall clock)."""
    per_rank: dict[int, float] = {}
    for e in c.all_events("first_step", after=t):
        per_rank.setdefault(e["rank"], e["t"])
    c.check(per_rank, "a first step after the restart")
    return max(per_rank.values())


LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \d+ flashckpt\.saver ")


def _log_time(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def memory_step(c: Cluster, lost: list[int], before: float, *, replicated: bool) -> int:
    """The step the job must resume at from memory after the nodes ``lost`` are gone, from what the
    survivors hold before ``before`` (the first resume): replicated state, the newest step a surviving rank
    saved; sharded state, the newest step every surviving rank saved and of which a surviving node received
    every lost rank's backup (its saver's ``event=backup_received ... ok=True``). A kill may fall between a
    snapshot and its backup: then the job rightly resumes from the step before."""
    saved: dict[int, set[int]] = {}
    for i in range(len(c.nodes)):
        if i not in lost:
            for e in c.events(i, "save"):
                if e["t"] < before:
                    saved.setdefault(e["rank"], set()).add(int(e["step"]))
    c.check(saved, f"the surviving ranks saved snapshots before the loss: {saved}")
    if replicated:
        return max(s for steps in saved.values() for s in steps)
    lost_ranks = {e["rank"] for i in lost for e in c.events(i, "save") if e["t"] < before}
    got: dict[int, set[int]] = {}
    with c._lock:
        logs = [text for (node, _gen, _job), text in c.saver_logs.items() if node not in lost]
    for ln in "\n".join(logs).splitlines():
        m = LOG_TIME.match(ln)
        b = re.search(r"event=backup_received rank=(\d+) step=(\d+) .*ok=True", ln)
        if m and b and _log_time(m.group(1)) < before:
            got.setdefault(int(b.group(1)), set()).add(int(b.group(2)))
    steps = set.intersection(*saved.values(), *(got.get(r, set()) for r in lost_ranks))
    c.check(steps, f"a step every rank has in surviving memory: saved {saved}, backups received {got}")
    return max(steps)
