"""The training loop that the kill-point tests kill (run as a script, not collected by pytest).

    python tests/support/_killpoint_trainer.py --ckpt DIR --journal FILE --mb 16 --every 3 --max_to_keep 2

Saves ``_fault_helpers.make_state(step)`` (updated in place) at every step from 1 on: a DISK save every
``--every`` steps, a MEMORY save otherwise, with ``max_to_keep`` retention, until ``--steps`` or until it
is killed. Every event is appended to the journal with one ``write`` on an O_APPEND descriptor, so it
survives a SIGKILL of this process (the page cache keeps it):

    R                  the engine is attached to its saver
    B <step> <kind>    save(step) is called
    D <step>           save(step) returned: its snapshot is COMPLETE in shared memory
    E <step> <error>   save(step) raised; the loop stops and the process holds until it is killed

The checker derives from it which snapshot a restarted process must find (see test_killpoints.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fault_helpers import fill_state, make_state  # noqa: E402
from flashckpt import CheckpointEngine, StorageType  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--journal", required=True)
    p.add_argument("--mb", type=float, default=16)
    p.add_argument("--every", type=int, default=3, help="a DISK save every this many steps")
    p.add_argument("--max_to_keep", type=int, default=2)
    p.add_argument("--steps", type=int, default=1_000_000)
    args = p.parse_args()

    fd = os.open(args.journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def note(line: str) -> None:
        os.write(fd, (line + "\n").encode())

    engine = CheckpointEngine(args.ckpt, max_to_keep=args.max_to_keep)
    note("R")
    sd = make_state(1, args.mb)
    for step in range(1, args.steps + 1):
        kind = StorageType.DISK if step % args.every == 0 else StorageType.MEMORY
        fill_state(sd, step)
        note(f"B {step} {kind.value}")
        try:
            engine.save(step, sd, storage_type=kind)
        except Exception as e:  # the saver was killed: say so and hold (the test kills this process)
            note(f"E {step} {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            while True:
                signal.pause()
        note(f"D {step}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
