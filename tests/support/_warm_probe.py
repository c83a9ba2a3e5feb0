"""A torchrun worker for the warm-worker tests (tests/multiproc/test_warm_workers.py): records what it sees at its
start, in the attempt it runs in, then fails (attempt 0, once the agent's warm workers are ready) or ends.

Usage: ``flashckpt-run --nproc_per_node 2 --standalone --max_restarts 1 _warm_probe.py OUT_DIR [hold]``;
with ``hold`` attempt 0 waits to be killed instead of failing."""

from __future__ import annotations

import sys

PRELOADED = "torch" in sys.modules  # before this script imports anything: only a warm worker has torch

import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import _warm_probe_helper  # noqa: E402  (the user's own module, beside the script: never imported ahead)
import torch  # noqa: E402, F401
from flashckpt.launch.warm import ATTEMPT_KEYS  # noqa: E402
from flashckpt.util.module_record import record_modules  # noqa: E402


def main() -> int:
    out, rank = sys.argv[1], os.environ["LOCAL_RANK"]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with open("/proc/self/cmdline", "rb") as f:
        cmd = [a.decode() for a in f.read().split(b"\0") if a]
    info = {
        "preloaded": PRELOADED, "argv": sys.argv, "path0": sys.path[0], "file": __file__,
        "main_file": sys.modules["__main__"].__file__, "helper_saw_main": _warm_probe_helper.MAIN_AT_IMPORT,
        "cwd": os.getcwd(), "cmdline": cmd, "flags": list(sys.flags), "pid": os.getpid(),
        "env": {k: v for k, v in os.environ.items() if k not in ATTEMPT_KEYS},
        "attempt_env": {k: os.environ.get(k) for k in sorted(ATTEMPT_KEYS)},
        "stdin_is_devnull": os.path.samestat(os.fstat(0), os.stat(os.devnull)),
        "nice": sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}),
    }
    path = os.path.join(out, f"attempt{attempt}_rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)  # whole, for the test that reads it while this runs
    print(f"probe stdout attempt {attempt} rank {rank}", flush=True)
    print(f"probe stderr attempt {attempt} rank {rank}", file=sys.stderr, flush=True)
    if attempt > 0:
        return 0
    record_modules()  # what an engine does at its first snapshot: the warm worker imports these ahead
    events = os.environ["FLASHCKPT_LAUNCH_EVENTS"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until both local ranks' warm workers have done their imports
        with open(events) as f:
            if sum('"warm_worker_ready"' in line for line in f) >= 2:
                break
        time.sleep(0.1)
    if "hold" in sys.argv[2:]:
        time.sleep(600)
    return 3


if __name__ == "__main__":
    sys.exit(main())
