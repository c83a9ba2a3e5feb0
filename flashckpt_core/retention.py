"""Which committed checkpoints to delete. Strategies are pure functions of the committed steps on
storage, so their state survives restarts; the engine applies them only after a commit and the
newest committed step is never deleted. "Newest" is the most recently committed step, which after a
rollback (a lower step saved after higher ones) is not the highest: strategies get the steps in commit
order."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

__all__ = ["CheckpointDeletionStrategy", "KeepLatestStepStrategy", "KeepStepIntervalStrategy"]


class CheckpointDeletionStrategy(ABC):
    """Decides which committed steps to delete.

    Call order: after each commit it observes, global rank 0's engine lists the committed steps on
    storage in commit order (the most recently committed last; ascending unless a step was saved again
    or the job rolled back), calls ``steps_to_delete`` and has the node's saver delete those steps.
    Other ranks never call it. The most recently committed step is removed from the answer before
    deleting.
    """

    @abstractmethod
    def steps_to_delete(self, committed_steps: Sequence[int]) -> list[int]:
        """The steps among ``committed_steps`` (in commit order, the newest last) to delete."""

    def clean_up(self, step: int, delete_func: Callable[[int], None],
                 committed_steps: Sequence[int] | None = None) -> None:
        """Seed-compatible entry point: deletes through ``delete_func`` after ``step`` was committed."""
        steps = [s for s in (committed_steps or []) if s != step] + [step]  # ``step`` was committed last
        newest = steps[-1]
        for s in self.steps_to_delete(steps):
            if s != newest:
                delete_func(s)


class KeepLatestStepStrategy(CheckpointDeletionStrategy):
    """Keeps the ``max_to_keep`` most recently committed steps.

    Args:
        max_to_keep: how many to keep (at least 1).
        checkpoint_dir: the checkpoint dir it applies to (kept for the seed signature).
    """

    def __init__(self, max_to_keep: int, checkpoint_dir: str = "") -> None:
        if max_to_keep < 1:
            raise ValueError(f"KeepLatestStepStrategy(max_to_keep={max_to_keep}): keep at least 1")
        self.max_to_keep = max_to_keep
        self.checkpoint_dir = checkpoint_dir

    def steps_to_delete(self, committed_steps: Sequence[int]) -> list[int]:
        steps = list(committed_steps)
        return steps[: max(0, len(steps) - self.max_to_keep)]


class KeepStepIntervalStrategy(CheckpointDeletionStrategy):
    """Keeps the steps that are multiples of ``keep_interval`` (and always the newest).

    Args:
        keep_interval: steps divisible by it are kept.
        checkpoint_dir: the checkpoint dir it applies to (kept for the seed signature).
    """

    def __init__(self, keep_interval: int, checkpoint_dir: str = "") -> None:
        if keep_interval < 1:
            raise ValueError(f"KeepStepIntervalStrategy(keep_interval={keep_interval}): must be >= 1")
        self.keep_interval = keep_interval
        self.checkpoint_dir = checkpoint_dir

    def steps_to_delete(self, committed_steps: Sequence[int]) -> list[int]:
        steps = list(committed_steps)
        return [s for s in steps[:-1] if s % self.keep_interval != 0]
