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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

from flashckpt import errors as E
from flashckpt.commit.adopt import adopt, unrecorded
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.protocol import commit_step
from flashckpt.commit.tiers import check_local_dir, durable_spec_of, local_layout, pending_uploads, upload_step
from flashckpt.config import Knobs, job_key_digest
from flashckpt.storage.base import CheckpointStorage
from flashckpt.storage.registry import checkpoint_location, storage_for
from flashckpt.transport.wire import Client
from flashckpt.util import owned_dirs as _owned_dirs

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


def _layout(args: argparse.Namespace) -> CommitLayout | None:
    """The commit layout of ``args.dir``; None (the reason printed) when it is not a checkpoint dir."""
    storage = storage_for(args.dir)
    why = _not_a_dir(storage, storage.normpath(args.dir))
    if why:
        print(why, file=sys.stderr)
        return None
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


def _ranks(rs: set[int]) -> str:
    return ",".join(str(r) for r in sorted(rs))


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
        names = [n for n in os.listdir(runtime) if n == digest or n.endswith("-" + digest)]
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


def _memory_column(held: dict[str, set[int]] | None) -> str:
    if not held:
        return "-"
    parts = [f"ranks {_ranks(held['own'])}" if held["own"] else "",
             f"backups of ranks {_ranks(held['backup'])}" if held["backup"] else ""]
    return "; ".join(p for p in parts if p).replace("-1", "?")


def _warn_stale(layout: CommitLayout) -> None:
    """Say on stderr when the commit records of `layout` are stale (and so not used)."""
    stale = layout.stale_reason() if layout.storage.isdir(layout.meta) else None
    if stale:
        print(f"the commit records in {layout.meta} are stale ({stale}); they are not used: a saver starting on "
              f"{layout.root} sets them aside (gives them to the dir they describe when it was renamed in its "
              f"parent), `flashckpt gc {layout.root}` removes them", file=sys.stderr)


def _committed_row(layout: CommitLayout, step: int, latest: int | None) -> tuple[Any, ...]:
    """The `ls` row of a committed step: its size, age and files, or "damaged" with why."""
    try:
        m = layout.read_manifest(step)
    except E.CheckpointCorruptError as e:
        return (step, "damaged", "-", "-", str(e))
    files = m.all_files()
    return (step, "committed" + (" (latest)" if step == latest else ""),
            _size(sum(f.size for f in files)), _age(m.time), ", ".join(f.path for f in files))


def _ls_rows(layout: CommitLayout, committed: list[int], pending: list[int], latest: int | None,
             memory: dict[int, dict[str, set[int]]], local: CommitLayout | None = None,
             local_steps: list[int] | None = None) -> list[tuple[Any, ...]]:
    """One row (step, state, size, age, files) per step committed, pending, held in this node's memory or
    committed on the local tier only."""
    rows = []
    only_local = set(local_steps or []) - set(committed)
    for step in sorted(set(committed) | set(pending) | set(memory) | only_local):
        if step in only_local and local is not None:
            r = _committed_row(local, step, None)
            rows.append((step, "committed locally, not yet on " + layout.root, *r[2:]))
        elif step not in committed and step not in pending:
            rows.append((step, "in memory", "-", "-", "(this node's shared memory)"))
        elif step in committed:
            rows.append(_committed_row(layout, step, latest))
        else:
            mtime = _mtime(layout, layout.step_dir(step))
            rows.append((step, "not committed", "-", "-" if mtime is None else _age(mtime),
                         "in progress, or left by a crash"))
    return rows


