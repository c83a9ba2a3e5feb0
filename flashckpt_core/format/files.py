"""Multi-file checkpoints: a ``FileSet`` names the files one rank's checkpoint consists of.

Frameworks write a checkpoint as several files in their own formats (a HuggingFace ``checkpoint-N/``
holds ``model.safetensors``, ``optimizer.pt``, ``trainer_state.json``, ...; DCP writes ``.distcp``
data files and a ``.metadata`` commit marker; DeepSpeed updates a ``latest`` file). A ``FileSet``
carries them through a memory snapshot; the saver persists each in its format:

- ``torch``: ``torch.save(tree)``;
- ``raw``: the bytes given, or the concatenation of parts (bytes, or tensors contributing their bytes in
  C order); ``add_safetensors`` builds a safetensors file this way.

An entry's ``kind`` says when it is written:

- ``file``: while persisting, under the set's directory;
- ``commit``: staged while persisting, moved into place by the committing saver once every rank's files
  are durable, before the manifest (DCP's ``.metadata``); it belongs to the step;
- ``tracker``: a framework's "latest" pointer, named relative to the checkpoint dir, written only after
  the step is committed, and never deleted by retention.

In shared memory a set is an ordinary state-dict tree under the key ``FILES_KEY``, so snapshots, plans,
tied storages and ``load(into=...)`` work for it unchanged.
"""

from __future__ import annotations

import functools
import json
import os
import posixpath
from dataclasses import dataclass
from typing import Any

import torch
from flashckpt import errors as E
from flashckpt.format.names import META

__all__ = ["FileSet", "FileEntry", "FILES_KEY", "is_fileset_tree", "safetensors_dtype", "tensor_view", "host_bytes",
           "write_entry"]

FILES_KEY = "__flashckpt_files__"
KINDS = ("file", "commit", "tracker")
FORMATS = ("torch", "raw")

_BYTES_TYPES = (bytes, bytearray, memoryview)

# safetensors dtype names (https://github.com/huggingface/safetensors, format spec); built on first use,
# as the saver daemon imports this module without torch.
@functools.cache
def _st_dtypes() -> dict[torch.dtype, str]:
    return {
        torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
        torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
        torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
    }


def safetensors_dtype(dtype: torch.dtype) -> str:
    try:
        return _st_dtypes()[dtype]
    except KeyError:
        raise E.InvalidStateDictError(f"safetensors cannot store dtype {dtype}") from None


@dataclass
class FileEntry:
    """One file of a set: its ``format`` ("torch" or "raw"), ``data`` and ``kind``."""

    format: str
    data: Any
    kind: str = "file"


