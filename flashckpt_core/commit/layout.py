"""The layout of a checkpoint dir's commit records, and the queries on them: ``CommitLayout`` names the
records (intents, per-rank done markers, manifests, the tracker), writes and reads the markers, and
answers which steps are committed, in which order, and whether their files verify. The commit protocol
that writes manifests is ``commit.protocol``; removing steps is ``commit.removal``; where the records live
is ``commit.records_home``. Imports the storage layer and the rest of ``commit`` below it; torch-free.
Readers (trainers, the CLI, adapters) may query from any process at once; only the saver writes.

The records of checkpoint dir ``D`` live in ``<parent(D)>/.flashckpt/<basename(D)>/`` (``D/.flashckpt/``
for checkpoint dirs written by older versions and a few other cases; ``_records`` decides, in one
place, and keeps them bound to ``D``). ``D`` itself holds only what the user's framework writes. In the
records (``CommitLayout.meta``)::

    dir.json                     the checkpoint dir they describe (its inode number; beside only)
    tracker.json                 newest committed step (atomically replaced)
    jobs/<job key>.lock          held (shared flock) by every live saver of that job
    steps/<step>/intent_rank_R.json  files rank R is about to write (for clean-up after a crash)
    steps/<step>/done_rank_R.json    rank R's files with sizes and checksums
    steps/<step>/failed_rank_R.json  rank R's persist failed
    steps/<step>/manifest.json   the commit record: all files, sizes, checksums, world layout
    steps/<step>/staged/rank_R/  a FileSet's commit-time and tracker files until the commit

A step is committed once its manifest exists; the tracker only names the newest one and is rewritten
after the manifest (readers go by the manifests; a new saver re-derives the tracker from them). Files
listed in manifests are relative to the checkpoint dir and confined to it; a record naming a path
outside, or of the wrong structure, makes its step damaged. A committed step's files are never
rewritten while it is committed: a save that reuses a file of an older step writes it staged and moves
it into place at its commit, which supersedes (removes) the older step.

Markers and manifests name the job that wrote them (``"job"``: its job key; absent in older ones). Two
jobs sharing a checkpoint dir never mix: a commit takes only its own job's done markers (another live
job's marker for the same step is a clear error), and start-up clean-up leaves alone the uncommitted
steps of every other job whose saver is alive (its job lock is held).

"Newest" means most recently committed, never the highest step: each manifest carries a commit
sequence number ``seq`` (one above every other manifest's), so a step saved again replaces its earlier
commit and a lower step (a rolled-back timeline) is newer than the abandoned higher ones. Load, the
tracker and retention all follow that order. Manifests without ``seq`` (older versions) count as 0 and
keep their step order among themselves.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, replace
from typing import Any

from flashckpt import errors as E
from flashckpt.commit import checkpoint_dir
from flashckpt.commit.manifest import Manifest, check_rel, need, record_from_json
from flashckpt.commit.records_home import Held, home_for
from flashckpt.commit.records_read import unreadable
from flashckpt.errors import TrackerUpdateError
from flashckpt.format.names import META
from flashckpt.storage import locations
from flashckpt.storage.base import CheckpointStorage, FileRecord

__all__ = ["Manifest", "CommitLayout", "TrackerUpdateError", "record_from_json"]


log = logging.getLogger(__name__)

class CommitLayout:
    """Reads and writes the commit records of one checkpoint dir through a storage backend.

    ``job`` is the job key of the job writing through it (a saver's); its markers and manifests carry it.
    Where the records live and how a job holds them depends on the backend (``records_home.home_for``).
    """

    def __init__(self, checkpoint_dir: str, storage: CheckpointStorage, *, job: str = "") -> None:
        self.storage = storage
        self.root = storage.normpath(checkpoint_dir)
        self.home = home_for(storage, self.root)
        self.job = job

    # the records dir -----------------------------------------------------
    @property
    def meta(self) -> str:
        """The records dir (see ``records``); may change at ``claim``."""
        return self.home.meta

    @property
    def beside(self) -> bool:
        """Whether the records live beside the checkpoint dir (else inside it, in ``.flashckpt``)."""
        return self.home.beside

    def claim(self) -> Held | None:
        """Makes the records ready for a saver starting on this checkpoint dir and takes this job's hold
        on them, kept for the saver's life (``RecordsHome.claim``: stale records removed, a lock or lease).

        Raises:
            CheckpointDirError: the records cannot be used (the message says why).
        """
        return self.home.claim(self.job, self)

    def stale_reason(self) -> str | None:
        """Why the records describe another directory of this name or files that are gone, or None."""
        return self.home.stale_reason(self)

    def records_in_use(self) -> bool:
        """Whether the records exist and describe this checkpoint dir (not stale)."""
        return self.storage.isdir(self.meta) and self.stale_reason() is None

    def tidy(self, *, dry_run: bool = False) -> list[str]:
        """``flashckpt gc DIR``: removes stale records and orphans no live job holds, and what the backend's
        interrupted writes left. Returns what was removed (or would be), one line each."""
        return self.home.tidy(self, dry_run=dry_run)

    def job_alive(self, job: str) -> bool:
        """Whether a saver of job ``job`` holds the records now; "" (unknown) is never alive."""
        return self.home.job_alive(job)

    def live_jobs(self) -> list[str]:
        """Jobs other than this one whose savers are alive on this checkpoint dir."""
        return self.home.live_jobs(exclude=self.job)

    # paths ---------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return locations.join(self.meta, "steps", f"{step:012d}")

    def marker_path(self, step: int, kind: str, rank: int) -> str:
        return locations.join(self.step_dir(step), f"{kind}_rank_{rank}.json")

    def manifest_path(self, step: int) -> str:
        return locations.join(self.step_dir(step), "manifest.json")

    @property
    def tracker_path(self) -> str:
        return locations.join(self.meta, "tracker.json")

    def rel(self, path: str) -> str:
        """``path``'s name relative to the checkpoint dir.

        Raises:
            CheckpointDirError: ``path`` lies outside it (or reaches outside through a symbolic link)."""
        p = self.storage.normpath(path)
        rel = locations.relpath(p, self.root)
        if rel is None or (rel != "." and not self.is_confined(p)):
            raise E.CheckpointDirError(f"{path} is outside the checkpoint dir {self.root} (or reaches outside "
                                       "through a symlink); persist paths must lie inside it so retention and "
                                       "verification can find them")
        return rel

    def abs(self, rel: str) -> str:
        """The location of ``rel`` (taken from a manifest, marker or intent), confined to the checkpoint
        dir: no absolute path, no ``..``, no symlinked directory leading outside.

        Raises:
            CheckpointCorruptError: ``rel`` is not confined (the record naming it is damaged or crafted).
        """
        path = locations.join(self.root, check_rel(rel, "a recorded path"))
        if not self.is_confined(path):
            raise E.CheckpointCorruptError(f"a recorded path: {rel!r} leads outside the checkpoint dir "
                                           f"{self.root} through a symlink")
        return path

    def is_confined(self, path: str, within: str | None = None) -> bool:
        """Whether ``path`` lies inside the checkpoint dir (or ``within``) as stored (``storage.confined``)."""
        return checkpoint_dir.confined(self.storage, path, within or self.root)

    def _inside(self, path: str, base: str) -> bool:
        return path == base or locations.inside(path, base, strict=True)

    def check_place(self, step: int, path: str, files: list[str] | None = None) -> list[str]:
        """The part of ``check_target`` that reads nothing: refuses a target in the commit records (or the
        name reserved for them) or outside the checkpoint dir; returns the targets, normalized (the path,
        then ``files``). Where another step's committed files are is ``check_target``'s question.

        Raises:
            CheckpointDirError: the target is refused (the message says what to do).
        """
        norm = self.storage.normpath
        targets = [norm(path)] + [norm(f) for f in (files or [])]
        # The records, wherever they are, and the name of the inside layout even when they are beside:
        # a checkpoint dir holding ``.flashckpt`` would be read as one an older flashckpt wrote.
        for records in dict.fromkeys((self.meta, locations.join(self.root, META))):
            for t in targets:
                if self._inside(t, records):
                    raise E.CheckpointDirError(
                        f"save(step={step}): {t} lies in {records}, " +
                        ("flashckpt's commit records (manifests, tracker.json)" if records == self.meta else
                         "a name flashckpt reserves for its commit records") + "; choose a path outside it")
        self.rel(path)
        return targets

    def check_target(self, step: int, path: str, *, files: list[str] | None = None) -> None:
        """Refuses a persist target that would change another step's committed files, before anything
        is written. ``path`` is the file, or the ``FileSet`` directory whose ``files`` (absolute paths,
        trackers excluded) are written.

        Refused: paths in the records dir (manifests, markers, the tracker) and in the checkpoint dir's
        ``.flashckpt`` (the name of the records dir inside it); paths equal to or inside
        another committed step's ``FileSet`` directory; a file where another step's committed files
        lie below. Allowed: a file that replaces exactly a file another committed step lists (a fixed
        name such as Lightning's ``last.ckpt``); it is written staged and moved into place at the
        commit, after which that older step no longer counts as committed (it is superseded).

        Raises:
            CheckpointDirError: the target is refused (the message says what to do).
        """
        targets = self.check_place(step, path, files)
        for s, m in self.committed_manifests().items():
            if s == step:
                continue
            for b in m.extra.get("bases", {}).values():
                base = locations.join(self.root, b)
                for t in targets:
                    if self._inside(t, base):
                        raise E.CheckpointDirError(
                            f"save(step={step}): {t} is inside {base}, the directory of committed step {s}; a "
                            "committed step's files are never rewritten: save each step to its own path "
                            f"(or delete step {s} first)")
            for f in m.all_files():
                p = locations.join(self.root, f.path)
                for t in targets[0 if files is None else 1:]:
                    if locations.inside(p, t, strict=True):
                        raise E.CheckpointDirError(
                            f"save(step={step}): {t} would be a file where committed step {s} keeps {p}; save "
                            "each step to its own path")

    def committed_manifests(self) -> dict[int, Manifest]:
        """Step -> manifest of every committed step whose manifest is sound, in commit order (each
        manifest read once; ``committed_steps`` also lists the damaged ones)."""
        out = []
        for name in self.step_names():
            if name.isdigit():
                try:
                    out.append((int(name), self.read_manifest(int(name))))
                except E.CheckpointCorruptError:  # missing (not committed) or damaged
                    continue
        return dict(sorted(out, key=lambda sm: (sm[1].seq, sm[0])))

    # markers -------------------------------------------------------------
    def write_intent(self, step: int, rank: int, paths: list[str]) -> None:
        body = json.dumps({"rank": rank, "paths": [self.rel(p) for p in paths], "job": self.job}).encode()
        self.storage.write_bytes(self.marker_path(step, "intent", rank), body)

    def write_done(self, step: int, rank: int, files: list[FileRecord], base: str = "", saved_at: float = 0.0) -> None:
        """Rank ``rank``'s files of ``step`` are durable; ``base`` is where the rank's set lives, ``saved_at``
        the wall time of the snapshot they were persisted from."""
        recs = [asdict(replace(f, path=self.rel(f.path), staged=self._staged_rel(f.staged) if f.staged else ""))
                for f in files]
        body = {"rank": rank, "files": recs, "base": self.rel(base) if base else "", "job": self.job,
                "saved_at": saved_at}
        self.storage.write_bytes(self.marker_path(step, "done", rank), json.dumps(body).encode())

    def clear_markers(self, step: int, rank: int) -> None:
        """Removes rank ``rank``'s done and failed markers of ``step`` left by an earlier save of the same
        step, before its new persist begins, so a commit never takes them for the new one's."""
        for kind in ("done", "failed"):
            self.storage.remove(self.marker_path(step, kind, rank))

    def staged_path(self, step: int, rank: int, index: int) -> str:
        """Where a rank's commit-time or tracker file waits for the commit."""
        return locations.join(self.step_dir(step), "staged", f"rank_{rank}", f"{index:05d}")

    def _staged_rel(self, path: str) -> str:
        """How markers and manifests name a staged file: relative to the records dir (``steps/...``)."""
        rel = locations.relpath(self.storage.normpath(path), self.meta)
        if rel is None or rel == "." or not self.is_confined(path, self.meta):
            raise E.CheckpointDirError(f"{path} is not a staged file in the commit records {self.meta}")
        return rel

    def staged_abs(self, rel: str) -> str:
        """The staged file a record names: relative to the records dir, or, in records written by older
        versions (``.flashckpt/steps/...``), relative to the checkpoint dir. Confined to either.

        Raises:
            CheckpointCorruptError: ``rel`` is not confined (the record naming it is damaged or crafted).
        """
        check_rel(rel, "a staged path")
        if rel.split("/")[0] == META:
            return self.abs(rel)
        path = locations.join(self.meta, rel)
        if not self.is_confined(path, self.meta):
            raise E.CheckpointCorruptError(f"a staged path: {rel!r} leads outside the commit records {self.meta} "
                                           "through a symlink")
        return path

    def write_failed(self, step: int, rank: int, error: str) -> None:
        try:
            self.storage.write_bytes(self.marker_path(step, "failed", rank),
                                     json.dumps({"rank": rank, "error": error, "job": self.job}).encode())
        except OSError:  # the storage that failed may refuse this too; the commit then times out
            log.exception("could not write the failure marker of step %d rank %d", step, rank)

    def read_marker(self, step: int, kind: str, rank: int) -> dict[str, Any] | None:
        """A marker's JSON object; None when it does not exist (yet).

        Raises:
            CheckpointCorruptError: it is not a JSON object with the fields its kind needs.
        """
        path = self.marker_path(step, kind, rank)
        try:
            d = json.loads(self.storage.read_bytes(path))
        except FileNotFoundError:
            return None
        except ValueError as e:
            raise E.CheckpointCorruptError(f"{path}: not valid JSON ({e})") from e
        try:
            need(isinstance(d, dict), f"a marker must be a JSON object, not {type(d).__name__}")
            if kind == "done":
                need(isinstance(d.get("files"), list), "'files' must be a list")
                d["files"] = [record_from_json(f, "files") for f in d["files"]]
                base = d.get("base", "")
                if base != "":
                    check_rel(base, "base")
            elif kind == "intent":
                need(isinstance(d.get("paths"), list), "'paths' must be a list")
            elif kind == "failed":
                need(isinstance(d.get("error", ""), str), "'error' must be a string")
        except E.CheckpointCorruptError as e:
            raise E.CheckpointCorruptError(f"{path} is damaged: {e}") from None
        return d

    def own_marker(self, step: int, kind: str, rank: int) -> dict[str, Any] | None:
        """Rank ``rank``'s marker of ``step`` when this job wrote it (or it names no job). Another job's
        marker counts as absent while that job is dead (this job's rank overwrites it) and is an error
        while it is alive: two live jobs save the same step into one checkpoint dir."""
        m = self.read_marker(step, kind, rank)
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
    def markers_complete(self, step: int, ranks: list[int]) -> bool:
        """Whether every one of ``ranks`` has this job's done marker for ``step``."""
        try:
            return bool(ranks) and all(self.own_marker(step, "done", r) is not None for r in ranks)
        except E.CheckpointCorruptError:
            return False

    def write_tracker(self, step: int | None) -> None:
        """Points ``tracker.json`` at ``step`` (removes it for None)."""
        if step is None:
            self.storage.remove(self.tracker_path)
        else:
            self.storage.write_bytes(self.tracker_path, json.dumps({"step": step}).encode())

    # reading -------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        """Every step with a manifest, in commit order: the most recently committed last (derived from
        storage alone; see the module docstring). Ascending for a job that never went back."""
        return [s for _q, s in self.commit_order()]

    def commit_order(self) -> list[tuple[int, int]]:
        """(commit seq, step) of every step with a manifest, oldest commit first. A damaged manifest sorts
        by its step among those without a seq; one that cannot be read (an OSError other than its removal)
        raises."""
        out = []
        for name in self.step_names():
            if name.isdigit() and self._has_manifest(int(name)):
                path = self.manifest_path(int(name))
                try:
                    raw = self.storage.read_bytes(path)
                except (FileNotFoundError, NotADirectoryError):
                    continue  # deleted since it was listed: no longer committed
                except OSError as e:
                    # A seq taken for 0 would reorder the commits (EMFILE on the newest manifest made the
                    # previous step "the newest", and a load took it silently).
                    raise unreadable("read the manifest", path, e) from e
                try:
                    seq = int(json.loads(raw).get("seq", 0))
                except (ValueError, TypeError, AttributeError):
                    seq = 0
                out.append((seq, int(name)))
        return sorted(out)

    def uncommitted_steps(self) -> list[int]:
        return sorted(int(n) for n in self.step_names() if n.isdigit() and not self._has_manifest(int(n)))

    def step_names(self) -> list[str]:
        """The names in the records' ``steps`` dir; [] when there is none.

        Raises:
            CheckpointDirError: it could not be listed (``_records_read.unreadable``): never "no step"."""
        base = locations.join(self.meta, "steps")
        try:
            return self.storage.listdir(base)
        except OSError as e:
            raise unreadable("list the committed steps in", base, e) from e

    def _has_manifest(self, step: int) -> bool:
        """Whether ``step`` has a manifest (is committed).

        Raises:
            CheckpointDirError: whether it has one could not be told (EACCES, EIO...): a committed step
                taken for uncommitted would be passed over by a load, or removed as half-written."""
        path = self.manifest_path(step)
        try:
            return self.storage.exists(path)
        except OSError as e:
            raise unreadable("look up the manifest", path, e) from e

    def read_manifest(self, step: int) -> Manifest:
        """Step ``step``'s manifest.

        Raises:
            CheckpointCorruptError: it has none (not committed), or it is damaged.
            CheckpointDirError: it could not be read (EMFILE, EACCES, EIO...; ``_records_read.unreadable``)."""
        path = self.manifest_path(step)
        try:
            return Manifest.from_json(self.storage.read_bytes(path))
        except (FileNotFoundError, NotADirectoryError) as e:
            raise E.CheckpointCorruptError(f"step {step} has no manifest in {self.meta}") from e
        except OSError as e:
            raise unreadable(f"read the manifest of step {step},", path, e) from e
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise E.CheckpointCorruptError(f"the manifest of step {step} is damaged: {e}") from e
        except E.CheckpointCorruptError as e:
            raise E.CheckpointCorruptError(f"the manifest of step {step} is damaged: {e}") from None

    def base(self, step: int, rank: int = 0) -> str | None:
        """The absolute directory of rank ``rank``'s file set in committed ``step`` (None for single files).
        For a rank the step holds no files of (saved by fewer ranks): the one directory every rank of the step
        wrote into (a DCP checkpoint, a Trainer's ``checkpoint-N``; adapters that reshard read it), else None:
        never another rank's own."""
        m = self.read_manifest(step)
        bases = m.extra.get("bases", {})
        b = bases.get(str(0 if m.replicated else rank))
        if b is None and not m.replicated and rank not in m.files:
            shared = set(bases.values())
            if len(shared) == 1 and set(bases) == {str(r) for r in m.files}:
                b = shared.pop()
        return self.abs(b) if b else None

    def tracker_step(self) -> int | None:
        """The step ``tracker.json`` names; None when it is missing or damaged (the manifests decide).

        Raises:
            CheckpointDirError: it could not be read (``_records_read.unreadable``)."""
        try:
            d = json.loads(self.storage.read_bytes(self.tracker_path))
        except (FileNotFoundError, NotADirectoryError, ValueError):
            return None
        except OSError as e:
            raise unreadable("read", self.tracker_path, e) from e
        step = d.get("step") if isinstance(d, dict) else None
        return step if isinstance(step, int) and not isinstance(step, bool) else None

    def verify(self, step: int, rank: int | None = None, *, deep: bool = True,
               world_size: int | None = None) -> list[str]:
        """Problems found in step ``step`` (all ranks' files, or those ``rank`` loads); [] when sound.
        ``deep=False`` checks that the files exist with their sizes only (a loader that verifies checksums
        while it reads, as from an object store, spares a second download). ``world_size``: ``rank`` is one
        of a job of that many ranks, and also verifies the files of the step's ranks it lacks (saved by more
        ranks: rank + k * world_size), which an adapter that reshards reads: every file is some rank's to
        verify."""
        try:
            m = self.read_manifest(step)
        except E.CheckpointCorruptError as e:
            return [str(e)]
        problems = []
        ranks = [rank] if rank is not None else sorted(m.files)
        if rank is not None and world_size and not m.replicated:
            ranks += [r for r in sorted(m.files) if r >= world_size and r % world_size == rank]
        for f in (f for r in ranks for f in m.files_for(r)):
            try:
                path = self.abs(f.path)
            except E.CheckpointCorruptError as e:
                problems.append(f"the manifest of step {step} is damaged: {e}")
                continue
            try:
                size, digest = self.storage.checksum(path) if deep else (self.storage.size(path), f.xxh3)
            except (FileNotFoundError, NotADirectoryError):
                problems.append(f"{path}: missing")
                continue
            except OSError as e:  # not a damaged step (a load would fall back to an older one): unknown
                raise unreadable(f"read a file of step {step},", path, e) from e
            if size != f.size:
                problems.append(f"{path}: size {size} != {f.size} in the manifest")
            elif digest != f.xxh3:
                problems.append(f"{path}: checksum {digest} != {f.xxh3} in the manifest")
        return problems

    def committed_files(self) -> dict[int, set[str]]:
        """Committed step -> the paths (relative) its manifest lists; damaged manifests are left out."""
        return {s: {f.path for f in m.all_files()} for s, m in self.committed_manifests().items()}

    def committed_paths(self) -> set[str]:
        return {locations.join(self.root, p) for paths in self.committed_files().values() for p in paths}
