"""The engine's side of the node-local tier: ``local_tier`` resolves the ``local_dir`` and
``local_max_to_keep`` of ``CheckpointEngine`` (or FLASHCKPT_LOCAL_DIR / FLASHCKPT_LOCAL_KEEP) into the knobs the
node's saver is started with (refusing a local dir that holds another checkpoint dir's steps); ``agreed_local``
and ``local_copy`` decide when a load reads the local tier (``local_candidate``: what a rank proposes,
``common_step``: the rule over every rank's proposal).

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
from flashckpt.storage.base import CheckpointStorage
from flashckpt.storage.posix import PosixDiskStorage

__all__ = ["local_tier", "local_copy", "agreed_local", "local_candidate", "common_step"]


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


def agreed_local(local: CommitLayout, durable: CommitLayout, committed: list[int], rank: int,
                 exclude: frozenset[int] | set[int], group: Any = None) -> int | None:
    """The step every rank of ``group`` loads from its local tier because it is newer than the checkpoint
    dir's newest commit (``committed``: its steps in commit order): ``common_step`` of every rank's
    ``local_candidate``; else None (each rank then reads the step the checkpoint dir serves, from its local
    copy where it has one). Collective: one ``all_reduce`` pair when several ranks."""
    return common_step(_min_max(local_candidate(local, durable, committed, rank, exclude), group))


def local_candidate(local: CommitLayout, durable: CommitLayout, committed: list[int], rank: int,
                    exclude: frozenset[int] | set[int]) -> int:
    """The step this rank proposes to load from its local tier: its newest locally committed step (not in
    ``exclude``), when that is not an older step of the checkpoint dir (``committed``), its snapshot is not
    older than the checkpoint dir's newest's, and its copy here is intact; else -1."""
    try:
        steps = [s for s in local.committed_steps() if s not in exclude]
        newest_at = 0.0
        if committed:
            newest_at = float(durable.read_manifest(committed[-1]).extra.get("saved_at", 0.0))
        if steps and (steps[-1] not in committed or steps[-1] == committed[-1]):
            m = local.read_manifest(steps[-1])
            if float(m.extra.get("saved_at", 0.0)) >= newest_at and local_copy(local, steps[-1], rank, durable.root):
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
