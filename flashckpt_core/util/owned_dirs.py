"""Private temporary directories named by the process that owns them, so that what a killed process left
behind is told from what a live one uses, and removed: ``owned_dir`` makes one, ``sweep`` removes those
whose owner is gone.

A name is ``<prefix><pid>-<start>-<random>``, ``prefix`` beginning with ``flashckpt-``: ``start`` is the
owner's start time (``/proc/<pid>/stat`` field 22, clock ticks since boot), so a pid that another process
took since does not keep a dead owner's directory alive. Names without a start time
(``<prefix><pid>-<random>``, as the warm workers' module records were named) are told by the pid alone.
``sweep`` looks only at directories of this uid (never a symbolic link) with such a name, and never
touches one whose owner runs.

Users: the adapters' staging directories (``integrations._kit_files.SnapshotDir``: the HF Trainer's
``flashckpt-hf-*`` in /dev/shm, DeepSpeed's, Lightning's), swept by the next process that makes one in the
same place and by ``flashckpt gc``; ``flashckpt-run``'s module records (``warm.make_modules_dir``).
Torch-free: the CLI uses it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
import threading

from flashckpt.errors import InvalidArgumentError
from flashckpt.util.lease import pid_running
from flashckpt.util.procfs import proc_stat

__all__ = ["owned_dir", "sweep", "sweep_once", "scratch_roots"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"flashckpt-(?:[a-z]+-)*?(\d+)-(?:(\d+)-)?[a-z0-9_]+")
_swept: set[str] = set()
_swept_lock = threading.Lock()


def _start_time(pid: int | str) -> int | None:
    """Process ``pid``'s start time in clock ticks since boot; None when it is not there (or unreadable)."""
    try:
        return int(proc_stat(pid)[19])  # stat(5) field 22
    except (OSError, IndexError, ValueError):
        return None


def owned_dir(root: str | None, prefix: str) -> str:
    """A new private (0700) directory in ``root`` (None: the system temp dir) named after this process
    (see the module docstring); ``prefix`` is ``flashckpt-<kind>-``."""
    if not _NAME.fullmatch(f"{prefix}1-1-x"):
        raise InvalidArgumentError(f"owned_dir(prefix={prefix!r}): use 'flashckpt-<lower-case words>-'")
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-{_start_time('self') or 0}-", dir=root)


def _owner_gone(name: str) -> int | None:
    """The pid of the owner of the directory ``name`` when that process is gone; None when it runs or
    when ``name`` is not an owned directory's."""
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    pid, start = int(m.group(1)), m.group(2)
    if pid <= 0:
        return None
    if pid_running(pid) and (start is None or int(start) == 0 or _start_time(pid) == int(start)):
        return None
    return pid


def sweep(root: str | None = None, *, dry_run: bool = False) -> list[str]:
    """Removes (``dry_run``: only lists) the owned directories in ``root`` (None: the system temp dir) whose
    owner is gone; returns one line per directory. Errors are logged, never raised: a sweep is tidying."""
    root = root or tempfile.gettempdir()
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    uid = os.getuid()
    done = []
    for name in names:
        pid = _owner_gone(name)
        if pid is None:
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            continue
        if not dry_run:
            try:
                shutil.rmtree(path)
            except FileNotFoundError:
                continue  # removed by another sweep meanwhile
            except OSError as e:
                log.warning("could not remove %s, left by process %d: %s", path, pid, e)
                continue
        done.append(f"{path} (left by process {pid}, which is gone)")
    return done


def sweep_once(root: str | None) -> None:
    """``sweep(root)`` the first time this process asks for ``root`` (a process that makes such
    directories tidies up after its killed predecessors once, not at every snapshot)."""
    key = os.path.realpath(root or tempfile.gettempdir())
    with _swept_lock:
        if key in _swept:
            return
        _swept.add(key)
    for line in sweep(root):
        log.info("removed %s", line)


def scratch_roots() -> list[str]:
    """Where the adapters stage files unless told otherwise, the one they use first: FLASHCKPT_SCRATCH_DIR
    when set; else /dev/shm (when writable) and the system temp dir (the fallback, and DeepSpeed's place).
    ``flashckpt gc`` sweeps them all."""
    from flashckpt.config import Knobs

    if (knob := Knobs.from_env().scratch_dir):
        return [knob]
    roots = ["/dev/shm"] if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else []
    return list(dict.fromkeys([*roots, tempfile.gettempdir()]))
