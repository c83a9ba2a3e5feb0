"""The ``flashckpt`` command line speaks plainly (issue #34, in part): every subcommand and every argument says
what it is for in ``--help`` (argparse shows an argument without help text as a bare name)."""

from __future__ import annotations

import argparse

from flashckpt.cli import parser


def _walk(p: argparse.ArgumentParser, where: str) -> list[str]:
    missing = []
    for action in p._actions:  # argparse keeps them there; no public accessor
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            helped = {a.dest for a in action._choices_actions if a.help}
            for name, sub in action.choices.items():
                if name not in helped:
                    missing.append(f"{where} {name} (the subcommand)")
                missing += _walk(sub, f"{where} {name}")
            continue
        if not action.help:
            missing.append(f"{where} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_subcommand_and_argument_has_help_text() -> None:
    assert _walk(parser(), "flashckpt") == []
