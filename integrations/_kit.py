"""The adapter kit: helpers every framework adapter needs, written once.

- ``rank`` / ``world`` / ``group_ranks``: where this process stands in a process group;
- ``path_inside`` / ``rel_inside``: whether a path lies inside a directory (``..`` and symbolic links
  resolved), and its name there;
- ``step_of``: the step number in a checkpoint directory's name (``checkpoint-100``, ``iter_0000100``);
- ``exchange_files``: the cross-rank exchange of snapshot files (every rank gets the files it lacks from a
  rank that holds them), with one error semantics: what fails on any rank is raised on every rank;
- ``Adapter``: ``wait`` / ``close`` / context manager over the adapter's ``CheckpointEngine``.

No framework is imported here (torch and torch.distributed only).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Self

import numpy as np
import torch
import torch.distributed as dist
from flashckpt.errors import FlashCheckpointError
from flashckpt.format.tree import map_tree
from flashckpt.storage import locations

__all__ = ["rank", "world", "barrier", "group_ranks", "path_inside", "rel_inside", "step_of", "swapped",
           "exchange_files", "Adapter"]


# ------------------------------------------------------------------------------------------ ranks
def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the default group when None); 0 when torch.distributed is not
    initialized (the process is then alone, whatever ``RANK`` says: collectives see one rank)."""
    return int(dist.get_rank(group)) if _initialized() else 0


def world(group: Any = None) -> int:
    """The number of ranks in ``group``; 1 when torch.distributed is not initialized."""
    return int(dist.get_world_size(group)) if _initialized() else 1


def barrier(group: Any = None) -> None:
    """``dist.barrier`` when there are other ranks."""
    if world(group) > 1:
        dist.barrier(group)


def group_ranks(group: Any = None) -> list[int]:
    """The global rank of each rank of ``group``, by group rank."""
    if group is None or not _initialized():
        return list(range(world(group)))
    return [int(r) for r in dist.get_process_group_ranks(group)]


# ------------------------------------------------------------------------------------------ paths
def path_inside(path: str | os.PathLike[str], root: str | os.PathLike[str], *, strict: bool = False) -> bool:
    """Whether ``path`` lies inside ``root`` (``root`` itself counts unless ``strict``).

    Both are made absolute and resolved (``..`` and symbolic links, as far as they exist), so a path that
    leaves ``root`` through ``..`` or through a link to elsewhere is outside, and a path given through a
    link to ``root`` is inside. URLs of a store (``s3://...``) are compared lexically.
    """
    if locations.is_url(os.fspath(root)) or locations.is_url(os.fspath(path)):  # a store: lexically
        return locations.inside(os.fspath(path), os.fspath(root), strict=strict)
    p, r = os.path.realpath(os.fspath(path)), os.path.realpath(os.fspath(root))
    if p == r:
        return not strict
    return p.startswith(r.rstrip(os.sep) + os.sep)


def rel_inside(path: Any, root: str | os.PathLike[str]) -> str | None:
    """The name (``/``-separated) of ``path`` relative to ``root`` when it lies strictly inside it (see
    ``path_inside``), else None; None also for what is not a path (a file object)."""
    if not isinstance(path, (str, os.PathLike)) or not path_inside(path, root, strict=True):
        return None
    if locations.is_url(os.fspath(root)):
        return locations.relpath(os.fspath(path), os.fspath(root))
    return os.path.relpath(os.path.realpath(os.fspath(path)), os.path.realpath(os.fspath(root))).replace(os.sep, "/")


def step_of(path: str | os.PathLike[str], pattern: re.Pattern[str]) -> int | None:
    """The step in the name of the directory ``path`` (a trailing separator ignored), read by
    ``pattern``'s first group; None when the name does not match."""
    m = pattern.match(os.path.basename(os.path.normpath(os.fspath(path))))
    return int(m.group(1)) if m else None


@contextlib.contextmanager
def swapped(swaps: Sequence[tuple[Any, str, Any]]) -> Iterator[None]:
    """Sets ``obj.name = value`` for each swap (a framework's module function, while a call runs);
    restores them on exit, in reverse order (an attribute the object did not have of its own is removed)."""
    missing = object()
    saved = []
    try:
        for obj, name, value in swaps:
            saved.append((obj, name, obj.__dict__.get(name, missing) if hasattr(obj, "__dict__") else missing))
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, old in reversed(saved):
            if old is missing:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
            else:
                setattr(obj, name, old)


