"""The process-group helpers every adapter uses: where this process stands in a group, one error gather
that raises the same exception on every rank (naming each rank that failed, as PyTorch DCP's
``CheckpointException`` does), and the cross-rank exchange of snapshot files.

- ``rank`` / ``world`` / ``barrier`` / ``group_ranks``: this process in a process group (alone when
  ``torch.distributed`` is not initialized);
- ``gather_errors`` / ``raise_failures``: every rank's error (None where it succeeded), and one
  ``RankFailures`` raised on every rank when any rank failed;
- ``exchange_files``: every rank gets the files it lacks from a rank that holds them; what fails on any
  rank is raised on every rank.

Imports torch and torch.distributed only (and flashckpt's errors and tree walk); no framework. Every
function here is collective unless it says otherwise: every rank of the group calls it, in the same order.
One thread per process group (as torch.distributed's collectives).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from flashckpt.errors import FlashCheckpointError
from flashckpt.format.tree import map_tree

__all__ = ["rank", "world", "barrier", "group_ranks", "all_gather", "gather_errors", "raise_failures",
           "RankFailures", "exchange_files"]


# ------------------------------------------------------------------------------------------ ranks
def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the default group when None); 0 when torch.distributed is not
    initialized (the process is then alone, whatever ``RANK`` says: collectives see one rank). Not collective."""
    return int(dist.get_rank(group)) if _initialized() else 0


def world(group: Any = None) -> int:
    """The number of ranks in ``group``; 1 when torch.distributed is not initialized. Not collective."""
    return int(dist.get_world_size(group)) if _initialized() else 1


def barrier(group: Any = None) -> None:
    """``dist.barrier`` when there are other ranks."""
    if world(group) > 1:
        dist.barrier(group)


def group_ranks(group: Any = None) -> list[int]:
    """The global rank of each rank of ``group``, by group rank. Not collective."""
    if group is None or not _initialized():
        return list(range(world(group)))
    return [int(r) for r in dist.get_process_group_ranks(group)]


def all_gather(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), by group rank; ``[obj]`` when alone."""
    if world(group) == 1:
        return [obj]
    out: list[Any] = [None] * world(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# ------------------------------------------------------------------------------------------ errors
class RankFailures(FlashCheckpointError):
    """Raised on every rank when an operation failed on some: ``failures`` maps each failed rank (in the
    group) to its error's text."""

    def __init__(self, message: str, failures: Mapping[int, str]) -> None:
        super().__init__(message)
        self.failures = dict(failures)


def gather_errors(error: BaseException | str | None, group: Any = None) -> dict[int, str]:
    """Every rank's error (``"<type>: <message>"`` for an exception), by group rank; the ranks that passed
    None (they succeeded) are left out. ``{}`` on every rank when no rank failed."""
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error
    return {r: e for r, e in enumerate(all_gather(text or None, group)) if e}


def raise_failures(what: str, error: BaseException | str | None, group: Any = None) -> None:
    """Returns on every rank when no rank failed; else raises one ``RankFailures`` on every rank, naming
    each failed rank and its error: ``"<what> failed on ranks {1: 'OSError: ...'}"``. Collective."""
    failures = gather_errors(error, group)
    if failures:
        raise RankFailures(f"{what} failed on ranks {failures}", failures)


# ------------------------------------------------------------------------------------------ exchange
class _Ref:
    """A piece (tensor or bytes) of a tree sent to other ranks: its index, byte size and what it was."""

    __slots__ = ("i", "n", "kind", "meta")

    def __init__(self, i: int, n: int, kind: str, meta: Any = None) -> None:
        self.i, self.n, self.kind, self.meta = i, n, kind, meta


_LEAVES = (torch.Tensor, _Ref, bytes, bytearray, memoryview)  # what the exchange replaces in a tree
_ALIGN = 64  # each piece starts at a multiple of this in the packed buffer (tensors are views of it)


def _map_tree(x: Any, fn: Callable[[Any], Any]) -> Any:
    """``x`` with every tensor, bytes-like and ``_Ref`` in its dicts, lists and tuples replaced by ``fn`` of it."""
    return map_tree(x, fn, _LEAVES)


