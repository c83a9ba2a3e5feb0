"""The engine's side of the node-local tier: ``local_tier`` resolves the ``local_dir`` and
``local_max_to_keep`` of ``CheckpointEngine`` (or FLASHCKPT_LOCAL_DIR / FLASHCKPT_LOCAL_KEEP) into the knobs the
node's saver is started with (refusing a local dir that holds another checkpoint dir's steps); ``agreed_local``,
``local_copy`` and ``whole_copy`` decide when a load reads the local tier: ``load()`` each rank its own copy
(``local_copy``), an adapter only a copy of the whole step (``whole_copy``: its framework may read another rank's
files); ``local_candidate`` is what a rank proposes, ``common_step`` the rule over every rank's proposal.

Imports ``commit`` and ``config``; used by one engine call at a time."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from flashckpt import errors as E
from flashckpt.commit.checkpoint_dir import prepare_dir
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.tiers import belongs, check_local_dir, foreign_steps, local_layout
from flashckpt.config import Knobs
from flashckpt.storage import locations
from flashckpt.storage.base import CheckpointStorage
from flashckpt.storage.posix import PosixDiskStorage

__all__ = ["local_tier", "local_copy", "whole_copy", "agreed_local", "local_candidate", "common_step", "local_file"]


def local_tier(knobs: Knobs, checkpoint_dir: str, storage: CheckpointStorage,
               local_dir: str | os.PathLike[str] | None, keep: int) -> tuple[Knobs, str | None]:
    """(the knobs with the local tier set, its path or None). ``local_dir`` None takes FLASHCKPT_LOCAL_DIR
    (and FLASHCKPT_LOCAL_KEEP); the directory is created.

    Raises:
        InvalidArgumentError: ``local_dir`` is a URL or overlaps the checkpoint dir.
        CheckpointDirError: it cannot be created or written.
    """
    given = os.fspath(local_dir) if local_dir is not None else knobs.local_dir
    if not given:
        return dataclasses.replace(knobs, local_dir=""), None
    path = check_local_dir(given, checkpoint_dir, storage)
    prepare_dir(PosixDiskStorage(), path, given)
    foreign = foreign_steps(local_layout(path), storage.normpath(checkpoint_dir))
    if foreign:
        owners = sorted(set(foreign.values()))
        example = os.path.join(os.path.dirname(given.rstrip("/")),
                               (os.path.basename(checkpoint_dir.rstrip("/")) or "run") + "-local")
        raise E.InvalidArgumentError(
            f"local_dir={given!r} holds the local tier of another checkpoint dir ({', '.join(owners)}: steps "
            f"{sorted(foreign)}), not of {checkpoint_dir}; give each checkpoint dir a local_dir of its own (for "
            f"example {example}), or remove "
            "what that one holds once its steps are on their checkpoint dir (`flashckpt ls DIR --local-dir L`)")
    return dataclasses.replace(knobs, local_dir=path, local_keep=keep if local_dir is not None else knobs.local_keep), path


def local_copy(local: CommitLayout, step: int, rank: int, durable_root: str) -> bool:
    """Whether the local tier holds ``rank``'s files of committed ``step`` of the checkpoint dir
    ``durable_root``, intact (checksums verified)."""
    try:
        if step not in local.committed_steps():
            return False
        m = local.read_manifest(step)
        if not belongs(m, durable_root) or not m.files_for(rank):
            return False
        return not local.verify(step, rank=rank, deep=True)
    except (OSError, E.FlashCheckpointError):
        return False


def whole_copy(local: CommitLayout, step: int, rank: int, world_size: int, durable_root: str) -> bool:
    """This rank's part of whether the local tier holds the whole committed ``step`` of the checkpoint dir
    ``durable_root``: its local manifest lists every rank of the job that saved it (rank 0 when replicated;
    a node of a multi-node job holds only its own ranks'), and the files this rank of a job of
    ``world_size`` ranks answers for are intact (checksums verified: its own, and those of the step's
    ranks it stands for when the step was saved by more ranks, as ``CommitLayout.verify`` says). Every rank
    checking its part and all agreeing means every file of the step is intact on this node, so a framework
    that reads another rank's files (DCP resharding, rank 0's replicated file) reads a complete copy."""
    try:
        if step not in local.committed_steps():
            return False
        m = local.read_manifest(step)
        if not belongs(m, durable_root) or not m.files:
            return False
        if (0 not in m.files) if m.replicated else any(r not in m.files for r in range(m.world_size)):
            return False
        return not local.verify(step, rank=rank, deep=True, world_size=world_size)
    except (OSError, E.FlashCheckpointError):
        return False


def local_file(local: CommitLayout, durable_root: str, path: str, rank: int, world_size: int) -> tuple[int, str] | None:
    """The local tier's newest committed step (of the checkpoint dir ``durable_root``) whose manifest lists the
    file ``path`` (a path of the checkpoint dir), and that file there, when the local tier holds that step
    whole for this rank (``whole_copy``); None otherwise. Not collective."""
    rel = locations.relpath(path, durable_root)
    if rel is None or rel == ".":
        return None
    rel = rel.replace(os.sep, "/")
    try:
        for step, m in reversed(local.committed_manifests().items()):
            if belongs(m, durable_root) and any(f.path == rel for f in m.all_files()):
                return (step, local.abs(rel)) if whole_copy(local, step, rank, world_size, durable_root) else None
    except (OSError, E.FlashCheckpointError):
        pass
    return None


def agreed_local(local: CommitLayout, durable: CommitLayout, committed: list[int], rank: int,
                 exclude: frozenset[int] | set[int], group: Any = None, *, whole: int = 0) -> int | None:
    """The step every rank of ``group`` loads from its local tier because it is newer than the checkpoint
    dir's newest commit (``committed``: its steps in commit order), or is that commit: ``common_step`` of
    every rank's ``local_candidate`` (with ``whole``, the job's number of ranks: only a whole copy of the step
    counts, ``whole_copy``); else None (each rank then reads the step the checkpoint dir serves, from its local
    copy where it has one). Collective: one ``all_reduce`` pair when several ranks."""
    return common_step(_min_max(local_candidate(local, durable, committed, rank, exclude, whole=whole), group))


def local_candidate(local: CommitLayout, durable: CommitLayout, committed: list[int], rank: int,
                    exclude: frozenset[int] | set[int], *, whole: int = 0) -> int:
    """The step this rank proposes to load from its local tier: its newest locally committed step (not in
    ``exclude``), when that is not an older step of the checkpoint dir (``committed``), its snapshot is not
    older than the checkpoint dir's newest's, and its copy here is intact (with ``whole``: the whole step is,
    ``whole_copy``); else -1."""
    try:
        steps = [s for s in local.committed_steps() if s not in exclude]
        newest_at = 0.0
        if committed:
            newest_at = float(durable.read_manifest(committed[-1]).extra.get("saved_at", 0.0))
        if steps and (steps[-1] not in committed or steps[-1] == committed[-1]):
            m = local.read_manifest(steps[-1])
            if float(m.extra.get("saved_at", 0.0)) >= newest_at and (
                    whole_copy(local, steps[-1], rank, whole, durable.root) if whole
                    else local_copy(local, steps[-1], rank, durable.root)):
                return steps[-1]
    except (OSError, E.FlashCheckpointError):
        pass
    return -1


def common_step(candidates: tuple[int, ...] | list[int]) -> int | None:
    """The step every rank proposed (``local_candidate``: -1 for none), or None when a rank proposed
    another or none: a rank never loads a local step another rank lacks."""
    return candidates[0] if candidates and min(candidates) == max(candidates) >= 0 else None


def _min_max(value: int, group: Any) -> tuple[int, int]:
    """The smallest and largest ``value`` over the ranks of ``group`` (this one's alone without a group)."""
    from flashckpt.engine.agreement import world

    if world(group) is None:
        return value, value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value, -value], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t[0].item()), -int(t[1].item())
