"""FlashCkptTrainer resumes without a script change, and says so in one line a user sees (#34).

- Under ``flashckpt-run``, a script shaped like transformers' ``run_clm.py`` (``_hf_clm_script.py``: its logging
  set-up, no resume path passed) is killed after step 5 (a memory snapshot of 5, no disk checkpoint): the
  restarted worker resumes at step 5 from memory and logs one WARNING line, which run_clm's default
  verbosity (INFO for the library, WARNING for the root logger flashckpt's loggers reach) shows; with ``FLASHCKPT_AUTO_RESUME=0`` it starts again at step 1.
- ``resume_from_checkpoint="True"`` (a command line's ``--resume_from_checkpoint True``) resumes as True does.
- Memory snapshots every step log no "Saving model checkpoint to /dev/shm/..." lines at INFO; a persisted
  checkpoint logs the Trainer's own line with its real path.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest
from _fault_helpers import FaultEnv, fault_env_fixture, run_restarting  # noqa: F401

pytest.importorskip("transformers")

from test_hf import _hf_env, make_trainer  # noqa: E402, F401  (_hf_env: the autouse fixture)

pytestmark = pytest.mark.framework

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "_hf_clm_script.py")


def _run_clm_under_launcher(fe: FaultEnv, out: str, **env: str) -> tuple[list[dict], str]:
    """flashckpt-run (1 worker, 1 restart) of the script, killed after step 5 on its first attempt: the
    RESULT lines of the attempts that ended, and the whole output."""
    return run_restarting(fe, SCRIPT, "--output_dir", out, "--max_steps", "7", "--per_device_train_batch_size", "4",
                          "--save_steps", "100", "--logging_steps", "1", "--report_to", "none", "--use_cpu",
                          "--disable_tqdm", "True", "--kill_at", "5", **env)


@pytest.mark.parametrize("auto", ["on", "off"])
def test_a_restarted_run_clm_worker_resumes_from_memory_by_itself(fault_env: FaultEnv, auto: str) -> None:
    out = os.path.join(fault_env.tmp, "out")
    env = {"FLASHCKPT_AUTO_RESUME": "0"} if auto == "off" else {}
    results, text = _run_clm_under_launcher(fault_env, out, **env)
    assert len(results) == 1, text[-6000:]  # the first attempt was killed
    lines = [line for line in text.splitlines() if "FlashCkptTrainer: resumed from" in line]
    if auto == "on":
        assert results[0] == {"first": 6, "last": 7, "source": "memory", "step": 5}, text[-6000:]
        assert len(lines) == 1, text[-6000:]
        assert " - WARNING - flashckpt.integrations.hf - " in lines[0], lines
        assert "resumed from memory at step 5, 0 steps lost" in lines[0], lines
    else:
        assert results[0] == {"first": 1, "last": 7, "source": None, "step": None}, text[-6000:]
        assert lines == [], lines
    # run_clm's default verbosity is INFO: the memory snapshots of every step are quiet, the checkpoint the
    # Trainer saves at the end logs its line as a vanilla Trainer's does (the last words' persist of step 5 is
    # the saver's, in its own log).
    # (The set of paths: where CI is set, transformers propagates its logs to the root logger
    # (transformers.utils.logging: ``propagate = is_ci``), so under run_clm's set-up every line shows twice,
    # in transformers' explicit format and in the root logger's, vanilla or not.)
    saving = {line.split("Saving model checkpoint to ", 1)[1].strip() for line in text.splitlines()
              if "Saving model checkpoint to" in line}
    assert saving == {os.path.join(out, "checkpoint-7")}, saving


def test_resume_from_checkpoint_as_a_command_line_string_means_the_newest(tmp_path) -> None:
    out = str(tmp_path / "out")
    first = make_trainer(out, max_steps=4, save_steps=4)
    first.train()
    for newest, word in ((4, "True"), (5, "true")):  # each run commits its last step when train() returns
        again = make_trainer(out, max_steps=newest + 1, save_steps=100)
        again.train(resume_from_checkpoint=word)
        assert again.flashckpt_last_resume is not None
        assert (again.flashckpt_last_resume.step, again.state.global_step) == (newest, newest + 1), word


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))


def test_memory_snapshots_are_quiet_at_info_and_a_persisted_checkpoint_logs_the_trainers_line(tmp_path) -> None:
    from transformers.utils import logging as hf_logging

    out = str(tmp_path / "out")
    lines = _Lines()
    hf_root = logging.getLogger("transformers")  # the library's loggers do not propagate to the root
    hf_root.addHandler(lines)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_info()
    try:
        make_trainer(out, max_steps=4, save_steps=3).train()  # memory snapshots at 1 and 2
    finally:
        hf_logging.set_verbosity(level)
        hf_root.removeHandler(lines)
    saving = [m for _, m in lines.lines if m.startswith("Saving model checkpoint to")]
    persisted = sorted((n for n in os.listdir(out) if n.startswith("checkpoint-")), key=lambda n: int(n[11:]))
    assert persisted == ["checkpoint-3", "checkpoint-4"]  # save_steps, and the last step
    assert saving == [f"Saving model checkpoint to {os.path.join(out, n)}" for n in persisted], saving
    assert not [m for _, m in lines.lines if "flashckpt-hf-" in m], lines.lines
    assert any("Training completed" in m or "train" in m.lower() for _, m in lines.lines)  # INFO lines still flow


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
