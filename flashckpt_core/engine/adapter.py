"""The adapter base: the load protocol every framework adapter follows, written once.

``resolve_load`` runs it: locate the newest checkpoint every rank has (``CheckpointEngine.locate``, or the
adapter's own ``locate``); when memory holds it, read this rank's snapshot and have the adapter open it
("open this step from memory"); when memory does not hold it, or cannot serve it (the adapter refuses it,
a rank cannot read its snapshot, the adapter's opener says why not), have the adapter open it from
storage ("open it from storage"), where ``LoadAttempt.stored()`` gives the newest committed step that
verifies: on this node's local tier when it holds the whole step (``Located.source`` "local", its path
under the local dir, which has the checkpoint dir's layout: an opener opens it as a durable path), else on
the checkpoint dir ("storage"); then the result (what was loaded, from where, which step, why memory was not used) and one
log line. An adapter implements only the two openers, in its framework's terms.

``AdapterBase`` adds ``wait`` / ``close`` / ``with`` over the adapter's ``CheckpointEngine``.

Call order (every rank of the engine's process group, together: ``locate`` and the agreement on a
damaged snapshot are collective, and so are the openers of adapters whose framework loads collectively)::

    refuse(located)          -> "" or why memory must not serve it (no snapshot read then)
    snapshot = engine.load_memory(step)            # every rank; with agree, one error gather
    from_memory(located, snapshot) -> Opened | why  # "open this step from memory"
    from_storage(attempt)    -> Opened | None       # "open it from storage" (None: nothing to load)

Imports torch.distributed (through ``collective``) and the engine's ``Located`` / ``LoadResult``; no
framework. One thread per adapter, as its engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

from flashckpt.engine.collective import gather_errors, rank
from flashckpt.engine.engine import LoadResult, Located
from flashckpt.engine.events import EventStream, Loaded

__all__ = ["AdapterBase", "LoadAttempt", "Opened", "Resolved", "resolve_load", "log_load", "is_stored",
           "MEMORY", "STORAGE", "LOCAL", "NONE"]

log = logging.getLogger(__name__)

MEMORY, STORAGE, LOCAL, NONE = "memory", "storage", "local", "none"


def is_stored(loc: Located) -> bool:
    """Whether ``loc`` is a committed step on a tier of files: the checkpoint dir ("storage") or this node's
    local tier ("local": a whole copy, see ``CheckpointEngine.locate(local=True)``)."""
    return loc.source in (STORAGE, LOCAL) and loc.step is not None


@dataclass(frozen=True)
class Opened:
    """What an opener opened: ``value`` (a state dict, a reader, a directory, what the framework's load
    returned), the ``step`` it is, and its ``path`` (None: not known). ``source`` is "storage", "local" (the
    node-local tier: ``LoadAttempt.stored()`` said so) or "none" (nothing loaded after all); the base sets
    "memory" for what ``from_memory`` opened."""

    value: Any
    step: int | None
    path: str | None = None
    source: str = STORAGE


@dataclass(frozen=True)
class Resolved:
    """The result of ``resolve_load``: what was loaded (``value``), from where (``source``: "memory",
    "local", "storage" or "none"), which ``step`` and ``path``, in how many ``seconds``, the snapshot's ``nbytes``
    (memory), why memory was not used when it held the step (``why_not_memory``, "" otherwise) and what
    ``locate`` answered (``located``)."""

    value: Any
    step: int | None
    source: str
    path: str | None
    seconds: float
    nbytes: int
    why_not_memory: str
    located: Located

    def result(self) -> LoadResult:
        """As the engine's ``last_load`` says it."""
        return LoadResult(self.step, self.source, self.seconds, self.nbytes)


class LoadAttempt:
    """What ``from_storage`` gets: ``located`` (what ``locate`` answered: memory, local, storage or none) and
    ``why_not_memory``; ``stored()`` is where the newest committed checkpoint is (on the local tier when this
    node's holds the whole step)."""

    def __init__(self, engine: Any, located: Located, why_not_memory: str) -> None:
        self.engine = engine
        self.located = located
        self.why_not_memory = why_not_memory
        self._stored: Located | None = None if located.source == MEMORY else located

    def stored(self) -> Located:
        """``located`` when it is committed (on the local tier or storage) or nothing; else, memory having
        held it but not served it, the newest committed step that verifies on every rank
        (``locate(memory=False, local=True)``; collective, once)."""
        if self._stored is None:
            self._stored = self.engine.locate(memory=False, local=True)
        return self._stored


def log_load(logger: logging.Logger, event: str, step: int | None, source: str, seconds: float,
             path: str | None = None) -> None:
    """The one log line of a load: ``event=<event> step=<step> source=<source> seconds=<s> [path=<path>]``."""
    if path:
        logger.info("event=%s step=%s source=%s seconds=%.4f path=%s", event, step, source, seconds, path)
    else:
        logger.info("event=%s step=%s source=%s seconds=%.4f", event, step, source, seconds)


def _read_snapshot(engine: Any, located: Located, agree: bool, group: Any) -> tuple[Any, str]:
    """This rank's snapshot of the located step, and "" or why memory cannot serve it: with ``agree``, on
    every rank alike (one error gather naming each rank that could not read its snapshot)."""
    snapshot: Any = None
    error: str | None = None
    try:
        snapshot = engine.load_memory(located.step)
    except Exception as e:  # the other ranks still need this one in the agreement below
        error = f"{type(e).__name__}: {e}"
    failures = gather_errors(error, group) if agree else ({rank(group): error} if error else {})
    if failures:
        return None, f"step {located.step} cannot be read from memory on ranks {failures}"
    return snapshot, ""


