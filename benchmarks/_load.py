"""Loads a checkpoint in a fresh interpreter, as a restarted trainer does, and times it.

The parent runs ``run_child(mode, cfg, ...)``; the child builds the "model" first (a GPT state dict of
zeros, every page touched, as a model and optimizer that exist before loading), then times only the
load and the copy into that model, and prints one JSON line. Modes:

* ``flashckpt``: ``CheckpointEngine(dir).load()`` (from the saver's shared memory), then ``copy_`` into the model;
* ``flashckpt_into``: ``CheckpointEngine(dir).load(into=model)``: straight into the model's tensors;
* ``torch`` / ``torch_mmap``: ``torch.load(file[, mmap=True])``, then ``copy_`` into the model;
* ``dcp``: ``torch.distributed.checkpoint.load(model, checkpoint_id=dir)``, which loads in place.

Engine construction (connecting to the saver) and interpreter start-up are reported apart, not in the load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks._common import REPO_ROOT, GPTConfig, build_gpt_state_dict, copy_tree_into, fingerprint, iter_tensors  # noqa: E402

__all__ = ["MODES", "run_child"]

MODES = ("flashckpt", "flashckpt_into", "torch", "torch_mmap", "dcp")
CHILD_TAG = "BENCH_CHILD_RESULT "


def child_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--cfg", required=True, help="GPTConfig fields as JSON")
    p.add_argument("--dir", default="", help="flashckpt checkpoint dir, or the DCP checkpoint dir")
    p.add_argument("--file", default="", help="torch.save file")
    args = p.parse_args(argv)
    cfg = GPTConfig(**json.loads(args.cfg))
    dst_tree = build_gpt_state_dict(cfg, fill="zeros")
    dst = iter_tensors(dst_tree)
    out: dict[str, Any] = {"mode": args.mode}
    sd: Any = None
    if args.mode in ("flashckpt", "flashckpt_into"):
        from flashckpt import CheckpointEngine

        t0 = time.perf_counter()
        engine = CheckpointEngine(args.dir, max_to_keep=1)
        out["init_s"] = time.perf_counter() - t0
        try:
            t0 = time.perf_counter()
            sd = engine.load(into=dst_tree) if args.mode == "flashckpt_into" else engine.load()
            out["load_s"] = time.perf_counter() - t0
            ll = engine.last_load
            out["source"] = ll.source if ll else "?"
            out["step"] = ll.step if ll else None
        finally:
            engine.close()  # release=True: the parent's engine keeps the saver and its snapshots
    elif args.mode == "dcp":
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        dcp.load(dst_tree, checkpoint_id=args.dir, no_dist=True)
        out["load_s"] = time.perf_counter() - t0
        out["source"] = "file"
        sd = dst_tree
    else:
        t0 = time.perf_counter()
        sd = torch.load(args.file, map_location="cpu", weights_only=True, mmap=args.mode == "torch_mmap")
        out["load_s"] = time.perf_counter() - t0
        out["source"] = "file"
    src = iter_tensors(sd)
    if len(src) != len(dst) or any(a.shape != b.shape for a, b in zip(src, dst, strict=False)):
        out["error"] = f"loaded {len(src)} tensors, expected {len(dst)} of the same shapes"
    elif args.mode in ("flashckpt_into", "dcp"):
        if not all(a.data_ptr() == b.data_ptr() for a, b in zip(src, dst, strict=False)):
            out["error"] = f"{args.mode} did not load into the existing tensors"
        out["copy_s"] = 0.0  # the load wrote into the model's tensors
    else:
        t0 = time.perf_counter()
        copy_tree_into(dst, src)
        out["copy_s"] = time.perf_counter() - t0
    out["fingerprint"] = fingerprint(dst_tree)
    print(CHILD_TAG + json.dumps(out), flush=True)
    sys.stderr.flush()
    os._exit(0)  # skip tearing down GBs of tensors and the interpreter: nothing is left to clean up


def run_child(mode: str, cfg: GPTConfig, *, ckpt_dir: str = "", file: str = "", timeout: float = 900,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """Runs one load in a new interpreter; its JSON result plus ``wall_s`` (the whole child), or ``{"error": ...}``."""
    cmd = [sys.executable, "-m", "benchmarks._load", "--mode", mode, "--cfg", json.dumps(cfg.__dict__),
           "--dir", ckpt_dir, "--file", file]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT,
                           env=dict(os.environ, **(env or {})))
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"no result within {timeout:.0f} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(CHILD_TAG):
            res: dict[str, Any] = json.loads(line[len(CHILD_TAG):])
            res["wall_s"] = time.perf_counter() - t0
            return res
    return {"mode": mode, "error": f"exit {p.returncode}: {p.stderr.strip()[-2000:]}"}


if __name__ == "__main__":
    sys.exit(child_main())
