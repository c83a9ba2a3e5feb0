"""Warm workers (``flashckpt.launch.warm``): ``flashckpt-run`` restarts a failed group by handing each rank's
worker to a process that already has torch and the script's libraries imported. The worker must not be
able to tell, except for that: the same arguments, environment (but for the attempt's rendezvous
variables), ``sys.path``, ``__main__``, command line, stdin, and torchrun's per-attempt log files. Real
launcher, real processes (``tests/support/_warm_probe.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
from _fault_helpers import (  # noqa: F401
    TESTS_DIR,
    VENV_BIN,
    FaultEnv,
    alive,
    fault_env_fixture,
    read_events,
    wait_for,
)
from flashckpt.launch.warm import ATTEMPT_KEYS, WarmPool, _Warm, make_modules_dir, script_imports, split_command

pytestmark = pytest.mark.multiproc

FLASHCKPT_RUN = os.path.join(VENV_BIN, "flashckpt-run")
PROBE = os.path.join(TESTS_DIR, "_warm_probe.py")


def _run_probe(fe: FaultEnv, *launcher_args: str, hold: bool = False) -> tuple[subprocess.Popen[bytes], str, str]:
    out = os.path.join(fe.tmp, "probe")
    os.makedirs(out, exist_ok=True)
    events = os.path.join(fe.tmp, "events.jsonl")
    argv = [FLASHCKPT_RUN, "--nproc_per_node", "2", "--standalone", "--max_restarts", "1", *launcher_args,
            PROBE, out, *(["hold"] if hold else [])]
    proc = fe.popen(argv, "launcher.log", env=fe.env(FLASHCKPT_LAUNCH_EVENTS=events, FLASHCKPT_WARM_DELAY_S="0"))
    return proc, out, events


def _info(out: str, attempt: int, rank: int) -> dict:
    with open(os.path.join(out, f"attempt{attempt}_rank{rank}.json")) as f:
        return json.load(f)


def _warm_pids(events: str) -> list[int]:
    return [e["pid"] for e in read_events(events) if e["event"] == "warm_worker_ready"]


def test_a_restarted_worker_starts_warm_and_sees_what_a_new_process_sees(fault_env: FaultEnv) -> None:
    logs = os.path.join(fault_env.tmp, "logs")
    proc, out, events = _run_probe(fault_env, "--redirects", "3", "--log-dir", logs)
    assert proc.wait(timeout=240) == 0, fault_env.log("launcher.log")
    used = [e for e in read_events(events) if e["event"] == "warm_worker_used"]
    assert sorted(e["local_rank"] for e in used) == [0, 1], fault_env.log("launcher.log")
    for rank in (0, 1):
        cold, warm = _info(out, 0, rank), _info(out, 1, rank)
        assert (cold["preloaded"], warm["preloaded"]) == (False, True)
        assert warm["pid"] in [e["pid"] for e in used]
        for key in ("argv", "path0", "file", "main_file", "cwd", "cmdline", "flags", "env", "stdin_is_devnull",
                    "nice"):
            assert warm[key] == cold[key], key
        # the user's module beside the script was imported by the script, not ahead of it
        assert warm["helper_saw_main"] == warm["main_file"] == PROBE
        assert warm["attempt_env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
        # torchrun's per-attempt, per-rank log files got the warm worker's output
        run_dir = next(os.path.join(logs, d) for d in os.listdir(logs))
        for stream in ("stdout", "stderr"):
            with open(os.path.join(run_dir, "attempt_1", str(rank), f"{stream}.log")) as f:
                assert f"probe {stream} attempt 1 rank {rank}" in f.read()
    # the warm workers made after the restart ended with the launcher: no process of the job is left
    assert _processes_of(fault_env.job_id) == []


def _processes_of(job_id: str) -> list[int]:
    """Live processes with FLASHCKPT_JOB_ID=job_id in their environment (workers, warm workers)."""
    out = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                found = f"FLASHCKPT_JOB_ID={job_id}".encode() in f.read().split(b"\0")
        except OSError:
            continue
        if found and alive(int(name)):
            out.append(int(name))
    return out


def test_no_warm_workers_starts_new_processes(fault_env: FaultEnv) -> None:
    proc, out, events = _run_probe(fault_env, "--no-warm-workers")
    # attempt 0 waits for warm workers that never come: it gives up after its own bound, so kill it sooner
    wait_for(lambda: all(os.path.exists(os.path.join(out, f"attempt0_rank{r}.json")) for r in (0, 1)), 120,
             "attempt 0")
    for rank in (0, 1):  # (the agent may have ended the second already)
        with contextlib.suppress(ProcessLookupError):
            os.kill(_info(out, 0, rank)["pid"], signal.SIGKILL)
    assert proc.wait(timeout=240) == 0, fault_env.log("launcher.log")
    assert not [e for e in read_events(events) if e["event"].startswith("warm_worker")]
    assert _info(out, 1, 0)["preloaded"] is False


def test_warm_workers_exit_when_the_launcher_is_killed(fault_env: FaultEnv) -> None:
    proc, out, events = _run_probe(fault_env, hold=True)
    wait_for(lambda: len(_warm_pids(events)) == 2, 120, "2 warm workers ready")
    warm = _warm_pids(events)
    os.kill(proc.pid, signal.SIGKILL)
    for rank in (0, 1):  # (they die with the launcher: test_starts_and_leftovers; ended here all the same)
        with contextlib.suppress(ProcessLookupError):
            os.kill(_info(out, 0, rank)["pid"], signal.SIGKILL)
    wait_for(lambda: not [p for p in warm if alive(p)], 30, "the warm workers to exit")
    assert _processes_of(fault_env.job_id) == []


def test_a_new_launcher_removes_the_module_records_of_agents_that_are_gone(monkeypatch, tmp_path) -> None:
    """A SIGKILLed launcher cannot remove its directory of module records; the next one removes those of
    agents no longer running (and keeps a running one's)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"flashckpt-warm-{gone.pid}-x1"
    live = tmp_path / f"flashckpt-warm-{os.getpid()}-x2"
    other = tmp_path / "flashckpt-warm-notapid-x3"
    for d in (dead, live, other):
        d.mkdir()
        (d / "local_rank_0.json").write_text("[]")
    made = make_modules_dir()
    try:
        assert not dead.exists() and live.exists() and other.exists()
        assert os.path.basename(made).startswith(f"flashckpt-warm-{os.getpid()}-")
        assert os.stat(made).st_mode & 0o777 == 0o700
    finally:
        os.rmdir(made)


# ------------------------------------------------------------------------------ what may be handed over
PY = sys.executable


@pytest.mark.parametrize(("args", "want"), [
    ((PY, "-u", "train.py", "--lr", "1"), (PY, ("-u",), ["train.py", "--lr", "1"])),
    ((PY, "-u", "-X", "dev", "-m", "pkg.train", "-x"), (PY, ("-u", "-X", "dev"), ["-m", "pkg.train", "-x"])),
    ((PY, "-c", "print(1)"), None),
    ((PY, "-I", "train.py"), None),
    ((PY, "-uB", "train.py"), None),
    (("numactl", "--cpunodebind=0", PY, "train.py"), None),
    (("./train.sh", "a"), None),
    ((PY, "-u"), None),
])
def test_which_worker_commands_can_start_warm(args: tuple, want: tuple | None) -> None:
    assert split_command(args) == want


def test_only_the_attempts_rendezvous_variables_may_differ() -> None:
    base = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "OMP_NUM_THREADS": "1", "MASTER_PORT": "1234",
            "TORCHELASTIC_RESTART_COUNT": "0"}
    warm = _Warm.__new__(_Warm)
    warm.interp, warm.opts, warm.env = PY, ("-u",), base
    attempt = {k: v + "9" for k, v in base.items() if k in ATTEMPT_KEYS}
    assert warm.fits(PY, ("-u",), {**base, **attempt, "TORCHELASTIC_ERROR_FILE": "/x"})
    assert not warm.fits(PY, (), base)
    for key in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS"):  # another rank, or read at import time
        assert not warm.fits(PY, ("-u",), {**base, key: "7"})
    assert not warm.fits(PY, ("-u",), {**base, "NEW": "1"})
    assert not warm.fits(PY, ("-u",), {k: v for k, v in base.items() if k != "OMP_NUM_THREADS"})


def test_script_imports_finds_the_top_level_absolute_imports(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import os, torch.nn as nn\nfrom transformers import AutoModel\nfrom . import rel\n"
                      "try:\n    import deepspeed\nexcept ImportError:\n    pass\n"
                      "def main():\n    import lazy_one\n")
    assert script_imports([str(script)]) == ["os", "torch.nn", "transformers", "deepspeed"]
    assert script_imports([str(tmp_path / "missing.py")]) == []


def test_a_pool_hands_out_nothing_it_was_not_asked_for() -> None:
    pool = WarmPool(delay_s=3600)
    assert pool.take(0, (PY, "-u", "x.py"), {}, None, None) is None
    pool.prepare(0, (PY, "-u", "x.py"), {})  # scheduled an hour ahead: close() cancels it
    assert pool.take(0, (PY, "-u", "x.py"), {}, None, None) is None
    pool.close()
