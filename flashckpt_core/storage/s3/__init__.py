"""The ``s3://`` backend (``S3Storage``, ``backend``) over its client I/O (``io``), configured by
``S3Options`` (``options``)."""

from __future__ import annotations

from flashckpt.util.lazy import lazy_attributes

__all__ = ["S3Storage", "S3Options"]

__getattr__, __dir__ = lazy_attributes(__name__, {"S3Storage": "flashckpt.storage.s3.backend",
                                                  "S3Options": "flashckpt.storage.s3.options"})
