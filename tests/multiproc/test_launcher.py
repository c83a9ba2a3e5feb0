"""``flashckpt-run`` with the 2-rank gloo DDP example: SIGTERM during training, and a worker failure
that restarts the group from host memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from _fault_helpers import (  # noqa: F401
    DDP_TRAIN,
    VENV_BIN,
    FaultEnv,
    alive,
    assert_bit_equal,
    cmdline,
    fault_env_fixture,
    read_events,
    run_cli,
    saver_pids,
    terminate_savers,
    tracker_step,
    wait_for,
)
from flashckpt.memory.writer import SharedMemoryHandler

pytestmark = pytest.mark.multiproc

FLASHCKPT_RUN = os.path.join(VENV_BIN, "flashckpt-run")
SMALL_MODEL = ["--vocab", "512", "--dim", "64", "--layers", "2", "--batch_size", "4", "--ctx", "32"]


def _launch(fe: FaultEnv, ckpt: str, metrics: str, *args: str, launcher_args: tuple[str, ...] = (),
            log_name: str = "launcher.log", **env: str) -> subprocess.Popen[bytes]:
    argv = [FLASHCKPT_RUN, "--nproc_per_node", "2", "--standalone", *launcher_args, DDP_TRAIN,
            "--checkpoint_dir", ckpt, "--metrics", metrics, *SMALL_MODEL, *args]
    return fe.popen(argv, log_name, env=fe.env(**env))


def _wait_exit(fe: FaultEnv, proc: subprocess.Popen[bytes], log_name: str, timeout: float = 240) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"flashckpt-run did not exit within {timeout:.0f} s\n{fe.log(log_name)}") from None


def _workers_of(ckpt: str) -> list[int]:
    """Live processes running the DDP example on ``ckpt`` (workers of a launcher)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            argv = cmdline(int(name))
            if DDP_TRAIN in argv and ckpt in argv and alive(int(name)):
                out.append(int(name))
    return out


