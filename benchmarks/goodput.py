"""Expected goodput at 1k-10k GPUs for torch.save, DCP async_save and flashckpt, from measured costs.

    python -m benchmarks.goodput [--run-json bench_out/run.json] [--size-gb 1] [--gpus 1000,2000,5000,10000]
                                 [--gpu-mtbf-h 50000] [--node-fraction 0.5] [--restart-s 120] [--replace-s 600]

Goodput = useful training time / elapsed time. Failures arrive with a per-GPU MTBF (default 50,000 GPU-hours:
Llama 3 405B saw 419 unexpected interruptions in 54 days on 16,384 GPUs, 16,384 x 54 x 24 / 419 = 50,700);
a job of N GPUs fails every MTBF / N. A fraction ``--node-fraction`` of failures lose the node (hardware that
must be replaced: host memory is gone); the rest are process failures (software faults, NCCL/network timeouts,
recoverable GPU errors) after which the node and its memory survive.

Per checkpoint the costs come from ``benchmarks.run``'s JSON for the GPT case of ``--size-gb`` (per rank; each
rank checkpoints its own shard at the same time), else from documented defaults (``DEFAULT_COSTS``):

* torch.save: training pauses for the save; every failure restarts from storage (``torch.load``);
* DCP async_save: training pauses for the staging (the better of the two stagers measured); the write runs
  in the background, so at most one save is in flight (interval >= time to durable) and a failure loses the
  work since the last *completed* save (its write latency adds to the lost work);
* flashckpt with ``auto_save``: memory snapshots placed for process failures, persists for node failures,
  by ``flashckpt.engine.interval.optimal_interval`` (Young/Daly); a process failure restarts from memory.

Restart: ``--restart-s`` for every failure (rescheduling, process start, rendezvous, framework init), plus
``--replace-s`` when a node is lost, plus the load. torch.save and DCP use Daly's interval
(``interval.daly_interval``) and ``interval.expected_goodput``; nothing here re-derives the formulas. The
model ignores the CPU and I/O that background writes take from training (see ``benchmarks/overhead.py``).

Writes ``<out>/goodput.md``, ``<out>/goodput.json`` and the plot ``docs/img/goodput_vs_interval.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashckpt.engine.interval import daly_interval, expected_goodput, optimal_interval  # noqa: E402

from benchmarks._common import REPO_ROOT, markdown_table, write_json  # noqa: E402

# Per-rank costs in seconds for a 1 GB state (params + Adam moments), used when no run.json is given. From
# docs/benchmarks.md (2 cores, 2026-11-22: snapshot, persist, torch.save, loads) and the first, provisional
# benchmarks.run of this suite (DCP; noisy machine). Replace them by measuring: python -m benchmarks.run.
DEFAULT_COSTS: dict[str, Any] = {
    "source": "defaults (docs/benchmarks.md, 1 GB, 2 CPU cores; DCP provisional)",
    "size_gb": 1.0,
    "torch_save_pause_s": 1.07,
    "torch_save_durable_s": 1.07,
    "torch_load_s": 3.80,
    "dcp_pause_s": 1.5,
    "dcp_durable_s": 4.5,
    "dcp_load_s": 4.0,
    "dcp_stager": "DefaultStager (shared memory)",
    "fc_snapshot_s": 0.098,
    "fc_persist_s": 3.57,
    "fc_load_memory_s": 0.251,
    "fc_load_storage_s": 3.80,
}


def costs_from_run(path: str, size_gb: float | None) -> dict[str, Any] | None:
    """Per-rank costs from a ``benchmarks.run`` JSON: the GPT case of ``size_gb`` (default: the largest)."""
    try:
        with open(path) as f:
            run = json.load(f)
    except (OSError, ValueError):
        return None
    gpts = [c for c in run.get("cases", []) if c.get("kind") == "gpt"]
    if size_gb is not None:
        gpts = [c for c in gpts if abs(c["bytes"] / 1e9 - size_gb) / size_gb < 0.1]
    if not gpts:
        return None
    c = max(gpts, key=lambda c: c["bytes"])
    m = c["medians"]

    def get(*keys: str) -> float | None:
        for k in keys:
            v = m.get(k)
            if v is not None and v == v:
                return float(v)
        return None

    # DCP: the better stager measured (lower pause)
    dcp = min((s for s in ("dcp.async_save.shm", "dcp.async_save") if get(f"{s}.blocking") is not None),
              key=lambda s: get(f"{s}.blocking") or math.inf, default=None)
    out = {
        "source": f"{path} ({c['label']}, {c.get('rounds', '?')} rounds, {run.get('machine', {}).get('date', '?')})",
        "size_gb": c["bytes"] / 1e9,
        "torch_save_pause_s": get("torch.save.blocking"),
        "torch_save_durable_s": get("torch.save.durable", "torch.save.blocking"),
        "torch_load_s": get("load.torch"),
        "dcp_pause_s": get(f"{dcp}.blocking") if dcp else None,
        "dcp_durable_s": get(f"{dcp}.durable") if dcp else None,
        "dcp_load_s": get("load.dcp", "load.torch"),
        "dcp_stager": {"dcp.async_save.shm": "DefaultStager (shared memory)",
                       "dcp.async_save": "default stager"}.get(dcp or "", "?"),
        "fc_snapshot_s": get("flashckpt.snapshot.blocking"),
        "fc_persist_s": get("flashckpt.persist.durable"),
        "fc_load_memory_s": get("load.flashckpt_into", "load.flashckpt"),
        "fc_load_storage_s": get("load.torch"),  # a persisted flashckpt file is a torch.save file
    }
    for k, v in out.items():  # fill what this run did not measure from the defaults, and say so
        if v is None:
            out[k] = DEFAULT_COSTS[k]
            out["source"] += f"; {k} from the defaults"
    return out


class Model:
    """Failure rates and restart costs for one job size; goodput of each method at a given interval."""

    def __init__(self, gpus: int, costs: dict[str, Any], args: argparse.Namespace) -> None:
        self.gpus, self.c = gpus, costs
        self.mtbf = args.gpu_mtbf_h * 3600.0 / gpus  # job MTBF, all failures
        f = args.node_fraction
        self.process_mtbf = math.inf if f >= 1 else self.mtbf / (1 - f)
        self.node_mtbf = math.inf if f <= 0 else self.mtbf / f
        self.f, self.restart, self.replace, self.step = f, args.restart_s, args.replace_s, args.step_s
        # single-level methods: every failure restarts from storage; a node failure also waits for a new node
        self.storage_restart = self.restart + f * self.replace

    # torch.save ------------------------------------------------------------
    def torch_save(self, interval: float) -> float:
        lag = max(0.0, self.c["torch_save_durable_s"] - self.c["torch_save_pause_s"])
        return expected_goodput(interval_s=interval, cost_s=self.c["torch_save_pause_s"], mtbf_s=self.mtbf,
                                restart_s=self.storage_restart + self.c["torch_load_s"] + lag)

    def torch_save_auto(self) -> tuple[float, float]:
        tau = daly_interval(self.c["torch_save_pause_s"], self.mtbf)
        return tau, self.torch_save(tau)

    # DCP async ------------------------------------------------------------
    def dcp(self, interval: float) -> float:
        if interval < self.c["dcp_durable_s"]:
            return math.nan  # a save would start before the previous one is durable
        lag = max(0.0, self.c["dcp_durable_s"] - self.c["dcp_pause_s"])
        return expected_goodput(interval_s=interval, cost_s=self.c["dcp_pause_s"], mtbf_s=self.mtbf,
                                restart_s=self.storage_restart + self.c["dcp_load_s"] + lag)

    def dcp_auto(self) -> tuple[float, float]:
        tau = max(daly_interval(self.c["dcp_pause_s"], self.mtbf), self.c["dcp_durable_s"])
        return tau, self.dcp(tau)

    # flashckpt ------------------------------------------------------------
    def fc_restarts(self) -> tuple[float, float]:
        mem = self.restart + self.c["fc_load_memory_s"]
        # a node failure loses memory: back to the newest committed persist, which lags by a persist
        sto = self.restart + self.replace + self.c["fc_load_storage_s"] + self.c["fc_persist_s"]
        return mem, sto

    def fc_auto(self) -> Any:
        mem, sto = self.fc_restarts()
        return optimal_interval(step_time_s=self.step, snapshot_cost_s=self.c["fc_snapshot_s"],
                                persist_cost_s=self.c["fc_persist_s"], process_mtbf_s=self.process_mtbf,
                                node_mtbf_s=self.node_mtbf, restart_from_memory_s=mem, restart_from_storage_s=sto)

    def fc(self, memory_interval: float, storage_interval: float) -> float:
        """Two levels: waste of the memory level (pauses + process failures) plus that of the storage level
        (node failures), each from ``expected_goodput``; the same sum ``optimal_interval`` maximises."""
        mem, sto = self.fc_restarts()
        c = self.c["fc_snapshot_s"]
        storage_interval = max(storage_interval, memory_interval)
        g_mem = expected_goodput(interval_s=memory_interval, cost_s=c, mtbf_s=self.process_mtbf, restart_s=mem)
        g_node = expected_goodput(interval_s=storage_interval, cost_s=0.0, mtbf_s=self.node_mtbf, restart_s=sto + c / 2)
        return max(0.0, g_mem + g_node - 1.0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.goodput", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-json", default=os.path.join(REPO_ROOT, "bench_out", "run.json"),
                   help="costs measured by benchmarks.run (defaults when missing)")
    p.add_argument("--size-gb", type=float, default=None, help="which GPT case of run.json (default: the largest)")
    p.add_argument("--state-gb", type=float, default=None,
                   help="per-rank state to model: scales every measured cost linearly from the measured size")
    p.add_argument("--gpus", default="1000,2000,5000,10000", help="job sizes, comma-separated")
    p.add_argument("--gpu-mtbf-h", type=float, default=50_000.0, help="per-GPU mean time between failures, hours")
    p.add_argument("--node-fraction", type=float, default=0.5,
                   help="fraction of failures that lose the node's memory (the rest: process failures)")
    p.add_argument("--restart-s", type=float, default=120.0, help="restart after any failure, seconds (excl. load)")
    p.add_argument("--replace-s", type=float, default=600.0, help="extra seconds to replace a lost node")
    p.add_argument("--step-s", type=float, default=5.0, help="training step time, seconds (rounds the intervals)")
    p.add_argument("--plot-gpus", default="1000,10000", help="job sizes plotted (goodput vs interval)")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "bench_out"), help="directory for goodput.md / .json")
    p.add_argument("--img", default=os.path.join(REPO_ROOT, "docs", "img"), help="directory for the plot")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    args.gpus = [int(x) for x in args.gpus.split(",") if x.strip()]
    args.plot_gpus = [int(x) for x in args.plot_gpus.split(",") if x.strip()]
    if not (0 <= args.node_fraction <= 1) or args.gpu_mtbf_h <= 0 or args.step_s <= 0 or not args.gpus:
        p.error("need 0 <= --node-fraction <= 1, --gpu-mtbf-h > 0, --step-s > 0 and at least one --gpus")
    return args


def _h(s: float) -> str:
    if s != s:
        return "n/a"
    return f"{s / 3600:.1f} h" if s >= 3600 else (f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    costs = costs_from_run(args.run_json, args.size_gb) or dict(DEFAULT_COSTS)
    if args.state_gb:
        k = args.state_gb / costs["size_gb"]
        costs = {key: (v * k if key.endswith("_s") else v) for key, v in costs.items()}
        costs["source"] += f"; scaled x{k:.2f} from {costs['size_gb']:.2f} GB"
        costs["size_gb"] = args.state_gb
    rows, table = [], []
    for n in args.gpus:
        m = Model(n, costs, args)
        t_tau, t_g = m.torch_save_auto()
        d_tau, d_g = m.dcp_auto()
        ch = m.fc_auto()
        recomputed = m.fc(ch.memory_interval_s, ch.storage_interval_s)
        rows.append({"gpus": n, "job_mtbf_s": m.mtbf, "process_mtbf_s": m.process_mtbf, "node_mtbf_s": m.node_mtbf,
                     "torch_save": {"interval_s": t_tau, "goodput": t_g},
                     "dcp_async": {"interval_s": d_tau, "goodput": d_g},
                     "flashckpt": {"memory_interval_s": ch.memory_interval_s, "storage_interval_s": ch.storage_interval_s,
                                   "memory_steps": ch.memory_steps, "storage_steps": ch.storage_steps,
                                   "goodput": ch.expected_goodput, "goodput_recomputed": recomputed}})
        lost = [(1 - g) * n * 24 for g in (t_g, d_g, ch.expected_goodput)]
        table.append([f"{n:,}", _h(m.mtbf),
                      f"{100 * t_g:.2f} % (every {_h(t_tau)})", f"{100 * d_g:.2f} % (every {_h(d_tau)})",
                      f"{100 * ch.expected_goodput:.2f} % (memory every {_h(ch.memory_interval_s)}, "
                      f"storage every {_h(ch.storage_interval_s)})",
                      " / ".join(f"{x:,.0f}" for x in lost)])
    text = markdown_table(["GPUs", "job MTBF", "torch.save", f"DCP async_save ({costs['dcp_stager']})",
                           "flashckpt auto_save", "GPU-hours lost per day (torch / DCP / flashckpt)"], table)
    text += (f"\n\nExpected goodput at the automatic interval of each method. Per-GPU MTBF {args.gpu_mtbf_h:,.0f} h; "
             f"{100 * args.node_fraction:.0f} % of failures lose the node; restart {args.restart_s:.0f} s (+ "
             f"{args.replace_s:.0f} s for a new node) + load. Costs per rank for a {costs['size_gb']:.2f} GB state: "
             f"torch.save {costs['torch_save_pause_s']:.3f} s; DCP pause {costs['dcp_pause_s']:.3f} s, durable after "
             f"{costs['dcp_durable_s']:.2f} s; flashckpt snapshot {costs['fc_snapshot_s']:.3f} s, persist "
             f"{costs['fc_persist_s']:.2f} s, load from memory {costs['fc_load_memory_s']:.2f} s; torch.load "
             f"{costs['torch_load_s']:.2f} s. Source: {costs['source']}.")
    print(text)
    curves = {}
    grid = [10 ** (0.5 + 3.5 * i / 199) for i in range(200)]  # 3 s .. 10,000 s
    for n in args.plot_gpus:
        m = Model(n, costs, args)
        ch = m.fc_auto()
        t_tau, t_g = m.torch_save_auto()
        d_tau, d_g = m.dcp_auto()
        curves[str(n)] = {
            "interval_s": grid,
            "torch_save": {"goodput": [m.torch_save(x) for x in grid], "opt": [t_tau, t_g]},
            "dcp_async": {"goodput": [m.dcp(x) for x in grid], "opt": [d_tau, d_g]},
            "flashckpt": {"goodput": [m.fc(x, ch.storage_interval_s) for x in grid],
                          "opt": [ch.memory_interval_s, ch.expected_goodput],
                          "storage_interval_s": ch.storage_interval_s},
        }
    result = {"costs": costs, "assumptions": {k: getattr(args, k) for k in
                                              ("gpu_mtbf_h", "node_fraction", "restart_s", "replace_s", "step_s")},
              "rows": rows, "curves": curves}
    write_json(os.path.join(args.out, "goodput.json"), result)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "goodput.md"), "w") as f:
        f.write("# Expected goodput at scale\n\n" + text + "\n")
    if not args.no_plot:
        from benchmarks.plots import plot_goodput

        path = plot_goodput(result, args.img)
        if path:
            print(f"\nplot: {os.path.relpath(path, REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
