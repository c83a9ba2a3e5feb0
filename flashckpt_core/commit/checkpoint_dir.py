"""The checkpoint dir on a storage backend, as the commit layer uses it: made ready and checked writable
before a saver starts (``prepare_dir``), and whether a location lies inside it (``confined``).

The backend's capability ``posix_files`` decides: on a file system the dir is created, checked to be a
directory, and confinement resolves symbolic links; on any other store a probe object is written and
removed (credentials, the bucket and the endpoint are checked before a saver starts, within the backend's
bound for a first contact, ``CheckpointStorage.first_contact``; a failure names the backend's ``access_hint``), and confinement is lexical (``storage.locations.inside``). Where the commit records live is
``records_home.home_for``. Imports the storage layer only; torch-free; safe from any thread.
"""

from __future__ import annotations

import os
import uuid

from flashckpt import errors as E
from flashckpt.storage import locations
from flashckpt.storage.base import CheckpointStorage

__all__ = ["prepare_dir", "confined"]


def prepare_dir(storage: CheckpointStorage, root: str, shown: str) -> None:
    """Creates the checkpoint dir ``root`` when the store needs that and checks that this process may write
    there, before a saver starts (``shown``: the dir as the user gave it, for messages).

    Raises:
        CheckpointDirError: ``root`` cannot be used (the message says why and what to do).
    """
    if storage.posix_files:
        _prepare_local(root, shown)
        return
    probe = locations.join(root, f".flashckpt-probe-{uuid.uuid4().hex}")
    try:
        with storage.first_contact():  # a store that does not answer fails the start in seconds
            storage.write_bytes(probe, b"ok")
            storage.remove(probe)
    except Exception as e:  # credentials, a missing bucket, an unreachable endpoint: whatever the store raises
        raise E.CheckpointDirError(f"CheckpointEngine({shown!r}): cannot write to {root} ({e}); "
                                   f"{storage.access_hint}") from e


def _prepare_local(root: str, shown: str) -> None:
    """Creates ``root`` when missing and checks that it is a writable directory."""
    f = root
    while f and not os.path.isdir(f):  # the nearest existing ancestor that is not a directory
        # isdir asked again: another rank may have made the directory between the two checks
        if os.path.lexists(f) and not os.path.isdir(f):
            what = "is a file" if f == root else f"lies under {f}, which is a file"
            raise E.CheckpointDirError(f"CheckpointEngine({shown!r}): the checkpoint dir {root} {what}, not a "
                                       "directory; pass a directory (it is created when missing)")
        up = os.path.dirname(f)
        f = "" if up == f else up
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".flashckpt-probe-{uuid.uuid4().hex}")
        with open(probe, "wb") as fh:
            fh.write(b"ok")
        os.unlink(probe)
    except OSError as e:
        raise E.CheckpointDirError(f"CheckpointEngine({shown!r}): the checkpoint dir {root} is not writable "
                                   f"({e}); choose a writable directory or fix its permissions") from e


def confined(storage: CheckpointStorage, location: str, root: str) -> bool:
    """Whether ``location`` lies inside ``root`` as stored. On a file system (``posix_files``): whether its
    directory, symbolic links resolved, lies inside ``root`` (the last component may itself be a link:
    removing or replacing it does not touch its target); elsewhere lexically."""
    if not storage.posix_files:
        return locations.inside(location, root)
    r = os.path.realpath(root)
    d = os.path.realpath(os.path.dirname(os.path.abspath(location)))
    return d == r or d.startswith(r + os.sep)
