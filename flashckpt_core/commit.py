"""The commit protocol on storage: intents, per-rank done markers, manifests and the tracker.

Layout under the checkpoint dir (``META`` = ``.flashckpt``)::

    .flashckpt/tracker.json                    newest committed step (atomically replaced)
    .flashckpt/jobs/<job key>.lock             held (shared flock) by every live saver of that job
    .flashckpt/steps/<step>/intent_rank_R.json files rank R is about to write (for clean-up after a crash)
    .flashckpt/steps/<step>/done_rank_R.json   rank R's files with sizes and checksums
    .flashckpt/steps/<step>/failed_rank_R.json rank R's persist failed
    .flashckpt/steps/<step>/manifest.json      the commit record: all files, sizes, checksums, world layout
    .flashckpt/steps/<step>/staged/rank_R/     a FileSet's commit-time and tracker files until the commit

A step is committed once its manifest exists; the tracker only names the newest one and is rewritten
after the manifest. Files listed in manifests are relative to the checkpoint dir.

Markers and manifests name the job that wrote them (``"job"``: its job key; absent in older ones). Two
jobs sharing a checkpoint dir never mix: a commit takes only its own job's done markers (another live
job's marker for the same step is a clear error), and start-up clean-up leaves alone the uncommitted
steps of every other job whose saver is alive (its job lock is held).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from . import errors as E
from ._lease import held
from .storage import CheckpointStorage, FileRecord

__all__ = ["META", "Manifest", "CommitLayout"]

log = logging.getLogger(__name__)

META = ".flashckpt"
MANIFEST_FORMAT = "flashckpt-manifest/1"


@dataclass(frozen=True)
class Manifest:
    """A committed step.

    Attributes:
        step: the step.
        world_size: ranks in the job that saved it.
        files: rank -> that rank's files (path relative to the checkpoint dir, size, xxh3).
        replicated: every rank's state is rank 0's (DDP): all ranks load rank 0's files.
        time: commit time (seconds since the epoch).
        extra: adapter-specific JSON (framework tracker files written at commit, ...).
        job: the job key of the job that wrote and committed it ("" in manifests older than the field).
    """

    step: int
    world_size: int
    files: dict[int, list[FileRecord]]
    replicated: bool
    time: float
    extra: dict[str, Any]
    job: str = ""

    def files_for(self, rank: int) -> list[FileRecord]:
        if self.replicated or rank not in self.files:
            return self.files.get(0, [])
        return self.files[rank]

    def all_files(self) -> list[FileRecord]:
        return [f for r in sorted(self.files) for f in self.files[r]]

    def to_json(self) -> bytes:
        d = {"format": MANIFEST_FORMAT, "step": self.step, "world_size": self.world_size,
             "replicated": self.replicated, "time": self.time, "extra": self.extra, "job": self.job,
             "files": {str(r): [asdict(f) for f in fs] for r, fs in self.files.items()}}
        return json.dumps(d, indent=1).encode()

    @staticmethod
    def from_json(raw: bytes) -> Manifest:
        d = json.loads(raw)
        if d.get("format") != MANIFEST_FORMAT:
            raise E.CheckpointCorruptError(f"unknown manifest format {d.get('format')!r}")
        files = {int(r): [FileRecord(**f) for f in fs] for r, fs in d["files"].items()}
        return Manifest(int(d["step"]), int(d["world_size"]), files, bool(d["replicated"]),
                        float(d["time"]), dict(d.get("extra", {})), str(d.get("job", "")))


class CommitLayout:
    """Reads and writes the commit records of one checkpoint dir through a storage backend.

    ``job`` is the job key of the job writing through it (a saver's); its markers and manifests carry it.
    """

    def __init__(self, checkpoint_dir: str, storage: CheckpointStorage, *, job: str = "") -> None:
        self.root = os.path.abspath(checkpoint_dir)
        self.storage = storage
        self.meta = os.path.join(self.root, META)
        self.job = job

    # paths ---------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return os.path.join(self.meta, "steps", f"{step:012d}")

    def _marker(self, step: int, kind: str, rank: int) -> str:
        return os.path.join(self.step_dir(step), f"{kind}_rank_{rank}.json")

    def manifest_path(self, step: int) -> str:
        return os.path.join(self.step_dir(step), "manifest.json")

    def job_lock_path(self, job: str) -> str:
        """The lock every live saver of job ``job`` holds (shared) on this checkpoint dir."""
        return os.path.join(self.meta, "jobs", f"{job}.lock")

    def job_alive(self, job: str) -> bool:
        """Whether a saver of job ``job`` is alive (holds its job lock); "" (unknown) is never alive."""
        if not job or os.sep in job or job.startswith("."):
            return False
        try:
            return held(self.job_lock_path(job))
        except OSError:
            return False

    def live_jobs(self) -> list[str]:
        """Jobs other than this one whose savers are alive on this checkpoint dir."""
        names = self.storage.listdir(os.path.join(self.meta, "jobs"))
        return [n[:-5] for n in names if n.endswith(".lock") and n[:-5] != self.job and self.job_alive(n[:-5])]

    @property
    def tracker_path(self) -> str:
        return os.path.join(self.meta, "tracker.json")

    def rel(self, path: str) -> str:
        rel = os.path.relpath(os.path.abspath(path), self.root)
        if rel.startswith(".."):
            raise E.CheckpointDirError(f"{path} is outside the checkpoint dir {self.root}; persist paths "
                                       "must lie inside it so retention and verification can find them")
        return rel

    def abs(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    # markers -------------------------------------------------------------
    def write_intent(self, step: int, rank: int, paths: list[str]) -> None:
        body = json.dumps({"rank": rank, "paths": [self.rel(p) for p in paths], "job": self.job}).encode()
        self.storage.write_bytes(self._marker(step, "intent", rank), body)

    def write_done(self, step: int, rank: int, files: list[FileRecord], base: str = "") -> None:
        """Rank ``rank``'s files of ``step`` are durable; ``base`` is where the rank's set lives."""
        recs = [asdict(replace(f, path=self.rel(f.path), staged=self.rel(f.staged) if f.staged else ""))
                for f in files]
        body = {"rank": rank, "files": recs, "base": self.rel(base) if base else "", "job": self.job}
        self.storage.write_bytes(self._marker(step, "done", rank), json.dumps(body).encode())

    def staged_path(self, step: int, rank: int, index: int) -> str:
        """Where a rank's commit-time or tracker file waits for the commit."""
        return os.path.join(self.step_dir(step), "staged", f"rank_{rank}", f"{index:05d}")

    def write_failed(self, step: int, rank: int, error: str) -> None:
        try:
            self.storage.write_bytes(self._marker(step, "failed", rank),
                                     json.dumps({"rank": rank, "error": error, "job": self.job}).encode())
        except OSError:  # the storage that failed may refuse this too; the commit then times out
            log.exception("could not write the failure marker of step %d rank %d", step, rank)

    def _read_marker(self, step: int, kind: str, rank: int) -> dict[str, Any] | None:
        try:
            return json.loads(self.storage.read_bytes(self._marker(step, kind, rank)))
        except FileNotFoundError:
            return None

    def _own_marker(self, step: int, kind: str, rank: int) -> dict[str, Any] | None:
        """Rank ``rank``'s marker of ``step`` when this job wrote it (or it names no job). Another job's
        marker counts as absent while that job is dead (this job's rank overwrites it) and is an error
        while it is alive: two live jobs save the same step into one checkpoint dir."""
        m = self._read_marker(step, kind, rank)
        if m is None or not self.job:
            return m
        other = m.get("job", self.job) if isinstance(m, dict) else ""
        if other == self.job:
            return m
        if self.job_alive(str(other)):
            raise E.PersistError(
                f"step {step}: rank {rank}'s {kind} marker in {self.step_dir(step)} was written by job "
                f"{other!r}, not by this job {self.job!r}: two live jobs save into the checkpoint dir "
                f"{self.root}. Give each job its own checkpoint dir.")
        return None

    # commit --------------------------------------------------------------
    def commit(self, step: int, ranks: list[int], world_size: int, *, replicated: bool,
               extra: dict[str, Any], timeout: float, stopping: Callable[[], bool] = lambda: False) -> Manifest:
        """Waits for every rank's done marker, moves the staged commit-time files into place, then writes
        the manifest, the tracker and the framework tracker files, in that order.

        Raises:
            PersistError: a rank reported a failure.
            CheckpointTimeoutError: markers missing after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        files: dict[int, list[FileRecord]] = {}
        bases: dict[int, str] = {}
        delay = 0.002
        while True:
            for r in ranks:
                if r in files:
                    continue
                failed = self._own_marker(step, "failed", r)
                if failed is not None:
                    raise E.PersistError(f"step {step}: rank {r} failed to persist: {failed.get('error')}")
                done = self._own_marker(step, "done", r)
                if done is not None:
                    files[r] = [FileRecord(**f) for f in done["files"]]
                    bases[r] = str(done.get("base", ""))
            if len(files) == len(ranks):
                break
            if time.monotonic() >= deadline or stopping():
                missing = sorted(set(ranks) - set(files))
                raise E.CheckpointTimeoutError(f"step {step}: ranks {missing} did not finish persisting "
                                               f"within {timeout:.0f} s; the step is not committed")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        trackers: list[FileRecord] = []
        for r, recs in files.items():
            kept = []
            for f in recs:
                if f.kind == "tracker":
                    trackers.append(f)
                    continue
                if f.kind == "commit" and f.staged:
                    self._move_staged(f)
                    f = replace(f, staged="")
                kept.append(f)
            files[r] = kept
        manifest = Manifest(step, world_size, files, replicated, time.time(),
                            {**extra, "bases": {str(r): b for r, b in bases.items() if b},
                             "trackers": [asdict(f) for f in trackers]}, self.job)
        self.storage.write_bytes(self.manifest_path(step), manifest.to_json())
        self.storage.write_bytes(self.tracker_path, json.dumps({"step": step}).encode())
        for f in trackers:
            self._move_staged(f)
        return manifest

    def finish_trackers(self) -> None:
        """Writes the framework tracker files of the newest committed step if a crash between its
        manifest and its trackers left them staged (a new saver calls this at start)."""
        steps = self.committed_steps()
        if not steps:
            return
        try:
            m = self.read_manifest(steps[-1])
        except E.CheckpointCorruptError:
            return
        for t in m.extra.get("trackers", []):
            f = FileRecord(**t)
            if f.staged and self.storage.exists(self.abs(f.staged)):
                self._move_staged(f)

    def _move_staged(self, f: FileRecord) -> None:
        src = self.abs(f.staged)
        if not self.storage.exists(src) and self.storage.exists(self.abs(f.path)):
            return  # moved by an earlier attempt at this commit
        self.storage.move(src, self.abs(f.path))

    # reading -------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        """Every step with a manifest, ascending (derived from storage alone)."""
        steps = []
        base = os.path.join(self.meta, "steps")
        for name in self.storage.listdir(base):
            if name.isdigit() and self.storage.exists(self.manifest_path(int(name))):
                steps.append(int(name))
        return sorted(steps)

    def uncommitted_steps(self) -> list[int]:
        base = os.path.join(self.meta, "steps")
        return sorted(int(n) for n in self.storage.listdir(base)
                      if n.isdigit() and not self.storage.exists(self.manifest_path(int(n))))

    def read_manifest(self, step: int) -> Manifest:
        try:
            return Manifest.from_json(self.storage.read_bytes(self.manifest_path(step)))
        except FileNotFoundError as e:
            raise E.CheckpointCorruptError(f"step {step} has no manifest in {self.meta}") from e
        except (ValueError, KeyError, TypeError) as e:
            raise E.CheckpointCorruptError(f"the manifest of step {step} is damaged: {e}") from e

    def base(self, step: int, rank: int = 0) -> str | None:
        """The absolute directory of rank ``rank``'s file set in committed ``step`` (None for single files)."""
        m = self.read_manifest(step)
        bases = m.extra.get("bases", {})
        b = bases.get(str(0 if m.replicated else rank)) or bases.get("0")
        return self.abs(b) if b else None

    def tracker_step(self) -> int | None:
        try:
            return int(json.loads(self.storage.read_bytes(self.tracker_path))["step"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None

    def verify(self, step: int, rank: int | None = None) -> list[str]:
        """Problems found in step ``step`` (all ranks' files, or those ``rank`` loads); [] when sound."""
        try:
            m = self.read_manifest(step)
        except E.CheckpointCorruptError as e:
            return [str(e)]
        problems = []
        for f in (m.all_files() if rank is None else m.files_for(rank)):
            path = self.abs(f.path)
            try:
                size, digest = self.storage.checksum(path)
            except FileNotFoundError:
                problems.append(f"{path}: missing")
                continue
            if size != f.size:
                problems.append(f"{path}: size {size} != {f.size} in the manifest")
            elif digest != f.xxh3:
                problems.append(f"{path}: checksum {digest} != {f.xxh3} in the manifest")
        return problems

    # deleting ------------------------------------------------------------
    def delete_step(self, step: int) -> None:
        """Removes a step: its manifest first (so it stops counting as committed), then its files.

        A file that another committed step also lists (a path reused across steps) is kept."""
        try:
            m: Manifest | None = self.read_manifest(step)
        except E.CheckpointCorruptError:
            m = None
        self.storage.remove(self.manifest_path(step))
        paths = [self.abs(f.path) for f in m.all_files()] if m else []
        paths += self._intent_paths(step)
        self._remove_files(paths)
        self.storage.remove_tree(self.step_dir(step))

    def _committed_paths(self) -> set[str]:
        out: set[str] = set()
        for s in self.committed_steps():
            try:
                out.update(self.abs(f.path) for f in self.read_manifest(s).all_files())
            except E.CheckpointCorruptError:
                continue
        return out

    def _intent_paths(self, step: int) -> list[str]:
        out = []
        for name in self.storage.listdir(self.step_dir(step)):
            if name.startswith("intent_rank_"):
                try:
                    body = json.loads(self.storage.read_bytes(os.path.join(self.step_dir(step), name)))
                    out += [self.abs(p) for p in body["paths"]]
                except (FileNotFoundError, ValueError, KeyError):
                    continue
        return out

    def remove_rank_files(self, step: int, rank: int) -> None:
        """Removes what this job's failed persist of ``step`` wrote for ``rank`` (its intent's files and
        their temp files, its staged files, its done marker), so a full disk gets its space back at once.
        A file a committed manifest lists is kept; so is everything when another job wrote the intent."""
        intent = self._read_marker(step, "intent", rank)
        if intent is None or (self.job and intent.get("job", self.job) != self.job):
            return
        try:
            paths = [self.abs(p) for p in intent["paths"]]
        except (KeyError, TypeError):
            return
        self._remove_files(paths)
        self.storage.remove_tree(os.path.join(self.step_dir(step), "staged", f"rank_{rank}"))
        self.storage.remove(self._marker(step, "done", rank))

    def _remove_files(self, paths: list[str]) -> None:
        keep = self._committed_paths()
        dirs = set()
        for p in paths:
            if p in keep:
                continue
            self.storage.remove(p)
            self.storage.remove(f"{p}.flashckpt-tmp")
            dirs.add(os.path.dirname(p))
        for d in sorted(dirs, key=len, reverse=True):  # prune directories left empty, up to the root
            while d.startswith(self.root + os.sep) and d != self.root:
                try:
                    os.rmdir(d)
                except OSError:
                    break
                d = os.path.dirname(d)

    def _writer_jobs(self, step: int) -> set[str]:
        """The jobs whose markers lie in ``step``'s dir ("" for a marker that names none)."""
        jobs = set()
        for name in self.storage.listdir(self.step_dir(step)):
            if name.endswith(".json") and "_rank_" in name:
                try:
                    body = json.loads(self.storage.read_bytes(os.path.join(self.step_dir(step), name)))
                    jobs.add(str(body.get("job", "")) if isinstance(body, dict) else "")
                except (FileNotFoundError, ValueError):
                    jobs.add("")
        return jobs

    def clean_uncommitted(self, keep: frozenset[int] | set[int] = frozenset()) -> list[int]:
        """Removes half-written steps (no manifest) left by a crash, except those in ``keep`` and those
        another live job is writing.

        Called by a saver that just started: no persist of this job can be running then. Another job's
        step is removed only when that job's savers are all gone (its job lock is free); a step whose
        writer is unknown (no marker yet, or markers older than the job field) only when no other job
        is alive on this checkpoint dir."""
        cleaned = []
        others: list[str] | None = None
        for step in self.uncommitted_steps():
            if step in keep:
                continue
            writers = self._writer_jobs(step)
            if any(self.job_alive(j) for j in writers if j != self.job):
                log.info("step %d is being written by live job(s) %s; left alone", step, sorted(writers - {self.job}))
                continue
            if not writers or "" in writers:
                others = self.live_jobs() if others is None else others
                if others:
                    log.info("step %d names no writer and jobs %s are alive; left alone", step, others)
                    continue
            self._remove_files(self._intent_paths(step))
            self.storage.remove_tree(self.step_dir(step))
            cleaned.append(step)
        return cleaned
