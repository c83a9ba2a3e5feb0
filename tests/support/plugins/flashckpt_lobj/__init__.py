"""A test backend of flashckpt: a local object store, served for ``lobj://bucket/key`` URLs.

It has what object stores have and nothing more: whole objects put and got by key, listing by prefix,
deletes; no rename, no directories, no locks, no local path. Objects live as flat files named by their
quoted key under ``$FLASHCKPT_LOBJ_ROOT/<bucket>/`` (a put writes a hidden temporary file and renames it
there: the store's own atomic put, invisible through the API). A checkpoint dir in it is not a path on
any local file system, so a part of flashckpt that used ``os.path`` or ``open`` on a checkpoint location
instead of its storage backend fails or leaves a stray ``lobj:`` directory behind (the tests look).

It registers through the entry-point group ``flashckpt.storage`` of a distribution beside it
(``flashckpt_lobj-0.1.dist-info``): with ``tests/support/plugins`` on ``sys.path`` (and on ``PYTHONPATH``, for the
saver daemon and its persist worker) ``storage_for("lobj://...")`` finds it as it would an installed one.

It implements only byte I/O, as every backend does (the ``CheckpointStorage`` call order): the commit
records, their leases and the checkpoint dir's probe are the commit layer's, written through this API.
"""

from __future__ import annotations

import os
import urllib.parse
import uuid

import xxhash
from flashckpt.storage.base import CheckpointStorage, FileRecord

__all__ = ["LocalObjectStorage", "ROOT_ENV"]

ROOT_ENV = "FLASHCKPT_LOBJ_ROOT"


class LocalObjectStorage(CheckpointStorage):
    """Objects by key in flat files; every operation goes through this API (see the module docstring)."""

    supports_rename = False  # move copies, then removes
    posix_files = False  # the commit layer keeps its records inside the dir, held by lease objects

    def __init__(self) -> None:
        root = os.environ.get(ROOT_ENV)
        if not root:
            raise RuntimeError(f"{ROOT_ENV} must name the directory that holds the lobj:// buckets")
        self.root = root
        self.puts = 0

    # -- keys ---------------------------------------------------------------------------------------
    def _split(self, url: str) -> tuple[str, str]:
        if not url.startswith("lobj://"):
            raise ValueError(f"not a lobj:// URL: {url!r}")
        bucket, _, key = url[len("lobj://"):].partition("/")
        return bucket, key.strip("/")

    def _file(self, url: str) -> str:
        bucket, key = self._split(url)
        d = os.path.join(self.root, bucket)
        os.makedirs(d, exist_ok=True)
        return os.path.join(d, urllib.parse.quote(key, safe=""))

    def _keys(self, bucket: str) -> list[str]:
        try:
            names = os.listdir(os.path.join(self.root, bucket))
        except FileNotFoundError:
            return []
        return [urllib.parse.unquote(n) for n in names if not n.startswith(".tmp-")]

    # -- the API ------------------------------------------------------------------------------------
    def write_bytes(self, path: str, data: bytes) -> FileRecord:
        f = self._file(path)
        tmp = os.path.join(os.path.dirname(f), f".tmp-{uuid.uuid4().hex}")
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, f)  # the store's atomic put
        self.puts += 1
        return FileRecord(path, len(data), xxhash.xxh3_64_hexdigest(data))

    def read_bytes(self, path: str) -> bytes:
        try:
            with open(self._file(path), "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            raise FileNotFoundError(2, "no such object", path) from None

    def exists(self, path: str) -> bool:
        return os.path.exists(self._file(path))

    def listdir(self, path: str) -> list[str]:
        bucket, key = self._split(path)
        prefix = key + "/" if key else ""
        return sorted({k[len(prefix):].split("/", 1)[0] for k in self._keys(bucket) if k.startswith(prefix)})

    def remove(self, path: str) -> None:
        try:
            os.unlink(self._file(path))
        except FileNotFoundError:
            pass

    def remove_tree(self, path: str) -> None:
        bucket, key = self._split(path)
        for k in self._keys(bucket):
            if k == key or k.startswith(key + "/"):
                self.remove(f"lobj://{bucket}/{k}")

    def checksum(self, path: str) -> tuple[int, str]:
        data = self.read_bytes(path)
        return len(data), xxhash.xxh3_64_hexdigest(data)

    def size(self, path: str) -> int:
        try:
            return os.path.getsize(self._file(path))
        except FileNotFoundError:
            raise FileNotFoundError(2, "no such object", path) from None