def _pack(refs: list[_Ref], offsets: list[int], pieces: list[Any], total: int) -> torch.Tensor:
    """The pieces copied into one uint8 buffer at their offsets."""
    wire = torch.empty(total, dtype=torch.uint8)
    for r, off in zip(refs, offsets, strict=True):
        x = pieces[r.i]
        if r.n and isinstance(x, torch.Tensor):
            wire[off:off + r.n].copy_(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
        elif r.n:
            wire[off:off + r.n].numpy()[:] = np.frombuffer(memoryview(x).cast("B"), dtype=np.uint8)
    return wire


def _send_tree(tree: Any, src: int, group: Any, device: torch.device) -> Any:
    """``tree`` of group rank ``src`` on every rank: its structure pickled (one ``broadcast_object_list``),
    its tensors and bytes packed into one uint8 buffer (one ``broadcast``; data is never pickled). Every
    rank calls it; ``tree`` matters on ``src`` only. Received tensors are CPU views of that buffer."""
    me = rank(group)
    pieces: list[Any] = []

    def strip(x: Any) -> _Ref:
        pieces.append(x)
        if isinstance(x, torch.Tensor):
            return _Ref(len(pieces) - 1, x.numel() * x.element_size(), "tensor", (tuple(x.shape), x.dtype))
        return _Ref(len(pieces) - 1, len(memoryview(x).cast("B")), type(x).__name__)

    box: list[Any] = [_map_tree(tree, strip) if me == src else None]
    src_global = group_ranks(group)[src]
    dist.broadcast_object_list(box, src=src_global, group=group)
    refs: list[_Ref] = []
    _map_tree(box[0], refs.append)
    refs.sort(key=lambda r: r.i)
    offsets, total = [], 0
    for r in refs:
        offsets.append(total)
        total += -(-r.n // _ALIGN) * _ALIGN
    if total == 0:
        return tree if me == src else _map_tree(box[0], lambda r: _piece(r, torch.empty(0, dtype=torch.uint8)))
    if me == src:
        dist.broadcast(_pack(refs, offsets, pieces, total).to(device), src=src_global, group=group)
        return tree
    wire = torch.empty(total, dtype=torch.uint8, device=device)
    dist.broadcast(wire, src=src_global, group=group)
    buf = wire.cpu()
    return _map_tree(box[0], lambda r: _piece(r, buf[offsets[r.i]:offsets[r.i] + r.n]))


def _piece(r: _Ref, data: torch.Tensor) -> Any:
    if r.kind == "tensor":
        shape, dtype = r.meta
        return data.view(dtype).reshape(shape) if r.n else torch.empty(shape, dtype=dtype)
    raw = data.numpy().tobytes()
    return bytearray(raw) if r.kind == "bytearray" else memoryview(raw) if r.kind == "memoryview" else raw


def _plan_serving(table: list[Any], what: str) -> dict[int, list[Any]]:
    """Group rank -> the names it serves (each name from the lowest rank that offers it), from every
    rank's ``(offered, wanted)``. Raises (on every rank alike) when a rank wants a name no rank offers."""
    owner: dict[Any, int] = {}
    for r, (names, _w) in enumerate(table):
        for n in names:
            owner.setdefault(n, r)
    serve: dict[int, list[Any]] = {}
    problems: list[str] = []
    for r, (names, want) in enumerate(table):
        own = set(names)
        for n in (want if want is not None else [n for n in owner if n not in own]):
            if n not in owner:
                problems.append(f"rank {r} needs {n}, which no rank holds in memory")
            elif n not in serve.setdefault(owner[n], []):
                serve[owner[n]].append(n)
    if problems:
        raise FlashCheckpointError(f"{what}: {'; '.join(problems)}")
    return serve


def exchange_files(held: Mapping[Any, Any] | Callable[[Any], Any], offered: Sequence[Any], wanted: Sequence[Any] | None,
                   *, group: Any = None, what: str = "exchange_files()") -> dict[Any, Any]:
    """Every rank gets the files it wants that it does not hold, each from the lowest rank that offers it.

    Collective: every rank of ``group`` calls it. A file is a name (any picklable, hashable key) and a
    value: a tree of dicts, lists and tuples whose tensors and bytes travel as raw bytes, the rest pickled.
    One ``all_gather_object`` tells who offers and who wants what, a second one (``raise_failures``)
    whether every server could read what it serves; then each rank that serves something broadcasts it
    (its tree's structure, then one buffer with all its tensors and bytes). Received tensors are CPU
    tensors (views of that buffer).

    Args:
        held: this rank's files (a mapping, or a function from a name to its value, called only for the
            names another rank wants).
        offered: the names this rank may serve.
        wanted: the names this rank needs and does not hold; None: every name any rank offers that this
            rank does not (the union of all ranks' files).

    Returns:
        name -> value of what this rank received (not its own files).

    Raises:
        FlashCheckpointError: on every rank, when a rank needs a name that no rank offers, or a rank failed
            to read what it serves (``RankFailures``; nothing is exchanged).
    """
    get = held if callable(held) else held.__getitem__
    mine = set(offered)
    if world(group) == 1:
        _check_alone(mine, wanted, what)
        return {}
    table = all_gather((list(offered), None if wanted is None else list(wanted)), group)
    serve = _plan_serving(table, what)
    if not serve:
        return {}
    me = rank(group)
    payload: Any = None
    error: BaseException | None = None
    if me in serve:
        try:
            payload = {n: get(n) for n in serve[me]}
        except Exception as e:  # reported on every rank below
            error = e
    raise_failures(f"{what}: serving files from memory", error, group)
    device = _wire_device(group)
    my_wants = table[me][1]
    out: dict[Any, Any] = {}
    for r in sorted(serve):
        got = _send_tree(payload if r == me else None, r, group, device)
        if r != me:
            _keep_received(got, mine, my_wants, out)
    return out


def _check_alone(mine: set[Any], wanted: Sequence[Any] | None, what: str) -> None:
    """``exchange_files`` in a group of one: raises when this rank wants a name it does not hold."""
    missing = [n for n in (wanted or ()) if n not in mine]
    if missing:
        raise FlashCheckpointError(f"{what}: {missing} are in no rank's memory snapshot")


def _wire_device(group: Any) -> torch.device:
    """Where broadcast buffers live: the current CUDA device under NCCL, else the CPU. Not collective."""
    return (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
            else torch.device("cpu"))


def _keep_received(got: Mapping[Any, Any], mine: set[Any], my_wants: list[Any] | None, out: dict[Any, Any]) -> None:
    """Adds to ``out`` what this rank received and wants (``my_wants`` None: every name it does not hold),
    unless it holds it or already received it. Not collective."""
    for n, v in got.items():
        if n not in mine and (my_wants is None or n in my_wants) and n not in out:
            out[n] = v
