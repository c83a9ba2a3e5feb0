"""The training pause of a checkpoint taken while the previous one is still being written, side by side.

    python -m benchmarks.bench_persist_overlap [--size-gb 0.25] [--rounds 6] [--gap-s 0] [--out FILE]

Informational only: it never passes or fails. A training loop that persists every k steps and snapshots
to memory every step takes its next snapshots while the persist of the last one is still running: this
is the case the slot state machine must handle without overwriting the newest complete snapshot (issue
15, defect 3). The state is a GPT-like state dict (``benchmarks._common.build_gpt_state_dict``); each
round, interleaved (machine drift hits all systems alike):

* copy limit: the state's bytes memmoved into a preallocated, prefaulted /dev/shm buffer (N threads);
* flashckpt, idle: a memory snapshot with no persist in flight;
* flashckpt, during a persist: a ``StorageType.DISK`` save (its persist starts in the saver), then,
  ``--gap-s`` later (a training step), ``--during`` memory snapshots back to back while it runs: the
  first of them is the one that needs the spare slot;
* DCP async: ``dcp.async_save`` while the previous ``async_save`` is still writing (its pause: staging);
* torch.save: the synchronous save to the same disk directory, for scale.

The same script runs against any flashckpt tree (it uses the public API only), so the figures before
and after a change are taken by running it from each tree (``PYTHONPATH=<tree>``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from benchmarks._common import (  # noqa: E402
    GB,
    ShmCopyTarget,
    build_gpt_state_dict,
    cores,
    gpt_config_for_bytes,
    iter_tensors,
    markdown_table,
    tensor_bytes,
)


def _ms(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs) * 1e3:.1f} ms (max {max(xs) * 1e3:.1f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_persist_overlap", description=__doc__.split("\n")[0])
    p.add_argument("--size-gb", type=float, default=0.25)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--during", type=int, default=3, help="memory snapshots taken while each persist runs")
    p.add_argument("--gap-s", type=float, default=0.0, help="seconds between the DISK save and the next snapshot")
    p.add_argument("--dir", default="", help="disk directory for checkpoints (default: a temporary dir in /tmp)")
    p.add_argument("--no-dcp", action="store_true")
    p.add_argument("--out", default="", help="also write the table and the raw samples (JSON) here")
    args = p.parse_args(argv)

    own_runtime = None
    if not os.environ.get("FLASHCKPT_RUNTIME_DIR"):
        own_runtime = os.environ["FLASHCKPT_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="fcbench-", dir="/dev/shm")
    from flashckpt import CheckpointEngine, StorageType

    work = args.dir or tempfile.mkdtemp(prefix="fcbench-overlap-", dir="/tmp")
    sd = build_gpt_state_dict(gpt_config_for_bytes(args.size_gb * GB))
    nbytes = tensor_bytes(sd)
    limit = ShmCopyTarget(iter_tensors(sd), threads=cores())
    eng = CheckpointEngine(os.path.join(work, "fc"), max_to_keep=1)
    step = 0

    def save(kind: Any) -> float:
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        eng.save(step, sd, storage_type=kind)
        return time.perf_counter() - t0

    # Allocation, the first touch of the slots and the saver's first persist are not measured.
    for _ in range(3):
        save(StorageType.MEMORY)
    save(StorageType.DISK)
    eng.wait()

    dcp: Any = None
    if not args.no_dcp:
        import torch.distributed.checkpoint

        dcp = torch.distributed.checkpoint

    samples: dict[str, list[float]] = {k: [] for k in ("copy limit", "flashckpt idle", "flashckpt first during persist",
                                                        "flashckpt later during persist", "flashckpt DISK save",
                                                        "DCP async during previous", "torch.save")}
    persist_s: list[float] = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        limit.memmove(cores())
        samples["copy limit"].append(time.perf_counter() - t0)
        time.sleep(0.7)  # the saver gives the spare slot back once no persist holds a slot
        samples["flashckpt idle"].append(save(StorageType.MEMORY))
        t_disk = time.perf_counter()
        samples["flashckpt DISK save"].append(save(StorageType.DISK))
        if args.gap_s:
            time.sleep(args.gap_s)
        for k in range(args.during):
            samples["flashckpt first during persist" if k == 0 else "flashckpt later during persist"].append(
                save(StorageType.MEMORY))
        eng.wait()
        persist_s.append(time.perf_counter() - t_disk)
        if dcp is not None:
            d1, d2 = os.path.join(work, f"dcp-{r}-a"), os.path.join(work, f"dcp-{r}-b")
            f1 = dcp.async_save({"sd": sd}, checkpoint_id=d1)
            t0 = time.perf_counter()
            f2 = dcp.async_save({"sd": sd}, checkpoint_id=d2)
            samples["DCP async during previous"].append(time.perf_counter() - t0)
            f1.result()
            f2.result()
            shutil.rmtree(d1, ignore_errors=True)
            shutil.rmtree(d2, ignore_errors=True)
        path = os.path.join(work, "torch.pt")
        t0 = time.perf_counter()
        torch.save(sd, path)
        samples["torch.save"].append(time.perf_counter() - t0)
        os.unlink(path)
    eng.close()
    limit.close()
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    if own_runtime is not None:  # the saver removes its job dir as it exits; then this one is empty
        deadline = time.monotonic() + 30
        while os.listdir(own_runtime) and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(own_runtime, ignore_errors=True)

    copy = statistics.median(samples["copy limit"])
    rows = [[k, _ms(v), f"{statistics.median(v) / copy:.2f}x" if v else "-"] for k, v in samples.items()]
    rows.append(["(persist until committed)", _ms(persist_s), ""])
    title = (f"Pause per checkpoint while a persist runs: {nbytes / GB:.2f} GB state, {args.rounds} rounds, "
             f"{args.during} snapshots per persist, gap {args.gap_s:g} s (median, max)")
    table = markdown_table(["case", "pause", "x copy limit"], rows)
    print(title)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(title + "\n\n" + table + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"nbytes": nbytes, "samples": samples, "persist_s": persist_s, "args": vars(args)}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
