"""Starts and leftovers (issue #30, items 14-16), with real processes:

- a stalled object store while the saver starts never holds up the engine's start; what needs the store
  later waits for it, bounded, or says why not;
- the staging directories of a trainer killed mid-snapshot (``SnapshotDir``: the HF Trainer's
  ``flashckpt-hf-*``) are removed by the next start and by ``flashckpt gc``, never those of a live process;
- ``flashckpt-run`` (torchrun's arguments: ``--master_port`` and the static rendezvous) brings every restart
  round up, and its workers never outlive it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from typing import Any

import pytest
from _fault_helpers import (  # noqa: F401
    VENV_BIN,
    FaultEnv,
    assert_state_of,
    close_and_wait,
    fault_env_fixture,
    make_state,
    read_events,
    wait_for,
)
from s3_fixtures import moto_server_fixture, s3_proxied_fixture  # noqa: F401
from s3_proxy import Fault
from test_warm_workers import _processes_of

FLASHCKPT_RUN = os.path.join(VENV_BIN, "flashckpt-run")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------------------ a stalled store
MB = 1.0


def test_a_store_stalled_at_the_savers_start_holds_up_neither_start_nor_memory_snapshots(
        s3_proxied: Any, fault_env: FaultEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request on the checkpoint dir's commit records goes unanswered while the saver starts (a store
    that stalls). The engine starts all the same (it used to fail after the spawn timeout: "the saver did
    not come up"), memory snapshots go on, and what needs the records (a load, a storage save) waits for
    them, bounded, then says why, writing nothing. Once the store answers, everything works."""
    from flashckpt import CheckpointEngine, CheckpointTimeoutError, StorageType

    monkeypatch.setenv("FLASHCKPT_SPAWN_TIMEOUT_S", "15")
    monkeypatch.setenv("FLASHCKPT_RECORDS_TIMEOUT_S", "2")
    proxy = s3_proxied.proxy
    proxy.set_faults([Fault("stall", key=".flashckpt/jobs/", times=None)])
    engine = CheckpointEngine(s3_proxied.url, max_to_keep=1)
    try:
        wait_for(lambda: proxy.stalled() >= 1, 30, "the saver's first request on the records to stall")
        engine.save(1, make_state(1, MB), storage_type=StorageType.MEMORY)
        assert engine.memory_steps() == [1]
        with pytest.raises(CheckpointTimeoutError, match=r"not ready.*has not answered within 2 s.*"
                                                         r"FLASHCKPT_RECORDS_TIMEOUT_S"):
            engine.load()
        with pytest.raises(CheckpointTimeoutError, match="the commit records in s3://.* are not ready"):
            engine.save(2, make_state(2, MB), storage_type=StorageType.DISK)
        assert not [k for k in s3_proxied.keys("run/") if "step_2" in k]  # nothing was written
        assert engine.memory_steps() == [1]
        proxy.set_faults([])
        proxy.release()
        assert_state_of(engine.load(), 1, MB)
        assert engine.last_load is not None and engine.last_load.source == "memory"
        engine.save(2, make_state(2, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=120)
        assert engine.committed_steps() == [2]
    finally:
        proxy.set_faults([])
        proxy.release()
        close_and_wait(engine)


def test_a_request_unanswered_past_the_read_timeout_at_start_is_retried_behind_the_start(
        s3_proxied: Any, fault_env: FaultEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case: one request of the saver's start gets no answer for longer than the read timeout,
    which is longer than the spawn timeout. The engine starts at once; the saver retries the request in the
    background, and a storage save made meanwhile waits for it and commits."""
    from flashckpt import CheckpointEngine, StorageType

    monkeypatch.setenv("FLASHCKPT_S3_READ_TIMEOUT_S", "20")
    monkeypatch.setenv("FLASHCKPT_SPAWN_TIMEOUT_S", "10")
    monkeypatch.setenv("FLASHCKPT_RECORDS_TIMEOUT_S", "120")
    proxy = s3_proxied.proxy
    proxy.set_faults([Fault("stall", key=".flashckpt/jobs/", times=1)])  # never answered (until closed)
    engine = CheckpointEngine(s3_proxied.url, max_to_keep=1)
    try:
        engine.save(1, make_state(1, MB), storage_type=StorageType.DISK)
        engine.wait(timeout=120)
        assert engine.committed_steps() == [1]
        assert proxy.stalled() == 1  # that request never got an answer: its retry did
    finally:
        proxy.release()
        close_and_wait(engine)


# ------------------------------------------------------------------------------------------ flashckpt-run
# Each round: init_process_group (gloo), an all-reduce, a record of it. "loop": in each round but the last,
# one rank (alternating) dies with SIGKILL and the other waits to be stopped. "hold": in each round but the
# last, rank 0 dies once the test says so (file go<round>); the last round holds until killed.
_ROUNDS = """
import json, os, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from flashckpt.util.module_record import record_modules

out, rounds, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
n = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
r = dist.get_rank()
t = torch.ones(1)
dist.all_reduce(t)
record_modules()  # the warm workers of the next round import what this one did
with open(os.path.join(out, f"round{n}_rank{r}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "sum": t.item(), "master_port": os.environ["MASTER_PORT"]}, f)
if n < rounds:
    if mode == "loop" and r == n % 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hold" and r == 0:
        while not os.path.exists(os.path.join(out, f"go{n}")):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)  # the agent stops this rank once it sees the other fail
elif mode == "hold":
    time.sleep(600)
dist.destroy_process_group()
"""


def _launch_rounds(fe: FaultEnv, mode: str, rounds: int, port: int, **env: str) -> tuple[subprocess.Popen[bytes], str]:
    script = os.path.join(fe.tmp, "rounds.py")
    with open(script, "w") as f:
        f.write(_ROUNDS)
    out = os.path.join(fe.tmp, "rounds")
    os.makedirs(out, exist_ok=True)
    argv = [FLASHCKPT_RUN, "--nproc_per_node", "2", "--master_port", str(port), "--max_restarts", str(rounds),
            script, out, str(rounds), mode]
    return fe.popen(argv, "launcher.log", env=fe.env(**env)), out


def _round(out: str, n: int, rank: int) -> dict | None:
    try:
        with open(os.path.join(out, f"round{n}_rank{rank}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def test_every_restart_round_of_a_static_rendezvous_comes_up(fault_env: FaultEnv) -> None:
    """10 rounds of kill and restart in one launch with torchrun's arguments (``--master_port``, the static
    rendezvous, whose store torch hands every round): each restart round's gloo group connects (it used to
    read the dead round's peer addresses from that store: "Gloo connectFullMesh failed ... Connection
    refused", or a hang). The first round keeps torchrun's MASTER_PORT; restarts may start warm."""
    rounds, port = 10, _free_port()
    events = os.path.join(fault_env.tmp, "events.jsonl")
    proc, out = _launch_rounds(fault_env, "loop", rounds, port, FLASHCKPT_WARM_DELAY_S="0",
                               FLASHCKPT_LAUNCH_EVENTS=events)
    try:
        rc = proc.wait(timeout=400)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"flashckpt-run hung\n{fault_env.log('launcher.log')}") from None
    log = fault_env.log("launcher.log")
    came_up = [n for n in range(rounds + 1) if all(_round(out, n, r) for r in (0, 1))]
    assert came_up == list(range(rounds + 1)) and rc == 0, (came_up, log)
    assert all(_round(out, n, r)["sum"] == 2 for n in came_up for r in (0, 1))
    assert _round(out, 0, 0)["master_port"] == str(port)  # the first round is torchrun's
    assert "connectFullMesh" not in log, log


@pytest.mark.parametrize("workers", ["cold", "warm"])
def test_workers_never_outlive_a_killed_launcher(fault_env: FaultEnv, workers: str) -> None:
    """SIGKILL to flashckpt-run while its workers run: they die with it (PR_SET_PDEATHSIG), the first
    round's (new processes) and a restart's handed to warm workers alike, and so do the warm workers
    waiting for the next restart. (A killed torchrun leaves its workers running.)"""
    events = os.path.join(fault_env.tmp, "events.jsonl")
    last = 0 if workers == "cold" else 1
    proc, out = _launch_rounds(fault_env, "hold", last, _free_port(), FLASHCKPT_WARM_DELAY_S="0",
                               FLASHCKPT_LAUNCH_EVENTS=events)
    job = fault_env.job_id
    pids: list[int] = []
    try:
        if workers == "warm":
            wait_for(lambda: sum(e["event"] == "warm_worker_ready" for e in read_events(events)) >= 2, 180,
                     f"2 warm workers ready\n{fault_env.log('launcher.log')}")
            open(os.path.join(out, "go0"), "w").close()  # rank 0 of round 0 dies: a restart, warm
        wait_for(lambda: all(_round(out, last, r) for r in (0, 1)) or proc.poll() is not None, 180,
                 "the workers of the last round")
        assert proc.poll() is None, fault_env.log("launcher.log")
        pids = [_round(out, last, r)["pid"] for r in (0, 1)]
        if workers == "warm":
            used = [e["pid"] for e in read_events(events) if e["event"] == "warm_worker_used"]
            assert sorted(used) == sorted(pids), (used, pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        wait_for(lambda: not _processes_of(job), 30,
                 f"the workers and warm workers of the killed launcher to exit (workers {pids})")
    finally:
        for pid in _processes_of(job):  # this test's orphans, by their job id
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------ leftovers
def _hf_main(mode: str, out: str, report: str) -> None:
    """A FlashCkptTrainer snapshotting every step. ``kill``: SIGKILLed in the middle of its step-2 snapshot,
    its staging dir written (``report`` gets that dir); ``run``: trains to the end."""
    from flashckpt.integrations.hf import FlashCkptConfig

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "framework"))
    from test_hf import make_trainer
    from transformers.trainer_callback import TrainerState

    if mode == "kill":
        save = TrainerState.save_to_json

        def save_and_die(self: TrainerState, path: str) -> None:
            save(self, path)
            if self.global_step == 2:  # path: <staging dir>/checkpoint-2/trainer_state.json
                with open(report, "w") as f:
                    f.write(os.path.dirname(os.path.dirname(path)))
                os.kill(os.getpid(), signal.SIGKILL)

        TrainerState.save_to_json = save_and_die  # type: ignore[method-assign]
    make_trainer(out, config=FlashCkptConfig(memory_snapshot_steps=1), max_steps=3).train()


