"""When an engine applies its deletion strategy: ``Deletions``.

Global rank 0's engine applies the strategy (``commit.retention``) after each commit newer than any that
existed when the engine started (an engine that only loads never deletes checkpoints), once per commit
order seen; the step committed last is never deleted, whatever its number. A ``clean_up`` strategy
(DLRover's contract) is called once per commit seen since its last call. The deletions themselves run in
the node's saver (``DeleteSteps`` requests, or the engine's ``delete_checkpoint`` given to ``clean_up``).

Imports ``commit.retention`` and ``transport.messages`` only; the engine hands in how to send a request and
how to delete a path. Used by one engine call at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from flashckpt.commit.retention import CheckpointDeletionStrategy, uses_clean_up
from flashckpt.transport import messages as M

__all__ = ["Deletions"]

log = logging.getLogger(__name__)


class Deletions:
    """The deletion strategy of one engine, applied after the commits the saver reports.

    Args:
        strategy: the engine's deletion strategy (None: keep every checkpoint).
        applies: whether this rank applies it (global rank 0).
        call: sends a request to the node's saver (the engine's ``_client_call``).
        delete: the ``delete_func`` a ``clean_up`` strategy is given (the engine's ``delete_checkpoint``).
    """

    def __init__(self, strategy: CheckpointDeletionStrategy | None, *, applies: bool, call: Callable[[Any], Any],
                 delete: Callable[[Any], None]) -> None:
        self.strategy, self.applies, self._call, self._delete = strategy, applies, call, delete
        self.ready = False  # the commit records were readied: what existed at the start is known
        self.applied: tuple[int, ...] = ()  # the commit order the strategy was last applied to
        self._baseline = -1  # the step committed last before this engine started
        self._cleaned_up: list[int] = []  # commit order last seen by a clean_up strategy

    def readied(self, committed: list[int]) -> None:
        """The saver readied the commit records, with ``committed`` (in commit order) committed then: the
        steps left alone until a newer commit."""
        self.ready = True
        self._baseline = committed[-1] if committed else -1  # in commit order
        self._cleaned_up = list(committed)

    def after_commits(self, committed: list[int]) -> None:
        """Applies the strategy to ``committed`` (in commit order), as the saver reported it."""
        if not self.applies or self.strategy is None or not committed or not self.ready:
            return  # (without the records, what existed when this engine started is not known yet)
        if uses_clean_up(self.strategy):
            self._clean_up(committed)
            return
        if committed[-1] == self._baseline:
            return
        key = tuple(committed)
        if key == self.applied:
            return
        doomed = [s for s in self.strategy.steps_to_delete(committed) if s != committed[-1]]
        self.applied = key
        if doomed:
            self._call(M.DeleteSteps(steps=doomed, background=True))

    def _clean_up(self, committed: list[int]) -> None:
        """DLRover's contract: ``clean_up(step, delete_func)`` once per commit seen since the last call,
        with the step committed just before it (in commit order); a step committed again counts anew."""
        seen = self._cleaned_up
        if committed == seen:
            return
        self._cleaned_up = list(committed)
        self.applied = tuple(committed)  # wait() waits for the deletions this schedules
        before = set(seen)
        moved = bool(seen) and committed[-1] in before and committed[-1] != seen[-1]  # saved again
        strategy = self.strategy
        assert strategy is not None  # checked by the caller
        for i, step in enumerate(committed):
            if i == 0 or (step in before and not (moved and i == len(committed) - 1)):
                continue
            prev = committed[i - 1]
            try:
                strategy.clean_up(prev, self._delete)
            except Exception as e:  # retention never stops training; the strategy's fault is reported
                log.error("%s.clean_up(step=%d) after the commit of step %d failed: %s: %s", type(strategy).__name__,
                          prev, step, type(e).__name__, e)
