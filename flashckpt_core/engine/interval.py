"""Checkpoint intervals by the Young/Daly optimum, for two levels: memory and storage.

A memory snapshot survives a process failure (the saver keeps it) but not a node failure; a persisted
checkpoint survives both. With a snapshot pausing training for ``delta`` seconds and failures arriving
with mean time ``M``, the waste per unit of time is about ``delta / tau + (tau / 2 + R) / M`` (pauses,
plus half an interval of lost work and a restart per failure). Young (1974) minimised it at
``tau = sqrt(2 * delta * M)``; Daly (2006) refined it to

    tau = sqrt(2 delta M) * (1 + sqrt(delta / (2M)) / 3 + delta / (18 M)) - delta     for delta < 2M
    tau = M                                                                              otherwise

Memory snapshots are placed for process failures; persisted checkpoints for node failures, never more
often than a persist takes (the saver writes one at a time).

Without measured failure rates, ``default_failure_rates`` assumes the rate Meta published for the
pre-training of Llama 3 405B: 419 unexpected interruptions in a 54-day snapshot on 16,384 H100 GPUs,
about 78% of them attributed to confirmed or suspected hardware issues (A. Grattafiori et al., "The
Llama 3 Herd of Models", arXiv:2407.21783, 2024, section 3.3.4 and table 5).

``SavePolicy`` is what an engine's ``save(storage_type=None)`` asks: the fixed intervals, or ``AutoIntervals``
with ``auto_save``. Pure policy: nothing here does I/O but log lines; one engine call at a time uses it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from flashckpt import errors as E
from flashckpt.config import StorageType

__all__ = ["storage_type_for", "daly_interval", "young_interval", "expected_goodput", "IntervalChoice", "optimal_interval", "AutoIntervals",
           "mtbf_from_failures_per_day", "FailureRates", "default_failure_rates", "SavePolicy"]

log = logging.getLogger(__name__)

# Llama 3 405B pre-training (arXiv:2407.21783, section 3.3.4): unexpected interruptions, days, GPUs, and
# the share attributed to (confirmed or suspected) hardware.
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_HARDWARE_SHARE = 0.78
#: Mean time between unexpected interruptions per GPU, in seconds (about 50,677 GPU-hours).
GPU_MTBF_S = LLAMA3_GPUS * LLAMA3_DAYS * 86400.0 / LLAMA3_INTERRUPTIONS


def storage_type_for(step: int, memory_interval: int, storage_interval: int) -> StorageType | None:
    """What fixed intervals ask for at ``step``: DISK every ``storage_interval`` steps, else MEMORY every
    ``memory_interval`` steps, else None (0 turns an interval off)."""
    if storage_interval and step % storage_interval == 0:
        return StorageType.DISK
    if memory_interval and step % memory_interval == 0:
        return StorageType.MEMORY
    return None


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum ``sqrt(2 * cost * MTBF)`` (seconds of work between checkpoints)."""
    _check(cost_s, mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (seconds of work between checkpoints)."""
    _check(cost_s, mtbf_s)
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = math.sqrt(cost_s / (2.0 * mtbf_s))
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + x / 3.0 + x * x / 9.0) - cost_s


def _check(cost_s: float, mtbf_s: float) -> None:
    if not (cost_s >= 0 and math.isfinite(cost_s)):
        raise E.InvalidArgumentError(f"checkpoint cost must be a finite number >= 0 seconds, got {cost_s!r}")
    if not mtbf_s > 0:
        raise E.InvalidArgumentError(f"MTBF must be > 0 seconds (math.inf for no failures), got {mtbf_s!r}")


def mtbf_from_failures_per_day(failures_per_day: float) -> float:
    """Mean time between failures in seconds for a failure rate per day (0 means none: infinity)."""
    if failures_per_day < 0:
        raise E.InvalidArgumentError(f"failures_per_day must be >= 0, got {failures_per_day}")
    return math.inf if failures_per_day == 0 else 86400.0 / failures_per_day


@dataclass(frozen=True)
class FailureRates:
    """Failure rates assumed for a job: mean seconds between failures that memory survives
    (``process_mtbf_s``) and that lose the node's memory (``node_mtbf_s``), and where they came from."""

    process_mtbf_s: float
    node_mtbf_s: float
    world_size: int
    gpu_mtbf_s: float
    node_share: float

    def describe(self) -> str:
        return (f"{LLAMA3_INTERRUPTIONS} unexpected interruptions in {LLAMA3_DAYS} days on {LLAMA3_GPUS:,} GPUs "
                f"(Llama 3, arXiv:2407.21783): one per {self.gpu_mtbf_s / 3600:,.0f} GPU-hours, so one per "
                f"{self.gpu_mtbf_s / self.world_size / 3600:,.1f} h for {self.world_size} rank(s), "
                f"{self.node_share:.0%} of them losing the node: process_mtbf_s={self.process_mtbf_s:,.0f}, "
                f"node_mtbf_s={self.node_mtbf_s:,.0f}")


def default_failure_rates(world_size: int) -> FailureRates:
    """The failure rates ``auto_save`` assumes when none are given, for a job of ``world_size`` ranks
    (one GPU each).

    Every rank fails at the per-GPU rate Meta published for Llama 3 405B's pre-training (419 unexpected
    interruptions in 54 days on 16,384 GPUs: one per ~50,677 GPU-hours), so the job fails ``world_size``
    times as often. The interruptions attributed to hardware (78%) are taken to lose the node's memory
    (the host is usually drained or replaced: a conservative choice, which persists more often); the
    rest (software bugs, NCCL timeouts, ...) are process failures that memory survives.
    """
    if world_size < 1:
        raise E.InvalidArgumentError(f"world_size must be >= 1, got {world_size}")
    job_mtbf = GPU_MTBF_S / world_size
    return FailureRates(job_mtbf / (1.0 - LLAMA3_HARDWARE_SHARE), job_mtbf / LLAMA3_HARDWARE_SHARE, world_size,
                        GPU_MTBF_S, LLAMA3_HARDWARE_SHARE)


def expected_goodput(*, interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Useful time over elapsed time for one checkpoint level (first-order model, clipped to [0, 1])."""
    if interval_s <= 0:
        raise E.InvalidArgumentError(f"interval_s must be > 0, got {interval_s}")
    period = interval_s + cost_s
    waste = cost_s / period + (0.0 if math.isinf(mtbf_s) else (period / 2.0 + restart_s) / mtbf_s)
    return min(1.0, max(0.0, 1.0 - waste))


@dataclass(frozen=True)
class IntervalChoice:
    """Chosen intervals, in steps and seconds, and the goodput they are expected to give."""

    memory_steps: int
    storage_steps: int
    memory_interval_s: float
    storage_interval_s: float
    expected_goodput: float


def optimal_interval(*, step_time_s: float, snapshot_cost_s: float, persist_cost_s: float,
                     process_mtbf_s: float, node_mtbf_s: float, restart_from_memory_s: float = 0.0,
                     restart_from_storage_s: float = 0.0, max_steps: int = 1_000_000) -> IntervalChoice:
    """Memory and storage intervals for measured costs and given failure rates.

    Args:
        step_time_s: seconds per training step without checkpointing.
        snapshot_cost_s: seconds training pauses for one memory snapshot.
        persist_cost_s: seconds the saver takes to persist one snapshot (in the background).
        process_mtbf_s: mean time between failures memory survives (process crashes); ``math.inf`` for none.
        node_mtbf_s: mean time between failures that lose the node's memory; ``math.inf`` for none.
        restart_from_memory_s / restart_from_storage_s: time to resume after each kind of failure.
        max_steps: upper bound of either interval, in steps (used when failures are rare).

    Returns:
        The intervals (the storage interval is a multiple of the memory interval) and the expected goodput.
    """
    if step_time_s <= 0:
        raise E.InvalidArgumentError(f"step_time_s must be > 0, got {step_time_s}")
    cap = max_steps * step_time_s
    tau_m = cap if math.isinf(process_mtbf_s) else min(cap, daly_interval(snapshot_cost_s, process_mtbf_s))
    tau_s = cap if math.isinf(node_mtbf_s) else min(cap, daly_interval(snapshot_cost_s, node_mtbf_s))
    tau_s = max(tau_s, persist_cost_s, tau_m)
    mem_steps = max(1, min(max_steps, round(tau_m / step_time_s)))
    sto_steps = max(mem_steps, min(max_steps, round(tau_s / step_time_s / mem_steps) * mem_steps))
    tau_m, tau_s = mem_steps * step_time_s, sto_steps * step_time_s
    # Waste adds up across the two levels: pauses once (a storage save is also a memory snapshot),
    # lost work and restart per failure of each kind.
    pause = snapshot_cost_s / (tau_m + snapshot_cost_s)
    lost_p = 0.0 if math.isinf(process_mtbf_s) else ((tau_m + snapshot_cost_s) / 2 + restart_from_memory_s) / process_mtbf_s
    lost_n = 0.0 if math.isinf(node_mtbf_s) else ((tau_s + snapshot_cost_s) / 2 + restart_from_storage_s) / node_mtbf_s
    goodput = min(1.0, max(0.0, 1.0 - pause - lost_p - lost_n))
    return IntervalChoice(mem_steps, sto_steps, tau_m, tau_s, goodput)


class AutoIntervals:
    """Decides, step by step, whether to snapshot to memory, persist, or skip (``auto_save=True``).

    It measures the step time (between ``decide`` calls, minus the pauses of our own snapshots), the
    snapshot pause and the persist time (exponential moving averages), and places checkpoints by
    ``optimal_interval``. The first call snapshots to memory (to measure), the second persists (so a
    durable checkpoint exists early and the persist time is known). Pure: the caller passes the clock.

    Args:
        process_mtbf_s: mean time between failures memory survives (``math.inf`` for none).
        node_mtbf_s: mean time between failures that lose the node's memory (``math.inf`` for none).
        restart_from_memory_s / restart_from_storage_s: time to resume after each kind of failure.
        smoothing: weight of a new measurement in the moving averages.
    """

    def __init__(self, *, process_mtbf_s: float, node_mtbf_s: float, restart_from_memory_s: float = 0.0,
                 restart_from_storage_s: float = 0.0, smoothing: float = 0.3) -> None:
        if math.isinf(process_mtbf_s) and math.isinf(node_mtbf_s):
            raise E.InvalidArgumentError("auto_save needs a failure rate: give process_mtbf_s and/or node_mtbf_s in seconds "
                             "(interval.mtbf_from_failures_per_day converts a daily failure count), or leave both "
                             "unset for the default (interval.default_failure_rates)")
        _check(0.0, process_mtbf_s)
        _check(0.0, node_mtbf_s)
        self.process_mtbf_s, self.node_mtbf_s = process_mtbf_s, node_mtbf_s
        self.restart_from_memory_s, self.restart_from_storage_s = restart_from_memory_s, restart_from_storage_s
        self.smoothing = smoothing
        self.step_time_s: float | None = None
        self.snapshot_cost_s: float | None = None
        self.persist_cost_s = 0.0
        self.choice: IntervalChoice | None = None
        self._last_call: tuple[int, float] | None = None
        self._paused = 0.0
        self._last_memory: int | None = None
        self._last_storage: int | None = None

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def decide(self, step: int, now: float) -> str | None:
        """"memory", "storage" or None (skip) for ``step``, called once per training step at time ``now``."""
        if self._last_call is not None and step > self._last_call[0]:
            work = max(0.0, now - self._last_call[1] - self._paused) / (step - self._last_call[0])
            if work > 0:
                self.step_time_s = self._ewma(self.step_time_s, work)
        self._last_call, self._paused = (step, now), 0.0
        if self.snapshot_cost_s is None:
            return "memory"
        if self._last_storage is None:
            return "storage"
        if self.step_time_s is None:
            return None
        self.choice = optimal_interval(
            step_time_s=self.step_time_s, snapshot_cost_s=self.snapshot_cost_s, persist_cost_s=self.persist_cost_s,
            process_mtbf_s=self.process_mtbf_s, node_mtbf_s=self.node_mtbf_s,
            restart_from_memory_s=self.restart_from_memory_s, restart_from_storage_s=self.restart_from_storage_s)
        if step - self._last_storage >= self.choice.storage_steps:
            return "storage"
        if self._last_memory is None or step - self._last_memory >= self.choice.memory_steps:
            return "memory"
        return None

    def observe_snapshot(self, step: int, kind: str, pause_s: float) -> None:
        """Records a snapshot taken for ``step`` (``kind`` as returned by ``decide``) and its pause."""
        self.snapshot_cost_s = self._ewma(self.snapshot_cost_s, pause_s)
        self._paused += pause_s
        self._last_memory = step
        if kind == "storage":
            self._last_storage = step

    def observe_persist(self, seconds: float) -> None:
        """Records how long the saver took to persist a snapshot."""
        if seconds > 0:
            self.persist_cost_s = self._ewma(self.persist_cost_s or None, seconds)


class SavePolicy:
    """Which snapshot ``CheckpointEngine.save(storage_type=None)`` takes at a step: the fixed intervals
    (``memory_interval``, ``storage_interval``: 0 turns one off) or, with ``auto``, ``AutoIntervals``; and
    what the engine measured (snapshot pauses, persist times) for ``auto``.

    Args:
        memory_interval / storage_interval: the engine's ``save_mem_interval`` / ``save_storage_interval``.
        auto: the interval chooser of ``auto_save`` (``for_auto_save`` makes it); None without.
    """

    def __init__(self, memory_interval: int, storage_interval: int, auto: AutoIntervals | None = None) -> None:
        self.memory_interval, self.storage_interval, self.auto = memory_interval, storage_interval, auto

    @staticmethod
    def for_auto_save(process_mtbf_s: float | None, node_mtbf_s: float | None, world_size: int) -> AutoIntervals:
        """``auto_save``'s interval chooser, with the default failure rates when none are given."""
        if process_mtbf_s is None and node_mtbf_s is None:
            rates = default_failure_rates(world_size)
            log.info("auto_save: no failure rates given; assuming %s. Pass process_mtbf_s / node_mtbf_s (seconds) "
                     "to use your cluster's own", rates.describe())
            return AutoIntervals(process_mtbf_s=rates.process_mtbf_s, node_mtbf_s=rates.node_mtbf_s)
        return AutoIntervals(process_mtbf_s=math.inf if process_mtbf_s is None else process_mtbf_s,
                             node_mtbf_s=math.inf if node_mtbf_s is None else node_mtbf_s)

    def choose(self, step: int, storage_type: StorageType | None, now: float) -> tuple[StorageType | None, str | None]:
        """The snapshot to take at ``step`` (None: skip the step) for ``save``'s ``storage_type`` (None:
        the intervals decide), and ``auto``'s kind of it ("memory", "storage"; None when ``auto`` did not
        decide); ``now``: a monotonic clock.

        Raises:
            InvalidArgumentError: ``storage_type`` is neither MEMORY nor DISK, or None without any interval.
        """
        auto_kind = None
        if storage_type is None and self.auto is not None:
            auto_kind = self.auto.decide(step, now)
            if auto_kind is None:
                return None, None
            storage_type = StorageType.DISK if auto_kind == "storage" else StorageType.MEMORY
        if storage_type is None:
            if not (self.memory_interval or self.storage_interval):
                raise E.InvalidArgumentError(f"save(step={step}, storage_type=None): no interval is set, so nothing would "
                                 "be saved; pass storage_type=StorageType.MEMORY or DISK, or construct the "
                                 "engine with save_mem_interval / save_storage_interval")
            return storage_type_for(step, self.memory_interval, self.storage_interval), None
        if storage_type not in (StorageType.MEMORY, StorageType.DISK):
            raise E.InvalidArgumentError(f"save(storage_type={storage_type!r}): use StorageType.MEMORY or StorageType.DISK")
        return storage_type, auto_kind

    def observe_snapshot(self, step: int, auto_kind: str | None, blocked: float) -> None:
        """A snapshot ``auto`` decided (``auto_kind``) paused training ``blocked`` seconds; logs the
        intervals when they change."""
        auto = self.auto
        if auto_kind is None or auto is None:
            return
        before = auto.choice
        auto.observe_snapshot(step, auto_kind, blocked)
        if auto.choice is not None and (before is None or (before.memory_steps, before.storage_steps)
                                        != (auto.choice.memory_steps, auto.choice.storage_steps)):
            c = auto.choice
            log.info("event=auto_intervals memory_steps=%d storage_steps=%d step_s=%.4f snapshot_s=%.4f "
                     "persist_s=%.3f expected_goodput=%.4f", c.memory_steps, c.storage_steps, auto.step_time_s or 0,
                     auto.snapshot_cost_s or 0, auto.persist_cost_s, c.expected_goodput)

    def observe_persist(self, seconds: float) -> None:
        """The saver reported the time of its last persist (for ``auto``)."""
        if self.auto is not None:
            self.auto.observe_persist(seconds)
