"""The names flashckpt reserves in a checkpoint dir: ``META``, the dir of its commit records (inside the
checkpoint dir on object stores, beside it on file systems). No file of a ``FileSet`` may lie under it.
Constants only: imports nothing; torch-free."""

from __future__ import annotations

__all__ = ["META"]

META = ".flashckpt"
