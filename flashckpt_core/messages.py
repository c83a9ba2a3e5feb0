"""The control protocol between trainers (engine, CLI, launcher, ``ipc``) and the node's saver, typed.

Each request is a frozen dataclass named after what it asks; its ``OP`` is the operation name on the wire.
On the wire a request is a JSON object: ``{"op": OP, <its fields>, "id": <request id>}`` (``_protocol``
frames it). ``parse_request`` turns a received object back into its dataclass, checking and converting
every field by its annotation; an unknown operation or a field of the wrong type is a ``ProtocolError``
that names it. Replies are JSON objects with ``ok`` and, on failure, ``error`` and ``kind`` (the
``flashckpt.errors`` class the client raises); ``StatusReply`` reads the fields that status-carrying
replies (hello, persist, status, wait, last words) share.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from . import errors as E

__all__ = [
    "Request", "Hello", "Alloc", "Persist", "Status", "Wait", "LastWords", "DeleteSteps", "DeletePath", "GiveWay",
    "Bye", "QueuePut", "QueueGet", "QueueSize", "DictUpdate", "DictGet", "REQUESTS", "parse_request", "StatusReply",
]

R = TypeVar("R", bound="Request")


@dataclass(frozen=True)
class Request:
    """A request to the saver; subclasses set ``OP`` and declare the fields."""

    OP: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    @classmethod
    def from_wire(cls: type[R], msg: dict[str, Any]) -> R:
        hints = typing.get_type_hints(cls)
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in msg:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise E.ProtocolError(f"bad {cls.OP!r} request: the field {f.name!r} is missing")
                continue
            try:
                kw[f.name] = _convert(hints[f.name], msg[f.name])
            except _Bad as e:
                raise E.ProtocolError(f"bad {cls.OP!r} request: field {f.name!r}={msg[f.name]!r}: {e}") from None
        return cls(**kw)


class _Bad(E.ProtocolError):
    """A field's value does not fit its annotation (``from_wire`` names the request and the field)."""


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
    if origin is bool:
        if not isinstance(value, bool):
            raise _Bad("a boolean is needed")
        return value
    if origin in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Bad(f"a number is needed, not {type(value).__name__}")
        if origin is int and value != int(value):
            raise _Bad("an integer is needed")
        return origin(value)
    if origin is str:
        if not isinstance(value, str):
            raise _Bad(f"a string is needed, not {type(value).__name__}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise _Bad(f"a list is needed, not {type(value).__name__}")
        return [_convert(args[0], v) for v in value] if args else list(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise _Bad(f"an object is needed, not {type(value).__name__}")
        return dict(value)
    raise _Bad(f"unsupported field type {hint!r}")  # a programming error in this module


@dataclass(frozen=True)
class Hello(Request):
    """First request of a connection: who the client is; the reply carries the saver's pid and status."""

    OP: ClassVar[str] = "hello"
    rank: int
    local_rank: int
    world_size: int = 1
    local_world_size: int = 1
    pid: int = 0
    persists: bool = False
    commit: dict[str, Any] | None = None  # global rank 0: what committing a step needs (engine._commit_spec)
    agent_pid: int = 0  # the job's launcher, whose exit the saver follows


@dataclass(frozen=True)
class Alloc(Request):
    """A segment for ``local_rank`` with slots of these capacities; the reply's ``path`` names it."""

    OP: ClassVar[str] = "alloc"
    local_rank: int
    meta_cap: int
    data_cap: int
    nslots: int | None = None


@dataclass(frozen=True)
class Persist(Request):
    """Persist the snapshot in ``slot`` of ``seg_path`` (of ``generation``) as ``step`` to ``path``."""

    OP: ClassVar[str] = "persist"
    step: int
    rank: int
    local_rank: int
    seg_path: str
    slot: int
    generation: int
    path: str
    commit: dict[str, Any] | None = None
    cursor: int = 0


@dataclass(frozen=True)
class Status(Request):
    """The saver's news since ``cursor``; with ``local_rank``, old segments of that rank are reaped."""

    OP: ClassVar[str] = "status"
    local_rank: int | None = None
    cursor: int = 0


@dataclass(frozen=True)
class Wait(Request):
    """Wait up to ``timeout_s`` for every persist, commit and deletion in flight."""

    OP: ClassVar[str] = "wait"
    timeout_s: float = 0.0
    cursor: int = 0


@dataclass(frozen=True)
class LastWords(Request):
    """Persist and commit the newest snapshot every persisting local rank holds (the launcher's request)."""

    OP: ClassVar[str] = "last_words"
    timeout_s: float | None = None
    cursor: int = 0


@dataclass(frozen=True)
class DeleteSteps(Request):
    """Delete committed steps (retention); ``background``: after the commits queued before it; ``newest``:
    the newest committed step too (a framework deleting its own checkpoints; not with ``background``)."""

    OP: ClassVar[str] = "delete_steps"
    steps: list[int] = field(default_factory=list)
    background: bool = False
    newest: bool = False


@dataclass(frozen=True)
class DeletePath(Request):
    """Delete a checkpoint's file or directory inside the checkpoint dir (``engine.delete_checkpoint``)."""

    OP: ClassVar[str] = "delete_path"
    path: str


@dataclass(frozen=True)
class GiveWay(Request):
    """Another job is short of shared memory: an idle saver persists what is newer and exits."""

    OP: ClassVar[str] = "give_way"
    dry_run: bool = False


@dataclass(frozen=True)
class Bye(Request):
    """The client's goodbye: ``final`` (no restart expected), ``intent`` "persist" asks for last words."""

    OP: ClassVar[str] = "bye"
    final: bool = True
    intent: str | None = None


@dataclass(frozen=True)
class QueuePut(Request):
    OP: ClassVar[str] = "q_put"
    name: str
    item: Any = None


@dataclass(frozen=True)
class QueueGet(Request):
    OP: ClassVar[str] = "q_get"
    name: str
    timeout_s: float = 0.0


@dataclass(frozen=True)
class QueueSize(Request):
    OP: ClassVar[str] = "q_size"
    name: str


@dataclass(frozen=True)
class DictUpdate(Request):
    OP: ClassVar[str] = "d_update"
    name: str
    items: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DictGet(Request):
    OP: ClassVar[str] = "d_get"
    name: str


REQUESTS: dict[str, type[Request]] = {cls.OP: cls for cls in (
    Hello, Alloc, Persist, Status, Wait, LastWords, DeleteSteps, DeletePath, GiveWay, Bye, QueuePut, QueueGet,
    QueueSize, DictUpdate, DictGet)}


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


@dataclass(frozen=True)
class StatusReply:
    """The status fields of a reply to hello, persist, status, wait or last words."""

    cursor: int | None  # None: the reply carries none (keep the one you have)
    committed: list[int]
    errors: list[dict[str, Any]]  # persist/commit failures since the request's cursor
    inflight: int | None  # persists, commits and deletions in flight; None: not told
    last_persist_s: float = 0.0
    pid: int = 0
    step: int | None = None  # last words: the step persisted, if any

    @classmethod
    def from_wire(cls, reply: dict[str, Any]) -> StatusReply:
        cursor, inflight = reply.get("cursor"), reply.get("inflight")
        return cls(cursor=None if cursor is None else int(cursor), committed=[int(s) for s in reply.get("committed", [])],
                   errors=list(reply.get("errors") or []), inflight=None if inflight is None else int(inflight),
                   last_persist_s=float(reply.get("last_persist_s", 0.0)),
                   pid=int(reply.get("pid", 0)), step=None if reply.get("step") is None else int(reply["step"]))