class FileSet(dict[str, FileEntry]):
    """The files of one rank's checkpoint, by name relative to the set's directory (``tracker`` entries:
    relative to the checkpoint dir). Build it with the ``add_*`` methods."""

    def add_torch(self, name: str, tree: Any, *, kind: str = "file") -> FileSet:
        """A file persisted as ``torch.save(tree)``."""
        self[_check_name(name, kind)] = FileEntry("torch", tree, kind)
        return self

    def add_raw(self, name: str, data: Any, *, kind: str = "file") -> FileSet:
        """A file persisted as exactly ``data``: bytes, a tensor (its bytes in C order), or a list of those
        written one after another."""
        parts = list(data) if isinstance(data, (list, tuple)) else [data]
        for i, p in enumerate(parts):
            if isinstance(p, (bytearray, memoryview)):
                parts[i] = bytes(p)
            elif not isinstance(p, (bytes, torch.Tensor)):
                raise E.InvalidStateDictError(f"FileSet.add_raw({name!r}): part {i} is a {type(p).__name__}; "
                                              "parts must be bytes or tensors")
        self[_check_name(name, kind)] = FileEntry("raw", parts, kind)
        return self

    def add_safetensors(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                        *, kind: str = "file") -> FileSet:
        """A safetensors file of ``tensors`` (as ``safetensors.torch.save_file`` writes; shared storages are
        written once per name, so deduplicate tied weights first, as ``save_pretrained`` does)."""
        header: dict[str, Any] = {}
        if metadata:
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
                raise E.InvalidStateDictError(f"FileSet.add_safetensors({name!r}): metadata must map str to str")
            header["__metadata__"] = dict(metadata)
        # The order safetensors itself uses: larger dtypes first, then by name.
        order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
        parts: list[Any] = [b""]
        off = 0
        for k in order:
            t = tensors[k]
            if not isinstance(t, torch.Tensor):
                raise E.InvalidStateDictError(f"FileSet.add_safetensors({name!r}): {k!r} is not a tensor")
            n = t.numel() * t.element_size()
            header[k] = {"dtype": safetensors_dtype(t.dtype), "shape": list(t.shape), "data_offsets": [off, off + n]}
            off += n
            parts.append(t)
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        parts[0] = len(raw).to_bytes(8, "little") + raw
        self[_check_name(name, kind)] = FileEntry("raw", parts, kind)
        return self

    def raw_bytes(self, name: str) -> bytes:
        """The content of a raw entry as bytes (parts joined)."""
        e = self[name]
        if e.format != "raw":
            raise E.InvalidArgumentTypeError(f"FileSet entry {name!r} is a {e.format} file, not raw bytes")
        parts = e.data if isinstance(e.data, list) else [e.data]
        return b"".join(p if isinstance(p, bytes) else _tensor_bytes(p) for p in parts)

    # -------------------------------------------------------------- encoding
    def encode(self) -> dict[str, Any]:
        """The set as a plain state-dict tree (what a memory snapshot stores)."""
        return {FILES_KEY: {name: {"k": e.kind, "f": e.format, "d": e.data} for name, e in self.items()}}

    @staticmethod
    def decode(tree: Any) -> FileSet:
        fs = FileSet()
        for name, e in tree[FILES_KEY].items():
            fs[name] = FileEntry(e["f"], e["d"], e["k"])
        return fs

    @staticmethod
    def encode_into(into: Any) -> Any:
        """Translates ``load(into={name: tree})`` to the encoded tree's key paths."""
        if into is None:
            return None
        return {FILES_KEY: {name: {"d": tree} for name, tree in into.items()}}


def write_entry(path: str, e: FileEntry) -> None:
    """Writes one ``FileSet`` entry to ``path`` (its directories made) as the saver would persist it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if e.format == "torch":
        torch.save(e.data, path)
        return
    parts = e.data if isinstance(e.data, list) else [e.data]
    with open(path, "wb") as f:
        for p in parts:
            if isinstance(p, torch.Tensor):
                if p.numel():
                    f.write(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            else:
                f.write(p)


def is_fileset_tree(tree: Any) -> bool:
    return type(tree) is dict and len(tree) == 1 and FILES_KEY in tree


def _check_name(name: str, kind: str) -> str:
    if kind not in KINDS:
        raise E.InvalidArgumentError(f"FileSet entry {name!r}: kind must be one of {KINDS}, not {kind!r}")
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        raise E.InvalidArgumentError(f"FileSet entry name {name!r}: must be a non-empty relative path with '/' separators")
    norm = posixpath.normpath(name)
    if os.path.isabs(name) or norm.startswith("..") or norm in (".", "") or norm.split("/")[0] == META:
        raise E.InvalidArgumentError(f"FileSet entry name {name!r}: must be a relative path inside the checkpoint "
                         f"(no '..', not absolute, not under {META}, the name flashckpt reserves for its records)")
    return norm


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(tensor_view(t))


def host_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes in C order as a flat uint8 CPU tensor: its own memory when it is contiguous on
    the CPU, else a copy made so."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def tensor_view(t: torch.Tensor) -> memoryview:
    """A tensor's bytes in C order (copied to the CPU and made contiguous only when it is not already)."""
    flat = host_bytes(t)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.numpy())  # type: ignore[arg-type]
