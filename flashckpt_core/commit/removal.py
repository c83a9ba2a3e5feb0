"""Removing steps from a checkpoint dir: a committed step (``delete_step``: retention, a superseded step),
what a failed persist wrote (``remove_rank_files``), and half-written steps (``clean_uncommitted``,
``discard_uncommitted``). A file a committed manifest lists is always kept, and every path taken from a
record is confined to the checkpoint dir before anything is removed.

Only the saver removes (one thread at a time per checkpoint dir); ``intent_paths`` only reads. Imports the
layout below it; torch-free.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.manifest import Manifest, need
from flashckpt.storage import locations

__all__ = ["delete_step", "intent_paths", "remove_rank_files", "clean_uncommitted", "discard_uncommitted"]

log = logging.getLogger(__name__)


def delete_step(layout: CommitLayout, step: int) -> None:
    """Removes a step: its manifest first (so it stops counting as committed), then its files.

    A file that another committed step also lists (a path reused across steps) is kept."""
    try:
        m: Manifest | None = layout.read_manifest(step)
    except E.CheckpointCorruptError:
        m = None
    layout.storage.remove(layout.manifest_path(step))
    paths = _confined_paths(layout, [f.path for f in m.all_files()], f"the manifest of step {step}") if m else []
    paths += intent_paths(layout, step)
    _remove_files(layout, paths)
    _remove_step_dir(layout, step)


def _remove_step_dir(layout: CommitLayout, step: int) -> None:
    d = layout.step_dir(step)
    if not layout.is_confined(d, layout.meta):
        log.error("not removing %s: it leads outside the commit records %s through a symlink", d, layout.meta)
        return
    layout.storage.remove_tree(d)


def _confined_paths(layout: CommitLayout, rels: list[Any], what: str) -> list[str]:
    """The absolute paths of ``rels``; a path that is not confined to the checkpoint dir is reported
    and skipped, never acted on."""
    out = []
    for r in rels:
        try:
            out.append(layout.abs(r))
        except E.CheckpointCorruptError as e:
            log.error("%s: skipped %s", what, e)
    return out


def intent_paths(layout: CommitLayout, step: int) -> list[str]:
    out = []
    for name in layout.storage.listdir(layout.step_dir(step)):
        if name.startswith("intent_rank_"):
            path = locations.join(layout.step_dir(step), name)
            try:
                body = json.loads(layout.storage.read_bytes(path))
                need(isinstance(body, dict) and isinstance(body.get("paths"), list), "no list of 'paths'")
            except (OSError, ValueError, E.CheckpointCorruptError) as e:
                log.error("%s: skipped, unreadable or damaged (%s)", path, e)
                continue
            out += _confined_paths(layout, body["paths"], path)
    return out


def remove_rank_files(layout: CommitLayout, step: int, rank: int) -> None:
    """Removes what this job's failed persist of ``step`` wrote for ``rank`` (its intent's files and
    their temp files, its staged files, its done marker), so a full disk gets its space back at once.
    A file a committed manifest lists is kept; so is everything when another job wrote the intent."""
    try:
        intent = layout.read_marker(step, "intent", rank)
    except E.CheckpointCorruptError as e:
        log.error("not removing the files of the failed persist of step %d rank %d: %s", step, rank, e)
        return
    if intent is None or (layout.job and intent.get("job", layout.job) != layout.job):
        return
    _remove_files(layout, _confined_paths(layout, intent["paths"], layout.marker_path(step, "intent", rank)))
    layout.storage.remove_tree(locations.join(layout.step_dir(step), "staged", f"rank_{rank}"))
    layout.storage.remove(layout.marker_path(step, "done", rank))


def _remove_files(layout: CommitLayout, paths: list[str]) -> None:
    keep = layout.committed_paths()
    dirs = set()
    doomed: list[str] = []
    for p in paths:
        if p in keep or not layout.is_confined(p):  # callers pass confined paths; checked again just before
            continue
        doomed.append(p)
        if layout.storage.temp_suffix:
            doomed.append(p + layout.storage.temp_suffix)
        dirs.add(locations.parent(p))
    layout.storage.remove_many(doomed)
    layout.storage.prune_empty_dirs(sorted(dirs), layout.root)  # directories left empty, up to the root


def _writer_jobs(layout: CommitLayout, step: int) -> set[str]:
    """The jobs whose markers lie in ``step``'s dir ("" for a marker that names none)."""
    jobs = set()
    for name in layout.storage.listdir(layout.step_dir(step)):
        if name.endswith(".json") and "_rank_" in name:
            try:
                body = json.loads(layout.storage.read_bytes(locations.join(layout.step_dir(step), name)))
                jobs.add(str(body.get("job", "")) if isinstance(body, dict) else "")
            except (FileNotFoundError, ValueError):
                jobs.add("")
    return jobs


def clean_uncommitted(layout: CommitLayout, keep: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """Removes half-written steps (no manifest) left by a crash, except those in ``keep`` and those
    another live job is writing.

    Called by a saver that just started: no persist of this job can be running then. Another job's
    step is removed only when that job's savers are all gone (its job lock is free); a step whose
    writer is unknown (no marker yet, or markers older than the job field) only when no other job
    is alive on this checkpoint dir."""
    cleaned = []
    others: list[str] | None = None
    for step in layout.uncommitted_steps():
        if step in keep:
            continue
        writers = _writer_jobs(layout, step)
        if any(layout.job_alive(j) for j in writers if j != layout.job):
            log.info("step %d is being written by live job(s) %s; left alone", step, sorted(writers - {layout.job}))
            continue
        if not writers or "" in writers:
            others = layout.live_jobs() if others is None else others
            if others:
                log.info("step %d names no writer and jobs %s are alive; left alone", step, others)
                continue
        discard_uncommitted(layout, step)
        cleaned.append(step)
    return cleaned


def discard_uncommitted(layout: CommitLayout, step: int) -> None:
    """Removes what the persists of ``step``, which has no manifest, wrote: the files its intents name
    (a file a committed manifest lists is kept) and its records. Only for a step nobody writes now."""
    _remove_files(layout, intent_paths(layout, step))
    _remove_step_dir(layout, step)
