"""Resume without a script change, and the one line that says where a run resumed from.

Shared by the adapters whose framework takes a resume path (the HF Trainer's ``train(resume_from_checkpoint=)``,
Lightning's ``fit(ckpt_path=)``): a worker that the launcher restarted after a failure (``flashckpt-run`` or
torchrun set ``TORCHELASTIC_RESTART_COUNT`` in its workers: 0 on the first start, 1, 2, ... on each restart)
resumes from the newest checkpoint by itself when the script passes none, unless the adapter's
``auto_resume`` argument or ``FLASHCKPT_AUTO_RESUME=0`` turns that off. The scripts that run unchanged under
the launcher (transformers' ``run_clm.py``, a Lightning script calling ``fit(model)``) pass the same arguments
on every attempt, so without this a restarted worker retrains from step 1 while the newest snapshot sits in
memory.

Torch-free; no framework imported. Nothing here is collective.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from flashckpt import errors as E
from flashckpt.config import knob

__all__ = ["restart_count", "auto_resume", "resume_flag", "steps_lost", "resume_line"]

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchelastic's agent in every worker


def restart_count() -> int:
    """How many times the launcher restarted this worker's group (0: the first start, or no launcher)."""
    raw = os.environ.get(RESTART_COUNT_ENV, "").strip()
    try:
        return max(0, int(raw)) if raw else 0
    except ValueError:
        return 0


def auto_resume(given: bool | None, *, op: str) -> bool:
    """Whether this worker resumes by itself when its script passes no resume path: it is a restarted
    worker, and ``given`` (the adapter's argument; None: ``FLASHCKPT_AUTO_RESUME``, on by default) allows it.

    Raises:
        InvalidArgumentError: ``given`` is not a bool or None (``op`` names the argument).
    """
    if given is not None and not isinstance(given, bool):
        raise E.InvalidArgumentError(f"{op} is {given!r}: give True, False, or None (FLASHCKPT_AUTO_RESUME decides)")
    return restart_count() > 0 and (knob("auto_resume") if given is None else given)


def resume_flag(value: Any) -> Any:
    """``value`` with the words a command line gives for a flag (``--resume_from_checkpoint True``, which
    reaches ``TrainingArguments`` as the string ``"True"``) as the bool they mean; anything else unchanged."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return value


def steps_lost(engine: Any, step: int | None) -> int:
    """How many steps older than the newest snapshot this rank knows of (in its node's memory, or committed)
    the resumed ``step`` is (None: started from scratch, everything known is lost)."""
    known = [*engine.memory_steps(), *engine.committed_steps()]
    newest = max(known, default=None)
    if newest is None:
        return 0
    return max(0, newest - (step if step is not None else 0))


def resume_line(logger: logging.Logger, who: str, *, source: str, step: int | None, path: str | None,
                lost: int, automatic: bool) -> None:
    """Logs where a run resumed from, once, at WARNING: the level the frameworks' scripts show by default
    (transformers' ``run_clm.py`` keeps the library's loggers at WARNING unless ``--log_level`` says otherwise).
    The structured ``event=resume`` line stays at INFO."""
    how = " (a restarted worker; FLASHCKPT_AUTO_RESUME=0 turns this off)" if automatic else ""
    if step is None:
        logger.warning("%s: no checkpoint to resume from, starting at step 1%s", who, how)
        return
    where = {"memory": "memory", "local": "the local tier"}.get(source, "storage")
    logger.warning("%s: resumed from %s at step %d, %d step%s lost (%s)%s", who, where, step, lost,
                   "" if lost == 1 else "s", path, how)
