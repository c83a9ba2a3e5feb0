"""The control protocol between trainers (engine, CLI, launcher, ``ipc``) and the node's saver, typed.

Each request is a frozen dataclass named after what it asks; its ``OP`` is the operation name on the wire
(the class name in snake case unless the class statement says ``op=``).
On the wire a request is a JSON object: ``{"op": OP, <its fields>, "id": <request id>}`` (``_protocol``
frames it). ``parse_request`` turns a received object back into its dataclass, checking and converting
every field by its annotation; an unknown operation or a field of the wrong type is a ``ProtocolError``
that names it. Each request names the type of its reply (``REPLY``, a frozen dataclass too), which the
saver sends as ``{"ok": true, <its fields>, "id": ...}`` and ``Client.request`` returns, converted the same
way; a failure travels as ``{"ok": false, "error", "kind"}`` (the ``flashckpt.errors`` class the client
raises).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from flashckpt import errors as E

__all__ = [
    "Request", "Hello", "Alloc", "Persist", "Status", "Wait", "LastWords", "DeleteSteps", "DeletePath", "GiveWay",
    "Bye", "QueuePut", "QueueGet", "QueueSize", "DictUpdate", "DictGet", "REQUESTS", "parse_request",
    "Reply", "Ok", "StatusReply", "HelloReply", "LastWordsReply", "AllocReply", "DeleteStepsReply", "DeletePathReply",
    "GiveWayReply", "QueueGetReply", "QueueSizeReply", "DictGetReply", "Inventory", "InventoryReply", "Fetch",
    "FetchReply", "AwaitRecords", "RecordsReply", "Inspect", "InspectReply",
]

R = TypeVar("R", bound="Request[Any]")
RP = TypeVar("RP", bound="Reply")
M_ = TypeVar("M_", bound="_Wire")


class _Wire:
    """A message's wire form: a JSON object of its dataclass fields, converted back by their annotations."""

    OP: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def _from_fields(cls: type[M_], msg: dict[str, Any], what: str) -> M_:
        hints = typing.get_type_hints(cls)
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in msg:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise E.ProtocolError(f"bad {what}: the field {f.name!r} is missing")
                continue
            try:
                kw[f.name] = _convert(hints[f.name], msg[f.name])
            except _Bad as e:
                raise E.ProtocolError(f"bad {what}: field {f.name!r}={msg[f.name]!r}: {e}") from None
        return cls(**kw)


@dataclass(frozen=True)
class Reply(_Wire):
    """A successful reply (``{"ok": true, <its fields>}`` on the wire); each request names its type
    (``REPLY``). A failure is not a reply: it travels as ``{"ok": false, "error", "kind"}`` and the client
    raises it (``_protocol``)."""

    @classmethod
    def from_wire(cls: type[RP], msg: dict[str, Any]) -> RP:
        return cls._from_fields(msg, f"{cls.__name__}")


@dataclass(frozen=True)
class Ok(Reply):
    """A reply that carries nothing but its success."""


@dataclass(frozen=True)
class StatusReply(Reply):
    """The saver's news, carried by the replies to hello, persist, status, wait and last words."""

    cursor: int | None = None  # None: the reply carries none (keep the one you have)
    committed: list[int] = field(default_factory=list)  # in commit order
    errors: list[dict[str, Any]] = field(default_factory=list)  # persist/commit failures since the cursor
    inflight: int | None = None  # persists, commits and deletions in flight; None: not told
    last_persist_s: float = 0.0
    records_ready: bool = True  # the saver's start-up work on the commit records is done (``committed`` known)
    # The newest commits this saver made, oldest first: {"step", "tier", "snapshot_at", "committed_at", "lag_s"}
    # (wall times; lag_s: from the snapshot to the commit, None when the snapshot's time is unknown).
    commits: list[dict[str, Any]] = field(default_factory=list)
    # The saver's events after the request's ``since`` ({"kind", "time", "seq", fields...}: ``SaverState.note``)
    # and the newest sequence number (the next ``since``; None: not told).
    events: list[dict[str, Any]] = field(default_factory=list)
    event_seq: int | None = None


@dataclass(frozen=True)
class HelloReply(StatusReply):
    pid: int = 0  # the saver's


