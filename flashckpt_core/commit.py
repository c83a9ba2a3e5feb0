"""The commit protocol on storage: intents, per-rank done markers, manifests and the tracker.

Layout under the checkpoint dir (``META`` = ``.flashckpt``)::

    .flashckpt/tracker.json                    newest committed step (atomically replaced)
    .flashckpt/steps/<step>/intent_rank_R.json files rank R is about to write (for clean-up after a crash)
    .flashckpt/steps/<step>/done_rank_R.json   rank R's files with sizes and checksums
    .flashckpt/steps/<step>/failed_rank_R.json rank R's persist failed
    .flashckpt/steps/<step>/manifest.json      the commit record: all files, sizes, checksums, world layout
    .flashckpt/steps/<step>/staged/rank_R/     a FileSet's commit-time and tracker files until the commit

A step is committed once its manifest exists; the tracker only names the newest one and is rewritten
after the manifest. Files listed in manifests are relative to the checkpoint dir.

"Newest" means most recently committed, never the highest step: each manifest carries a commit
sequence number ``seq`` (one above every other manifest's), so a step saved again replaces its earlier
commit and a lower step (a rolled-back timeline) is newer than the abandoned higher ones. Load, the
tracker and retention all follow that order. Manifests without ``seq`` (older versions) count as 0 and
keep their step order among themselves.
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
        extra: adapter-specific JSON (framework tracker files written at commit, ...); ``saved_at`` is the
            wall time of the newest of the ranks' snapshots it was persisted from.
        seq: commit sequence number: higher is committed later (0 in manifests older than it).
    """

    step: int
    world_size: int
    files: dict[int, list[FileRecord]]
    replicated: bool
    time: float
    extra: dict[str, Any]
    seq: int = 0

    def files_for(self, rank: int) -> list[FileRecord]:
        if self.replicated or rank not in self.files:
            return self.files.get(0, [])
        return self.files[rank]

    def all_files(self) -> list[FileRecord]:
        return [f for r in sorted(self.files) for f in self.files[r]]

    def to_json(self) -> bytes:
        d = {"format": MANIFEST_FORMAT, "step": self.step, "world_size": self.world_size,
             "replicated": self.replicated, "time": self.time, "seq": self.seq, "extra": self.extra,
             "files": {str(r): [asdict(f) for f in fs] for r, fs in self.files.items()}}
        return json.dumps(d, indent=1).encode()

    @staticmethod
    def from_json(raw: bytes) -> Manifest:
        d = json.loads(raw)
        if d.get("format") != MANIFEST_FORMAT:
            raise E.CheckpointCorruptError(f"unknown manifest format {d.get('format')!r}")
        files = {int(r): [FileRecord(**f) for f in fs] for r, fs in d["files"].items()}
        return Manifest(int(d["step"]), int(d["world_size"]), files, bool(d["replicated"]),
                        float(d["time"]), dict(d.get("extra", {})), int(d.get("seq", 0)))


