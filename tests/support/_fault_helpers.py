"""Helpers of the fault-injection, launcher, CLI and security tests.

- ``fault_env``: a fixture giving each test its own runtime dir (conftest's isolated one when the suite
  has it, else a fresh dir on /dev/shm), its own scratch dir (FLASHCKPT_SCRATCH_DIR: the adapters' staging
  dirs, which ``flashckpt gc`` sweeps), a unique job id and a short saver grace, in ``os.environ`` (for
  engines made in the test process) and in ``env()`` (for subprocesses). On teardown it kills the
  processes the test started, waits (bounded) for every saver daemon of the runtime dir to exit and
  fails the test when one is left or when anything is left under the runtime dir. Test modules import
  it as ``fault_env_fixture`` (its fixture name is ``fault_env``).
- A deterministic, large-ish state (``make_state``/``fill_state``) and a bit-exact comparison.
- Process helpers: find saver daemons via /proc, SIGSTOP/SIGKILL a process and wait for the kernel to
  report it, bounded polls (``wait_for``) for every condition: no test sleeps to synchronize.
- ``_fault_trainer.py`` (beside this file) is the training process that the kill -9 tests kill.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(TESTS_DIR))
VENV_BIN = os.path.dirname(sys.executable)
TRAINER = os.path.join(TESTS_DIR, "_fault_trainer.py")
DDP_TRAIN = os.path.join(REPO, "examples", "ddp_train.py")

GRACE_S = 5.0


# ------------------------------------------------------------------------------------------ processes
from helpers import _proc_state as proc_state  # noqa: E402  (shared with the core tests)
from helpers import saver_pids as all_saver_pids  # noqa: E402
from helpers import wait_for  # noqa: E402


def alive(pid: int) -> bool:
    """Running (a zombie, waiting for init to reap it, counts as dead)."""
    return proc_state(pid) not in (None, "Z", "X")


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def saver_pids(runtime_dir: str, job_dir: str | None = None) -> list[int]:
    """Live saver daemons whose ``--job-dir`` is under ``runtime_dir`` (or is exactly ``job_dir``)."""
    found = all_saver_pids(runtime_dir)
    return sorted(pid for pid, argv in found.items() if "--job-dir" in argv and
                  (job_dir is None or argv[argv.index("--job-dir") + 1] == job_dir))


def saver_pid(runtime_dir: str, job_dir: str) -> int:
    """The pid of the one saver daemon serving ``job_dir`` (polls until it is up)."""
    pids = wait_for(lambda: saver_pids(runtime_dir, job_dir), 30, f"a saver for {job_dir}")
    assert len(pids) == 1, f"several savers serve one job dir: {pids}"
    return pids[0]


def kill9(pid: int, timeout: float = 30) -> None:
    """SIGKILLs ``pid`` and waits until the kernel reports it dead."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), timeout, f"pid {pid} to die after SIGKILL")


def stop(pid: int, timeout: float = 10) -> None:
    """SIGSTOPs ``pid`` and waits until it is stopped (state T)."""
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: proc_state(pid) in ("T", "t", None, "Z"), timeout, f"pid {pid} to stop")


def close_and_wait(engine: Any, timeout: float = 60) -> None:
    """Closes ``engine`` with a final goodbye and waits for its saver to exit (it does at once, after its
    persists, when every client of the job said a final goodbye)."""
    engine.close()
    wait_for(lambda: not saver_pids(engine.knobs.runtime_dir, engine.job_dir), timeout,
             "the saver to exit after the final goodbye")


def terminate_savers(runtime_dir: str, timeout: float = 60) -> None:
    """SIGTERMs every saver daemon of ``runtime_dir`` (their last words run) and waits for them to exit."""
    for pid in saver_pids(runtime_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not saver_pids(runtime_dir), timeout, f"the savers of {runtime_dir} to exit on SIGTERM")


from helpers import leftovers  # noqa: E402,F401  (re-exported for the fault tests)


def files_named(root: str, suffix: str) -> list[str]:
    return sorted(os.path.join(r, n) for r, _d, fs in os.walk(root) for n in fs if n.endswith(suffix))


