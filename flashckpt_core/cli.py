"""The ``flashckpt`` command: inspect, verify and clean up checkpoints and runtime state.

    flashckpt ls DIR [--local-dir L] steps in DIR: committed or not, size, age, the tiers holding each (this
                                     node's memory, the local tier L, the durable DIR), files
    flashckpt verify DIR [--step N]  checks sizes and checksums against the manifests (exit 1 on damage)
    flashckpt gc [DIR] [--dry-run]   removes runtime dirs (segments, sockets, locks) of dead jobs and the
                                     staging dirs of dead trainers (/dev/shm/flashckpt-hf-*...); with DIR,
                                     also DIR's stale commit records and the records of deleted dirs beside it
    flashckpt adopt DIR --from ORIG  DIR is a copy or a move of checkpoint dir ORIG whose commit records stayed
                                     behind: gives DIR the committed steps of ORIG whose files it holds intact
    flashckpt native [--build]       the C++ fast path for many small tensors: built or not; build it now
    flashckpt upload DIR --local-dir L  uploads the steps committed on the local tier L and not on DIR (left by a
                                     saver that died mid-upload) and commits them there, oldest first
    flashckpt status [DIR]           what this node's savers are doing now (``flashckpt.status``)
    flashckpt export DIR OUT         a step's weights as sharded safetensors or one torch file
                                     (``flashckpt.export``)

Every failure is one line on stderr and exit code 2 (``main``). ~650 lines: the commands that read commit
records and the ``ls`` table; the commands with their own concern (status, export) are modules of their own.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from typing import Any

from flashckpt import errors as E
from flashckpt.commit.adopt import adopt, unrecorded
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.manifest import Manifest
from flashckpt.commit.protocol import commit_step
from flashckpt.commit.tiers import check_local_dir, durable_spec_of, local_layout, pending_uploads, upload_step
from flashckpt.config import Knobs, is_job_key_of_dir, job_key_digest
from flashckpt.storage.base import CheckpointStorage
from flashckpt.storage.registry import checkpoint_location, storage_for
from flashckpt.transport.wire import Client
from flashckpt.util import owned_dirs as _owned_dirs
from flashckpt.util.progress import bar as progress_bar
from tqdm import tqdm

__all__ = ["main", "parser"]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _age(t: float) -> str:
    s = max(0.0, time.time() - t)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def _not_a_dir(storage: CheckpointStorage, path: str) -> str | None:
    """Why ``path`` cannot be a checkpoint dir (missing, a file), or None. A symbolic link to a directory
    is that directory."""
    local = storage.local_path(path)
    if storage.isdir(path) or (local is not None and os.path.isdir(local)):
        return None
    if local is None:
        return f"{path} holds nothing"
    if not os.path.lexists(local):
        return f"{path} does not exist"
    return f"{path} is a file, not a checkpoint dir" if os.path.isfile(local) else f"{path} is not a directory"


class _Refused(Exception):
    """A command refuses its input (a dir that is not a checkpoint dir, a step not committed): ``main``
    prints the message as it is, one line, and exits 2."""


def _layout(args: argparse.Namespace) -> CommitLayout:
    """The commit layout of ``args.dir``.

    Raises:
        _Refused: it is not a checkpoint dir (missing, a file): says which."""
    storage = storage_for(args.dir)
    why = _not_a_dir(storage, storage.normpath(args.dir))
    if why:
        raise _Refused(why)
    return CommitLayout(args.dir, storage)


def _mtime(layout: CommitLayout, d: str) -> float | None:
    """The newest modification time of the files in the step's records dir ``d`` (a step being written:
    its markers come and go, so a file gone since the listing is passed over)."""
    local = layout.storage.local_path(d)
    if local is None or not os.path.isdir(local):
        return None
    times = []
    for n in os.listdir(local):
        try:
            times.append(os.path.getmtime(os.path.join(local, n)))
        except FileNotFoundError:
            continue
    return max(times, default=time.time())


def _in_memory(checkpoint_dir: str) -> dict[int, dict[str, set[int]]]:
    """step -> {"own": ranks, "backup": ranks} that this node's shared memory holds for ``checkpoint_dir``
    (every job of it on this node: its own snapshots, and backups of other nodes' ranks).

    Raises:
        SharedMemoryError: the runtime dir or a segment is there but could not be read (EMFILE...)."""
    from flashckpt.format.segment import Segment, live_snapshots, segment_paths, unreadable
    from flashckpt.saver.segments import backup_paths, own_local_ranks

    digest = job_key_digest(checkpoint_dir)
    runtime = Knobs.from_env().runtime_dir
    try:
        names = [n for n in os.listdir(runtime) if is_job_key_of_dir(n, digest)]
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as e:
        raise unreadable("list the runtime dir", runtime, e) from e
    out: dict[int, dict[str, set[int]]] = {}
    for name in names:
        jd = os.path.join(runtime, name)
        groups = [("own", [p for _e, p in segment_paths(jd, lr)]) for lr in own_local_ranks(jd)]
        groups += [("backup", [p for _e, p in paths]) for paths in backup_paths(jd).values()]
        for kind, paths in groups:
            segs = []
            for p in paths:
                try:
                    segs.append(Segment(p, populate=False, readonly=True))
                except (FileNotFoundError, E.FlashCheckpointError):
                    continue  # removed since it was listed, or not a segment of ours
                except OSError as e:
                    for seg in segs:
                        seg.close()
                    raise unreadable("open the shared-memory segment", p, e) from e
            try:
                for _seg, _i, h in live_snapshots(segs):
                    out.setdefault(h.step, {"own": set(), "backup": set()})[kind].add(-1 if h.rank is None else h.rank)
            finally:
                for seg in segs:
                    seg.close()
    return out


def _warn_stale(layout: CommitLayout) -> None:
    """Say on stderr when the commit records of `layout` are stale (and so not used)."""
    stale = layout.stale_reason() if layout.storage.isdir(layout.meta) else None
    if stale:
        print(f"the commit records in {layout.meta} are stale ({stale}); they are not used: a saver starting on "
              f"{layout.root} sets them aside (gives them to the dir they describe when it was renamed in its "
              f"parent), `flashckpt gc {layout.root}` removes them", file=sys.stderr)


@dataclasses.dataclass
class _Row:
    """One step of ``flashckpt ls``: the numbers (``--json`` prints them as they are) and the table's text.

    ``training_step``/``epoch``: the trainer's own count, read from the step's file names when they carry it
    (Lightning's ``epoch=E-step=S.ckpt``): flashckpt's ``step`` of a Lightning dir counts saves."""

    step: int
    state: str
    latest: bool = False
    bytes: int | None = None
    saved_at: float | None = None  # commit time (committed), the records' newest change (not committed)
    files: list[str] = dataclasses.field(default_factory=list)
    note: str = ""  # why damaged, what a step not committed may be
    memory: dict[str, list[int | None]] = dataclasses.field(default_factory=dict)
    tiers: str = "-"
    training_step: int | None = None
    epoch: int | None = None

    def as_json(self) -> dict[str, Any]:
        age = None if self.saved_at is None else round(max(0.0, time.time() - self.saved_at), 3)
        return {**dataclasses.asdict(self), "age_s": age}


_TRAINING = re.compile(r"(?:^|[-_/ ])(epoch|step)=(\d+)")


def _training_step(files: list[str], root: str | None = None) -> tuple[int | None, int | None]:
    """(training step, epoch) named by the step's file names (``epoch=3-step=400.ckpt``), else Nones. A
    Lightning ``.ckpt`` whose name carries none (``last.ckpt``) in a local dir ``root``: the ``global_step`` and
    ``epoch`` Lightning put in it (``_ckpt_step``)."""
    for path in files:
        got = dict(_TRAINING.findall(os.path.basename(path)))
        if "step" in got:
            return int(got["step"]), int(got["epoch"]) if "epoch" in got else None
    for path in files:
        if root is not None and path.endswith(".ckpt"):
            return _ckpt_step(os.path.join(root, path))
    return None, None


def _ckpt_step(path: str) -> tuple[int | None, int | None]:
    """``global_step`` and ``epoch`` of the Lightning checkpoint file ``path`` (its pickle only: memory-mapped,
    no tensor read; ``weights_only``, so nothing in it runs), else Nones."""
    try:
        import torch

        ck = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        step, epoch = ck.get("global_step"), ck.get("epoch")
        return (step if isinstance(step, int) else None), (epoch if isinstance(epoch, int) else None)
    except Exception:  # not a readable Lightning checkpoint: no training step to show
        return None, None


def _committed_row(layout: CommitLayout, step: int, latest: int | None, state: str = "committed") -> _Row:
    """The `ls` row of a committed step: its size, commit time and files, or "damaged" with why."""
    try:
        m = layout.read_manifest(step)
    except E.CheckpointCorruptError as e:
        return _Row(step, "damaged", note=str(e))
    files = [f.path for f in m.all_files()]
    trained, epoch = _training_step(files, layout.storage.local_path(layout.root))
    return _Row(step, state, latest=step == latest, bytes=m.nbytes(), saved_at=m.time,
                files=files, training_step=trained, epoch=epoch)


def _ls_rows(layout: CommitLayout, committed: list[int], pending: list[int], latest: int | None,
             memory: dict[int, dict[str, set[int]]], local: CommitLayout | None = None,
             local_steps: list[int] | None = None) -> list[_Row]:
    """One row per step committed, pending, held in this node's memory or committed on the local tier only,
    with which ranks' snapshots of it this node's memory holds (its own, backups of other nodes') and the
    tiers holding it."""
    rows = []
    only_local = set(local_steps or []) - set(committed)
    for step in sorted(set(committed) | set(pending) | set(memory) | only_local):
        if step in only_local and local is not None:
            row = _committed_row(local, step, None, "committed locally")
        elif step not in committed and step not in pending:
            row = _Row(step, "in memory", note="(this node's shared memory)")
        elif step in committed:
            row = _committed_row(layout, step, latest)
        else:
            row = _Row(step, "not committed", saved_at=_mtime(layout, layout.step_dir(step)),
                       note="in progress, or left by a crash")
        held = memory.get(step) or {"own": set(), "backup": set()}
        row.memory = {k: [None if r == -1 else r for r in sorted(held[h])]
                      for k, h in (("ranks", "own"), ("backups_of_ranks", "backup"))}
        row.tiers = _tiers(step, memory, local_steps or [], committed)
        rows.append(row)
    return rows


def _files_cell(files: list[str], note: str) -> str:
    """The FILES cell: the first file and how many more (a step of 64 ranks has 64 files), or the note."""
    if not files:
        return note
    return files[0] + (f" (+{len(files) - 1} more)" if len(files) > 1 else "")


def _cells(row: _Row, root: str, training: bool) -> list[str]:
    """The table's cells of ``row``: STEP, [TRAINING STEP,] STATE, SIZE, AGE, MEMORY, TIERS, FILES."""
    state = {"committed": "committed (latest)" if row.latest else "committed",
             "committed locally": f"committed locally, not yet on {root}"}.get(row.state, row.state)
    held = {k: ["?" if r is None else str(r) for r in v] for k, v in row.memory.items()}
    memory = "; ".join(p for p in (f"ranks {','.join(held['ranks'])}" if held.get("ranks") else "",
                                   f"backups of ranks {','.join(held['backups_of_ranks'])}"
                                   if held.get("backups_of_ranks") else "") if p) or "-"
    trained = "-" if row.training_step is None else str(row.training_step) + (
        "" if row.epoch is None else f" (epoch {row.epoch})")
    return [str(row.step), *([trained] if training else []), state, "-" if row.bytes is None else _size(row.bytes),
            "-" if row.saved_at is None else _age(row.saved_at), memory, row.tiers, _files_cell(row.files, row.note)]


def _clip(text: str, width: int, *, middle: bool = False) -> str:
    """``text`` in at most ``width`` characters: its end (``middle``: its middle, so that a path keeps its
    start and its file name) elided with "…" when longer."""
    if len(text) <= width:
        return text
    if width < 2:
        return text[:width]
    if not middle:
        return text[:width - 1] + "…"
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def _width() -> int | None:
    """The terminal's width when rows should fit one (stdout a terminal, or COLUMNS set); None when the
    output goes to a pipe or a file, which gets every row whole."""
    if os.environ.get("COLUMNS") or sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


#: the columns ``_fit`` may narrow, most readily first, and how narrow (their header's width at least)
_SHRINK = {"MEMORY": 6, "TIERS": 5, "STATE": 9}
_FILES_MIN = 10


def _fit(table: list[list[str]], cols: int) -> tuple[list[list[str]], list[int]]:
    """The table (header first, FILES last) and the widths of its padded columns, made to fit ``cols``
    characters: a column of "-" only (MEMORY when this node's memory holds nothing) is left out, then
    MEMORY, TIERS and STATE are narrowed, until FILES has room."""
    head = table[0]
    keep = [i for i, h in enumerate(head) if h not in _SHRINK or any(r[i] != "-" for r in table[1:])]
    table = [[r[i] for i in keep] for r in table]
    head = table[0]
    n = len(head) - 1
    widths = [max(len(r[i]) for r in table) for i in range(n)]
    for name, least in _SHRINK.items():
        if name not in head:
            continue
        i = head.index(name)
        over = sum(widths) + 2 * n + _FILES_MIN - (cols - 1)
        if over > 0:
            widths[i] = max(least, len(name), widths[i] - over)
    return table, widths


def _print_ls_table(rows: list[_Row], root: str) -> None:
    """Prints the `ls` rows as aligned columns under a header, the files column last. On a terminal every
    row fits its width (``_fit``; the files cell elided in its middle, a row that is still too wide cut):
    a row never wraps. A dir whose files name the trainer's steps (Lightning's) gets a TRAINING STEP
    column: flashckpt's STEP of such a dir counts saves."""
    training = any(r.training_step is not None for r in rows)
    head = ["STEP", *(["TRAINING STEP"] if training else []), "STATE", "SIZE", "AGE", "MEMORY", "TIERS", "FILES"]
    table = [head] + [_cells(r, root, training) for r in rows]
    cols = _width()
    if cols is None:
        widths = [max(len(r[i]) for r in table) for i in range(len(head) - 1)]
    else:
        table, widths = _fit(table, cols)
    n = len(widths)
    for r in table:
        line = "  ".join(_clip(v, w).ljust(w) for v, w in zip(r[:n], widths)) + "  "
        if cols is None:
            line += r[n]
        else:
            line = _clip(line + _clip(r[n], max(cols - 1 - len(line), 1), middle=True), cols - 1)
        print(line.rstrip())


def _local_tier(args: argparse.Namespace, layout: CommitLayout) -> CommitLayout | None:
    """The local tier ``--local-dir`` (default FLASHCKPT_LOCAL_DIR) names, or None."""
    given = args.local_dir if args.local_dir is not None else Knobs.from_env().local_dir
    return local_layout(check_local_dir(given, layout.root, layout.storage, "flashckpt")) if given else None


def _tiers(step: int, memory: dict[int, dict[str, set[int]]], local: list[int], durable: list[int]) -> str:
    """Which tiers hold ``step``: this node's memory, the local tier, the durable checkpoint dir."""
    return ", ".join(t for t, has in (("memory", bool(memory.get(step))), ("local", step in local),
                                      ("durable", step in durable)) if has) or "-"


def cmd_ls(args: argparse.Namespace) -> int:
    layout = _layout(args)
    _warn_stale(layout)
    committed = layout.committed_steps()
    pending = layout.uncommitted_steps()
    latest = layout.tracker_step()
    memory = _in_memory(layout.root)
    local = _local_tier(args, layout)
    local_steps = local.committed_steps() if local is not None else []
    rows = _ls_rows(layout, committed, pending, latest, memory, local, local_steps)
    note = None if committed else unrecorded(layout)
    if note:
        print(note, file=sys.stderr)
    if args.json:  # numbers as numbers: bytes, epoch times, seconds
        print(json.dumps([r.as_json() for r in rows], indent=1))
        return 0
    if not rows:
        print(f"no flashckpt checkpoints in {layout.root}")
        return 0
    _print_ls_table(rows, layout.root)
    return 0


def cmd_upload(args: argparse.Namespace) -> int:
    """Uploads the steps committed on the local tier and not on the checkpoint dir, and commits them there
    (global rank 0's node: the steps whose local manifest carries the durable commit spec; on other nodes
    only their files and done markers go up). Run it where no saver of the job runs."""
    layout = _layout(args)
    local = _local_tier(args, layout)
    if local is None:
        raise _Refused("give the local tier (--local-dir, or FLASHCKPT_LOCAL_DIR)")
    steps = pending_uploads(local, layout)
    if not steps:
        print(f"nothing to upload: {layout.root} holds every step committed on {local.root}")
        return 0
    knobs = Knobs.from_env()
    sizes = {step: local.read_manifest(step).nbytes() for step in steps}
    with _progress("upload", sum(sizes.values())) as bar:
        for step in steps:
            t0 = time.monotonic()
            layout.job = local.job = local.read_manifest(step).job  # the markers and the manifest name the job
            m = upload_step(local, layout, step)
            spec = durable_spec_of(m)
            if spec is not None:
                commit_step(layout, step, [int(r) for r in spec["ranks"]], int(spec["world_size"]),
                            replicated=bool(spec.get("replicated", False)), extra=dict(spec.get("extra", {})),
                            timeout=knobs.commit_timeout_s)
            bar.update(sizes[step])
            bar.write(f"step {step}: uploaded{' and committed' if spec is not None else ''} "
                      f"({_size(sizes[step])}, {time.monotonic() - t0:.1f} s)", file=sys.stdout)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    layout = _layout(args)
    steps = layout.committed_steps()
    if args.step is not None:
        if args.step not in steps:
            raise _Refused(f"step {args.step} is not committed in {layout.root} (committed: {steps})")
        steps = [args.step]
    if not steps:
        raise _Refused(f"no committed checkpoints in {layout.root}")
    manifests = {}
    for step in steps:
        with contextlib.suppress(E.CheckpointCorruptError):  # verify says why
            manifests[step] = layout.read_manifest(step)
    bad = 0
    with _progress("verify", sum(m.nbytes() for m in manifests.values())) as bar:
        for step in steps:
            m = manifests.get(step)
            # Rank by rank (the bar moves within a step of many ranks); [None]: the verify says what is damaged.
            problems = [p for r in (sorted(m.files) if m is not None else [None])
                        for p in _verify_rank(layout, step, r, m, bar)]
            if problems:
                bad += 1
                bar.write("\n".join([f"step {step}: DAMAGED", *(f"  {p}" for p in problems)]), file=sys.stdout)
            else:
                n = len(m.all_files()) if m is not None else 0
                bar.write(f"step {step}: ok ({n} file{'s' if n != 1 else ''})", file=sys.stdout)
    return 1 if bad else 0


def _verify_rank(layout: CommitLayout, step: int, rank: int | None, m: Manifest | None, bar: tqdm) -> list[str]:
    """The problems of rank ``rank``'s files of ``step`` (every rank's: None); moves ``bar`` by their bytes."""
    problems = layout.verify(step, rank)
    if m is not None and rank is not None:
        bar.update(sum(f.size for f in m.files[rank]))
    return problems


@contextlib.contextmanager
def _progress(what: str, total: int) -> Iterator[tqdm]:
    """A progress bar of ``total`` bytes on stderr when it is a terminal (``util.progress.bar``)."""
    with progress_bar(what, total) as bar:
        yield bar


def _alive(job_dir: str) -> bool:
    sock = os.path.join(job_dir, "saver.sock")
    if not os.path.exists(sock):
        return False
    try:
        Client(sock, timeout=5).close()
        return True
    except E.SaverError:
        return True  # served by another uid: Client sent it nothing, and it is not ours to remove
    except OSError:
        return False


def cmd_gc(args: argparse.Namespace) -> int:
    removed = 0
    if args.dir is not None:
        storage = storage_for(args.dir)
        path = storage.normpath(args.dir)
        local = storage.local_path(path)
        if local is not None:
            if os.path.lexists(local) and not os.path.isdir(local):
                print(_not_a_dir(storage, path), file=sys.stderr)
                return 2
            if not os.path.isdir(os.path.dirname(local)):
                print(f"{os.path.dirname(local)} does not exist", file=sys.stderr)
                return 2
        for line in CommitLayout(path, storage).tidy(dry_run=args.dry_run):
            print(f"{'would remove' if args.dry_run else 'removed'} {line}")
            removed += 1
    removed += _gc_runtime(args.dry_run)
    removed += _gc_staging(args.dry_run)
    if not removed:
        print("nothing to clean" + (" (dry run: nothing would be removed)" if args.dry_run else ""))
    return 0


def cmd_adopt(args: argparse.Namespace) -> int:
    try:
        lines = adopt(args.dir, args.src, dry_run=args.dry_run)
    except E.FlashCheckpointError as e:
        print(str(e), file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


def _gc_runtime(dry_run: bool) -> int:
    """Removes (or, ``dry_run``, lists) the runtime dirs of jobs whose saver is gone; returns how many."""
    from flashckpt.transport.spawn import lock_job

    root = Knobs.from_env().runtime_dir
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return 0
    removed = 0
    for name in names:
        d = os.path.join(root, name)
        if not os.path.isdir(d) or _alive(d):
            continue
        size = sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if os.path.isfile(os.path.join(d, n)))
        if dry_run:
            print(f"would remove {d} ({_size(size)})")
            removed += 1
            continue
        lock = lock_job(d)  # a saver starting right now holds it until its socket answers
        try:
            if _alive(d):
                continue
            shutil.rmtree(d, ignore_errors=True)
        finally:
            lock.release()
        removed += 1
        print(f"removed {d} ({_size(size)} of shared memory and sockets of a job whose saver is gone)")
    return removed


def _gc_staging(dry_run: bool) -> int:
    """Removes (or, ``dry_run``, lists) the staging dirs that processes gone since left in the default
    scratch places (/dev/shm, the temp dir); a live process's are never touched. Returns how many."""
    lines = [line for root in _owned_dirs.scratch_roots() for line in _owned_dirs.sweep(root, dry_run=dry_run)]
    for line in lines:
        print(f"{'would remove' if dry_run else 'removed'} {line}")
    return len(lines)


def cmd_native(args: argparse.Namespace) -> int:
    from flashckpt.util import native as _native

    if args.build:
        try:
            _native.build()
        except Exception as e:  # the message says what is missing (compiler, ninja, headers)
            print(f"build failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    print(_native.status())
    return 0


def parser() -> argparse.ArgumentParser:
    """The ``flashckpt`` command line (every argument with its help text)."""
    p = argparse.ArgumentParser(prog="flashckpt", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list the checkpoints of a checkpoint dir")
    ls.add_argument("dir", help="the checkpoint dir (a path, file:// or s3:// URL)")
    ls.add_argument("--json", action="store_true", help="one JSON list of rows instead of the table")
    ls.add_argument("--local-dir", default=None, help="the job's local tier (default: FLASHCKPT_LOCAL_DIR)")
    ls.set_defaults(fn=cmd_ls)
    up = sub.add_parser("upload", help="upload to DIR the steps committed on the local tier and not on DIR, and "
                                       "commit them there (a saver that died mid-upload)")
    up.add_argument("dir", help="the durable checkpoint dir (a path, file:// or s3:// URL)")
    up.add_argument("--local-dir", default=None, help="the job's local tier (default: FLASHCKPT_LOCAL_DIR)")
    up.set_defaults(fn=cmd_upload)
    v = sub.add_parser("verify", help="check files against their manifests; exit 1 on damage")
    v.add_argument("dir", help="the checkpoint dir (a path, file:// or s3:// URL)")
    v.add_argument("--step", type=int, help="verify this committed step only (default: every committed step)")
    v.set_defaults(fn=cmd_verify)
    g = sub.add_parser("gc", help="remove shared memory and sockets of jobs whose saver is gone and the staging "
                                  "dirs of dead trainers; with DIR, also DIR's stale commit records and those of "
                                  "deleted checkpoint dirs beside it")
    g.add_argument("dir", nargs="?", help="a checkpoint dir")
    g.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    g.set_defaults(fn=cmd_gc)
    a = sub.add_parser("adopt", help="give a copied or moved checkpoint dir the committed steps of the dir it came "
                                     "from (its commit records stayed behind), each file checked first")
    a.add_argument("dir", help="the copy (or the dir moved)")
    a.add_argument("--from", dest="src", required=True, help="the checkpoint dir it was copied or moved from")
    a.add_argument("--dry-run", action="store_true", help="say what would be adopted; change nothing")
    a.set_defaults(fn=cmd_adopt)
    n = sub.add_parser("native", help="the C++ fast path for many small tensors: its state; --build builds it now")
    n.add_argument("--build", action="store_true", help="compile it now (needs a C++ compiler and ninja)")
    n.set_defaults(fn=cmd_native)
    from flashckpt.export import add_parser as add_export  # flashckpt export (#34): its own module

    add_export(sub)
    from flashckpt.status import add_parser as add_status  # flashckpt status (#34): its own module

    add_status(sub)
    return p


def _is_failure(e: BaseException) -> bool:
    """Whether ``e`` is a failure the command reports in one line: flashckpt's own errors, the system's
    (OSError: a missing file, a full disk, no connection) and the AWS SDK's (botocore: no credentials,
    an endpoint that does not answer), which the S3 backend raises as they are in a few places."""
    return isinstance(e, (E.FlashCheckpointError, OSError)) or any(
        c.__module__.split(".")[0] == "botocore" for c in type(e).__mro__)


class _HeldWarnings(logging.Handler):
    """The warnings flashckpt's modules log while a command runs (an S3 backend's outage warning and its
    retries, ...), held until the command ends: printed after a success (one line each), dropped after a
    failure, whose one line says what failed and why (the outage's cause included)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(" ".join(record.getMessage().split()))


@contextlib.contextmanager
def _holding_warnings() -> Iterator[_HeldWarnings]:
    """Holds the warnings of the ``flashckpt`` loggers in a ``_HeldWarnings`` for the block (not shown
    through the root logger meanwhile); undoes it after (``main`` also runs inside other programs)."""
    logger = logging.getLogger("flashckpt")
    held = _HeldWarnings()
    propagate = logger.propagate
    logger.addHandler(held)
    logger.propagate = False
    try:
        yield held
    finally:
        logger.removeHandler(held)
        logger.propagate = propagate


def main(argv: list[str] | None = None) -> int:
    """Runs the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code. Every failure of
    every subcommand (bad input, a checkpoint dir that is not one, a store that does not answer) is one
    line on stderr and exit code 2: the subcommands raise, this reports."""
    args = parser().parse_args(argv)
    with _holding_warnings() as held:
        try:
            if getattr(args, "dir", None) is not None:  # a plain path or a URL, as the engine takes it
                args.dir = checkpoint_location(args.dir, f"flashckpt {args.cmd}")
            rc = int(args.fn(args))
        except _Refused as e:
            print(f"flashckpt {args.cmd}: {e}", file=sys.stderr)
            return 2
        except Exception as e:
            if not _is_failure(e):
                raise  # a bug: its traceback helps
            # Said in full (what failed, and what to do); no traceback.
            print(f"flashckpt {args.cmd}: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
    for line in held.lines:
        print(f"flashckpt {args.cmd}: {line}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