class CommitLayout:
    """Reads and writes the commit records of one checkpoint dir through a storage backend."""

    def __init__(self, checkpoint_dir: str, storage: CheckpointStorage) -> None:
        self.root = os.path.abspath(checkpoint_dir)
        self.storage = storage
        self.meta = os.path.join(self.root, META)

    # paths ---------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return os.path.join(self.meta, "steps", f"{step:012d}")

    def _marker(self, step: int, kind: str, rank: int) -> str:
        return os.path.join(self.step_dir(step), f"{kind}_rank_{rank}.json")

    def manifest_path(self, step: int) -> str:
        return os.path.join(self.step_dir(step), "manifest.json")

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
        body = json.dumps({"rank": rank, "paths": [self.rel(p) for p in paths]}).encode()
        self.storage.write_bytes(self._marker(step, "intent", rank), body)

    def write_done(self, step: int, rank: int, files: list[FileRecord], base: str = "", saved_at: float = 0.0) -> None:
        """Rank ``rank``'s files of ``step`` are durable; ``base`` is where the rank's set lives, ``saved_at``
        the wall time of the snapshot they were persisted from."""
        recs = [asdict(replace(f, path=self.rel(f.path), staged=self.rel(f.staged) if f.staged else ""))
                for f in files]
        body = {"rank": rank, "files": recs, "base": self.rel(base) if base else "", "saved_at": saved_at}
        self.storage.write_bytes(self._marker(step, "done", rank), json.dumps(body).encode())

    def clear_markers(self, step: int, rank: int) -> None:
        """Removes rank ``rank``'s done and failed markers of ``step`` left by an earlier save of the same
        step, before its new persist begins, so a commit never takes them for the new one's."""
        for kind in ("done", "failed"):
            self.storage.remove(self._marker(step, kind, rank))

    def staged_path(self, step: int, rank: int, index: int) -> str:
        """Where a rank's commit-time or tracker file waits for the commit."""
        return os.path.join(self.step_dir(step), "staged", f"rank_{rank}", f"{index:05d}")

    def write_failed(self, step: int, rank: int, error: str) -> None:
        try:
            self.storage.write_bytes(self._marker(step, "failed", rank),
                                     json.dumps({"rank": rank, "error": error}).encode())
        except OSError:  # the storage that failed may refuse this too; the commit then times out
            log.exception("could not write the failure marker of step %d rank %d", step, rank)

    def _read_marker(self, step: int, kind: str, rank: int) -> dict[str, Any] | None:
        try:
            return json.loads(self.storage.read_bytes(self._marker(step, kind, rank)))
        except FileNotFoundError:
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
        saved_at = 0.0
        delay = 0.002
        while True:
            for r in ranks:
                if r in files:
                    continue
                failed = self._read_marker(step, "failed", r)
                if failed is not None:
                    raise E.PersistError(f"step {step}: rank {r} failed to persist: {failed.get('error')}")
                done = self._read_marker(step, "done", r)
                if done is not None:
                    files[r] = [FileRecord(**f) for f in done["files"]]
                    bases[r] = str(done.get("base", ""))
                    saved_at = max(saved_at, float(done.get("saved_at", 0.0)))
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
        order = self.commit_order()
        manifest = Manifest(step, world_size, files, replicated, time.time(),
                            {**extra, "bases": {str(r): b for r, b in bases.items() if b},
                             "trackers": [asdict(f) for f in trackers], "saved_at": saved_at},
                            seq=max((q for q, _s in order), default=0) + 1)
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
        """Every step with a manifest, in commit order: the most recently committed last (derived from
        storage alone; see the module docstring). Ascending for a job that never went back."""
        return [s for _q, s in self.commit_order()]

    def commit_order(self) -> list[tuple[int, int]]:
        """(commit seq, step) of every step with a manifest, oldest commit first. A manifest that cannot
        be read sorts by its step among those without a seq."""
        out = []
        base = os.path.join(self.meta, "steps")
        for name in self.storage.listdir(base):
            if name.isdigit() and self.storage.exists(self.manifest_path(int(name))):
                try:
                    seq = int(json.loads(self.storage.read_bytes(self.manifest_path(int(name)))).get("seq", 0))
                except (OSError, ValueError, TypeError, AttributeError):
                    seq = 0
                out.append((seq, int(name)))
        return sorted(out)

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

    def clean_uncommitted(self, keep: frozenset[int] | set[int] = frozenset()) -> list[int]:
        """Removes half-written steps (no manifest) left by a crash, except those in ``keep``.

        Only called when no persist of those steps can be running (a saver that just started)."""
        cleaned = []
        for step in self.uncommitted_steps():
            if step in keep:
                continue
            self._remove_files(self._intent_paths(step))
            self.storage.remove_tree(self.step_dir(step))
            cleaned.append(step)
        return cleaned
