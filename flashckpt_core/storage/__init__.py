"""Byte I/O for persisted files: the ``CheckpointStorage`` interface (``base``), the resolver by URL scheme
(``registry``), the POSIX backend (``posix``) and the S3 backend (``s3``); lexical rules for paths and URLs in
``locations``. Imports nothing above the format layer.

The names a backend author or user needs are importable from here: ``CheckpointStorage``, ``FileRecord``,
``storage_for``, ``register_storage``, ``PosixDiskStorage``.
"""

from __future__ import annotations

from flashckpt.util.lazy import lazy_attributes

__all__ = ["CheckpointStorage", "FileRecord", "storage_for", "register_storage", "PosixDiskStorage"]

__getattr__, __dir__ = lazy_attributes(__name__, {
    "CheckpointStorage": "flashckpt.storage.base", "FileRecord": "flashckpt.storage.base",
    "storage_for": "flashckpt.storage.registry", "register_storage": "flashckpt.storage.registry",
    "PosixDiskStorage": "flashckpt.storage.posix"})
