"""What the tests of the ``flashckpt`` command share: checkpoint dirs with committed steps, and the installed
command run in a process of its own with a given environment."""

from __future__ import annotations

import os
import subprocess

from _fault_helpers import VENV_BIN, close_and_wait, make_state
from flashckpt import CheckpointEngine, StorageType


def save_steps(ckpt: str, steps: list[int], mb: float, name: str | None = None) -> None:
    """Commits ``steps`` of about ``mb`` MiB each in ``ckpt`` (a saver of its own, closed after); ``name``:
    each step's file ``step_<N>/<name>`` (default: the engine's ``step_<N>/rank_00000.pt``)."""
    engine = CheckpointEngine(ckpt, max_to_keep=0)
    try:
        for step in steps:
            path = None if name is None else os.path.join(ckpt, f"step_{step}", name)
            engine.save(step, make_state(step, mb), path=path, storage_type=StorageType.DISK)
            engine.wait(timeout=60)
    finally:
        close_and_wait(engine)


def flashckpt(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The installed ``flashckpt *args`` with ``env``, stdout and stderr pipes."""
    return subprocess.run([os.path.join(VENV_BIN, "flashckpt"), *args], env=env, capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)