# ------------------------------------------------------------------------------------------ exchange
class _Ref:
    """A piece (tensor or bytes) of a tree sent to other ranks: its index, byte size and what it was."""

    __slots__ = ("i", "n", "kind", "meta")

    def __init__(self, i: int, n: int, kind: str, meta: Any = None) -> None:
        self.i, self.n, self.kind, self.meta = i, n, kind, meta


_LEAVES = (torch.Tensor, _Ref, bytes, bytearray, memoryview)  # what the exchange replaces in a tree


def _map_tree(x: Any, fn: Callable[[Any], Any]) -> Any:
    """``x`` with every tensor, bytes-like and ``_Ref`` in its dicts, lists and tuples replaced by ``fn`` of it."""
    return map_tree(x, fn, _LEAVES)


_ALIGN = 64  # each piece starts at a multiple of this in the packed buffer (tensors are views of it)


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
        wire = torch.empty(total, dtype=torch.uint8)
        for r, off in zip(refs, offsets, strict=True):
            x = pieces[r.i]
            if r.n and isinstance(x, torch.Tensor):
                wire[off:off + r.n].copy_(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8))
            elif r.n:
                wire[off:off + r.n].numpy()[:] = np.frombuffer(memoryview(x).cast("B"), dtype=np.uint8)
        dist.broadcast(wire.to(device), src=src_global, group=group)
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


def exchange_files(held: Mapping[Any, Any] | Callable[[Any], Any], offered: Sequence[Any], wanted: Sequence[Any] | None,
                   *, group: Any = None, what: str = "exchange_files()") -> dict[Any, Any]:
    """Every rank gets the files it wants that it does not hold, each from the lowest rank that offers it.

    Collective: every rank of ``group`` calls it. A file is a name (any picklable, hashable key) and a
    value: a tree of dicts, lists and tuples whose tensors and bytes travel as raw bytes, the rest pickled.
    One ``all_gather_object`` tells who offers and who wants what, a second one whether every server could
    read what it serves; then each rank that serves something broadcasts it (its tree's structure, then
    one buffer with all its tensors and bytes). Received tensors are CPU tensors (views of that buffer).

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
            to read what it serves (nothing is exchanged).
    """
    get = held if callable(held) else held.__getitem__
    mine = set(offered)
    if world(group) == 1:
        missing = [n for n in (wanted or ()) if n not in mine]
        if missing:
            raise FlashCheckpointError(f"{what}: {missing} are in no rank's memory snapshot")
        return {}
    table: list[Any] = [None] * world(group)
    dist.all_gather_object(table, (list(offered), None if wanted is None else list(wanted)), group=group)
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
    if not serve:
        return {}
    me = rank(group)
    payload: Any = None
    error: str | None = None
    if me in serve:
        try:
            payload = {n: get(n) for n in serve[me]}
        except Exception as e:  # reported on every rank below
            error = f"{type(e).__name__}: {e}"
    errors: list[Any] = [None] * world(group)
    dist.all_gather_object(errors, error, group=group)
    failed = {r: e for r, e in enumerate(errors) if e}
    if failed:
        raise FlashCheckpointError(f"{what}: serving files from memory failed on ranks {failed}")
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
              else torch.device("cpu"))
    my_wants = table[me][1]
    out: dict[Any, Any] = {}
    for r in sorted(serve):
        got = _send_tree(payload if r == me else None, r, group, device)
        if r == me:
            continue
        for n, v in got.items():
            if n not in mine and (my_wants is None or n in my_wants) and n not in out:
                out[n] = v
    return out


# ------------------------------------------------------------------------------------------ base
class Adapter:
    """``wait`` / ``close`` / ``with`` for an adapter over one ``CheckpointEngine`` (``self.engine``;
    override ``_flash_engine`` when it lives elsewhere). Leaving a ``with`` block by an exception keeps
    the snapshots in memory for a restart (``close(release=False)``)."""

    def _flash_engine(self) -> Any:
        return self.engine  # type: ignore[attr-defined]

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