def _hf_run(fe: FaultEnv, mode: str, out: str) -> tuple[subprocess.CompletedProcess[bytes], str]:
    report = os.path.join(fe.tmp, f"staging-{mode}.txt")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "hf", mode, out, report], env=fe.env(),
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=300)
    return p, report


@pytest.mark.framework
def test_staging_dirs_of_a_trainer_killed_mid_snapshot_are_removed_by_gc_and_by_the_next_start(
        fault_env: FaultEnv) -> None:
    """A FlashCkptTrainer SIGKILLed while its snapshot's files are staged (``/dev/shm/flashckpt-hf-*`` by
    default; here the test's FLASHCKPT_SCRATCH_DIR) leaves the staging dir behind. ``flashckpt gc`` removes
    it, and so does the next trainer's first snapshot there; the staging dir of a live process (this one)
    is never touched, whatever its age."""
    from flashckpt.integrations._kit_files import SnapshotDir

    scratch = fault_env.base_env["FLASHCKPT_SCRATCH_DIR"]
    live = SnapshotDir(scratch, "checkpoint-1", prefix="flashckpt-hf-")
    try:
        def killed(n: int) -> str:
            p, report = _hf_run(fault_env, "kill", os.path.join(fault_env.tmp, f"run{n}"))
            assert p.returncode == -signal.SIGKILL, p.stdout.decode()[-3000:] + p.stderr.decode()[-3000:]
            with open(report) as f:
                left = f.read()
            assert os.path.dirname(left) == scratch and os.path.isdir(left), left  # left behind by the kill
            return left

        from _fault_helpers import run_cli

        left = killed(1)
        r = run_cli(fault_env, "gc", "--dry-run")
        assert r.returncode == 0 and f"would remove {left}" in r.stdout and live.base not in r.stdout, r.stdout
        assert os.path.isdir(left)
        r = run_cli(fault_env, "gc", console=True)
        assert r.returncode == 0 and f"removed {left}" in r.stdout and live.base not in r.stdout, r.stdout
        assert not os.path.exists(left) and os.path.isdir(live.dir)

        left = killed(2)
        p, _ = _hf_run(fault_env, "run", os.path.join(fault_env.tmp, "run3"))  # the next start
        assert p.returncode == 0, p.stdout.decode()[-3000:] + p.stderr.decode()[-3000:]
        assert not os.path.exists(left) and os.path.isdir(live.dir)
        assert sorted(os.listdir(scratch)) == [os.path.basename(live.base)]  # the run left nothing either
    finally:
        live.close()


