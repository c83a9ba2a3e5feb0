"""Locations of checkpoints: local paths and URLs, handled by one set of rules.

A checkpoint dir is a local path (``/data/ckpt``, ``relative/ckpt``, ``file:///data/ckpt``) or a URL of a
storage backend (``s3://bucket/prefix``; see ``storage.storage_for``). Every location under it has the
root's form: an absolute local path, or a URL whose path part is ``/``-separated. The helpers here are
lexical (they never touch a file system): ``..`` is resolved in the text; symbolic links are the
backend's business (``CheckpointStorage.confined``).

Torch-free: the saver daemon imports it.
"""

from __future__ import annotations

import os
import posixpath
import re
import urllib.parse

from flashckpt import errors as E

__all__ = ["URL", "is_url", "split_url", "url_scheme", "normpath", "relpath", "inside", "join", "parent", "basename",
           "local_dir", "resolve_in"]

URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` is a URL of a backend other than the local file system (``file://`` is local)."""
    m = URL.match(os.fspath(location))
    return m is not None and m.group(1).lower() != "file"


def url_scheme(location: str | os.PathLike[str]) -> str:
    """The scheme of a location: ``file`` for local paths and ``file://`` URLs."""
    m = URL.match(os.fspath(location))
    return m.group(1).lower() if m else "file"


def split_url(url: str) -> tuple[str, str]:
    """(``scheme://authority``, ``/path``) of a backend URL; the path is ``/`` at least."""
    m = URL.match(url)
    if m is None:
        raise E.InvalidArgumentError(f"{url!r} is not a URL (scheme://...)")
    rest = url[m.end():]
    authority, slash, path = rest.partition("/")
    return f"{m.group(1).lower()}://{authority}", "/" + path if slash else "/"


def normpath(location: str | os.PathLike[str]) -> str:
    """The canonical form of a location: an absolute, normalized local path (``os.path.abspath``), or a URL
    with ``.``, ``..``, repeated and trailing ``/`` removed from its path (never above its root)."""
    loc = os.fspath(location)
    if not is_url(loc):
        return os.path.abspath(local_dir(loc, "normpath") if URL.match(loc) else loc)
    head, path = split_url(loc)
    path = posixpath.normpath(path)
    if path.startswith("//"):  # posixpath keeps a leading double slash
        path = "/" + path.lstrip("/")
    return head if path == "/" else head + path


def relpath(location: str, root: str) -> str | None:
    """``location``'s path relative to ``root`` (``os.sep``-separated for local paths, ``/`` for URLs),
    ``"."`` for the root itself; None when it lies outside (lexically, after ``normpath``)."""
    loc, base = normpath(location), normpath(root)
    if is_url(base) != is_url(loc):
        return None
    if not is_url(base):
        rel = os.path.relpath(loc, base)
        return None if rel == ".." or rel.startswith(".." + os.sep) else rel
    (h1, p1), (h2, p2) = split_url(loc), split_url(base)
    if h1 != h2:
        return None
    if p1 == p2:
        return "."
    prefix = p2.rstrip("/") + "/"
    return p1[len(prefix):] if p1.startswith(prefix) else None


def inside(location: str, root: str, *, strict: bool = False) -> bool:
    """Whether ``location`` lies inside ``root`` (lexically; ``root`` itself counts unless ``strict``)."""
    rel = relpath(location, root)
    return rel is not None and not (strict and rel == ".")


def join(root: str, *parts: str) -> str:
    """``root`` joined with ``parts`` (``/`` for URLs)."""
    return posixpath.join(root, *parts) if is_url(root) else os.path.join(root, *parts)


def parent(location: str) -> str:
    """The directory holding ``location`` (a URL's root is its own parent)."""
    loc = normpath(location)
    if not is_url(loc):
        return os.path.dirname(loc)
    head, path = split_url(loc)
    up = posixpath.dirname(path)
    return head if up == "/" else head + up


def basename(location: str) -> str:
    return posixpath.basename(split_url(normpath(location))[1]) if is_url(location) else \
        os.path.basename(os.path.normpath(location))


def local_dir(checkpoint_dir: str | os.PathLike[str], what: str = "CheckpointEngine") -> str:
    """The local path ``checkpoint_dir`` names, as given (relative paths stay relative): a ``file://``
    URL becomes its path; a URL of another scheme is refused (a caller that needs a local directory).

    Raises:
        CheckpointDirError: another URL, a ``file://`` URL naming a host, or an empty path.
        InvalidArgumentTypeError: not a path.
    """
    d = os.fspath(checkpoint_dir)
    if not isinstance(d, str):
        raise E.InvalidArgumentTypeError(f"{what}(checkpoint_dir={d!r}): a path (str or os.PathLike) is needed")
    m = URL.match(d)
    if m is not None:
        scheme = m.group(1).lower()
        if scheme != "file":
            raise E.CheckpointDirError(
                f"{what}({d!r}): needs a local directory, not a {scheme}:// URL. Pass a local directory (or mount "
                "the store, for example with mountpoint-s3, and pass the mount's path)")
        url = urllib.parse.urlparse(d)
        if url.netloc not in ("", "localhost") or not url.path:
            raise E.CheckpointDirError(f"{what}({d!r}): a file:// URL names an absolute local path, as in "
                                       "file:///data/ckpt (three slashes); a host or a relative path is not allowed")
        return urllib.parse.unquote(url.path)
    if not d:
        raise E.CheckpointDirError(f"{what}(checkpoint_dir=''): give a directory")
    return d


def resolve_in(root: str, given: str, path: str | os.PathLike[str], what: str = "path") -> str:
    """The absolute path that a ``path`` argument names, for a checkpoint dir ``root`` (absolute) given
    by the user as ``given``.

    An absolute path (or ``file://`` URL) is itself. A relative path that begins with the checkpoint dir
    as it was given (relative), such as ``os.path.join(checkpoint_dir, "checkpoint-10.pt")``, or with the
    checkpoint dir as seen from the current directory, is that path: relative to where the checkpoint
    dir was given, or to the current directory. Any other relative path is relative to the checkpoint
    dir. So with ``checkpoint_dir="work/s01"`` (or its absolute path, from the directory holding
    ``work``), ``"work/s01/ckpt-10.pt"`` and ``"ckpt-10.pt"`` both mean ``<cwd>/work/s01/ckpt-10.pt``;
    to mean a subdirectory of the checkpoint dir that repeats its relative name
    (``work/s01/work/s01/...``), pass an absolute path. For a checkpoint dir in an object store
    (``s3://...``), a URL is itself and a relative path lies inside the checkpoint dir.
    """
    if is_url(root):  # an object store: a URL is itself, a relative path is inside the root
        p = os.fspath(path)
        if is_url(p):
            return normpath(p)
        if not isinstance(p, str) or not p or os.path.isabs(p):
            raise E.InvalidArgumentError(f"{what}={path!r}: the checkpoint dir is {root}; give a URL inside it or a "
                                         "path relative to it")
        return normpath(join(root, p))
    p = local_dir(path, what)
    if os.path.isabs(p):
        return os.path.abspath(p)
    n = os.path.normpath(p)
    prefixes = [os.path.normpath(given)] if given and not os.path.isabs(given) else []
    try:
        here = os.path.relpath(root, os.getcwd())
        if not (here == ".." or here.startswith(".." + os.sep)):
            prefixes.append(here)
    except OSError:  # the current directory was removed
        pass
    for g in prefixes:
        if g != "." and (n == g or n.startswith(g + os.sep)):
            return os.path.abspath(os.path.join(root, os.path.relpath(n, g)))
    return os.path.abspath(os.path.join(root, p))
