"""What checkpointing does, as one stream of typed events in the training process: ``EventStream``.

Every event is a frozen dataclass (``Event`` and its kinds below), made where the work happens: snapshots
and loads by this engine, persists, commits, uploads, retries, last words and replica traffic by the node's
saver, which keeps them in a journal (``saver.state.SaverState.note``) that every status reply carries from
the engine's cursor on (``StatusReply.events``), and failures by the engine's durability policy. The stream
hands each event to three readers, in the training thread, during the engine call that learnt of it (a
save, ``wait``, ``stats``, a load, ``close``): the listeners (``CheckpointEngine.add_listener``), Python
logging (one line per event at INFO on the ``flashckpt.events`` logger, in the trainer's own log), and a
running summary (``Stats``, ``CheckpointEngine.stats()``). A Prometheus text file (``PrometheusFile``,
FLASHCKPT_METRICS_FILE, off by default) is one more listener.

Which engine hears which event: each engine hears its own rank's (snapshots, loads, failures, the persists
and backups of its rank's snapshots); the node's events that belong to no rank of it (commits, retries,
last words, backups received from other nodes) are heard by the node's local rank 0. Commits on the durable
tier are made by global rank 0's node, so that engine hears every durable commit.

Imports ``errors`` only; used by one engine call at a time (the engine's guard), listeners included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from flashckpt import errors as E

__all__ = ["Event", "SnapshotTaken", "PersistStarted", "Persisted", "PersistFailed", "Committed", "Uploaded",
           "Retried", "LastWords", "ReplicaSent", "ReplicaReceived", "Loaded", "Failed", "Stats", "EventStream",
           "PrometheusFile", "Listener", "metrics_file"]

log = logging.getLogger("flashckpt.events")

_MB = 1e6


@dataclass(frozen=True)
class Event:
    """One thing checkpointing did. ``kind``: the event's name (the class's ``KIND``); ``time``: when (wall
    time, seconds since the epoch); ``step``: the training step it concerns (None: none); ``rank``: the global
    rank whose state it concerns (None: the job's, such as a commit)."""

    KIND: ClassVar[str] = "event"
    time: float
    step: int | None = None
    rank: int | None = None

    @property
    def kind(self) -> str:
        return self.KIND

    def describe(self) -> str:
        """One line in plain words (what the ``flashckpt.events`` logger prints)."""
        return f"{self.kind} of step {self.step}"


def _mb(n: int) -> str:
    return f"{n / _MB:.1f} MB"


def _rate(nbytes: int, seconds: float) -> float | None:
    return nbytes / _MB / seconds if seconds > 0 else None


@dataclass(frozen=True)
class SnapshotTaken(Event):
    """A save copied the state into shared memory: ``bytes`` copied, ``pause_s`` the time training waited for
    the save call, ``storage`` "memory" or "disk" (persisted next), ``overlap`` whether the copy went on in
    the background after the call returned."""

    KIND: ClassVar[str] = "snapshot"
    bytes: int = 0
    pause_s: float = 0.0
    storage: str = "memory"
    overlap: bool = False

    def describe(self) -> str:
        then = ", to be persisted" if self.storage == "disk" else ""
        return f"step {self.step}: snapshot of {_mb(self.bytes)} in memory, training paused {self.pause_s * 1e3:.1f} ms{then}"


@dataclass(frozen=True)
class PersistStarted(Event):
    """The saver began writing rank ``rank``'s snapshot of ``step`` to ``path`` on ``tier`` ("durable": the
    checkpoint dir; "local": the node-local tier)."""

    KIND: ClassVar[str] = "persist_start"
    bytes: int = 0
    path: str = ""
    tier: str = "durable"

    def describe(self) -> str:
        return f"step {self.step}: persisting rank {self.rank}'s {_mb(self.bytes)} to {self.path} ({self.tier} tier)"


@dataclass(frozen=True)
class Persisted(Event):
    """Rank ``rank``'s files of ``step`` are written (not yet committed: ``Committed`` says that)."""

    KIND: ClassVar[str] = "persist"
    bytes: int = 0
    seconds: float = 0.0
    path: str = ""
    tier: str = "durable"

    @property
    def mb_per_s(self) -> float | None:
        """The write throughput in MB/s (None: no time measured)."""
        return _rate(self.bytes, self.seconds)

    def describe(self) -> str:
        rate = self.mb_per_s
        return (f"step {self.step}: rank {self.rank}'s {_mb(self.bytes)} written to the {self.tier} tier in "
                f"{self.seconds:.2f} s" + (f" ({rate:.1f} MB/s)" if rate is not None else ""))


@dataclass(frozen=True)
class PersistFailed(Event):
    """Writing rank ``rank``'s files of ``step`` failed (``error`` says where and why)."""

    KIND: ClassVar[str] = "persist_failed"
    error: str = ""

    def describe(self) -> str:
        return f"step {self.step}: persisting rank {self.rank}'s files failed: {self.error}"


@dataclass(frozen=True)
class Committed(Event):
    """``step`` is committed on ``tier`` ("durable": the checkpoint dir; "local": this node's local tier):
    ``lag_s`` from its snapshot to the commit (None: unknown), ``bytes`` of its files (the node's, on the
    local tier)."""

    KIND: ClassVar[str] = "commit"
    tier: str = "durable"
    lag_s: float | None = None
    bytes: int = 0
    ranks: tuple[int, ...] = ()

    def describe(self) -> str:
        lag = "" if self.lag_s is None else f", {self.lag_s:.2f} s after its snapshot"
        where = "the checkpoint dir" if self.tier == "durable" else "the node's local tier"
        return f"step {self.step}: committed on {where} ({_mb(self.bytes)}{lag})"


@dataclass(frozen=True)
class Uploaded(Event):
    """``step`` went from the node-local tier to the checkpoint dir: ``bytes``, ``seconds``, ``attempts``."""

    KIND: ClassVar[str] = "upload"
    bytes: int = 0
    seconds: float = 0.0
    attempts: int = 1

    def describe(self) -> str:
        again = f" after {self.attempts} attempts" if self.attempts > 1 else ""
        return f"step {self.step}: uploaded {_mb(self.bytes)} to the checkpoint dir in {self.seconds:.2f} s{again}"


@dataclass(frozen=True)
class Retried(Event):
    """Requests to the store were retried since the last such event: ``counts`` by why ("throttled": the
    store asked to slow down; "unreachable": refused, timed out or stalled; "error": another retryable
    error)."""

    KIND: ClassVar[str] = "retry"
    counts: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        return "storage requests retried: " + ", ".join(f"{n} {k}" for k, n in sorted(self.counts.items()))


@dataclass(frozen=True)
class LastWords(Event):
    """The saver persists ``step``, the newest snapshot, because its trainers ended or failed (last words:
    what a crash would otherwise lose), for ``ranks``."""

    KIND: ClassVar[str] = "last_words"
    ranks: tuple[int, ...] = ()

    def describe(self) -> str:
        return f"step {self.step}: last words: the saver persists the newest snapshot of ranks {list(self.ranks)}"


@dataclass(frozen=True)
class ReplicaSent(Event):
    """A copy of rank ``rank``'s snapshot of ``step`` went to another node: ``what`` "backup" (to its partner
    node, ``node``) or "fetch" (asked for by a node resuming from it)."""

    KIND: ClassVar[str] = "replica_sent"
    what: str = "backup"
    node: int | None = None
    bytes: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        to = f" to node {self.node}" if self.node is not None else ""
        return f"step {self.step}: {self.what} of rank {self.rank}'s snapshot sent{to}: {_mb(self.bytes)} in {self.seconds:.2f} s"


@dataclass(frozen=True)
class ReplicaReceived(Event):
    """A copy of rank ``rank``'s snapshot of ``step`` arrived from another node (``what``: "backup" or
    "fetch"); ``ok`` False: it changed while it was sent and was not kept."""

    KIND: ClassVar[str] = "replica_received"
    what: str = "backup"
    bytes: int = 0
    seconds: float = 0.0
    ok: bool = True

    def describe(self) -> str:
        kept = "" if self.ok else " (changed while sent: not kept)"
        return f"step {self.step}: {self.what} of rank {self.rank}'s snapshot received: {_mb(self.bytes)} in {self.seconds:.2f} s{kept}"


@dataclass(frozen=True)
class Loaded(Event):
    """A load returned ``step`` from ``source`` ("memory", "local", "storage", or "none": nothing to
    load) in ``seconds``; ``note``: why memory was not used, when it was not."""

    KIND: ClassVar[str] = "load"
    source: str = "none"
    seconds: float = 0.0
    bytes: int = 0
    note: str = ""

    def describe(self) -> str:
        if self.source == "none":
            return "load: no checkpoint to resume" + (f" ({self.note})" if self.note else "")
        return f"load: step {self.step} from {self.source} in {self.seconds:.2f} s ({_mb(self.bytes)})"


@dataclass(frozen=True)
class Failed(Event):
    """A persist, commit or upload failed (``error``), and what is still safe: the newest durable step, the
    newest on the local tier, the newest in memory (None: none)."""

    KIND: ClassVar[str] = "failure"
    error: str = ""
    durable_step: int | None = None
    local_step: int | None = None
    memory_step: int | None = None

    def describe(self) -> str:
        return (f"checkpoint failure: {self.error} (still safe: durable step {self.durable_step}, local step "
                f"{self.local_step}, memory step {self.memory_step})")


Listener = Callable[[Event], Any]

# The saver's journal entries (``SaverState.note``) as events: its kind -> the event's class.
_FROM_SAVER: dict[str, type[Event]] = {
    "persist_start": PersistStarted, "persist": Persisted, "persist_failed": PersistFailed, "commit": Committed,
    "upload": Uploaded, "retry": Retried, "last_words": LastWords, "backup_sent": ReplicaSent,
    "replica_fetch_sent": ReplicaSent, "backup_received": ReplicaReceived, "replica_fetch": ReplicaReceived,
}
# The saver's kinds about a snapshot of this node's own rank (heard by that rank's engine; the others by
# local rank 0's).
_OWN = frozenset({"persist_start", "persist", "persist_failed", "backup_sent"})
_WHAT = {"backup_sent": "backup", "replica_fetch_sent": "fetch", "backup_received": "backup", "replica_fetch": "fetch"}


def from_saver(rec: dict[str, Any]) -> Event | None:
    """The event of one saver journal entry (None: a kind this engine does not know, from a newer saver)."""
    kind = str(rec.get("kind", ""))
    cls = _FROM_SAVER.get(kind)
    if cls is None:
        return None
    names = {f.name: f for f in dataclasses.fields(cls)}
    args: dict[str, Any] = {k: v for k, v in rec.items() if k in names}
    if "what" in names and kind in _WHAT:
        args["what"] = _WHAT[kind]
    if "ranks" in args:
        args["ranks"] = tuple(int(r) for r in args["ranks"] or ())
    try:
        return cls(**args)
    except TypeError:
        return None


@dataclass(frozen=True)
class Stats:
    """The running summary of one engine's events (``CheckpointEngine.stats()``).

    Attributes:
        snapshots: saves that took a snapshot; snapshot_bytes: the last one's size; pause_s_total /
            pause_s_last / pause_s_max: how long training waited for them.
        persists / persisted_bytes / persist_seconds: this rank's files written; persist_mb_per_s: their
            throughput, persist_s_last: the newest one's seconds (None: none yet).
        commits: per tier ("durable", "local"), the commits heard; durable_step / local_step / memory_step:
            the newest step committed on each tier and in memory (None: none), and lag_s: how far the
            checkpoint dir is behind the newest storage save now, as ``durability()`` knows them (it sees
            every save and every commit the saver reports, on every rank).
        retries: storage requests retried, by why; failures: failures seen; last_words: steps persisted as
            last words.
        loads: loads, by source; last_load: the newest ``Loaded`` (None: none).
        replica_sent_bytes / replica_received_bytes: snapshots copied to and from other nodes.
        events: events heard; missed: events the saver's journal no longer had when this engine asked (it
            keeps the newest 1024).
    """

    snapshots: int = 0
    snapshot_bytes: int = 0
    pause_s_total: float = 0.0
    pause_s_last: float = 0.0
    pause_s_max: float = 0.0
    persists: int = 0
    persisted_bytes: int = 0
    persist_seconds: float = 0.0
    persist_mb_per_s: float | None = None
    persist_s_last: float | None = None
    commits: dict[str, int] = field(default_factory=dict)
    durable_step: int | None = None
    local_step: int | None = None
    memory_step: int | None = None
    lag_s: float = 0.0
    retries: dict[str, int] = field(default_factory=dict)
    failures: int = 0
    last_words: int = 0
    loads: dict[str, int] = field(default_factory=dict)
    last_load: Loaded | None = None
    replica_sent_bytes: int = 0
    replica_received_bytes: int = 0
    events: int = 0
    missed: int = 0


def _add(counts: dict[str, int], key: str, n: int = 1) -> dict[str, int]:
    return {**counts, key: counts.get(key, 0) + n}


def _summed(s: Stats, ev: Event) -> Stats:
    """``s`` after ``ev``."""
    up: dict[str, Any] = {"events": s.events + 1}
    if isinstance(ev, SnapshotTaken):
        up.update(snapshots=s.snapshots + 1, snapshot_bytes=ev.bytes, pause_s_total=s.pause_s_total + ev.pause_s,
                  pause_s_last=ev.pause_s, pause_s_max=max(s.pause_s_max, ev.pause_s))
    elif isinstance(ev, Persisted):
        nbytes, secs = s.persisted_bytes + ev.bytes, s.persist_seconds + ev.seconds
        up.update(persists=s.persists + 1, persisted_bytes=nbytes, persist_seconds=secs,
                  persist_mb_per_s=_rate(nbytes, secs), persist_s_last=ev.seconds)
    elif isinstance(ev, Committed):
        up["commits"] = _add(s.commits, ev.tier)
    elif isinstance(ev, Retried):
        retries = dict(s.retries)
        for k, n in ev.counts.items():
            retries = _add(retries, k, int(n))
        up["retries"] = retries
    elif isinstance(ev, (Failed, PersistFailed)):
        up["failures"] = s.failures + 1
    elif isinstance(ev, LastWords):
        up["last_words"] = s.last_words + 1
    elif isinstance(ev, Loaded):
        up.update(loads=_add(s.loads, ev.source), last_load=ev)
    elif isinstance(ev, ReplicaSent):
        up["replica_sent_bytes"] = s.replica_sent_bytes + ev.bytes
    elif isinstance(ev, ReplicaReceived):
        up["replica_received_bytes"] = s.replica_received_bytes + ev.bytes
    return dataclasses.replace(s, **up)


class EventStream:
    """One engine's events: heard (``emit``, ``from_saver``), handed to the listeners, logged, summed.

    Args:
        rank / local_rank: the engine's.
    """

    def __init__(self, rank: int, local_rank: int) -> None:
        self.rank, self.local_rank = rank, local_rank
        self._listeners: list[tuple[Listener, frozenset[str] | None]] = []
        self._stats = Stats()
        self._holding = 0  # inside ``one_load``: the loads it makes are one, emitted by its caller
        self._after: list[Event] | None = None  # inside ``after``: the events heard, emitted at its end

    @contextlib.contextmanager
    def one_load(self) -> Iterator[None]:
        """Inside, ``Loaded`` events are not emitted: an adapter's load (``resolve_load``) reads memory or
        storage through engine calls that each report a load, and reports the one load they make up itself."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1

    def add_listener(self, fn: Listener, kinds: Iterable[str] | None = None) -> Callable[[], None]:
        """Calls ``fn(event)`` for every event from now on (only those whose ``kind`` is in ``kinds``, when
        given); returns a function that removes it."""
        if not callable(fn):
            raise E.InvalidArgumentError(f"add_listener({fn!r}): give a function that takes one event")
        wanted = None if kinds is None else frozenset(kinds)
        unknown = sorted((wanted or frozenset()) - _KINDS)
        if unknown:
            raise E.InvalidArgumentError(f"add_listener(kinds={sorted(wanted or ())}): unknown kind(s) {unknown}; "
                                         f"the kinds are {sorted(_KINDS)}")
        entry = (fn, wanted)
        self._listeners.append(entry)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(entry)
        return remove

    @contextlib.contextmanager
    def after(self, first: Callable[[], Event]) -> Iterator[None]:
        """The events heard inside are emitted at its end, after ``first()`` (made then): a save's snapshot
        event carries the whole pause, the persist request's round trip included, and still comes before the
        news that round trip brought."""
        held: list[Event] = []
        self._after = held
        try:
            yield
        finally:
            self._after = None
            for ev in [first(), *held]:
                self.emit(ev)

    def emit(self, ev: Event) -> None:
        """Hands ``ev`` to the summary, the log and the listeners. A listener that raises is logged once per
        call and never stops training nor the other listeners."""
        if self._holding and isinstance(ev, Loaded):
            return
        if self._after is not None:
            self._after.append(ev)
            return
        self._stats = _summed(self._stats, ev)
        if log.isEnabledFor(logging.INFO):
            log.info("%s", ev.describe())
        for fn, kinds in list(self._listeners):
            if kinds is not None and ev.kind not in kinds:
                continue
            try:
                fn(ev)
            except Exception as e:  # a listener's bug is the listener's
                log.warning("a checkpoint event listener (%r) raised on %s: %s: %s", fn, ev.kind, type(e).__name__, e)

    def from_saver(self, records: list[dict[str, Any]], since: int) -> None:
        """The saver's journal entries after this engine's cursor ``since`` (a status reply's ``events``): the
        persists and backups of this rank's snapshots, and on local rank 0 the node's other events."""
        if records and since >= 0:
            first = int(records[0].get("seq", since + 1))
            if first > since + 1:
                self._stats = dataclasses.replace(self._stats, missed=self._stats.missed + first - since - 1)
        for rec in records:
            if int(rec.get("seq", since + 1)) <= since:  # heard already (two replies over one stretch)
                continue
            ev = from_saver(rec)
            if ev is None:
                continue
            if (ev.rank == self.rank) if rec.get("kind") in _OWN else self.local_rank == 0:
                self.emit(ev)

    def stats(self, **now: Any) -> Stats:
        """The summary, with ``now``'s fields (the durability report's steps and lag) as they are now."""
        return dataclasses.replace(self._stats, **now)


_KINDS = frozenset(c.KIND for c in (SnapshotTaken, PersistStarted, Persisted, PersistFailed, Committed, Uploaded,
                                    Retried, LastWords, ReplicaSent, ReplicaReceived, Loaded, Failed))


class PrometheusFile:
    """A listener that keeps ``path`` holding the engine's figures in Prometheus' text exposition format
    (for a node exporter's textfile collector, or any scraper of files): rewritten whole and renamed into
    place (a reader never sees half a file) after an event, at most every ``every_s`` seconds, and at
    ``flush``. Each sample carries the labels ``rank`` and ``job`` (the checkpoint dir's job key).

    Args:
        path: the file; stats: returns the summary now; labels: the labels of every sample.
    """

    def __init__(self, path: str, stats: Callable[[], Stats], labels: dict[str, str], every_s: float = 1.0) -> None:
        self.path, self._stats, self.every_s = path, stats, every_s
        self._labels = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        self._written = 0.0

    def __call__(self, ev: Event) -> None:
        if time.monotonic() - self._written >= self.every_s:
            self.flush()

    def flush(self) -> None:
        """Writes the file now (an error is logged, never raised: metrics never stop training)."""
        self._written = time.monotonic()
        try:
            text = self.render(self._stats())
            d = os.path.dirname(os.path.abspath(self.path))
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".flashckpt-metrics-")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:
            log.warning("FLASHCKPT_METRICS_FILE: cannot write %s: %s", self.path, e)

    def render(self, s: Stats) -> str:
        """The summary ``s`` in Prometheus' text format."""
        out: list[str] = []

        def metric(name: str, kind: str, helptext: str, values: list[tuple[str, float | int | None]]) -> None:
            out.append(f"# HELP flashckpt_{name} {helptext}")
            out.append(f"# TYPE flashckpt_{name} {kind}")
            for extra, v in values:
                if v is None:
                    continue
                labels = self._labels + ("," + extra if extra else "")
                out.append(f"flashckpt_{name}{{{labels}}} {float(v)!r}")

        metric("snapshots_total", "counter", "Saves that took a snapshot into shared memory.", [("", s.snapshots)])
        metric("snapshot_bytes", "gauge", "Bytes of the newest snapshot.", [("", s.snapshot_bytes)])
        metric("snapshot_pause_seconds_total", "counter", "Seconds training waited for snapshots.",
               [("", s.pause_s_total)])
        metric("snapshot_pause_seconds_last", "gauge", "Seconds training waited for the newest snapshot.",
               [("", s.pause_s_last)])
        metric("persisted_bytes_total", "counter", "Bytes of this rank's files written to storage.",
               [("", s.persisted_bytes)])
        metric("persist_seconds_total", "counter", "Seconds spent writing this rank's files.", [("", s.persist_seconds)])
        metric("commits_total", "counter", "Steps committed, by tier.",
               [(f'tier="{t}"', n) for t, n in sorted(s.commits.items())])
        metric("step", "gauge", "The newest step held, by where (memory, local, durable).",
               [('tier="memory"', s.memory_step), ('tier="local"', s.local_step), ('tier="durable"', s.durable_step)])
        metric("lag_seconds", "gauge", "How far the checkpoint dir is behind the newest storage save.", [("", s.lag_s)])
        metric("retries_total", "counter", "Storage requests retried, by why.",
               [(f'reason="{k}"', n) for k, n in sorted(s.retries.items())])
        metric("failures_total", "counter", "Failed persists, commits and uploads seen.", [("", s.failures)])
        metric("loads_total", "counter", "Loads, by source.", [(f'source="{k}"', n) for k, n in sorted(s.loads.items())])
        metric("replica_bytes_total", "counter", "Snapshot bytes copied between nodes, by direction.",
               [('direction="sent"', s.replica_sent_bytes), ('direction="received"', s.replica_received_bytes)])
        return "\n".join(out) + "\n"


def metrics_file(path: str, rank: int, local_rank: int, job: str, stats: Callable[[], Stats]) -> PrometheusFile | None:
    """The ``PrometheusFile`` listener of an engine for FLASHCKPT_METRICS_FILE ``path`` ("": none; ``{rank}``
    in it: the global rank, one file per rank; without it, local rank 0's engine writes it)."""
    if not path:
        return None
    if "{rank}" not in path and local_rank != 0:
        return None
    return PrometheusFile(path.replace("{rank}", str(rank)), stats, {"rank": str(rank), "job": job})


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
