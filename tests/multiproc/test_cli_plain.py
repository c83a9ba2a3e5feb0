"""The ``flashckpt`` command speaks plainly (#34): a failure is one line and exit code 2, S3's included
(a store that does not answer: a closed port on loopback, the installed command in a process of its own);
``ls`` rows fit a narrow terminal and never wrap, while a pipe gets them whole."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
from _cli_helpers import flashckpt, save_steps
from _fault_helpers import FaultEnv, fault_env_fixture  # noqa: F401


@pytest.fixture(name="closed_port")
def closed_port_fixture() -> Iterator[int]:
    """A loopback port bound and never listened on: a connection to it is refused at once (no other
    process can take it while the test runs)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


def test_an_s3_store_that_does_not_answer_is_one_line_and_exit_2(fault_env: FaultEnv, closed_port: int) -> None:
    """ls, verify and upload of an s3:// dir whose endpoint refuses connections: one line on stderr (what
    failed and why; not the backend's outage warning beside it, nor a traceback), exit code 2."""
    env = fault_env.env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{closed_port}", AWS_ACCESS_KEY_ID="testing",
                        AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                        AWS_EC2_METADATA_DISABLED="true", FLASHCKPT_S3_MAX_ATTEMPTS="2")  # fail in a second
    local = os.path.join(fault_env.tmp, "local")
    os.makedirs(local)
    for args in (["ls", "s3://bucket/run"], ["verify", "s3://bucket/run"],
                 ["upload", "s3://bucket/run", "--local-dir", local]):
        r = flashckpt(env, *args)
        lines = r.stderr.splitlines()
        assert r.returncode == 2 and len(lines) == 1, (args, r.stderr)
        assert lines[0].startswith(f"flashckpt {args[0]}: ") and f"127.0.0.1:{closed_port}" in lines[0], lines
        assert "s3://bucket/run" in lines[0] and "Traceback" not in r.stderr and r.stdout == "", (args, r)


def test_ls_rows_fit_a_narrow_terminal_and_a_pipe_gets_them_whole(fault_env: FaultEnv) -> None:
    """A dir with a long name and long file names: with COLUMNS=60 every line of ``ls`` is under 60
    characters (cells elided in their middle, the step and its state kept); without (a pipe) the files are
    there whole."""
    ckpt = os.path.join(fault_env.tmp, "a-checkpoint-dir-with-a-rather-long-name-" + "x" * 40)
    long_name = "model_with_a_very_long_name_" + "y" * 50 + ".pt"
    save_steps(ckpt, [1, 2], 0.1, long_name)
    narrow = flashckpt(fault_env.env(COLUMNS="60"), "ls", ckpt)
    assert narrow.returncode == 0, narrow.stderr
    lines = narrow.stdout.splitlines()
    assert len(lines) == 3 and all(len(line) < 60 for line in lines), narrow.stdout
    assert lines[0].split()[:2] == ["STEP", "STATE"] and "FILES" in lines[0], lines[0]
    assert lines[1].split()[:2] == ["1", "committed"] and "…" in lines[1], lines[1]
    assert lines[2].split()[:3] == ["2", "committed", "(latest)"], lines[2]

    env = fault_env.env()
    env.pop("COLUMNS", None)
    whole = flashckpt(env, "ls", ckpt)
    assert whole.returncode == 0 and os.path.join("step_2", long_name) in whole.stdout, whole.stdout
    assert "…" not in whole.stdout
