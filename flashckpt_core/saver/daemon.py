"""The saver daemon's ``main``, run as ``python -m`` this module (``transport.spawn.ensure_saver`` starts it
by that name): it forks into the background, builds a ``CheckpointSaver``, reports on the spawner's pipe
that it serves (or why not), and serves until the saver exits."""

from __future__ import annotations

# ruff: noqa: E402  (the daemon defers torch before the imports below)
if __name__ == "__main__":  # the daemon never loads torch: its persist worker does (_persist_worker)
    from flashckpt.util.lazy import defer

    defer("torch")

import argparse
import json
import logging
import os
import signal
import sys
from typing import Any

from flashckpt.config import knob
from flashckpt.saver.server import CheckpointSaver
from flashckpt.saver.state import log
from flashckpt.storage.registry import options_from_env, storage_from_spec
from flashckpt.transport.spawn import SAVER_MODULE, explain_os_error

__all__ = ["main"]

def _report(fd: int | None, msg: dict[str, Any]) -> None:
    """Writes one start-up report line to the spawner's pipe (see ``transport.spawn._read_ready``); never raises."""
    if fd is None:
        return
    try:
        os.write(fd, json.dumps(msg).encode() + b"\n")
    except OSError:
        pass




def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {SAVER_MODULE}", description="flashckpt node saver")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--storage", default="", help="the backend's class as module:qualname (default: by the URL)")
    p.add_argument("--local-dir", default="", help="the job's node-local tier (default: none)")
    p.add_argument("--local-keep", type=int, default=2, help="locally committed steps kept (0: all)")
    p.add_argument("--daemonize", action="store_true", help="fork into the background and return at once")
    p.add_argument("--ready-fd", type=int, default=None,
                   help="a pipe to report on: a JSON line with the daemon's pid, then one saying it serves "
                        "(ready) or why it could not start (error)")
    args = p.parse_args(argv)
    if args.daemonize:
        child = os.fork()
        if child > 0:
            # The spawner reaps this parent; the daemon is re-parented and never a zombie of it. Its pid
            # lets the spawner stop it should it not come up.
            _report(args.ready_fd, {"pid": child})
            os._exit(0)
    logging.basicConfig(level=knob("saver_log_level"),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    saver = CheckpointSaver(args.job_dir, args.checkpoint_dir,
                            storage=storage_from_spec(args.storage, args.checkpoint_dir, options_from_env()),
                            local_dir=args.local_dir, local_keep=args.local_keep)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: saver.request_stop(last_words=True))
    try:
        saver.start()
    except BaseException as e:
        # A saver that cannot serve exits and removes what it made; the spawner gets the reason over the
        # pipe (the log may be on the very file system that is full).
        log.exception("the saver could not start")
        _report(args.ready_fd, {"error": explain_os_error(e, args.job_dir)})
        saver.shutdown(drain_timeout=0)
        return 1
    _report(args.ready_fd, {"ready": True, "pid": os.getpid()})
    if args.ready_fd is not None:
        os.close(args.ready_fd)
    saver.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())