@dataclass(frozen=True)
class LastWordsReply(StatusReply):
    step: int | None = None  # the step persisted, if any


@dataclass(frozen=True)
class RecordsReply(Reply):
    """The commit records are ready: ``committed`` are the steps committed when they became so."""

    committed: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class AllocReply(Reply):
    path: str  # the new segment


@dataclass(frozen=True)
class DeleteStepsReply(Reply):
    deleted: list[int] = field(default_factory=list)  # done (a synchronous request)
    scheduled: list[int] = field(default_factory=list)  # queued after the commits before it (background)


@dataclass(frozen=True)
class DeletePathReply(Reply):
    missing: bool = False  # nothing is there
    scheduled: list[int] = field(default_factory=list)  # the committed steps it holds, deleted with it


@dataclass(frozen=True)
class GiveWayReply(Reply):
    idle: bool = False
    idle_s: float = 0.0
    giving_way: bool = False


@dataclass(frozen=True)
class QueueGetReply(Reply):
    found: bool = False
    item: Any = None


@dataclass(frozen=True)
class QueueSizeReply(Reply):
    size: int = 0


@dataclass(frozen=True)
class InventoryReply(Reply):
    """What this node holds in memory: its own snapshots and backups of other nodes' ranks (``held``: one
    object per live snapshot: rank, step, wall_time, seq, kind "own" | "backup", local_rank), and where its
    saver's peer service listens (``port`` 0: none, a single-node job)."""

    node: int = -1
    instance: str = ""
    host: str = ""
    port: int = 0
    held: list[dict[str, Any]] = field(default_factory=list)
    persisting: list[list[int]] = field(default_factory=list)  # [step, rank] of persists queued or running


@dataclass(frozen=True)
class InspectReply(Reply):
    """What a saver is doing now, for ``flashckpt status`` (see ``Inspect``)."""

    pid: int = 0
    checkpoint_dir: str = ""
    started_at: float = 0.0  # wall time
    clients: list[dict[str, Any]] = field(default_factory=list)  # {"rank", "local_rank", "pid", "world_size"}
    # persists running now: {"step", "rank", "bytes", "done" (bytes written so far; None: the store cannot
    # tell), "path", "tier", "seconds"}
    persisting: list[dict[str, Any]] = field(default_factory=list)
    queued: int = 0  # units of work in flight (persists, commits, deletions, last words)
    committed: int | None = None  # the newest step committed on the checkpoint dir, as this saver knows it
    local_committed: int | None = None  # the newest on the node-local tier (None: none, or no local tier)
    local_dir: str = ""
    commits: list[dict[str, Any]] = field(default_factory=list)  # the newest commits (``StatusReply.commits``)
    held: list[dict[str, Any]] = field(default_factory=list)  # snapshots in this node's memory (``Inventory``)
    memory_bytes: int = 0  # shared memory of this job on the node
    replica: dict[str, Any] = field(default_factory=dict)  # {} single node; else node, nnodes, partners, sent
    events: list[dict[str, Any]] = field(default_factory=list)  # the newest events of the journal


@dataclass(frozen=True)
class FetchReply(Reply):
    """A fetched snapshot now in this node's memory: which segment of the local rank holds it."""

    path: str = ""
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class DictGetReply(Reply):
    items: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Request(_Wire, Generic[RP]):
    """A request to the saver; subclasses set ``OP`` and ``REPLY`` (the type of its reply) and declare the
    fields."""

    OP: ClassVar[str] = ""
    REPLY: ClassVar[type[Reply]] = Ok

    def __init_subclass__(cls, op: str = "", **kw: Any) -> None:
        """``OP`` is the class name in snake case unless ``op`` says otherwise; ``REPLY`` is the type
        argument of ``Request[...]`` in the class statement."""
        super().__init_subclass__(**kw)
        cls.OP = op or re.sub(r"(?<!^)([A-Z])", r"_\1", cls.__name__).lower()
        for base in getattr(cls, "__orig_bases__", ()):
            if typing.get_origin(base) is Request:
                (cls.REPLY,) = typing.get_args(base)

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, **super().to_wire()}

    @classmethod
    def from_wire(cls: type[R], msg: dict[str, Any]) -> R:
        return cls._from_fields(msg, f"{cls.OP!r} request")


