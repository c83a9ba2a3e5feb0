"""The persist worker: writes snapshots' files for the saver, in a process of its own.

Persisting needs torch (a snapshot's tree of zero-copy tensors, ``torch.save``'s format); the saver does
not: it serves trainers, pins slots, writes markers and commits. The saver therefore never imports torch
(~250 MB of RSS it would keep for the rest of its life, a 600 s grace period after a crash included):
its first persist starts this worker (``python -m flashckpt.saver.persist_worker``; its end in the saver is
``saver.worker.PersistWorker``), and the worker exits once it was idle for
FLASHCKPT_PERSIST_WORKER_IDLE_S (``Knobs.persist_worker_idle_s``), so memory goes back down once
persists are done. The next persist starts a new one.

Protocol, over the worker's stdin (requests) and stdout (replies): a 4-byte big-endian length and a UTF-8
JSON object each, as on the saver's socket (``_protocol``). A request persists one pinned slot::

    {"id": N, "seg_path": ..., "slot": i, "generation": g, "step": s, "rank": r, "path": ...}

and its reply carries the request's ``id`` and either ``{"ok": true, "records": [FileRecord fields ...],
"fileset": bool}`` or ``{"ok": false, "type": "OSError", "message": ..., "errno": 28, "strerror": ...,
"filename": ...}``, from which the saver raises the same kind of error (a full disk still says "No space
left on device" in the trainer's ``PersistError``). Requests are served concurrently, one thread each:
the saver persists its local ranks in parallel. The worker's threads run ``persist_nice`` below the
saver's priority.

The worker writes the intent marker and the files (the saver writes the done marker once the reply came,
or the failed marker); it maps segments read-only and never writes to them: pinning and unpinning slots
is the saver's, under the segment lock. It exits at the end of its stdin: when the saver closes it (idle,
or its shutdown) and when the saver dies. A worker that dies (killed, crashed) fails the persists in
flight with an error that says so; the saver starts a new one for the next persist.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import functools
import logging
import os
import pickle
import signal
import sys
import threading
import warnings
from typing import Any

import torch
from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.config import knob
from flashckpt.format.files import FileSet, is_fileset_tree
from flashckpt.format.rawpickle import EMPTY_BYTES, RawPickle
from flashckpt.format.segment import COMPLETE, Segment
from flashckpt.format.tensormeta import TensorMeta, build_tensor
from flashckpt.format.torchfile import SPLICING_MODULE, torch_save_parts, zip_crc_slots
from flashckpt.format.tree import split_opaque, unflatten
from flashckpt.storage import locations
from flashckpt.storage.base import CheckpointStorage, FileRecord, HashingWriter, take_retries
from flashckpt.storage.registry import options_from_env, storage_from_spec
from flashckpt.transport.wire import read_frame, write_frame

__all__ = ["main", "WORKER_MODULE"]

log = logging.getLogger(__name__)

WORKER_MODULE = __spec__.name  # flashckpt.saver.persist_worker, also when run with -m


# ---------------------------------------------------------------------- the worker's end
@dataclasses.dataclass
class _Job:
    step: int
    rank: int
    path: str


class _Writer:
    """Writes what one request names (runs in the worker, one thread per request)."""

    def __init__(self, layout: CommitLayout) -> None:
        self.layout = layout
        self.storage = layout.storage

    def persist(self, req: dict[str, Any]) -> tuple[list[FileRecord], bool]:
        job = _Job(int(req["step"]), int(req["rank"]), str(req["path"]))
        slot, generation = int(req["slot"]), int(req["generation"])
        seg = Segment(str(req["seg_path"]), populate=False, readonly=True)
        try:
            h = seg.header(slot)  # pinned by the saver: it stays this snapshot until unpinned
            if h.state != COMPLETE or h.generation != generation or h.step != job.step:
                raise E.PersistError(f"the snapshot of step {job.step} was overwritten before it was persisted")
            tree, raw = _zero_copy_tree(seg, slot, h)
            is_set = is_fileset_tree(tree)
            if is_set:
                recs = self._persist_fileset(job, FileSet.decode(tree), raw)
            else:
                self.layout.check_target(job.step, job.path)
                self.layout.write_intent(job.step, job.rank, [job.path])
                staged = self._staging(job, job.path, 0)
                rec = _torch_save(self.storage, staged or job.path, tree, raw_pickles=raw)
                recs = [FileRecord(job.path, rec.size, rec.xxh3, staged=staged)]
            del tree  # drop the views of the segment before it is unmapped
            return recs, is_set
        finally:
            seg.close()

    def _persist_fileset(self, job: _Job, fs: FileSet, raw: bool) -> list[FileRecord]:
        """Writes a rank's file set: plain files in place; commit-time and tracker files staged for the
        commit. The intent names every final path a crash could leave behind (not trackers: they are
        only written once the step is committed). ``raw``: the set holds ``RawPickle`` leaves."""
        targets = {}
        for i, (name, e) in enumerate(sorted(fs.items())):
            final = self.layout.abs(name) if e.kind == "tracker" else locations.join(job.path, *name.split("/"))
            self.layout.rel(final)  # inside the checkpoint dir
            staged = self.layout.staged_path(job.step, job.rank, i) if e.kind != "file" else ""
            targets[name] = (final, staged or self._staging(job, final, i))
        self.layout.check_target(job.step, job.path, files=[f for n, (f, _) in targets.items()
                                                             if fs[n].kind != "tracker"])
        self.layout.write_intent(job.step, job.rank, [f for n, (f, _) in targets.items() if fs[n].kind != "tracker"])
        recs = []
        for name, e in sorted(fs.items()):
            final, staged = targets[name]
            rec = (_torch_save(self.storage, staged or final, e.data, raw_pickles=raw) if e.format == "torch"
                   else self.storage.write_parts(staged or final, e.data))
            recs.append(FileRecord(final, rec.size, rec.xxh3, e.format, name, e.kind, staged))
        return recs

    def _staging(self, job: _Job, final: str, index: int) -> str:
        """Where a file that replaces one a committed step lists is written until the commit ("" for any
        other file, written in place): the committed step's file stays intact until this step is
        committed. A file no committed step lists (a leftover of a failed persist) is simply replaced,
        and whatever blocks its path fails this persist, as it would fail a plain write."""
        if not self.storage.exists(final) or self.storage.normpath(final) not in self.layout.committed_paths():
            return ""
        return self.layout.staged_path(job.step, job.rank, index)


def _zero_copy_tree(seg: Segment, slot: int, h: Any) -> tuple[Any, bool]:
    """The snapshot's tree with tensors viewing the segment (no copy), its opaque leaves as the trainer's
    pickles (``RawPickle``: never unpickled here) and ``b""`` as ``EMPTY_BYTES``; and whether it holds
    opaque leaves."""
    meta = seg.read_meta(slot, h)
    data_off = seg.data_off(slot)
    storages: dict[tuple[int, int], torch.UntypedStorage] = {}
    tensors = []
    for v in meta["tensors"]:
        m = TensorMeta.from_json(v)
        key = (m.offset, m.nbytes)
        st = storages.get(key)
        if st is None:
            st = (torch.frombuffer(seg.mm, dtype=torch.uint8, count=m.nbytes, offset=data_off + m.offset)
                  .untyped_storage() if m.nbytes else torch.UntypedStorage(0))
            storages[key] = st
        tensors.append(build_tensor(st, m))
    blob_off = data_off + h.tensor_bytes
    blob = seg.mm[blob_off: blob_off + h.blob_len]
    opaque = [RawPickle(b) for b in split_opaque(blob, meta["opaque"])]
    return unflatten(meta["tree"], tensors, opaque, empty_bytes=EMPTY_BYTES), bool(opaque)


def _torch_save(storage: CheckpointStorage, path: str, tree: Any, *, raw_pickles: bool) -> FileRecord:
    """Writes ``torch.save(tree)``'s file to ``path`` through ``storage``; returns its record.

    The file is split into its ``torch.save`` bytes and the storages' data (``torch_save_parts``) and
    streamed by the backend (``write_parts``: direct I/O on disk, a multipart upload to an object store),
    the zip CRC-32s filled in on the way when torch's CRC option is on (its default). A torch whose
    archive layout the split does not recognize gets a plain ``torch.save`` instead (``_torch_save_plain``).
    ``raw_pickles``: ``tree`` holds ``RawPickle`` leaves, written as they are (``torchfile``)."""
    try:
        parts = torch_save_parts(tree, raw_pickles=raw_pickles)
        slots = zip_crc_slots(parts) if torch.serialization.get_crc32_options() else None
    except E.FlashCheckpointError as e:
        global _warned_plain
        if not _warned_plain:
            _warned_plain = True
            log.warning("%s; persisting with torch.save instead", e)
        return storage.write_file(path, functools.partial(_torch_save_plain, tree, raw_pickles=raw_pickles))
    return storage.write_parts(path, parts, crc_slots=slots)


_warned_plain = False


def _torch_save_plain(tree: Any, path: str, *, raw_pickles: bool = False) -> tuple[int, str]:
    """``torch.save`` through a Python file object that checksums as it writes; returns (size, xxh3).

    Writing through a file object also makes a failing write surface as its OSError: given a path,
    torch's C++ writer reports ENOSPC, EDQUOT or EIO only as an opaque ``RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos ...``, while here the failing ``write`` raises the OSError,
    which torch leaves as the RuntimeError's context: re-raise it, so the trainer's PersistError says
    "No space left on device"."""
    with open(path, "wb") as f:
        w = HashingWriter(f)
        try:
            torch.save(tree, w, pickle_module=SPLICING_MODULE if raw_pickles else pickle)  # type: ignore[arg-type]
        except RuntimeError as e:
            if isinstance(e.__context__, OSError):
                raise e.__context__ from e
            raise
    return w.size, w.hexdigest()


def _error_reply(rid: Any, e: BaseException) -> dict[str, Any]:
    reply: dict[str, Any] = {"id": rid, "ok": False, "type": type(e).__name__, "message": str(e)}
    if isinstance(e, OSError) and e.errno is not None:
        reply.update(errno=e.errno, strerror=e.strerror or os.strerror(e.errno),
                     filename=None if e.filename is None else os.fsdecode(e.filename))
    return reply


def _serve(writer: _Writer, req: dict[str, Any], out_fd: int, out_lock: threading.Lock) -> None:
    rid = req.get("id")
    try:
        recs, is_set = writer.persist(req)
        reply: dict[str, Any] = {"id": rid, "ok": True, "fileset": is_set,
                                 "records": [dataclasses.asdict(r) for r in recs]}
    except BaseException as e:  # reported to the saver, which fails the persist with it
        log.error("persist of step %s rank %s failed: %s: %s", req.get("step"), req.get("rank"), type(e).__name__, e,
                  exc_info=not isinstance(e, (OSError, E.FlashCheckpointError)))
        reply = _error_reply(rid, e)
    retries = take_retries()  # this process's, since the last reply: the saver counts them as its own
    if retries:
        reply["retries"] = retries
    try:
        with out_lock:
            write_frame(out_fd, reply)
    except OSError:
        os._exit(1)  # the saver is gone


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {WORKER_MODULE}", description="flashckpt persist worker")
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--job", default="")
    p.add_argument("--storage", default="")
    p.add_argument("--nice", type=int, default=0)
    p.add_argument("--no-options", action="store_true", help="build the storage without the saver's storage_options "
                   "(the local tier's worker: a POSIX dir, whatever the checkpoint dir's backend takes)")
    args = p.parse_args(argv)
    # The protocol's pipes get fds of their own; fd 0 and 1 become /dev/null and stderr, so nothing a
    # library prints can corrupt a reply.
    in_fd, out_fd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    logging.basicConfig(level=knob("saver_log_level"),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    # The saver stops it (the end of its stdin), and it dies with the saver. A SIGTERM or ^C sent to the
    # whole process group (scancel, a terminal) is the saver's to handle: its last words need the worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.nice:
        # Linux nice is per thread: set on this one before any other starts, every thread inherits it.
        try:
            os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + args.nice)
        except OSError as e:
            log.warning("could not lower the persist worker's priority: %s", e)
    # Segments are mapped read-only: torch warns that its views of them are not writable (they are not
    # written: the files are only read from them).
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    options = {} if args.no_options else options_from_env()
    writer = _Writer(CommitLayout(args.checkpoint_dir, storage_from_spec(args.storage, args.checkpoint_dir, options),
                                  job=args.job))
    out_lock = threading.Lock()
    with out_lock:
        write_frame(out_fd, {"ready": True, "pid": os.getpid()})
    while True:
        try:
            req = read_frame(in_fd)
        except (OSError, ValueError, E.ProtocolError) as e:
            log.error("bad request from the saver: %s; exiting", e)
            req = None
        if req is None:
            # The saver closed the pipe (idle, or its shutdown: nothing is in flight) or died (what is in
            # flight is of no use to anyone): exit at once.
            os._exit(0)
        threading.Thread(target=_serve, args=(writer, req, out_fd, out_lock), daemon=True,
                         name=f"persist{req.get('id')}").start()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(1)
    except OSError as e:
        if e.errno == errno.EPIPE:
            sys.exit(1)
        raise
