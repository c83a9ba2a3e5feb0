"""Facts about processes from ``/proc`` (Linux): a process's stat fields, whether it is stopped, the CPU
time it (and its children) used. Imports nothing of flashckpt; safe from any thread."""

from __future__ import annotations

import os

__all__ = ["proc_stat", "process_stopped", "process_cpu_seconds"]


def proc_stat(pid: int | str) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may hold spaces and parentheses):
    index 0 is stat(5)'s field 3 (the state), index ``k`` its field ``k + 3``. ``pid`` may be ``"self"``."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal or a tracer (state T or t in /proc/<pid>/stat)."""
    try:
        return proc_stat(pid)[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def process_cpu_seconds(pid: int, *, children: bool = False) -> float | None:
    """User + system CPU seconds process ``pid`` (all its threads) has used so far, from
    ``/proc/<pid>/stat``; None where that cannot be read (not Linux, or the process is gone).

    With ``children``, its children's too: those it reaped (cutime, cstime) and those alive now (the
    saver's persist worker), found in ``/proc/<pid>/task/*/children``."""
    try:
        return _cpu_ticks(pid, children) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _cpu_ticks(pid: int, children: bool) -> int:
    fields = proc_stat(pid)
    ticks = int(fields[11]) + int(fields[12])  # utime, stime: stat(5) fields 14, 15
    if children:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime: children it reaped
        for kid in _live_children(pid):
            try:
                ticks += _cpu_ticks(kid, True)
            except (OSError, ValueError, IndexError):
                pass  # exited meanwhile
    return ticks


def _live_children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            continue
    return out
