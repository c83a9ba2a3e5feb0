"""Which committed checkpoints to delete, after each commit.

Two ways to write a strategy (subclass ``CheckpointDeletionStrategy`` and implement one of them):

- ``steps_to_delete(committed_steps)``: a pure function of the committed steps on storage (in commit
  order), so its state survives restarts. The built-in strategies work this way. The engine deletes the
  steps it names, never the most recently committed one. "Newest" is the most recently committed step,
  which after a rollback (a lower step saved after higher ones) is not the highest.
- ``clean_up(step, delete_func)``, the contract of DLRover's Flash Checkpoint guide: after each commit,
  the engine calls it with the step that commit superseded (the step committed just before it, as
  DLRover does), and ``delete_func(path)`` deletes a file or directory inside the checkpoint dir
  (see ``CheckpointEngine.delete_checkpoint`` for what it refuses).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flashckpt import errors as E

__all__ = ["CheckpointDeletionStrategy", "KeepLatestStepStrategy", "KeepStepIntervalStrategy", "uses_clean_up"]


class CheckpointDeletionStrategy:
    """Decides which committed checkpoints to delete. Implement ``steps_to_delete`` or ``clean_up``.

    Call order: only global rank 0's engine calls a strategy, after each commit it observes (the saver's
    replies to saves and ``wait`` report commits), never for commits that happened before the engine
    started (an engine that only loads deletes nothing).

    - A strategy that overrides ``clean_up`` gets ``clean_up(step, delete_func)`` once per commit, with
      ``step`` the step committed just before that commit (the checkpoint the new one supersedes; no call
      for the first commit, nor when a step is committed again). ``delete_func(path)`` deletes ``path``
      (a file or directory inside the checkpoint dir, absolute or relative as for ``save``; a committed
      step number is accepted too) through the node's saver, in the background, and updates the commit
      records; it raises, deleting nothing, for a path outside the checkpoint dir, the checkpoint dir
      itself, a path holding the newest committed step, part of a committed step or a step still being
      persisted (``CheckpointDirError``), and for a path that does not exist (``FileNotFoundError``).
      An exception escaping ``clean_up`` is logged, never raised into training.
    - Otherwise the engine lists the committed steps on storage in commit order (the most recently
      committed last), calls ``steps_to_delete`` and deletes those steps, less the most recent one.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> CheckpointDeletionStrategy:
        if not uses_clean_up(cls) and cls.steps_to_delete is CheckpointDeletionStrategy.steps_to_delete:
            raise E.InvalidArgumentTypeError(f"{cls.__name__}: a CheckpointDeletionStrategy implements clean_up(self, step, "
                            "delete_func) (DLRover's contract) or steps_to_delete(self, committed_steps)")
        return super().__new__(cls)

    def steps_to_delete(self, committed_steps: Sequence[int]) -> list[int]:
        """The steps among ``committed_steps`` (in commit order, the newest last) to delete."""
        raise NotImplementedError

    def clean_up(self, step: int, delete_func: Callable[[Any], None],
                 committed_steps: Sequence[int] | None = None) -> None:
        """Deletes, through ``delete_func(step)``, what ``steps_to_delete`` names once ``step`` is the most
        recently committed of ``committed_steps``. (The engine calls ``steps_to_delete`` itself; this
        serves callers that drive a step-list strategy by hand.)"""
        steps = [s for s in (committed_steps or []) if s != step] + [step]  # ``step`` was committed last
        for s in self.steps_to_delete(steps):
            if s != step:
                delete_func(s)


def uses_clean_up(strategy: Any) -> bool:
    """Whether ``strategy`` (an instance or a class) overrides ``clean_up``: the engine then calls it."""
    cls = strategy if isinstance(strategy, type) else type(strategy)
    return getattr(cls, "clean_up", None) is not CheckpointDeletionStrategy.clean_up


class _BuiltinStrategy(CheckpointDeletionStrategy):
    """The built-in strategies' common argument, as in DLRover's signatures.

    Args:
        checkpoint_dir: the checkpoint dir it applies to (the engine deletes the steps' own files wherever
            they lie in the checkpoint dir it was given).
    """

    def __init__(self, checkpoint_dir: str = "") -> None:
        self.checkpoint_dir = checkpoint_dir


class KeepLatestStepStrategy(_BuiltinStrategy):
    """Keeps the ``max_to_keep`` (at least 1) most recently committed steps; ``checkpoint_dir`` as in DLRover."""

    def __init__(self, max_to_keep: int, checkpoint_dir: str = "") -> None:
        super().__init__(checkpoint_dir)
        self.max_to_keep = _at_least_one("KeepLatestStepStrategy(max_to_keep=...)", max_to_keep)

    def steps_to_delete(self, committed_steps: Sequence[int]) -> list[int]:
        return list(committed_steps)[: max(0, len(committed_steps) - self.max_to_keep)]


class KeepStepIntervalStrategy(_BuiltinStrategy):
    """Keeps the steps that are multiples of ``keep_interval`` (at least 1), and always the newest;
    ``checkpoint_dir`` as in DLRover."""

    def __init__(self, keep_interval: int, checkpoint_dir: str = "") -> None:
        super().__init__(checkpoint_dir)
        self.keep_interval = _at_least_one("KeepStepIntervalStrategy(keep_interval=...)", keep_interval)

    def steps_to_delete(self, committed_steps: Sequence[int]) -> list[int]:
        return [s for s in list(committed_steps)[:-1] if s % self.keep_interval != 0]


def _at_least_one(call: str, value: Any) -> int:
    """``value`` when it is an integer >= 1, else an ``InvalidArgumentError`` naming ``call``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise E.InvalidArgumentError(f"{call.replace('...', repr(value))}: must be an integer >= 1")
    return value
