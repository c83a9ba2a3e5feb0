"""fsspec's ``s3://`` for Lightning where s3fs cannot be installed, read through flashckpt's S3 backend.

Lightning reaches a remote ``ModelCheckpoint(dirpath="s3://...")`` through fsspec (``get_filesystem``), which
needs s3fs; s3fs needs aiobotocore, whose releases pin botocore below the 1.44 that flashckpt's S3 backend
(boto3) uses, so the two cannot be installed together. Where s3fs is missing, importing
``flashckpt.integrations.lightning`` registers ``FlashStoreFileSystem`` for ``s3://`` (by name: this module
is imported on fsspec's first use of ``s3://``): enough
of a file system for what ``ModelCheckpoint`` and the ``Trainer`` ask of a checkpoint dir while
``FlashCheckpointIO`` saves, loads and removes the checkpoints themselves:

- ``exists`` / ``isfile`` / ``isdir`` / ``info`` / ``ls``: the store's objects, plus the saves a
  ``FlashCheckpointIO`` of this process still persists (a ``.ckpt`` exists once ``save_checkpoint``
  returns, as after ``torch.save``: ``ModelCheckpoint``'s ``-v1`` names rely on it); flashckpt's records
  (``.flashckpt/``) are left out of listings;
- ``open(..., "rb")``: reads an object;
- writes and removals are refused (``PermissionError``): only the node's saver writes to the store.
  ``FlashCheckpointIO`` saves and removes checkpoints; other files (``ModelCheckpoint.to_yaml``) need
  s3fs.

A path inside the directory of a ``FlashCheckpointIO`` goes through its engine's backend (its
``storage_options``); others through a backend built for the call, closed after it.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

from flashckpt.errors import CheckpointNotFoundError, WriteRefusedError
from flashckpt.integrations import _lightning_io as lio
from flashckpt.storage import locations
from flashckpt.storage.base import CheckpointStorage
from flashckpt.storage.registry import storage_for
from fsspec.spec import AbstractFileSystem

__all__ = ["FlashStoreFileSystem"]

_RECORDS = ".flashckpt"  # the records of a checkpoint dir in a store (never the framework's)


class FlashStoreFileSystem(AbstractFileSystem):
    """A read-only fsspec file system over flashckpt's ``s3://`` backend (see the module docstring)."""

    protocol = "s3"
    root_marker = ""
    cachable = False  # an instance holds no connection: nothing to share

    # ------------------------------------------------------------------ paths
    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        p = str(path)
        return (p[len("s3://"):] if p.startswith("s3://") else p).rstrip("/")

    @staticmethod
    def _url(path: Any) -> str:
        p = str(path)
        return locations.normpath(p if p.startswith("s3://") else "s3://" + p.lstrip("/"))

    @contextlib.contextmanager
    def _storage(self, url: str) -> Iterator[CheckpointStorage]:
        plugin = lio.plugin_for(url)
        engine = plugin.engine if plugin is not None else None
        if engine is not None:
            yield engine.storage
            return
        st = storage_for(url, plugin.storage_options if plugin is not None else None)
        try:
            yield st
        finally:
            st.close()

    # ------------------------------------------------------------------ reading
    def exists(self, path: Any, **kwargs: Any) -> bool:
        url = self._url(path)
        if lio.pending_save(url):
            return True
        with self._storage(url) as st:
            return st.exists(url) or st.isdir(url)

    def isfile(self, path: Any) -> bool:
        url = self._url(path)
        if lio.pending_save(url):
            return True
        with self._storage(url) as st:
            return st.exists(url)

    def isdir(self, path: Any) -> bool:
        url = self._url(path)
        with self._storage(url) as st:
            return st.isdir(url)

    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        url = self._url(path)
        name = self._strip_protocol(url)
        if lio.pending_save(url):
            return {"name": name, "size": 0, "type": "file"}
        with self._storage(url) as st:
            if st.exists(url):
                return {"name": name, "size": st.size(url), "type": "file"}
            if st.isdir(url):
                return {"name": name, "size": 0, "type": "directory"}
        raise CheckpointNotFoundError(2, "no such object or prefix", url)

    def ls(self, path: Any, detail: bool = True, **kwargs: Any) -> list[Any]:
        url = self._url(path)
        with self._storage(url) as st:
            names = set(st.listdir(url)) | {locations.relpath(p, url) or "" for p in lio.pending_saves(url)}
            names = {n for n in names if n and "/" not in n and n != _RECORDS and n != "."}
            if not names and not st.isdir(url):
                if st.exists(url) or lio.pending_save(url):  # a file lists itself, as in fsspec
                    return [self.info(url)] if detail else [self._strip_protocol(url)]
                raise CheckpointNotFoundError(2, "no such object or prefix", url)
            children = [locations.join(url, n) for n in sorted(names)]
            if not detail:
                return [self._strip_protocol(c) for c in children]
            return [{"name": self._strip_protocol(c), "size": 0,
                     "type": "file" if lio.pending_save(c) or st.exists(c) else "directory"} for c in children]

    def cat_file(self, path: Any, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        url = self._url(path)
        with self._storage(url) as st:
            return st.read_bytes(url)[start:end]

    def _open(self, path: Any, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" not in mode or "+" in mode:
            self._refuse("open", path, f"mode {mode!r}")
        return io.BytesIO(self.cat_file(path))

    # ------------------------------------------------------------------ writing: the saver's
    def makedirs(self, path: Any, exist_ok: bool = False) -> None:
        return None  # an object store has no directories

    def mkdir(self, path: Any, create_parents: bool = True, **kwargs: Any) -> None:
        return None

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._refuse("rm", path, "removal")

    def rm_file(self, path: Any) -> None:
        self._refuse("rm_file", path, "removal")

    def _refuse(self, op: str, path: Any, what: str) -> None:
        raise WriteRefusedError(
            f"{type(self).__name__}.{op}({self._url(path)!r}): {what} refused. s3:// is served here by flashckpt's "
            "backend, read-only in the training process (s3fs is not installed: it cannot be installed beside "
            "boto3/botocore 1.44). Checkpoints are saved and removed by FlashCheckpointIO (give it to the Trainer: "
            "Trainer(plugins=[FlashCheckpointIO(...)])); for other files install s3fs in another environment")
