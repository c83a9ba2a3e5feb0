"""The commit record of a step (``Manifest``) and the file records in it, each field checked when read:
a record of the wrong structure, or a path that is not confined to the checkpoint dir, makes its step
damaged (``CheckpointCorruptError``), never a crash. Torch-free."""

from __future__ import annotations

import json
import posixpath
from dataclasses import asdict, dataclass
from typing import Any

from flashckpt import errors as E
from flashckpt.storage.base import FileRecord

__all__ = ["MANIFEST_FORMAT", "Manifest", "record_from_json", "check_rel", "need"]

MANIFEST_FORMAT = "flashckpt-manifest/1"
_KINDS = ("file", "commit", "tracker")
_FORMATS = ("torch", "raw")


def need(cond: bool, what: str) -> None:
    if not cond:
        raise E.CheckpointCorruptError(what)


def check_rel(rel: Any, what: str) -> str:
    """``rel`` as a path relative to the checkpoint dir: a non-empty string, not absolute, no ``..``."""
    need(isinstance(rel, str) and bool(rel) and "\0" not in rel, f"{what}: {rel!r} is not a relative path")
    parts = rel.split("/")
    need(not posixpath.isabs(rel) and ".." not in parts and "://" not in rel,
          f"{what}: {rel!r} is not confined to the checkpoint dir (absolute, or with '..')")
    return rel


def record_from_json(d: Any, what: str) -> FileRecord:
    """A ``FileRecord`` from its JSON object, every field's type checked (``CheckpointCorruptError``)."""
    need(isinstance(d, dict), f"{what}: a file record must be an object, not {type(d).__name__}")
    unknown = set(d) - {"path", "size", "xxh3", "fmt", "name", "kind", "staged"}
    need(not unknown, f"{what}: unknown fields {sorted(unknown)} in a file record")
    need(isinstance(d.get("size"), int) and not isinstance(d.get("size"), bool) and d["size"] >= 0,
          f"{what}: size {d.get('size')!r} is not a byte count")
    need(isinstance(d.get("xxh3"), str), f"{what}: checksum {d.get('xxh3')!r} is not a string")
    need(d.get("fmt", "torch") in _FORMATS, f"{what}: format {d.get('fmt')!r} is not one of {_FORMATS}")
    need(d.get("kind", "file") in _KINDS, f"{what}: kind {d.get('kind')!r} is not one of {_KINDS}")
    need(isinstance(d.get("name", ""), str), f"{what}: name {d.get('name')!r} is not a string")
    staged = d.get("staged", "")
    if staged != "":
        check_rel(staged, what)
    return FileRecord(check_rel(d.get("path"), what), d["size"], d["xxh3"], d.get("fmt", "torch"),
                      d.get("name", ""), d.get("kind", "file"), staged)


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
            wall time of the newest of the ranks' snapshots it was persisted from, ``saved_at_ranks`` that
            of each rank's (compared only with snapshots of the same rank: one node's clock).
        seq: commit sequence number: higher is committed later (0 in manifests older than it).
        job: the job key of the job that wrote and committed it ("" in manifests older than the field).
    """

    step: int
    world_size: int
    files: dict[int, list[FileRecord]]
    replicated: bool
    time: float
    extra: dict[str, Any]
    job: str = ""
    seq: int = 0

    def files_for(self, rank: int) -> list[FileRecord]:
        """The files rank ``rank`` loads: its own (replicated: rank 0's, which are every rank's state); []
        when the step holds none of it (saved by fewer ranks): never another rank's."""
        return self.files.get(0 if self.replicated else rank, [])

    def ranks_without_state(self, world_size: int) -> list[int]:
        """The ranks of a job of ``world_size`` ranks that have no files in this step (none when replicated)."""
        return [] if self.replicated else [r for r in range(world_size) if r not in self.files]

    def nbytes(self) -> int:
        """The bytes of every file of the step."""
        return sum(f.size for fs in self.files.values() for f in fs)

    def saved_at_ranks(self) -> dict[str, float]:
        """Rank (as a string) -> the wall time of the snapshot its files were persisted from
        (``extra.saved_at_ranks``); {} in manifests that do not record it."""
        return {str(r): float(t) for r, t in self.extra.get("saved_at_ranks", {}).items()}

    def all_files(self) -> list[FileRecord]:
        return [f for r in sorted(self.files) for f in self.files[r]]

    def to_json(self) -> bytes:
        d = {"format": MANIFEST_FORMAT, "step": self.step, "world_size": self.world_size,
             "replicated": self.replicated, "time": self.time, "seq": self.seq, "extra": self.extra, "job": self.job,
             "files": {str(r): [asdict(f) for f in fs] for r, fs in self.files.items()}}
        return json.dumps(d, indent=1).encode()

    @staticmethod
    def from_json(raw: bytes) -> Manifest:
        """Parses and checks a manifest: every field's type, every file record (paths relative and
        confined). Raises ``CheckpointCorruptError`` (or ``ValueError`` for invalid JSON)."""
        d = json.loads(raw)
        need(isinstance(d, dict), f"a manifest must be a JSON object, not {type(d).__name__}")
        if d.get("format") != MANIFEST_FORMAT:
            raise E.CheckpointCorruptError(f"unknown manifest format {d.get('format')!r}")
        for k, types in (("step", int), ("world_size", int), ("replicated", bool), ("time", (int, float))):
            v = d.get(k)
            need(isinstance(v, types) and (k == "replicated" or not isinstance(v, bool)),
                  f"field {k!r} is {v!r}, not a {getattr(types, '__name__', 'number')}")
        need(d["step"] >= 0 and d["world_size"] >= 1, f"step {d['step']} / world_size {d['world_size']} out of range")
        fs = d.get("files")
        need(isinstance(fs, dict), f"field 'files' must map ranks to lists of files, not {type(fs).__name__}")
        files: dict[int, list[FileRecord]] = {}
        for r, recs in fs.items():
            need(r.isdigit(), f"files: rank {r!r} is not a rank")
            need(isinstance(recs, list), f"files of rank {r} must be a list, not {type(recs).__name__}")
            files[int(r)] = [record_from_json(f, f"files of rank {r}") for f in recs]
        extra = d.get("extra", {})
        need(isinstance(extra, dict), f"field 'extra' must be an object, not {type(extra).__name__}")
        bases = extra.get("bases", {})
        need(isinstance(bases, dict) and all(isinstance(k, str) and k.isdigit() for k in bases),
              "extra.bases must map ranks to directories")
        for b in bases.values():
            check_rel(b, "extra.bases")
        trackers = extra.get("trackers", [])
        need(isinstance(trackers, list), "extra.trackers must be a list")
        for t in trackers:
            record_from_json(t, "extra.trackers")
        sup = extra.get("supersedes", [])
        need(isinstance(sup, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in sup),
              "extra.supersedes must be a list of steps")
        job, seq = d.get("job", ""), d.get("seq", 0)
        need(isinstance(job, str), "field 'job' must be a string")
        need(isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0, "field 'seq' must be an integer >= 0")
        need(isinstance(extra.get("saved_at", 0.0), (int, float)), "extra.saved_at must be a number")
        ranks_at = extra.get("saved_at_ranks", {})
        need(isinstance(ranks_at, dict) and all(isinstance(v, (int, float)) for v in ranks_at.values()),
              "extra.saved_at_ranks must map ranks to times")
        return Manifest(d["step"], d["world_size"], files, d["replicated"], float(d["time"]), extra, job, seq)
