"""PNG plots of the benchmark results (matplotlib, Agg backend).

    python -m benchmarks.plots [--in benchmarks/results] [--img docs/img]

Reads what exists of ``<in>/run.json`` (``benchmarks.run``), ``<in>/overhead.json`` (``benchmarks.overhead``)
and ``<in>/goodput.json`` (``benchmarks.goodput``) and writes the figures below. ``--in`` defaults to
``benchmarks/results``, the committed results that drew the figures in docs/img (docs/benchmarks.md says which
run), so that anyone can redraw them; ``--in bench_out`` draws a run of one's own.

* ``pause_by_method.png``: training paused per checkpoint, per method and state size (log scale);
* ``training_overhead.png``: step-time overhead of each checkpointing mode against no checkpointing;
* ``goodput_vs_interval.png``: expected goodput versus checkpoint interval, with each method's automatic interval.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import textwrap
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import REPO_ROOT  # noqa: E402

IMG = os.path.join(REPO_ROOT, "docs", "img")
RESULTS = os.path.join(REPO_ROOT, "benchmarks", "results")
COLORS = {"copy_limit": "#999999", "flashckpt.snapshot": "#d62728", "flashckpt.persist": "#ff9896",
          "torch.save": "#1f77b4", "dcp.save": "#2ca02c", "dcp.async_save": "#98df8a",
          "dcp.async_save.shm": "#17becf", "dlrover.snapshot": "#9467bd",
          "none": "#999999", "torch_save": "#1f77b4", "dcp_async": "#98df8a", "dcp_async_shm": "#17becf",
          "flashckpt": "#d62728", "flashckpt_overlap": "#ff7f0e", "flashckpt_mem": "#ff9896"}


def _shown_path(text: str) -> str:
    """``text`` with each absolute path made relative to the repository (else its file name): a figure
    in docs/ names no machine's directories."""
    def rel(m: re.Match[str]) -> str:
        path = m.group(0)
        inside = os.path.commonpath([REPO_ROOT, path]) == REPO_ROOT if os.path.isabs(path) else False
        return os.path.relpath(path, REPO_ROOT) if inside else os.path.basename(path)

    # an absolute path starts the text or follows a space or a bracket: not the "/results/..." of "benchmarks/results/..."
    return re.sub(r"(?<![^\s(])/[^\s,;()]+", rel, text)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _stamp(fig: Any, machine: dict[str, Any] | None, extra: str = "", command: str = "") -> float:
    """The footer: the machine, the date and commit of the run, and the command that ran it (its settings).
    Returns the fraction of the figure's height it takes, for ``tight_layout`` to keep the axes above it."""
    if not machine:
        return 0.01
    git = f", commit {machine['git']}" if machine.get("git") else ""
    lines = [f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, torch {machine.get('torch', '?')}, "
             f"{machine.get('date', '?')[:10]}{git}{extra}"]
    if command:
        lines.append(_shown_path(command))
    fig.text(0.01, 0.005, "\n".join(lines), fontsize=7, color="#666666", ha="left", va="bottom")
    return (0.05 + 0.13 * len(lines)) / fig.get_figheight()  # 7 pt lines: ~0.13 inch each


def _save(fig: Any, img: str, name: str) -> str | None:
    """Writes ``fig`` as ``img/name`` and closes it; the path, or None without a figure."""
    if fig is None:
        return None
    os.makedirs(img, exist_ok=True)
    path = os.path.join(img, name)
    fig.savefig(path, dpi=130)
    _plt().close(fig)
    return path


