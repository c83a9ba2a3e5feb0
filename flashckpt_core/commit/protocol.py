"""The commit protocol: a step becomes committed. ``commit_step`` waits for every rank's done marker, moves
the staged commit-time files into place, writes the manifest (the commit point), then the tracker and the
framework tracker files, and removes the steps it supersedes; ``repair`` completes what a crash left
after the newest commits (a new saver calls it at start). ``commit_spec`` is what committing a step needs.

Only the committing saver calls these (one commit at a time per checkpoint dir); readers go by the
manifests (``CommitLayout``). Imports the layout and the removal of steps below it; torch-free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.manifest import Manifest, record_from_json
from flashckpt.commit.removal import delete_step
from flashckpt.errors import TrackerUpdateError
from flashckpt.storage.base import FileRecord

__all__ = ["commit_spec", "commit_step", "repair", "finish_trackers"]

log = logging.getLogger(__name__)


def commit_spec(world_size: int, replicated: bool) -> dict[str, Any]:
    """What committing a step of a job needs (a ``Persist`` request's ``commit``): the ranks whose done
    markers make it whole (replicated state: rank 0's only), the world size, and whether state is replicated.
    Global rank 0's engine sends it; a survivor that commits for a lost rank 0 builds the same."""
    return {"ranks": [0] if replicated else list(range(world_size)), "world_size": world_size,
            "replicated": replicated, "extra": {}}


def commit_step(layout: CommitLayout, step: int, ranks: list[int], world_size: int, *, replicated: bool,
                extra: dict[str, Any], timeout: float, stopping: Callable[[], bool] = lambda: False,
                waiting: Callable[[list[int], float], None] | None = None) -> Manifest:
    """Waits for every rank's done marker, moves the staged commit-time files into place, then writes
    the manifest, the tracker and the framework tracker files, in that order.

    Raises:
        PersistError: a rank reported a failure, or the step's files are gone from the checkpoint dir
            (``RecordsHome.before_commit``).
        CheckpointTimeoutError: markers missing after ``timeout`` seconds.
        TrackerUpdateError: the step is committed, but what follows the manifest failed (its message
            lists what).

    ``waiting(missing ranks, seconds waited)`` is called while ranks are missing; it may raise to give up
    sooner (the saver's: a rank lost with its node that nobody holds).
    """
    dones = _wait_for_done(layout, step, ranks, timeout, stopping, waiting)
    files = {r: list(d["files"]) for r, d in dones.items()}
    bases = {r: str(d.get("base", "")) for r, d in dones.items()}
    ranks_at = {str(r): float(d.get("saved_at", 0.0)) for r, d in dones.items()}  # when its snapshot was taken
    saved_at = max([0.0, *ranks_at.values()])
    trackers: list[FileRecord] = []
    for r, recs in files.items():
        kept = []
        for f in recs:
            if f.kind == "tracker":
                trackers.append(f)
                continue
            if f.staged:  # commit-time files, and files that replace an existing one
                _move_staged(layout, f)
                f = replace(f, staged="")
            kept.append(f)
        files[r] = kept
    layout.home.before_commit(layout, step, [f for fs in files.values() for f in fs])
    # Older steps listing a path this step wrote (a fixed path reused across steps): the file holds
    # this step's data now, so they stop counting as committed once this manifest is written.
    mine = {f.path for fs in files.values() for f in fs}
    supersedes = [s for s, paths in layout.committed_files().items() if s != step and paths & mine]
    order = layout.commit_order()
    manifest = Manifest(step, world_size, files, replicated, time.time(),
                        {**extra, "bases": {str(r): b for r, b in bases.items() if b},
                         "trackers": [asdict(f) for f in trackers], "supersedes": supersedes,
                         "saved_at": saved_at, "saved_at_ranks": ranks_at},
                        layout.job, seq=max((q for q, _s in order), default=0) + 1)
    _write_manifest(layout, step, manifest.to_json())
    # Committed. Nothing below may report the step as failed: it is loadable whatever happens now.
    _after_commit(layout, step, trackers, supersedes)
    return manifest


def _wait_for_done(layout: CommitLayout, step: int, ranks: list[int], timeout: float, stopping: Callable[[], bool],
                   waiting: Callable[[list[int], float], None] | None) -> dict[int, dict[str, Any]]:
    """Rank -> its done marker of ``step``, once every one of ``ranks`` has one (see ``commit_step``)."""
    start = time.monotonic()
    deadline = start + timeout
    dones: dict[int, dict[str, Any]] = {}
    delay = 0.002
    while True:
        for r in ranks:
            if r in dones:
                continue
            try:
                failed = layout.own_marker(step, "failed", r)
                done = None if failed is not None else layout.own_marker(step, "done", r)
            except E.CheckpointCorruptError as e:
                raise E.PersistError(f"step {step}: rank {r}'s commit record is unusable: {e}") from e
            if failed is not None:
                raise E.PersistError(f"step {step}: rank {r} failed to persist: {failed.get('error')}")
            if done is not None:
                dones[r] = done
        if len(dones) == len(ranks):
            return dones
        if waiting is not None:
            waiting(sorted(set(ranks) - set(dones)), time.monotonic() - start)
        if time.monotonic() >= deadline or stopping():
            missing = sorted(set(ranks) - set(dones))
            raise E.CheckpointTimeoutError(f"step {step}: ranks {missing} did not finish persisting "
                                           f"within {timeout:.0f} s; the step is not committed")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _after_commit(layout: CommitLayout, step: int, trackers: list[FileRecord], supersedes: list[int]) -> None:
    """What follows the manifest of ``step``: the tracker, the framework tracker files, the removal of the
    steps it supersedes. Each is tried; what failed is raised together (``TrackerUpdateError``)."""
    problems = []
    try:
        layout.write_tracker(step)
    except OSError as e:
        problems.append(f"updating {layout.tracker_path} failed: {e}")
    for f in trackers:
        try:
            _move_staged(layout, f)
        except (OSError, E.CheckpointCorruptError) as e:
            problems.append(f"writing the framework tracker file {f.path} failed: {e}")
    for s in supersedes:
        try:
            delete_step(layout, s)
            log.info("step %d superseded step %d (it rewrote that step's files)", step, s)
        except OSError as e:
            problems.append(f"removing superseded step {s} failed: {e}")
    if problems:
        raise TrackerUpdateError(step, problems)


def _write_manifest(layout: CommitLayout, step: int, body: bytes) -> None:
    """The commit point. A first commit of ``step`` creates its manifest only if none appeared meanwhile
    (``write_new``: an atomic create-if-absent where the backend has one); a step committed again
    replaces its earlier manifest."""
    path = layout.manifest_path(step)
    if layout.storage.exists(path):
        layout.storage.write_bytes(path, body)
        return
    try:
        layout.storage.write_new(path, body)
    except FileExistsError:
        raise E.PersistError(f"step {step}: another writer committed it at the same moment ({path}); give each "
                             f"job its own checkpoint dir") from None


def repair(layout: CommitLayout) -> list[str]:
    """Completes what a crash or a failed write left after the newest commits (a new saver calls it
    at start): removes steps that a committed step supersedes, points the tracker at the newest
    step with a sound manifest, and writes that step's staged framework tracker files.

    Returns:
        What was repaired, one line each (empty when nothing was).
    """
    done = []
    manifests = layout.committed_manifests()
    for s, m in manifests.items():  # in commit order
        for old in m.extra.get("supersedes", []):
            # Only a commit older than this one: a step committed again since is not superseded.
            if (old != s and old in manifests and manifests[old].seq <= m.seq
                    and layout.storage.exists(layout.manifest_path(old))):
                delete_step(layout, old)
                done.append(f"removed step {old}, superseded by step {s}")
    newest = next((s for s in reversed(list(manifests)) if layout.storage.exists(layout.manifest_path(s))), None)
    tracked = layout.tracker_step()
    if tracked != newest and (newest is not None or layout.storage.exists(layout.tracker_path)):
        layout.write_tracker(newest)
        done.append(f"tracker.json named step {tracked}; now names step {newest}, the newest committed step")
    finish_trackers(layout)
    return done


def finish_trackers(layout: CommitLayout) -> None:
    """Writes the framework tracker files of the newest committed step if a crash between its
    manifest and its trackers left them staged (a new saver calls this at start)."""
    steps = layout.committed_steps()
    if not steps:
        return
    try:
        m = layout.read_manifest(steps[-1])
    except E.CheckpointCorruptError:
        return
    for t in m.extra.get("trackers", []):
        try:
            f = record_from_json(t, "extra.trackers")
            if f.staged and layout.storage.exists(layout.staged_abs(f.staged)):
                _move_staged(layout, f)
        except E.CheckpointCorruptError as e:
            log.error("step %d: not writing a framework tracker file: %s", steps[-1], e)


def _move_staged(layout: CommitLayout, f: FileRecord) -> None:
    src = layout.staged_abs(f.staged)
    if not layout.storage.exists(src) and layout.storage.exists(layout.abs(f.path)):
        return  # moved by an earlier attempt at this commit
    layout.storage.move(src, layout.abs(f.path))

