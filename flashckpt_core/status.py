"""``flashckpt status [DIR] [--json] [--watch S]``: what this node's savers are doing now.

For every job on this node with a live saver (of checkpoint dir DIR only, when given): its trainers, the
persists running with the bytes written so far, the newest step committed on the checkpoint dir and on the
node-local tier with its lag, the snapshots in the node's memory, the replica partners and the newest events.
The saver answers an ``Inspect`` request (no hello: the command is never counted as a trainer). ``--json``
prints the answers as they are (numbers: bytes, seconds, wall times); ``--watch S`` prints them again every
S seconds until interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any

from flashckpt import errors as E
from flashckpt.config import Knobs, is_job_key_of_dir, job_key_digest
from flashckpt.transport import messages as M
from flashckpt.transport.spawn import SOCKET_NAME
from flashckpt.transport.wire import Client

__all__ = ["add_parser", "cmd_status", "inspect_node"]


def add_parser(sub: Any) -> None:
    """Adds ``status`` to the ``flashckpt`` command's subcommands."""
    s = sub.add_parser("status", help="what this node's savers are doing now: trainers, persists in flight with the "
                                      "bytes written, the durable and local steps and their lag, memory, replica")
    s.add_argument("dir", nargs="?", help="only the jobs of this checkpoint dir (default: every job on this node)")
    s.add_argument("--json", action="store_true", help="print the savers' answers as JSON (numbers: bytes, seconds, "
                                                       "wall times since the epoch), one object per job")
    s.add_argument("--watch", type=float, metavar="S", default=0.0,
                   help="print again every S seconds until interrupted (Ctrl-C)")
    s.add_argument("--events", type=int, default=5, metavar="N", help="the newest N events of each saver (default 5)")
    s.set_defaults(fn=cmd_status)


def inspect_node(checkpoint_dir: str | None = None, events: int = 5) -> list[tuple[str, M.InspectReply]]:
    """(job dir, its saver's answer) for every job on this node whose saver answers; of ``checkpoint_dir``'s
    jobs only, when given."""
    runtime = Knobs.from_env().runtime_dir
    digest = job_key_digest(checkpoint_dir) if checkpoint_dir else None
    try:
        names = sorted(os.listdir(runtime))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        if digest is not None and not is_job_key_of_dir(name, digest):
            continue
        sock = os.path.join(runtime, name, SOCKET_NAME)
        if not os.path.exists(sock):
            continue
        try:
            client = Client(sock, timeout=5)
        except (OSError, E.FlashCheckpointError):
            continue  # a saver that is gone (``flashckpt gc`` removes what it left)
        try:
            out.append((os.path.join(runtime, name), client.request(M.Inspect(events=events))))
        except (OSError, E.FlashCheckpointError):
            continue
        finally:
            client.close()
    return out


def cmd_status(args: argparse.Namespace) -> int:
    target = os.path.abspath(args.dir) if args.dir and "://" not in args.dir else args.dir
    if args.watch < 0 or args.events < 0:
        raise E.InvalidArgumentError("status: --watch and --events take a number >= 0")
    try:
        while True:
            found = inspect_node(target, args.events)
            if args.json:
                print(json.dumps([{"job_dir": d, **dataclasses.asdict(r)} for d, r in found]), flush=True)
            elif not found:
                print(f"no saver runs on this node{f' for {args.dir}' if args.dir else ''}", flush=True)
            else:
                print("\n\n".join(_shown(d, r) for d, r in found), flush=True)
            if args.watch <= 0:
                return 0
            time.sleep(args.watch)
            if not args.json:
                print(f"\n---- {time.strftime('%H:%M:%S')}", flush=True)
    except KeyboardInterrupt:
        return 0


def _mb(n: float | None) -> str:
    return "?" if n is None else f"{n / 1e6:.1f} MB"


def _ago(wall: float) -> str:
    s = max(0.0, time.time() - wall)
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def _steps(held: list[dict[str, Any]]) -> str:
    by: dict[int, set[int]] = {}
    for h in held:
        by.setdefault(int(h["step"]), set()).add(int(h["rank"]))
    return ", ".join(f"step {s} (ranks {sorted(r)})" for s, r in sorted(by.items(), reverse=True)) or "nothing"


def _shown(job_dir: str, r: M.InspectReply) -> str:
    """One job's answer in lines a person reads."""
    lines = [f"job {os.path.basename(job_dir)}: saver pid {r.pid}, up {_ago(r.started_at).replace(' ago', '')}; "
             f"checkpoint dir {r.checkpoint_dir}" + (f", local tier {r.local_dir}" if r.local_dir else "")]
    ranks = sorted(c["rank"] for c in r.clients)
    lines.append(f"  trainers: {'ranks ' + str(ranks) if ranks else 'none attached'}")
    lines.append(f"  memory: {_steps(r.held)}; {_mb(r.memory_bytes)} of shared memory")
    durable = [c for c in r.commits if c.get("tier") == "durable"]
    if durable:
        c = durable[-1]
        lag = "" if c.get("lag_s") is None else f", {c['lag_s']:.1f} s after its snapshot"
        lines.append(f"  durable: step {c['step']} committed {_ago(c['committed_at'])}{lag}")
    else:
        lines.append(f"  durable: {'step ' + str(r.committed) if r.committed is not None else 'nothing'} committed"
                     " (no commit by this saver yet)")
    if r.local_dir:
        lines.append(f"  local: {'step ' + str(r.local_committed) if r.local_committed is not None else 'nothing'}"
                     " committed")
    if r.persisting:
        for p in r.persisting:
            done = p.get("done")
            part = (f"{_mb(done)} of {_mb(p['bytes'])} ({100 * done / p['bytes']:.0f}%)" if done is not None
                    and p["bytes"] else f"{_mb(p['bytes'])}, bytes written not told by the store")
            lines.append(f"  persisting step {p['step']} rank {p['rank']} to the {p['tier']} tier: {part}, "
                         f"for {p['seconds']:.1f} s")
    else:
        lines.append(f"  persisting: nothing{f' ({r.queued} unit(s) of work queued)' if r.queued else ''}")
    if r.replica:
        rp = r.replica
        lines.append(f"  replica: node {rp['node']} of {rp['nnodes']}, partners {rp['partners']}, sent "
                     f"{_mb(rp['sent_bytes'])}")
    for ev in r.events:
        fields = " ".join(f"{k}={v}" for k, v in ev.items() if k not in ("kind", "time", "seq"))
        lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(ev['time']))} {ev['kind']} {fields}")
    return "\n".join(lines)