def draw_pause(run: dict[str, Any]) -> Any:
    """Grouped bars: blocking time per checkpoint for each system and case (None without cases)."""
    cases = run.get("cases", [])
    if not cases:
        return None
    plt = _plt()
    labels = run.get("labels", {})
    systems = [s for s in run.get("blocking_systems", []) if any(f"{s}.blocking" in c["medians"] for c in cases)]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.9 * len(cases) + 3), 4.8))
    width = 0.8 / max(1, len(systems))
    for j, sid in enumerate(systems):
        xs, ys = [], []
        for i, c in enumerate(cases):
            v = c["medians"].get(f"{sid}.blocking")
            if v is not None and v == v and v > 0:
                xs.append(i + (j - (len(systems) - 1) / 2) * width)
                ys.append(v * 1e3)
        label = labels.get(sid, sid) + (" (blocking)" if sid == "flashckpt.persist" else "")
        ax.bar(xs, ys, width=width, label=label, color=COLORS.get(sid))
        for i, c in enumerate(cases):  # a system that could not do this case
            if sid in c.get("failed", {}):
                ax.text(i + (j - (len(systems) - 1) / 2) * width, 0.02, "failed", rotation=90, ha="center",
                        va="bottom", fontsize=7, color=COLORS.get(sid), transform=ax.get_xaxis_transform())
    ax.set_yscale("log")
    ax.set_ylabel("training paused per checkpoint (ms, log scale)")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"{c['label']}\n{c['tensors']:,} tensors" for c in cases], fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    rounds = run.get("machine", {}).get("rounds")
    ax.set_title(f"Pause per checkpoint (median of {rounds} interleaved rounds)" if rounds
                 else "Pause per checkpoint (median of interleaved rounds)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    foot = _stamp(fig, run.get("machine"), command=run.get("command", ""))
    fig.tight_layout(rect=(0, foot, 1, 1))
    return fig


def plot_pause(run: dict[str, Any], img: str) -> str | None:
    """``pause_by_method.png`` in ``img`` (None when the results hold nothing to draw)."""
    return _save(draw_pause(run), img, "pause_by_method.png")


def draw_overhead(ov: dict[str, Any]) -> Any:
    """Bars: step-time overhead (mean step) of each mode versus no checkpointing, per-round range as whiskers
    (None without a mode measured against the baseline)."""
    modes = {m: s for m, s in ov.get("modes", {}).items() if m != "none" and s.get("overhead_pct") is not None}
    if not modes:
        return None
    plt = _plt()
    names = list(modes)
    fig, ax = plt.subplots(figsize=(max(7.5, 1.75 * len(names) + 1.5), 4.6))
    ys = [modes[m]["overhead_pct"] for m in names]
    lo = [y - min(modes[m].get("overhead_pct_per_round") or [y]) for m, y in zip(names, ys, strict=True)]
    hi = [max(modes[m].get("overhead_pct_per_round") or [y]) - y for m, y in zip(names, ys, strict=True)]
    ax.bar(range(len(names)), ys, yerr=[lo, hi], capsize=4, color=[COLORS.get(m, "#777777") for m in names])
    for i, y in enumerate(ys):
        ax.annotate(f"{y:+.1f} %", (i + 0.08, y), textcoords="offset points", xytext=(2, 3 if y >= 0 else -11),
                    ha="left", fontsize=8)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(names)))
    cfg = ov.get("config", {})
    every = cfg.get("save_every")
    # the labels say "every k steps"; the run's k is in its config (and in the title)
    shown = [modes[m]["label"].replace("every k", f"every {every}") if every else modes[m]["label"] for m in names]
    ax.set_xticklabels([textwrap.fill(label, 20) for label in shown], fontsize=7)
    base = ov.get("modes", {}).get("none", {}).get("mean_step_s")
    ax.set_ylabel("step-time overhead vs no checkpointing (%)")
    steps = f"{cfg['steps']} steps, " if cfg.get("steps") else ""
    ax.set_title(f"Training overhead, DDP on {cfg.get('ranks', 2)} gloo ranks, {steps}persist every "
                 f"{cfg.get('save_every', '?')} steps" + (f" (step {base * 1e3:.0f} ms)" if base else ""), fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    rounds = f"{cfg['rounds']} rounds" if cfg.get("rounds") else "rounds"
    foot = _stamp(fig, ov.get("machine"), f"; median and, as whiskers, range over {rounds}",
                  command=ov.get("command", ""))
    fig.tight_layout(rect=(0, foot, 1, 1))
    return fig


def plot_overhead(ov: dict[str, Any], img: str) -> str | None:
    """``training_overhead.png`` in ``img`` (None when the results hold nothing to draw)."""
    return _save(draw_overhead(ov), img, "training_overhead.png")


def draw_goodput(gp: dict[str, Any]) -> Any:
    """Goodput versus checkpoint interval per job size; each method's automatic interval marked (None without
    curves)."""
    curves = gp.get("curves", {})
    if not curves:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(curves), figsize=(5.2 * len(curves), 5.0), squeeze=False)
    names = {"torch_save": "torch.save", "dcp_async": "DCP async_save",
             "flashckpt": "flashckpt (memory interval; storage at auto)"}
    for ax, (n, cv) in zip(axes[0], curves.items(), strict=True):
        xs = cv["interval_s"]
        for key, label in names.items():
            ys = [100 * y if y is not None and not (isinstance(y, float) and math.isnan(y)) else math.nan
                  for y in cv[key]["goodput"]]
            color = COLORS.get("flashckpt" if key == "flashckpt" else key)
            ox, oy = cv[key]["opt"]
            best = ox and oy is not None
            # each optimum's value goes in the legend: beside the dots, labels would cross the other curves
            ax.plot(xs, ys, color=color,
                    label=f"{label}: {100 * oy:.1f} % at {ox:,.0f} s" if best else label)
            if best:
                ax.plot([ox], [100 * oy], "o", color=color)
        ax.set_xscale("log")
        ax.set_xlabel("checkpoint interval (s)")
        ax.set_ylabel("expected goodput (%)")
        # zoom on the optima: down to three times the worst optimum's waste below it
        opts = [100 * cv[k]["opt"][1] for k in names if cv[k]["opt"][1] is not None]
        if opts:
            worst = min(opts)
            ax.set_ylim(max(0.0, worst - 3 * (100 - worst) - 0.1), 100 + 0.15 * (100 - worst) + 0.05)
        ax.grid(which="both", alpha=0.3)
        ax.set_title(f"{int(n):,} GPUs", fontsize=10)
        # below the axes: inside, the legend would hide the curves' flanks
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    a = gp.get("assumptions", {})
    fig.suptitle(f"Goodput vs checkpoint interval (per-GPU MTBF {a.get('gpu_mtbf_h', 0):,.0f} h, "
                 f"{100 * a.get('node_fraction', 0):.0f} % node failures, restart {a.get('restart_s', 0):.0f} s, "
                 f"+{a.get('replace_s', 0):.0f} s to replace a node)",
                 fontsize=10)
    src = gp.get("costs", {}).get("source", "")
    fig.text(0.01, 0.005, f"costs: {_shown_path(src)}"[:180], fontsize=6, color="#666666", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    return fig


def plot_goodput(gp: dict[str, Any], img: str) -> str | None:
    """``goodput_vs_interval.png`` in ``img`` (None when the results hold nothing to draw)."""
    return _save(draw_goodput(gp), img, "goodput_vs_interval.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plots", description=__doc__.split("\n\n")[0])
    p.add_argument("--in", dest="inp", default=RESULTS,
                   help="directory of the JSON results (default: benchmarks/results, the committed ones)")
    p.add_argument("--img", default=IMG, help="where the PNGs go")
    args = p.parse_args(argv)
    wrote = []
    for name, fn in (("run.json", plot_pause), ("overhead.json", plot_overhead), ("goodput.json", plot_goodput)):
        path = os.path.join(args.inp, name)
        if not os.path.exists(path):
            print(f"note: {path} not found; run the benchmark that writes it first")
            continue
        with open(path) as f:
            out = fn(json.load(f), args.img)
        if out:
            wrote.append(out)
    for w in wrote:
        print(f"wrote {os.path.relpath(w, REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