def resolve_load(engine: Any, *, op: str, event: str,
                 from_memory: Callable[[Located, Any], Opened | str] | None,
                 from_storage: Callable[[LoadAttempt], Opened | None],
                 refuse: Callable[[Located], str] | None = None,
                 locate: Callable[[], Located] | None = None,
                 agree: bool = True, group: Any = None, logger: logging.Logger = log,
                 reshard: bool = False) -> Resolved:
    """The load protocol (see the module docstring): memory when it holds the step and serves it, else
    storage; the result, and its log line.

    Args:
        engine: the adapter's ``CheckpointEngine`` (it locates, reads snapshots and verifies storage steps).
        op: the adapter's call, for messages (``"load_checkpoint()"``).
        event: the log line's event name (``"fsdp_load"``).
        from_memory: opens the located step from memory, given this rank's snapshot (what
            ``engine.load_memory`` returned); returns what it opened, or why memory cannot serve it (the
            same on every rank when it is collective). None: memory is never used.
        from_storage: opens the checkpoint from storage (``attempt.stored()`` is where the newest one is);
            None when there is nothing to load.
        refuse: "" when memory may serve the located step, else why not (checked before the snapshot is read).
        locate: where the checkpoint is, instead of ``engine.locate(local=True)`` (an adapter that agrees its
            own way).
        agree: the ranks agree on whether every rank could read its snapshot (False where each rank loads
            on its own: replicated state, whose ranks fall back one by one).
        group: the process group of that agreement (default: the engine's).
        logger: the adapter's logger (the log line names its module).
        reshard: the framework reshards a checkpoint saved by another number of ranks (DCP): memory may serve
            such a step (``CheckpointEngine.locate(reshard=True)``); ``from_memory`` then gets a ``Resharded``
            (the old ranks' states) instead of this rank's snapshot.

    Raises:
        What the openers raise (a snapshot that cannot be read is not an error: storage serves then).
    """
    events: EventStream | None = getattr(engine, "_events", None)
    if events is None:
        return _resolve(engine, op, event, from_memory, from_storage, refuse, locate, agree, group, logger, reshard)
    with events.one_load():  # the engine calls below report their loads: this is one, reported once
        out = _resolve(engine, op, event, from_memory, from_storage, refuse, locate, agree, group, logger, reshard)
    events.emit(Loaded(time.time(), out.step, getattr(engine.ranks, "rank", None), source=out.source,
                       seconds=out.seconds, bytes=out.nbytes, note=out.why_not_memory))
    return out


def _resolve(engine: Any, op: str, event: str, from_memory: Callable[[Located, Any], Opened | str] | None,
             from_storage: Callable[[LoadAttempt], Opened | None], refuse: Callable[[Located], str] | None,
             locate: Callable[[], Located] | None, agree: bool, group: Any, logger: logging.Logger,
             reshard: bool) -> Resolved:
    t0 = time.perf_counter()
    located = locate() if locate is not None else engine.locate(local=True, reshard=reshard)
    why = ""
    if located.source == MEMORY and located.step is not None and from_memory is not None:
        why = refuse(located) if refuse is not None else ""
        if why:
            logger.info("%s: the newest checkpoint (step %s) is in memory, but %s; loading from storage", op,
                        located.step, why)
        else:
            grp = group if group is not None else getattr(engine, "process_group", None)
            snapshot, why = _read_snapshot(engine, located, agree, grp)
            opened = from_memory(located, snapshot) if not why else why
            del snapshot
            if isinstance(opened, Opened):
                nbytes = engine.last_load.nbytes if getattr(engine, "last_load", None) is not None else 0
                return _done(logger, event, t0, opened, MEMORY, nbytes, "", located)
            why = opened
            logger.warning("%s: %s; loading from storage", op, why)
    opened_s = from_storage(LoadAttempt(engine, located, why))
    if opened_s is None:
        opened_s = Opened(None, None, None, NONE)
    return _done(logger, event, t0, opened_s, opened_s.source, 0, why, located)


def _done(logger: logging.Logger, event: str, t0: float, opened: Opened, source: str, nbytes: int, why: str,
          located: Located) -> Resolved:
    out = Resolved(opened.value, opened.step if source != NONE else None, source, opened.path,
                   time.perf_counter() - t0, nbytes, why, located)
    log_load(logger, event, out.step, out.source, out.seconds, out.path)
    return out


class AdapterBase:
    """``wait`` / ``close`` / ``with`` and ``resolve_load`` for an adapter over one ``CheckpointEngine``
    (``self.engine``; override ``_flash_engine`` when it lives elsewhere). Leaving a ``with`` block by an
    exception keeps the snapshots in memory for a restart (``close(release=False)``)."""

    def _flash_engine(self) -> Any:
        return self.engine  # type: ignore[attr-defined]

    def resolve_load(self, **kw: Any) -> Resolved:
        """``resolve_load`` over this adapter's engine (same keyword arguments)."""
        return resolve_load(self._flash_engine(), **kw)

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every scheduled persist is committed; raises the first persist error."""
        self._flash_engine().wait(timeout)

    def close(self, release: bool = True) -> None:
        """See ``CheckpointEngine.close``."""
        self._flash_engine().close(release)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(release=exc_type is None)
