"""The names and tensor records of flashckpt's DCP files, shared by the writer (``dcp``) and the memory
reader (``_dcp_memory``): ``data_file_name`` (``__{rank}_0.distcp``), ``METADATA_NAME`` (``.metadata``) and
``torch_save_frame`` (the bytes ``torch.save`` writes around a tensor's data, computed once per dtype and
shape). Imports torch only; the frame cache is filled under the GIL (one entry per key).
"""

from __future__ import annotations

import re

import torch
from flashckpt.errors import FlashCheckpointError
from flashckpt.format.torchfile import torch_save_parts
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
)

__all__ = ["METADATA_NAME", "DATA_FILE", "data_file_name", "torch_save_frame"]

METADATA_NAME = ".metadata"
DATA_FILE = re.compile(r"^__(\d+)_(\d+)" + re.escape(DEFAULT_SUFFIX) + "$")


def data_file_name(rank: int) -> str:
    """The data file of ``rank`` (its rank in the checkpoint's process group): ``__{rank}_0.distcp``."""
    return f"__{rank}_0{DEFAULT_SUFFIX}"


_FRAMES: dict[tuple[torch.dtype, tuple[int, ...]], tuple[bytes, bytes]] = {}


def torch_save_frame(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """The bytes ``torch.save`` writes before and after the data of a contiguous CPU tensor of this dtype
    and shape: ``head + data (C order) + tail`` is a ``torch.save`` file of that tensor.

    Computed once per (dtype, shape) and cached; no tensor data is allocated or touched.

    Raises:
        FlashCheckpointError: this torch writes ``torch.save`` files in a way the split does not expect.
    """
    key = (dtype, tuple(shape))
    frame = _FRAMES.get(key)
    if frame is not None:
        return frame
    # The tensor is never touched (skip_data only records its size): no pages are used.
    parts = torch_save_parts(torch.empty(shape, dtype=dtype))
    if len(parts) == 1 and isinstance(parts[0], bytes):  # no data (a zero-size tensor)
        frame = (parts[0], b"")
    elif len(parts) == 3 and isinstance(parts[0], bytes) and isinstance(parts[2], bytes):
        frame = (parts[0], parts[2])
    else:
        raise FlashCheckpointError(f"torch_save_frame({dtype}, {tuple(shape)}): torch {torch.__version__} wrote the "
                                   "tensor's data in an unexpected way; flashckpt's DCP writer does not support this "
                                   "torch version")
    _FRAMES[key] = frame
    return frame
