"""The documentation site builds, cleanly, with a reference that holds the docstrings (issue #34, in part).

``mkdocs build --strict`` (mkdocs.yml) fails on any warning: a ``:::`` directive that names nothing, a
docstring griffe cannot parse, a link to a missing page or anchor, a page left out of the nav. The build
runs once, in a subprocess, into a temporary site dir; the tests then read the HTML it wrote. mkdocs and
mkdocstrings are in the ``dev`` extra: without them the tests fail rather than skip.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from flashckpt import CheckpointEngine
from flashckpt.cli import parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built by ``mkdocs build --strict`` into a temporary dir; fails the tests on any warning."""
    missing = [m for m in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: the docs build needs the dev extra "
                    "(pip install -c constraints.txt -e '.[dev]')")
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                          "--site-dir", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    assert "WARNING" not in log, f"mkdocs build warned:\n{log}"
    return out


def _text(page: Path) -> str:
    """The words of an HTML page, whitespace removed (so that markup between words does not matter)."""
    return re.sub(r"\s+", "", html.unescape(re.sub(r"<[^>]+>", " ", page.read_text())))


def _words(doc: str) -> str:
    """Docstring text as it reads once rendered: no reST backquotes, no whitespace."""
    return re.sub(r"\s+", "", doc.replace("``", ""))


def _nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(pages) - set(nav)) == [], "pages under docs/ missing from mkdocs.yml's nav"
    assert sorted(set(nav) - set(pages)) == [], "nav entries of mkdocs.yml with no page under docs/"


def test_reference_renders_the_docstrings(site: Path) -> None:
    engine = _text(site / "reference" / "engine" / "index.html")
    for method in (CheckpointEngine.save, CheckpointEngine.load):
        summary = inspect.getdoc(method).split("\n\n")[0]  # type: ignore[union-attr]
        assert _words(summary) in engine, f"the reference lacks the docstring of CheckpointEngine.{method.__name__}"
    # FlashCheckpointIO gets its docstring at run time (__init_subclass__); the build must show it all the same
    lightning = _text(site / "reference" / "lightning" / "index.html")
    assert _words("Lightning ``CheckpointIO`` that snapshots checkpoints to shared memory") in lightning
    assert "teardown_timeout_s" in lightning


def test_cli_reference_lists_every_command(site: Path) -> None:
    cli = _text(site / "reference" / "cli" / "index.html")
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        assert f"usage:flashckpt{name}" in cli, f"the CLI reference lacks `flashckpt {name}`"
        for action in p._actions:
            for option in action.option_strings:
                assert option in cli, f"the CLI reference lacks `flashckpt {name} {option}`"