def test_sigterm_to_flashckpt_run_commits_the_newest_snapshot(fault_env: FaultEnv) -> None:
    """SIGTERM while training (memory snapshot every step, no storage save due): before the launcher
    exits, the newest snapshot in memory is committed, bit-exact."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    metrics = os.path.join(fault_env.tmp, "metrics.jsonl")
    launcher = _launch(fault_env, ckpt, metrics, "--steps", "1000000", "--save_memory_interval", "1",
                       "--save_storage_interval", "1000000", FLASHCKPT_SAVER_GRACE_S="120")

    def training() -> bool:
        assert launcher.poll() is None, f"flashckpt-run exited early:\n{fault_env.log('launcher.log')}"
        return sum(e["event"] == "save" for e in read_events(metrics)) >= 5

    wait_for(training, 180, "5 memory snapshots")
    assert tracker_step(ckpt) is None  # nothing committed yet: no storage save was due
    # The savers of a launcher that is gone exit once their last client left: this one (which persists
    # nothing) holds the saver, and its snapshots, for the comparison below.
    from flashckpt.transport.wire import Client

    holder = Client(os.path.join(fault_env.job_dir(ckpt), "saver.sock"), timeout=60)
    holder.call("hello", rank=1000, local_rank=1000, persists=False)
    os.kill(launcher.pid, signal.SIGTERM)
    rc = _wait_exit(fault_env, launcher, "launcher.log")
    log = fault_env.log("launcher.log")
    assert rc != 0, log  # interrupted
    assert _workers_of(ckpt) == []

    events = read_events(metrics)
    assert not any(e["event"] == "end" for e in events)
    last_saved = max(e["step"] for e in events if e["event"] == "save")
    committed = tracker_step(ckpt)
    assert committed is not None and committed >= last_saved, (committed, last_saved, log)
    assert "last words" in log

    # What was committed is the newest snapshot memory held, byte for byte.
    reader = SharedMemoryHandler(0, fault_env.job_dir(ckpt))
    try:
        assert reader.memory_steps()[0] == committed
        snap = reader.load_snapshot(committed)
    finally:
        reader.close()
    assert snap is not None and snap.state_dict["step"] == committed
    persisted = torch.load(os.path.join(ckpt, f"step_{committed}", "checkpoint.pt"), weights_only=True)
    assert_bit_equal(persisted, snap.state_dict)
    r = run_cli(fault_env, "verify", ckpt)
    assert r.returncode == 0, r.stdout

    holder.call("bye", final=True)
    holder.close()  # the last client gone, with the launcher: the saver exits (nothing newer to persist)
    wait_for(lambda: not saver_pids(fault_env.runtime_dir), 30, "the saver to exit after its last client")
    assert tracker_step(ckpt) == committed


def test_worker_failure_resumes_from_memory_and_matches_an_uninterrupted_run(fault_env: FaultEnv) -> None:
    """Rank 0 is SIGKILLed after step 6; flashckpt-run restarts the group, which resumes from the step-6
    snapshot in memory (storage holds only step 4) and ends with the weights of an uninterrupted run."""
    common = ("--steps", "10", "--save_memory_interval", "1", "--save_storage_interval", "4")
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    metrics = os.path.join(fault_env.tmp, "metrics.jsonl")
    ref_ckpt = os.path.join(fault_env.tmp, "ref")
    ref_metrics = os.path.join(fault_env.tmp, "ref.jsonl")
    # Rank 0 (the one that snapshots) kills itself after its step-6 save returned, so step 6 is surely in
    # memory when the group fails. The grace must outlast a restart (rendezvous, and two workers importing torch on 2 busy cores); it costs
    # nothing here, as the savers exit at once after the final goodbyes.
    crashing = _launch(fault_env, ckpt, metrics, *common, "--resume", "--crash_at_step", "6", "--crash_rank", "0",
                       launcher_args=("--max_restarts=2",), FLASHCKPT_SAVER_GRACE_S="30")
    # A concurrent job whose id starts with this one's: the crashing job's last words must not touch it.
    reference = _launch(fault_env, ref_ckpt, ref_metrics, *common, log_name="reference.log",
                        FLASHCKPT_JOB_ID=fault_env.job_id + "-ref")
    rc = _wait_exit(fault_env, crashing, "launcher.log")
    log = fault_env.log("launcher.log")
    assert rc == 0, log
    assert "last words of" in log and f"{fault_env.job_id}-ref" not in log, log
    assert _wait_exit(fault_env, reference, "reference.log") == 0, fault_env.log("reference.log")

    events = read_events(metrics)
    resumes = [e for e in events if e["event"] == "resume"]
    assert [(e["source"], e["step"]) for e in resumes] == [("none", None), ("memory", 6)], resumes
    ends = [e for e in events if e["event"] == "end"]
    ref_ends = [e for e in read_events(ref_metrics) if e["event"] == "end"]
    assert len(ends) == 1 and len(ref_ends) == 1
    assert ends[0]["digest"] == ref_ends[0]["digest"]
    # Steps 7..10 ran once, after the restart; step 6 was not redone.
    assert [e["step"] for e in events if e["event"] == "save"] == list(range(1, 11))
    r = run_cli(fault_env, "verify", ckpt)
    assert r.returncode == 0, r.stdout
    wait_for(lambda: not saver_pids(fault_env.runtime_dir), 60, "the savers to exit after the final goodbyes")


_PRINT_JOB = """
import json, os, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({k: os.environ.get(k) for k in ("FLASHCKPT_JOB_ID", "FLASHCKPT_AGENT_PID")}) + "\\n")
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_launches_with_the_same_rdzv_id_share_a_job_id(fault_env: FaultEnv) -> None:
    """The job id comes from the rendezvous id: two launches (a launcher restarted) with one --rdzv-id
    give their workers one FLASHCKPT_JOB_ID, so the second finds the first one's savers; each passes its
    own pid as FLASHCKPT_AGENT_PID. (A random job id per launch stranded the savers of the first.)"""
    script = os.path.join(fault_env.tmp, "print_job.py")
    out = os.path.join(fault_env.tmp, "jobs.jsonl")
    with open(script, "w") as f:
        f.write(_PRINT_JOB)
    env = fault_env.env()
    del env["FLASHCKPT_JOB_ID"]
    rdzv = f"rdzv-{fault_env.job_id}"
    pids = []
    for i in range(2):
        argv = [FLASHCKPT_RUN, "--nnodes", "1", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", rdzv, script, out]
        p = fault_env.popen(argv, f"launch{i}.log", env=env)
        pids.append(p.pid)
        assert _wait_exit(fault_env, p, f"launch{i}.log", timeout=120) == 0, fault_env.log(f"launch{i}.log")
    jobs = read_events(out)
    assert [j["FLASHCKPT_JOB_ID"] for j in jobs] == [rdzv, rdzv], jobs
    assert [j["FLASHCKPT_AGENT_PID"] for j in jobs] == [str(p) for p in pids], jobs


def test_savers_exit_when_their_launcher_is_gone(fault_env: FaultEnv) -> None:
    """A standalone launch (a random job id: nothing can re-attach once its launcher is gone) is killed
    with its worker: the saver persists the newest snapshot and exits within seconds, not after its
    grace period."""
    from _fault_helpers import TRAINER, kill9

    ckpt = os.path.join(fault_env.tmp, "ckpt")
    argv = [FLASHCKPT_RUN, "--standalone", "--nproc_per_node", "1", TRAINER, "--ckpt", ckpt, "--mb", "1",
            "--plan", "1:disk,2:memory", "--wait", "--hold"]
    launcher = fault_env.popen(argv, "launcher.log", env=fault_env.env(FLASHCKPT_SAVER_GRACE_S="120"))
    wait_for(lambda: "holding" in fault_env.log("launcher.log") or launcher.poll() is not None, 180,
             "the worker to save")
    assert launcher.poll() is None, fault_env.log("launcher.log")
    workers = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
               if TRAINER in cmdline(pid) and ckpt in cmdline(pid) and "flashckpt-run" not in " ".join(cmdline(pid))]
    assert len(workers) == 1, workers
    savers = saver_pids(fault_env.runtime_dir)
    assert len(savers) == 1
    kill9(launcher.pid)
    kill9(workers[0])
    wait_for(lambda: not saver_pids(fault_env.runtime_dir), 30,
             "the saver to exit once its launcher and worker are gone (its grace is 120 s)")
    assert tracker_step(ckpt) == 2, fault_env.saver_logs()


