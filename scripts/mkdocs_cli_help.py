"""mkdocs hook: writes the ``flashckpt`` command's usage into docs/reference/cli.md at build time.

The page holds the marker ``<!-- flashckpt-cli-help -->``; this hook replaces it with the help text of the
command and of each subcommand, as ``flashckpt.cli.parser()`` prints it, so that the reference cannot
drift from the command line (a command added to cli.py shows up on the next build).
"""

from __future__ import annotations

import argparse
from typing import Any

MARKER = "<!-- flashckpt-cli-help -->"


def cli_help() -> str:
    """The Markdown for the command's usage: the top-level help, then one section per subcommand."""
    from flashckpt.cli import parser

    top = parser()
    parts = ["```text", top.format_help().strip(), "```", ""]
    for action in top._actions:  # argparse has no public way to list subcommands
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                parts += [f"## flashckpt {name}", "", helps.get(name) or "", "", "```text",
                          sub.format_help().strip(), "```", ""]
    return "\n".join(parts)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """mkdocs event: fills the marker on the page that has it."""
    return markdown.replace(MARKER, cli_help()) if MARKER in markdown else markdown
