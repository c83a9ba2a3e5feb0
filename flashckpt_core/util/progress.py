"""The progress bar of the ``flashckpt`` command's long work (``verify``, ``upload``, ``export``): tqdm on
stderr, shown only when stderr is a terminal."""

from __future__ import annotations

import sys

from tqdm import tqdm

__all__ = ["Bar", "bar"]


class Bar(tqdm):
    """tqdm without its monitor thread (started by every bar, shown or not, and left running): a command
    that runs inside another program (``cli.main``) leaves no thread behind."""

    monitor_interval = 0


def bar(what: str, total: int, *, unit: str = "B", show: bool | None = None) -> Bar:
    """A bar of ``total`` ``unit`` (bytes: scaled by 1024) on stderr; ``show`` None: when stderr is a terminal
    (tqdm's ``disable=None``), so a pipe or a log file gets the result lines only. Lines printed meanwhile go
    through ``bar.write`` (above the bar)."""
    scaled = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    return Bar(total=total, desc=what, unit=unit, file=sys.stderr, disable=None if show is None else not show,
               dynamic_ncols=True, leave=False, **scaled)