def _print_ls_table(table: list[tuple[Any, ...]]) -> None:
    """Print the `ls` rows as aligned columns under a header, the files column last and unpadded."""
    head = ("STEP", "STATE", "SIZE", "AGE", "MEMORY", "TIERS", "FILES")
    widths = [max(len(str(r[i])) for r in table + [head]) for i in range(6)]
    for r in [head] + table:
        print("  ".join(str(v).ljust(w) for v, w in zip(r[:6], widths)) + "  " + str(r[6]))


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
    if layout is None:
        return 2
    _warn_stale(layout)
    committed = layout.committed_steps()
    pending = layout.uncommitted_steps()
    latest = layout.tracker_step()
    memory = _in_memory(layout.root)
    local = _local_tier(args, layout)
    local_steps = local.committed_steps() if local is not None else []
    rows = _ls_rows(layout, committed, pending, latest, memory, local, local_steps)
    # Which ranks' snapshots of each step this node holds in memory, its own and backups of other nodes'.
    table: list[tuple[Any, ...]] = [(*r[:4], _memory_column(memory.get(r[0])),
                                     _tiers(r[0], memory, local_steps, committed), r[4]) for r in rows]
    note = None if committed else unrecorded(layout)
    if note:
        print(note, file=sys.stderr)
    if args.json:
        print(json.dumps([dict(zip(("step", "state", "size", "age", "memory", "tiers", "files"), r)) for r in table],
                         indent=1))
        return 0
    if not table:
        print(f"no flashckpt checkpoints in {layout.root}")
        return 0
    _print_ls_table(table)
    return 0


def cmd_upload(args: argparse.Namespace) -> int:
    """Uploads the steps committed on the local tier and not on the checkpoint dir, and commits them there
    (global rank 0's node: the steps whose local manifest carries the durable commit spec; on other nodes
    only their files and done markers go up). Run it where no saver of the job runs."""
    layout = _layout(args)
    if layout is None:
        return 2
    local = _local_tier(args, layout)
    if local is None:
        print("flashckpt upload: give the local tier (--local-dir, or FLASHCKPT_LOCAL_DIR)", file=sys.stderr)
        return 2
    steps = pending_uploads(local, layout)
    if not steps:
        print(f"nothing to upload: {layout.root} holds every step committed on {local.root}")
        return 0
    knobs = Knobs.from_env()
    for step in steps:
        t0 = time.monotonic()
        layout.job = local.job = local.read_manifest(step).job  # the markers and the manifest name the job
        m = upload_step(local, layout, step)
        spec = durable_spec_of(m)
        if spec is not None:
            commit_step(layout, step, [int(r) for r in spec["ranks"]], int(spec["world_size"]),
                        replicated=bool(spec.get("replicated", False)), extra=dict(spec.get("extra", {})),
                        timeout=knobs.commit_timeout_s)
        print(f"step {step}: uploaded{' and committed' if spec is not None else ''} "
              f"({_size(sum(f.size for f in m.all_files()))}, {time.monotonic() - t0:.1f} s)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    layout = _layout(args)
    if layout is None:
        return 2
    steps = layout.committed_steps()
    if args.step is not None:
        if args.step not in steps:
            print(f"step {args.step} is not committed in {layout.root} (committed: {steps})")
            return 2
        steps = [args.step]
    if not steps:
        print(f"no committed checkpoints in {layout.root}")
        return 2
    bad = 0
    for step in steps:
        problems = layout.verify(step)
        if problems:
            bad += 1
            print(f"step {step}: DAMAGED")
            for p in problems:
                print(f"  {p}")
        else:
            n = len(layout.read_manifest(step).all_files())
            print(f"step {step}: ok ({n} file{'s' if n != 1 else ''})")
    return 1 if bad else 0


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
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if getattr(args, "dir", None) is not None:  # a plain path or a URL, as the engine takes it
        try:
            args.dir = checkpoint_location(args.dir, f"flashckpt {args.cmd}")
        except E.FlashCheckpointError as e:
            print(f"flashckpt {args.cmd}: {e}", file=sys.stderr)
            return 2
    try:
        return int(args.fn(args))
    except (E.FlashCheckpointError, OSError) as e:  # said in full (what failed, and what to do); no traceback
        print(f"flashckpt {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