def test_an_owned_dir_is_told_dead_by_its_owners_pid_and_start_time(tmp_path) -> None:
    """A staging dir's name carries its owner's pid and start time: a dir of a process that exited, or of
    a pid another process has taken since, is swept; a live owner's, a name of another form, another
    user's (not tested: needs a second uid) or a symbolic link are not."""
    from flashckpt.util.owned_dirs import _start_time, owned_dir, sweep

    root = str(tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    mine = owned_dir(root, "flashckpt-hf-")
    assert os.path.basename(mine).startswith(f"flashckpt-hf-{os.getpid()}-{_start_time('self')}-")
    assert os.stat(mine).st_mode & 0o777 == 0o700
    dead = os.path.join(root, f"flashckpt-hf-{gone.pid}-{_start_time('self')}-abcd1234")
    reused = os.path.join(root, f"flashckpt-ds-{os.getpid()}-1-abcd1234")  # this pid, another start time
    old_form = os.path.join(root, f"flashckpt-warm-{gone.pid}-x1")
    other = os.path.join(root, "flashckpt-hf-notapid-x3")
    for d in (dead, reused, old_form, other):
        os.mkdir(d)
    os.symlink(mine, os.path.join(root, f"flashckpt-hf-{gone.pid}-1-link0000"))
    assert sorted(line.split()[0] for line in sweep(root, dry_run=True)) == sorted([dead, reused, old_form])
    assert all(os.path.exists(d) for d in (dead, reused, old_form))
    sweep(root)
    assert sorted(os.listdir(root)) == sorted(os.path.basename(p) for p in (mine, other, f"{root}/flashckpt-hf-"
                                                                             f"{gone.pid}-1-link0000"))


if __name__ == "__main__":
    if sys.argv[1:2] == ["hf"]:
        _hf_main(*sys.argv[2:5])
        sys.exit(0)
    sys.exit(f"{__file__}: run it with pytest")