class _Bad(E.ProtocolError):
    """A field's value does not fit its annotation (``from_wire`` names the request and the field)."""


def _as_bool(_origin: type, _args: tuple[Any, ...], value: Any) -> Any:
    if not isinstance(value, bool):
        raise _Bad("a boolean is needed")
    return value


def _as_number(origin: type, _args: tuple[Any, ...], value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Bad(f"a number is needed, not {type(value).__name__}")
    if origin is int and value != int(value):
        raise _Bad("an integer is needed")
    return origin(value)


def _as_str(_origin: type, _args: tuple[Any, ...], value: Any) -> Any:
    if not isinstance(value, str):
        raise _Bad(f"a string is needed, not {type(value).__name__}")
    return value


def _as_list(_origin: type, args: tuple[Any, ...], value: Any) -> Any:
    if not isinstance(value, list):
        raise _Bad(f"a list is needed, not {type(value).__name__}")
    return [_convert(args[0], v) for v in value] if args else list(value)


def _as_dict(_origin: type, _args: tuple[Any, ...], value: Any) -> Any:
    if not isinstance(value, dict):
        raise _Bad(f"an object is needed, not {type(value).__name__}")
    return dict(value)


# A field's type (its annotation's origin: ``list`` for ``list[int]``) -> its converter (origin, type args, value).
_CONVERTERS: dict[Any, Callable[[Any, tuple[Any, ...], Any], Any]] = {
    bool: _as_bool, int: _as_number, float: _as_number, str: _as_str, list: _as_list, dict: _as_dict,
}


def _convert(hint: Any, value: Any) -> Any:
    """``value`` as the annotated type (JSON gives ints for floats and lists for tuples)."""
    if hint is Any:
        return value
    args = typing.get_args(hint)
    if type(None) in args:  # X | None
        if value is None:
            return None
        (hint,) = [a for a in args if a is not type(None)]
        args = typing.get_args(hint)
    origin = typing.get_origin(hint) or hint
    convert = _CONVERTERS.get(origin)
    if convert is None:
        raise _Bad(f"unsupported field type {hint!r}")  # a programming error in this module
    return convert(origin, args, value)


@dataclass(frozen=True)
class Hello(Request[HelloReply]):
    """First request of a connection: who the client is; the reply carries the saver's pid and status."""

    rank: int
    local_rank: int
    world_size: int = 1
    local_world_size: int = 1
    pid: int = 0
    persists: bool = False
    commit: dict[str, Any] | None = None  # global rank 0: what committing a step needs (engine._commit_spec)
    agent_pid: int = 0  # the job's launcher, whose exit the saver follows
    replicated: bool = False  # every rank holds the same state (one holder per node is enough)
    local_dir: str = ""  # the job's local tier ("": none); every engine of a job gives the same


@dataclass(frozen=True)
class Alloc(Request[AllocReply]):
    """A segment for ``local_rank`` with slots of these capacities; the reply's ``path`` names it."""

    local_rank: int
    meta_cap: int
    data_cap: int
    nslots: int | None = None


@dataclass(frozen=True)
class Persist(Request[StatusReply]):
    """Persist the snapshot in ``slot`` of ``seg_path`` (of ``generation``) as ``step`` to ``path``."""

    step: int
    rank: int
    local_rank: int
    seg_path: str
    slot: int
    generation: int
    path: str
    commit: dict[str, Any] | None = None
    cursor: int = 0
    since: int = -1  # events after this sequence number (-1: none)
    # With a local tier: {"node_ranks": the ranks of this node that persist the step, "world_size",
    # "replicated"}; the files go to the local tier, committed there per node, then uploaded (None: straight
    # to the checkpoint dir).
    local: dict[str, Any] | None = None


@dataclass(frozen=True)
class Status(Request[StatusReply]):
    """The saver's news since ``cursor``; with ``local_rank``, old segments of that rank are reaped."""

    local_rank: int | None = None
    cursor: int = 0
    since: int = -1  # events after this sequence number (-1: none)


@dataclass(frozen=True)
class Wait(Request[StatusReply]):
    """Wait up to ``timeout_s`` for every persist, commit and deletion in flight."""

    timeout_s: float = 0.0
    cursor: int = 0
    since: int = -1  # events after this sequence number (-1: none)


@dataclass(frozen=True)
class AwaitRecords(Request[RecordsReply]):
    """Wait up to ``timeout_s`` for the saver's start-up work on the commit records (an error says why they
    are not ready)."""

    timeout_s: float = 0.0


@dataclass(frozen=True)
class LastWords(Request[LastWordsReply]):
    """Persist and commit the newest snapshot every persisting local rank holds (the launcher's request)."""

    timeout_s: float | None = None
    cursor: int = 0
    since: int = -1  # events after this sequence number (-1: none)


@dataclass(frozen=True)
class DeleteSteps(Request[DeleteStepsReply]):
    """Delete committed steps (retention); ``background``: after the commits queued before it; ``newest``:
    the newest committed step too (a framework deleting its own checkpoints; not with ``background``)."""

    steps: list[int] = field(default_factory=list)
    background: bool = False
    newest: bool = False


@dataclass(frozen=True)
class DeletePath(Request[DeletePathReply]):
    """Delete a checkpoint's file or directory inside the checkpoint dir (``engine.delete_checkpoint``)."""

    path: str


@dataclass(frozen=True)
class GiveWay(Request[GiveWayReply]):
    """Another job is short of shared memory: an idle saver persists what is newer and exits."""

    dry_run: bool = False


@dataclass(frozen=True)
class Bye(Request[Ok]):
    """The client's goodbye: ``final`` (no restart expected: the saver exits once every client said it) or
    not (the snapshots are kept for a restart). Either way the saver persists the newest snapshot when it
    is newer than the last commit. ``intent`` ("release", "keep", "persist") says which end it was."""

    final: bool = True
    intent: str | None = None


@dataclass(frozen=True)
class Inventory(Request[InventoryReply]):
    """What this node holds in memory, its own and its peers' backups (a load's agreement across nodes)."""


@dataclass(frozen=True)
class Inspect(Request[InspectReply]):
    """What the saver is doing now (``flashckpt status``; no hello needed): its trainers, the persists running
    with the bytes written so far, the newest commits per tier, the memory it holds, its replica partners and
    its newest ``events`` journal entries."""

    events: int = 20


@dataclass(frozen=True)
class Fetch(Request[FetchReply]):
    """Copy ``rank``'s snapshot of ``step`` (any rank's with ``rank`` -1: replicated state) from the first
    of ``sources`` (peer savers: host, port) that holds it into a new segment of ``local_rank`` here; with
    ``world``, only a snapshot saved by a job of that many ranks (a load that reshards another layout)."""

    local_rank: int
    rank: int
    step: int
    sources: list[dict[str, Any]] = field(default_factory=list)
    world: int = 0


@dataclass(frozen=True)
class QueuePut(Request[Ok], op="q_put"):
    name: str
    item: Any = None


@dataclass(frozen=True)
class QueueGet(Request[QueueGetReply], op="q_get"):
    name: str
    timeout_s: float = 0.0


@dataclass(frozen=True)
class QueueSize(Request[QueueSizeReply], op="q_size"):
    name: str


@dataclass(frozen=True)
class DictUpdate(Request[Ok], op="d_update"):
    name: str
    items: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DictGet(Request[DictGetReply], op="d_get"):
    name: str


REQUESTS: dict[str, type[Request]] = {cls.OP: cls for cls in (
    Hello, Alloc, Persist, Status, Wait, LastWords, DeleteSteps, DeletePath, GiveWay, Bye, QueuePut, QueueGet,
    QueueSize, DictUpdate, DictGet, Inventory, Inspect, Fetch, AwaitRecords)}


def parse_request(msg: dict[str, Any]) -> Request:
    """The request ``msg`` (a received JSON object) asks, checked field by field.

    Raises:
        ProtocolError: an unknown operation, a missing field, or a field of the wrong type.
    """
    op = msg.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise E.ProtocolError(f"unknown operation {op!r} (known: {', '.join(sorted(REQUESTS))})")
    return cls.from_wire(msg)
