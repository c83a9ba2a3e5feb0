"""Progress on the ``flashckpt`` command's long work (#34): ``verify`` and ``upload`` draw a progress bar
on stderr when stderr is a terminal (a pseudo-terminal here, the installed command in a process of its
own), and write none to a pipe; their result lines go to stdout either way."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import termios
import time

from _cli_helpers import save_steps
from _fault_helpers import VENV_BIN, FaultEnv, fault_env_fixture  # noqa: F401
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.protocol import commit_step
from flashckpt.commit.tiers import DURABLE_ROOT, local_layout
from flashckpt.storage.posix import PosixDiskStorage


def _run(env: dict[str, str], *args: str, tty: bool) -> tuple[int, str, str]:
    """Runs ``flashckpt *args``, its stderr a pseudo-terminal (``tty``) or a pipe; reads both to the end.
    Returns the exit code, stdout and stderr."""
    cmd = [os.path.join(VENV_BIN, "flashckpt"), *args]
    if not tty:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        return r.returncode, r.stdout, r.stderr
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 x 0
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL)
    finally:
        os.close(slave)  # the child holds the only other end: EOF (EIO) once it exits
    got = b""
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's last writer is gone
                break
            if not chunk:
                break
            got += chunk
        assert proc.stdout is not None
        out = proc.stdout.read().decode()
        rc = proc.wait(timeout=60)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    return rc, out, got.decode(errors="replace")


def _has_bar(text: str, what: str) -> bool:
    """tqdm's bar of ``what`` at its end: its label, 100% and the unit of its rate (bytes per second)."""
    return f"{what}: 100%" in text and "B/s" in text


def test_verify_draws_a_bar_on_a_terminal_and_none_into_a_pipe(fault_env: FaultEnv) -> None:
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    save_steps(ckpt, [1, 2], 2)
    rc, out, err = _run(fault_env.env(), "verify", ckpt, tty=True)
    assert rc == 0 and "step 1: ok" in out and "step 2: ok" in out, (out, err)
    assert _has_bar(err, "verify"), repr(err)
    rc, out, err = _run(fault_env.env(), "verify", ckpt, tty=False)
    assert rc == 0 and "step 2: ok" in out and err == "", (out, err)


def test_upload_draws_a_bar_on_a_terminal_and_none_into_a_pipe(fault_env: FaultEnv) -> None:
    """Steps committed on a local tier only (a saver that died before their upload) go up with a bar."""
    durable = CommitLayout(os.path.join(fault_env.tmp, "durable"), PosixDiskStorage())
    os.makedirs(durable.root)
    local = local_layout(os.path.join(fault_env.tmp, "local"), "job")
    os.makedirs(local.root)
    for step in (1, 2, 3):
        rec = local.storage.write_bytes(os.path.join(local.root, f"step_{step}", "a.pt"), os.urandom(1 << 20))
        local.write_done(step, 0, [rec], saved_at=float(step))
        commit_step(local, step, [0], 1, replicated=False, timeout=5,
                    extra={"tier_ranks": [0], DURABLE_ROOT: durable.root,
                           "durable_spec": {"ranks": [0], "world_size": 1, "replicated": False}})
    rc, out, err = _run(fault_env.env(), "upload", durable.root, "--local-dir", local.root, tty=True)
    assert rc == 0 and all(f"step {s}: uploaded and committed" in out for s in (1, 2, 3)), (out, err)
    assert _has_bar(err, "upload") and "3.00M/3.00M" in err, repr(err)  # 3 MiB
    assert durable.committed_steps() == [1, 2, 3]

    local_only = 4
    rec = local.storage.write_bytes(os.path.join(local.root, f"step_{local_only}", "a.pt"), b"x" * 4096)
    local.write_done(local_only, 0, [rec], saved_at=4.0)
    commit_step(local, local_only, [0], 1, replicated=False, timeout=5,
                extra={"tier_ranks": [0], DURABLE_ROOT: durable.root,
                       "durable_spec": {"ranks": [0], "world_size": 1, "replicated": False}})
    rc, out, err = _run(fault_env.env(), "upload", durable.root, "--local-dir", local.root, tty=False)
    assert rc == 0 and f"step {local_only}: uploaded and committed" in out and err == "", (out, err)


def test_export_draws_a_bar_on_a_terminal_and_none_into_a_pipe(fault_env: FaultEnv) -> None:
    """``flashckpt export`` of a committed step: tqdm's bar over the tensors it prepares, on a terminal only."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    save_steps(ckpt, [1], 1)
    rc, out, err = _run(fault_env.env(), "export", ckpt, os.path.join(fault_env.tmp, "out"), tty=True)
    assert rc == 0, (out, err)
    assert "export step 1: 100%" in err and "tensor/s" in err, repr(err)
    rc, out, err = _run(fault_env.env(), "export", ckpt, os.path.join(fault_env.tmp, "out2"), tty=False)
    assert rc == 0 and "export step 1" not in err, (out, err)
