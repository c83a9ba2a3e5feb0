"""How far behind storage is, and what a failed persist does to training: ``DurabilityPolicy`` and the
``Durability`` report (``CheckpointEngine.durability()``).

The saver reports each commit with its times (``StatusReply.commits``: the step, the tier, the wall time of
the snapshot its files came from and of the commit). From them and from this rank's own saves the policy
knows, at any moment, the newest step in memory, the newest durable step, the lag of each commit (from its
snapshot to its commit) and the lag now: how long ago the oldest storage save that is not yet durable was
taken (0 when storage holds everything asked of it). A save asked of storage that keeps failing keeps the
lag growing; a newer durable commit ends it.

Two policies (``on_persist_error``, FLASHCKPT_ON_PERSIST_ERROR):

- ``"raise"`` (the default): a failed persist or commit raises ``PersistError`` at the next save or wait,
  as it always did; with a lag bound (``max_lag_s``, FLASHCKPT_MAX_LAG_S), a save finding storage further
  behind than the bound raises ``DurabilityLagError`` once its snapshot is in memory.
- ``"warn"``: training goes on. Each failure is logged once, as a warning naming what failed and what is
  still safe (the newest durable step, the newest snapshot in memory); a lag over the bound is logged once
  when it is crossed and once when storage has caught up again. Later saves to storage go on being asked,
  so storage catches up by itself when it answers again.

Imports ``errors`` only; pure bookkeeping, used by one engine call at a time (the engine's guard)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from flashckpt import errors as E

__all__ = ["Durability", "DurabilityPolicy", "POLICIES"]

log = logging.getLogger("flashckpt.engine")

#: The values ``on_persist_error`` takes.
POLICIES = ("raise", "warn")
#: Seconds a checkpoint dir found unreadable under "warn" is left alone by saves (then read again), by default.
UNREADABLE_BACKOFF_S = 30.0


@dataclass(frozen=True)
class Durability:
    """Where this rank's newest state is safe, as its engine knows it now.

    Attributes:
        memory_step: the newest step this engine snapshotted into the node's memory (None: none yet).
        local_step: with a node-local tier (``local_dir``), the newest step committed there (None: none).
        durable_step: the newest step committed in the checkpoint dir (None: none).
        lag_s: how far the checkpoint dir is behind now: seconds since the oldest save asked of storage
            that is not committed yet was taken (0.0: storage holds every step asked of it).
        pending: the steps asked of storage that are not committed yet (oldest first).
        commit_lags: step -> seconds from its snapshot to its commit, for the newest commits seen.
        failures: failed persists and commits seen by this engine (raised or, with ``"warn"``, logged).
        policy: ``on_persist_error``; max_lag_s: the bound on ``lag_s`` (None: none).
    """

    memory_step: int | None
    local_step: int | None
    durable_step: int | None
    lag_s: float
    pending: tuple[int, ...]
    commit_lags: dict[int, float] = field(default_factory=dict)
    failures: int = 0
    policy: str = "raise"
    max_lag_s: float | None = None


class DurabilityPolicy:
    """One engine's view of durability and its failure policy (see the module docstring).

    Args:
        on_error: ``"raise"`` or ``"warn"``.
        max_lag_s: the lag bound in seconds (None or 0: none).
        where: the checkpoint dir, for messages.
        backoff_s: under "warn", how long saves leave a checkpoint dir found unreadable alone.
    """

    _KEEP = 16  # commit lags kept for the report

    def __init__(self, on_error: str, max_lag_s: float | None, where: str, *,
                 backoff_s: float = UNREADABLE_BACKOFF_S) -> None:
        if on_error not in POLICIES:
            raise E.InvalidArgumentError(f"on_persist_error={on_error!r}: must be one of {', '.join(POLICIES)} "
                                         "(\"warn\" goes on training while storage fails)")
        if max_lag_s is not None and (not isinstance(max_lag_s, (int, float)) or max_lag_s < 0):
            raise E.InvalidArgumentError(f"max_lag_s={max_lag_s!r}: seconds >= 0 (None or 0: no bound)")
        self.on_error = on_error
        self.max_lag_s = float(max_lag_s) if max_lag_s else None
        self.where = where
        self.backoff_s = backoff_s
        self.memory_step: int | None = None
        self.local_step: int | None = None
        self.durable_step: int | None = None
        self._pending: dict[int, float] = {}  # step asked of storage -> wall time of its save
        self._lags: dict[int, float] = {}
        self._failures = 0
        self._over = False  # the lag is over the bound (warned once)
        self._retrying: set[int] = set()  # steps whose retried upload failed (reported once)
        self._unreadable_until = 0.0  # "warn": the checkpoint dir could not be read; not asked again before

    @property
    def warns(self) -> bool:
        return self.on_error == "warn"

    # ------------------------------------------------------------------ what happened
    def saved(self, step: int, to_storage: bool, at: float | None = None) -> None:
        """This rank snapshotted ``step`` (and asked the saver to persist it, ``to_storage``)."""
        self.memory_step = step
        if to_storage:
            self.owe(step, at)

    def owe(self, step: int, at: float | None = None) -> None:
        """Storage owes ``step`` (asked of it: persisting, or not persisted because the checkpoint dir could
        not be read)."""
        self._pending[step] = time.time() if at is None else at

    def observe(self, committed: list[int], commits: list[dict[str, Any]]) -> None:
        """A status reply's commits: ``committed`` (in commit order) and their times (``StatusReply.commits``)."""
        for c in commits:
            if c.get("tier", "durable") == "local":
                self.local_step = int(c["step"])  # oldest first: the last one is the newest
            elif c.get("lag_s") is not None:
                self._lags[int(c["step"])] = float(c["lag_s"])
        while len(self._lags) > self._KEEP:
            del self._lags[min(self._lags)]
        if committed:
            newest = committed[-1]
            self.durable_step = newest
            # A durable step supersedes every save asked of storage up to it (those failed or were
            # superseded); saves after it are still owed.
            self._pending = {s: t for s, t in self._pending.items() if s > newest}
            self._retrying = {s for s in self._retrying if s > newest}

    def lag_s(self, now: float | None = None) -> float:
        """Seconds since the oldest save asked of storage that is not durable yet was taken (0.0: none)."""
        if not self._pending:
            return 0.0
        return max(0.0, (time.time() if now is None else now) - min(self._pending.values()))

    def first_report(self, error: dict[str, Any]) -> bool:
        """Whether a status error entry is news: an attempt at an upload the saver retries (``"retrying"``)
        counts once per step until that step is durable; every other failure counts each time."""
        if not error.get("retrying"):
            return True
        step = int(error["step"])
        if step in self._retrying:
            return False
        self._retrying.add(step)
        return True

    # ------------------------------------------------------------------ a checkpoint dir that cannot be read
    def unreadable(self, now: float | None = None) -> bool:
        """Whether the checkpoint dir was found unreadable less than ``backoff_s`` ago ("warn"):
        a save to storage then goes to memory at once, owed, instead of waiting out the store's deadline
        again on the training path."""
        return (time.monotonic() if now is None else now) < self._unreadable_until

    def not_readable(self, step: int, why: str, now: float | None = None) -> None:
        """``save(step)`` found the checkpoint dir unreadable ("warn"): the step is owed, the failure counted
        (logged at the outage's start only; ``readable`` logs its end), and the dir left alone for
        ``backoff_s`` from the save that asked it."""
        t = time.monotonic() if now is None else now
        if self.unreadable(t):  # not asked: the back-off runs from the save that asked
            self._failures += 1
        elif self._unreadable_until:  # asked again, still unreadable: the outage was logged at its start
            self._failures += 1
            self._unreadable_until = t + self.backoff_s
        else:
            self.failed(f"save(step={step}) is not persisted: {why}; later saves go to memory only, owed to "
                        f"storage, until it is read again (tried every {self.backoff_s:g} s)", 1)
            self._unreadable_until = t + self.backoff_s
        self.owe(step)

    def readable(self) -> None:
        """The checkpoint dir was read again."""
        if self._unreadable_until:
            log.warning("the checkpoint dir %s can be read again: saves to storage persist again", self.where)
        self._unreadable_until = 0.0

    # ------------------------------------------------------------------ what it does to training
    def failed(self, message: str, count: int) -> bool:
        """``count`` persist or commit failures (``message`` says which): True when they are to be raised;
        with ``"warn"`` each is logged here, once, with what is still safe, and False."""
        self._failures += count
        if not self.warns:
            return True
        log.warning("%s. Training goes on (on_persist_error='warn'); still safe: %s", message, self.safe())
        return False

    def check_lag(self, now: float | None = None) -> None:
        """After a save: with a bound, a lag over it raises (``"raise"``) or is logged once (``"warn"``).

        Raises:
            DurabilityLagError: the checkpoint dir is further behind than ``max_lag_s`` (``"raise"``).
        """
        if self.max_lag_s is None:
            return
        lag = self.lag_s(now)
        if lag <= self.max_lag_s:
            if self._over:
                log.warning("the checkpoint dir %s has caught up (durable step %s)", self.where, self.durable_step)
            self._over = False
            return
        owed = sorted(self._pending)
        msg = (f"the checkpoint dir {self.where} is {lag:.0f} s behind (bound max_lag_s={self.max_lag_s:g}): steps "
               f"{owed} asked of storage are not committed; still safe: {self.safe()}")
        if not self.warns:
            raise E.DurabilityLagError(msg + ". The snapshot of this save is in memory. Check the store (its errors "
                                       "are in the saver's log), raise the bound, or use on_persist_error='warn' "
                                       "to go on training meanwhile")
        if not self._over:
            log.warning("%s; training goes on (on_persist_error='warn')", msg)
        self._over = True

    def safe(self) -> str:
        """What is safe now, in words: the newest durable step and the newest snapshot in memory."""
        durable = f"step {self.durable_step} committed in {self.where}" if self.durable_step is not None else \
            f"no step committed in {self.where} yet"
        memory = f"step {self.memory_step} in the node's memory" if self.memory_step is not None else "nothing in memory"
        local = f"; step {self.local_step} committed on the node's local tier" if self.local_step is not None else ""
        return f"{durable}{local}; {memory}"

    def report(self, now: float | None = None) -> Durability:
        """The ``Durability`` report now."""
        return Durability(self.memory_step, self.local_step, self.durable_step, self.lag_s(now), tuple(sorted(self._pending)),
                          dict(self._lags), self._failures, self.on_error, self.max_lag_s)
