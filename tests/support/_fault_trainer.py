"""The training process that the fault-injection tests kill (run as a script, not collected by pytest).

    python tests/support/_fault_trainer.py --ckpt DIR --mb 200 --plan 1:disk,2:memory --loop 50 --hold

Takes the snapshots of ``--plan`` (``step:memory`` or ``step:disk``) of ``_fault_helpers.make_state``,
updated in place each step, then ``--loop N`` more memory snapshots (steps after the plan), then with
``--wait`` waits for its persists, and with ``--hold`` blocks until it is killed; without ``--hold`` it
closes the engine and exits 0. With ``--fork`` it first forks a child that sleeps until it is killed (a
DataLoader worker, say; prints ``child <pid>``). Prints one line per event (``ready``, ``saved <step>``,
``holding``).
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
    p.add_argument("--mb", type=float, default=64)
    p.add_argument("--plan", default="")
    p.add_argument("--loop", type=int, default=0)
    p.add_argument("--max_to_keep", type=int, default=0)
    p.add_argument("--wait", action="store_true")
    p.add_argument("--hold", action="store_true")
    p.add_argument("--fork", action="store_true")
    args = p.parse_args()

    plan = [(int(s), StorageType(k)) for s, k in (item.split(":") for item in args.plan.split(",") if item)]
    last = plan[-1][0] if plan else 0
    plan += [(last + i, StorageType.MEMORY) for i in range(1, args.loop + 1)]
    engine = CheckpointEngine(args.ckpt, max_to_keep=args.max_to_keep)
    print("ready", flush=True)
    if args.fork:
        child = os.fork()
        if child == 0:
            while True:
                signal.pause()
        print(f"child {child}", flush=True)
    sd = make_state(plan[0][0] if plan else 0, args.mb)
    for step, kind in plan:
        fill_state(sd, step)
        engine.save(step, sd, storage_type=kind)
        print(f"saved {step} {kind.value}", flush=True)
    if args.wait:
        engine.wait(timeout=120)
        print("persisted", flush=True)
    if args.hold:
        print("holding", flush=True)
        while True:
            signal.pause()
    engine.close()
    print("closed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