# ------------------------------------------------------------------------------------------ the fixture
@dataclass
class FaultEnv:
    """One test's flashckpt environment (see the module docstring)."""

    runtime_dir: str
    job_id: str
    tmp: str
    base_env: dict[str, str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for a subprocess of this test (``extra`` overrides)."""
        env = dict(os.environ)
        env.update(self.base_env)
        env.update(extra)
        env["PYTHONPATH"] = os.pathsep.join([REPO, TESTS_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env["PATH"] = os.pathsep.join([VENV_BIN, env.get("PATH", "")])
        return env

    def job_dir(self, checkpoint_dir: str, job_id: str | None = None) -> str:
        """The runtime dir of the saver of ``checkpoint_dir`` for ``job_id`` (default: this test's)."""
        digest = hashlib.sha256(os.path.realpath(checkpoint_dir).encode()).hexdigest()[:10]
        return os.path.join(self.runtime_dir, f"{job_id or self.job_id}-{digest}")

    def popen(self, argv: list[str], log_name: str, env: dict[str, str] | None = None,
              **kw: Any) -> subprocess.Popen[bytes]:
        """Starts a subprocess (output to ``tmp/log_name``) that teardown kills if it is still running."""
        with open(os.path.join(self.tmp, log_name), "ab") as log:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 env=env or self.env(), cwd=self.tmp, **kw)
        self.procs.append(p)
        return p

    def log(self, log_name: str) -> str:
        try:
            with open(os.path.join(self.tmp, log_name), "rb") as f:
                return f.read()[-8000:].decode(errors="replace")
        except OSError:
            return "<no output>"

    def saver_logs(self) -> str:
        out = []
        for p in files_named(self.runtime_dir, "saver.log"):
            with open(p, "rb") as f:
                out.append(f"---- {p}\n" + f.read()[-4000:].decode(errors="replace"))
        return "\n".join(out)

    def trainer(self, ckpt: str, *args: str, log_name: str = "trainer.log", **env: str) -> subprocess.Popen[bytes]:
        """Starts ``_fault_trainer.py --ckpt ckpt *args``."""
        return self.popen([sys.executable, TRAINER, "--ckpt", ckpt, *args], log_name, env=self.env(**env))


@pytest.fixture(name="fault_env")
def fault_env_fixture(request: pytest.FixtureRequest, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultEnv]:
    """A private runtime dir, a unique job id and a short grace; leak checks on teardown.

    The runtime dir is the suite's isolated one (conftest's ``runtime_dir``) when there is one, else a
    fresh dir on /dev/shm."""
    own_root = None
    try:
        runtime_dir = str(request.getfixturevalue("runtime_dir"))
    except pytest.FixtureLookupError:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
        own_root = os.path.join(base, f"flashckpt-ftest-{uuid.uuid4().hex[:10]}")
        runtime_dir = os.path.join(own_root, "rt")
    job_id = f"ft-{uuid.uuid4().hex[:10]}"
    scratch_dir = os.path.join(str(tmp_path), "scratch")
    os.makedirs(scratch_dir, exist_ok=True)
    base_env = {
        "FLASHCKPT_RUNTIME_DIR": runtime_dir,
        "FLASHCKPT_SCRATCH_DIR": scratch_dir,
        "FLASHCKPT_JOB_ID": job_id,
        "FLASHCKPT_SAVER_GRACE_S": str(GRACE_S),
        "FLASHCKPT_RPC_TIMEOUT_S": "60",
        "FLASHCKPT_SPAWN_TIMEOUT_S": "60",
        "FLASHCKPT_COMMIT_TIMEOUT_S": "60",
        "FLASHCKPT_TERM_TIMEOUT_S": "60",
        "FLASHCKPT_COPY_THREADS": "2",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    for k, v in base_env.items():
        monkeypatch.setenv(k, v)
    for k in ("TORCHELASTIC_RUN_ID", "FLASHCKPT_SHM_LIMIT_BYTES", "FLASHCKPT_SLOTS", "RANK", "WORLD_SIZE",
              "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    fe = FaultEnv(runtime_dir, job_id, str(tmp_path), base_env)
    try:
        yield fe
    finally:
        for p in fe.procs:  # only the processes this test started, by pid
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        problems = []
        try:
            wait_for(lambda: not saver_pids(runtime_dir), GRACE_S + 30, "saver daemons to exit after their grace")
        except TimeoutError as e:
            problems.append(f"{e}; left running: {saver_pids(runtime_dir)}\n{fe.saver_logs()}")
            for pid in saver_pids(runtime_dir):
                kill9(pid)
        left = leftovers(runtime_dir)
        if left:
            problems.append(f"runtime state left behind: {left}")
            for path in left:  # leave a clean runtime dir to the suite's own check
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                elif os.path.lexists(path):
                    os.unlink(path)
        if own_root:
            shutil.rmtree(own_root, ignore_errors=True)
        if problems:
            pytest.fail("\n".join(problems))


# ------------------------------------------------------------------------------------------ states
def fill_state(sd: dict[str, Any], step: int) -> dict[str, Any]:
    """Overwrites ``sd`` (made by ``make_state``) in place with the content of ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    sd["model"]["big"].fill_(step)
    sd["model"]["small"].copy_(torch.randn(sd["model"]["small"].shape, generator=g))
    sd["model"]["half"].copy_(torch.randn(sd["model"]["half"].shape, generator=g).to(torch.bfloat16))
    sd["optimizer"]["state"]["count"].fill_(step * 3)
    sd["step"] = step
    sd["note"] = f"state of step {step}"
    return sd


def make_state(step: int, mb: float) -> dict[str, Any]:
    """A deterministic state dict of about ``mb`` MiB: every tensor's content depends on ``step``."""
    n = max(1, int(mb * (1 << 20)) // 4)
    sd = {"model": {"big": torch.empty(n, dtype=torch.int32), "small": torch.empty(64, 64),
                    "half": torch.empty(4096, dtype=torch.bfloat16)},
          "optimizer": {"state": {"count": torch.empty(7, dtype=torch.int64)}, "lr": 0.5},
          "step": 0, "note": ""}
    return fill_state(sd, step)


def assert_bit_equal(got: Any, want: Any, where: str = "state") -> None:
    """``got`` equals ``want`` bit for bit: same tree, same dtypes and shapes, same bytes."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__} instead of a tensor"
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), \
            f"{where}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
        a = got.detach().contiguous().view(-1).view(torch.uint8)
        b = want.detach().contiguous().view(-1).view(torch.uint8)
        assert torch.equal(a, b), f"{where}: tensor bytes differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_bit_equal(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_bit_equal(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def assert_state_of(sd: Any, step: int, mb: float) -> None:
    """``sd`` is exactly ``make_state(step, mb)`` (checks the cheap step tag first for a clear message)."""
    assert isinstance(sd, dict) and sd.get("step") == step, \
        f"expected the state of step {step}, got step {sd.get('step') if isinstance(sd, dict) else sd!r}"
    assert_bit_equal(sd, make_state(step, mb))


# ------------------------------------------------------------------------------------------ storage
def read_events(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _layout(ckpt: str) -> Any:
    from flashckpt.commit.layout import CommitLayout
    from flashckpt.storage.posix import PosixDiskStorage

    return CommitLayout(ckpt, PosixDiskStorage())


def tracker_step(ckpt: str) -> int | None:
    try:
        with open(_layout(ckpt).tracker_path) as f:
            return int(json.load(f)["step"])
    except FileNotFoundError:
        return None


def step_meta_dir(ckpt: str, step: int) -> str:
    return _layout(ckpt).step_dir(step)


def committed(ckpt: str, step: int) -> bool:
    return os.path.exists(os.path.join(step_meta_dir(ckpt, step), "manifest.json"))


def run_cli(fe: FaultEnv, *args: str, console: bool = False, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Runs ``flashckpt *args`` with this test's environment: in this process (``cli.main``, fast), or
    with ``console=True`` as the installed console script in a subprocess."""
    if console:
        return subprocess.run([os.path.join(VENV_BIN, "flashckpt"), *args], env=fe.env(), capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    from flashckpt import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(list(args))
        except SystemExit as e:  # argparse errors
            rc = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["flashckpt", *args], rc, out.getvalue(), err.getvalue())


def run_restarting(fe: FaultEnv, script: str, *args: str, **env: str) -> tuple[list[dict[str, Any]], str]:
    """Runs ``flashckpt-run`` (1 worker, 1 restart) of ``script *args`` with this test's environment (a 30 s
    saver grace; ``env`` overrides), which must succeed: the ``RESULT {json}`` lines its attempts printed, and
    the whole output (for the auto-resume tests, whose scripts kill their first attempt)."""
    argv = [os.path.join(VENV_BIN, "flashckpt-run"), "--nproc_per_node", "1", "--standalone", "--max_restarts", "1",
            script, *args]
    p = subprocess.run(argv, env=fe.env(FLASHCKPT_SAVER_GRACE_S="30", **env), cwd=fe.tmp, stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240)
    text = p.stdout.decode(errors="replace")
    assert p.returncode == 0, text[-6000:]
    return [json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines() if "RESULT " in line], text


# ------------------------------------------------------------------------------------------ tmpfs
@contextlib.contextmanager
def small_tmpfs(path: str, size: str) -> Iterator[str]:
    """Mounts a tmpfs of ``size`` at ``path`` (skips the test when that is not possible); always unmounts."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", path],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", path], check=False, capture_output=True)
        if os.path.ismount(path):
            subprocess.run(["umount", "-l", path], check=False, capture_output=True)
        assert not os.path.ismount(path), f"could not unmount the test tmpfs {path}"