def test_savers_keep_a_crashed_workers_snapshot_past_their_grace_while_the_launcher_lives(fault_env: FaultEnv) -> None:
    """A worker of a launcher (FLASHCKPT_AGENT_PID: here a stand-in process, since the restart itself is
    not what is tested) crashes: its saver keeps the snapshot past its grace period while the launcher
    lives, since a restart (slow on a loaded machine) can still come for it; once the launcher is gone it
    persists the newest snapshot and exits."""
    from _fault_helpers import TRAINER, kill9

    ckpt = os.path.join(fault_env.tmp, "ckpt")
    agent = subprocess.Popen(["sleep", "600"])
    try:
        env = fault_env.env(FLASHCKPT_SAVER_GRACE_S="1", FLASHCKPT_AGENT_PID=str(agent.pid))
        worker = fault_env.popen([sys.executable, TRAINER, "--ckpt", ckpt, "--mb", "1", "--plan", "1:disk,2:memory",
                                  "--wait", "--hold"], "worker.log", env=env)
        wait_for(lambda: "holding" in fault_env.log("worker.log") or worker.poll() is not None, 180, "the worker to save")
        assert worker.poll() is None, fault_env.log("worker.log")
        kill9(worker.pid)
        worker.wait()
        time.sleep(6)  # six grace periods
        assert saver_pids(fault_env.runtime_dir), "the saver exited within its grace while the launcher lives"
    finally:
        agent.kill()
        agent.wait()
    wait_for(lambda: not saver_pids(fault_env.runtime_dir), 30, "the saver to exit once its launcher is gone")
    assert tracker_step(ckpt) == 2, fault_env.saver_logs()  # the newest snapshot persisted
