"""README.md's code snippets run as written (#34).

Every fenced ``python`` block of README.md is either runnable, marked by its first line
``# run as: <command> <file>.py   (again: it resumes)``, or listed in ``NOT_RUN`` below with why. A runnable
one is written to ``<file>.py`` in a fresh directory (the test fills in nothing) and run there twice with
its command: both runs exit 0, the first starts from scratch and the second resumes from what the first
saved (its output says so: ``RESUMED``). A block that is neither fails the test, so a new snippet is
either made runnable or given a reason.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from _fault_helpers import FaultEnv, fault_env_fixture  # noqa: F401

pytestmark = pytest.mark.framework

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_AS = re.compile(r"^# run as: (?P<cmd>.*?(?P<file>\w+\.py))\s")

# Blocks not run, by their first line: fragments of a training loop that show the calls in place.
NOT_RUN = {
    "from flashckpt import CheckpointEngine, StorageType": "a loop's calls, on the user's model (the HF, "
    "Lightning and FSDP snippets are whole programs)",
    "from flashckpt.integrations.ddp import DdpCheckpointer, StorageType": "three calls of a DDP loop",
    "# runs in a DeepSpeed job": "needs a DeepSpeed engine from deepspeed.initialize in a launched job "
    "(tests/framework/test_deepspeed.py runs the adapter under a launcher)",
    "from flashckpt.patches.megatron import": "needs Megatron-LM's training loop (docs/megatron.md)",
    "from flashckpt.memory.reader import SnapshotReader": "reads a running job's memory",
    "engine = CheckpointEngine(\"s3://bucket/run\"": "needs an S3 store",
}

# What the second run's output shows when it resumed from the first run's last step (20 in each snippet).
RESUMED = {
    "train_hf.py": r"FlashCkptTrainer: resumed from (memory|storage) at step 20, 0 steps lost",
    "train_lightning.py": r"Restoring states from the checkpoint path at .*step=20\.ckpt",
    "train_fsdp.py": r"resumed after step 20",
}


def _blocks() -> list[str]:
    with open(os.path.join(REPO, "README.md")) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), re.M | re.S)


def _runnable() -> dict[str, tuple[str, str]]:
    out = {}
    for block in _blocks():
        m = RUN_AS.match(block)
        if m:
            out[m["file"]] = (m["cmd"], block)
    return out


def test_every_python_block_is_run_or_says_why_not() -> None:
    blocks = _blocks()
    assert len(blocks) >= 8, "README.md's python blocks were not found"
    unexplained = [b.splitlines()[0] for b in blocks
                   if not RUN_AS.match(b) and not any(b.startswith(first) for first in NOT_RUN)]
    assert not unexplained, f"README python blocks neither runnable ('# run as: ...') nor in NOT_RUN: {unexplained}"
    assert set(_runnable()) == set(RESUMED)


@pytest.mark.parametrize("name", sorted(RESUMED))
def test_snippet_runs_and_a_second_run_resumes(fault_env: FaultEnv, name: str) -> None:
    cmd, code = _runnable()[name]
    work = os.path.join(fault_env.tmp, "work")
    os.makedirs(work)
    with open(os.path.join(work, name), "w") as f:
        f.write(code)
    env = fault_env.env(HF_HUB_OFFLINE="1", FLASHCKPT_SAVER_GRACE_S="5")
    outputs = []
    for _ in range(2):
        p = subprocess.run(cmd, shell=True, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=180)
        text = p.stdout.decode(errors="replace")
        assert p.returncode == 0, f"{cmd}:\n{text[-6000:]}"
        outputs.append(text)
    assert not re.search(RESUMED[name], outputs[0]), outputs[0][-4000:]
    assert re.search(RESUMED[name], outputs[1]), outputs[1][-4000:]
