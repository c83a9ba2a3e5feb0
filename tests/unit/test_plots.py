"""The figures in docs/img as ``benchmarks/plots.py`` draws them from the committed results (benchmarks/results,
issue #34): no two of a figure's texts overlap or leave the figure, no text names a directory of the machine
that ran the benchmark, and the titles and footers say the settings of the run they show.

Needs matplotlib (the ``bench`` extra); skipped without it.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import pytest

pytest.importorskip("matplotlib")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # for benchmarks (the repository root is not on pytest's path)
    sys.path.insert(0, REPO)
from benchmarks import plots  # noqa: E402

RESULTS = os.path.join(REPO, "benchmarks", "results")
FIGURES = {"run.json": plots.draw_pause, "overhead.json": plots.draw_overhead, "goodput.json": plots.draw_goodput}


def _results(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def _drawn_texts(fig) -> list:
    """Every non-empty text the figure draws: titles, axis labels, the tick labels in view, legends,
    annotations, footers."""
    from matplotlib.text import Text

    fig.canvas.draw()
    texts = [t for t in fig.texts if isinstance(t, Text)]  # the footers and the suptitle
    for ax in fig.axes:
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        legend = ax.get_legend()
        if legend is not None:
            texts += list(legend.get_texts())
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for ticks, locs in ((axis.get_major_ticks(), axis.get_majorticklocs()),
                                (axis.get_minor_ticks(), axis.get_minorticklocs())):
                texts += [t.label1 for t, loc in zip(ticks, locs, strict=False)
                          if lo - 1e-9 * abs(hi - lo) <= loc <= hi + 1e-9 * abs(hi - lo)]
    return [t for t in dict.fromkeys(texts) if t.get_visible() and t.get_text().strip()]


def _close(fig) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


@pytest.mark.parametrize("name", list(FIGURES))
def test_no_two_texts_overlap_and_none_leaves_the_figure(name):
    fig = FIGURES[name](_results(name))
    try:
        renderer = fig.canvas.get_renderer()
        texts = _drawn_texts(fig)
        assert len(texts) > 5, f"{name}: only {[t.get_text() for t in texts]} drawn"
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
        overlaps = [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2) if ba.overlaps(bb)]
        assert not overlaps, f"{name}: texts overlap: {overlaps}"
        page = fig.bbox
        outside = [text for text, box in boxes
                   if box.x0 < page.x0 - 1 or box.y0 < page.y0 - 1 or box.x1 > page.x1 + 1 or box.y1 > page.y1 + 1]
        assert not outside, f"{name}: texts cut off at the figure's edge: {outside}"
    finally:
        _close(fig)


@pytest.mark.parametrize("name", list(FIGURES))
def test_no_text_names_a_directory_of_the_machine(name):
    data = _results(name)
    if name == "goodput.json":  # the costs' source as benchmarks.goodput writes it: an absolute path
        data["costs"]["source"] = os.path.join(REPO, "bench_out", "run.json") + " (GPT 1 GB, 3 rounds)"
    fig = FIGURES[name](data)
    try:
        texts = [t.get_text() for t in _drawn_texts(fig)]
        assert not [t for t in texts if REPO in t or "/home/" in t or "/tmp/" in t], texts
        if name == "goodput.json":
            assert "costs: bench_out/run.json (GPT 1 GB, 3 rounds)" in texts
    finally:
        _close(fig)
    if name == "goodput.json":  # outside the repository: the file name; relative: as it is
        for source, shown in (("/elsewhere/results/run.json (GPT 1 GB)", "costs: run.json (GPT 1 GB)"),
                              ("benchmarks/results/run.json (GPT 1 GB)", "costs: benchmarks/results/run.json (GPT 1 GB)")):
            data["costs"]["source"] = source
            fig = plots.draw_goodput(data)
            try:
                assert shown in [t.get_text() for t in _drawn_texts(fig)]
            finally:
                _close(fig)


def test_titles_and_footers_say_the_runs_settings():
    run, ov, gp = (_results(n) for n in FIGURES)

    fig = plots.draw_pause(run)
    try:
        texts = [t.get_text() for t in _drawn_texts(fig)]
        assert f"Pause per checkpoint (median of {run['machine']['rounds']} interleaved rounds)" in texts
        # the command as the footer shows it: a path on the machine that ran it becomes its name (_shown_path)
        assert any(plots._shown_path(run["command"]) in t for t in texts), "the footer names the command that ran the suite"
    finally:
        _close(fig)

    fig = plots.draw_overhead(ov)
    try:
        cfg = ov["config"]
        texts = [t.get_text() for t in _drawn_texts(fig)]
        title = fig.axes[0].get_title()
        assert f"{cfg['steps']} steps, persist every {cfg['save_every']} steps" in title
        assert not [t for t in texts if "every k" in t], "the labels say the run's k"
        assert any(f"range over {cfg['rounds']} rounds" in t and plots._shown_path(ov["command"]) in t for t in texts)
    finally:
        _close(fig)

    fig = plots.draw_goodput(gp)
    try:
        a = gp["assumptions"]
        title = fig._suptitle.get_text()
        assert f"per-GPU MTBF {a['gpu_mtbf_h']:,.0f} h" in title
        assert f"restart {a['restart_s']:.0f} s, +{a['replace_s']:.0f} s to replace a node" in title
    finally:
        _close(fig)
