"""``torch.save`` files as ``FileSet`` parts: the bytes ``torch.save`` writes, with every storage's data
left in place as a tensor part, so a file is staged in shared memory with one copy of its tensors and
persisted byte for byte as ``torch.save(obj, buffer)`` writes it.

``torch.save`` runs under ``torch.serialization.skip_data`` into a sink that records the bytes written
and the gaps seeked over (one per non-empty storage, in the order of the archive's ``data/<key>``
records). A second pickling pass with the same protocol lists the storages in the order ``torch.save``
numbers them (first appearance while pickling); each gap is filled by a uint8 view of its storage.
Differences from a plain ``torch.save`` of the same object into a buffer: none in layout; the zip
CRC-32 of the data records is 0 and ``.data/serialization_id`` differs (``torch.load`` checks neither).
``zip_crc_slots`` says where those CRC-32s go, so a writer can fill them in as it streams the data
(``filewriter.write_parts``); the file is then a zip archive any zip tool verifies.
A ``torch.save`` to a path names the archive's records after the file (``model_optim_rng/...``), one
to a buffer ``archive/...``; ``torch.load`` reads both.

``PartsReader`` reads such parts back with ``torch.load`` without joining them first.

A tree holding ``RawPickle`` leaves (Python objects as a trainer pickled them: ``_rawpickle``) is written
with ``raw_pickles=True``: pickled by the pure-Python ``SplicingPickler``, which writes those pickles into the
stream unread; every other tree by the C pickler.
"""

from __future__ import annotations

import pickle
import threading
import types
from typing import Any

import torch
from flashckpt import errors as E
from flashckpt.errors import FlashCheckpointError
from flashckpt.format.rawio import ViewsReader, part_view
from flashckpt.format.rawpickle import RawPickle, SplicingPickler

__all__ = ["torch_save_parts", "parts_size", "PartsReader", "load_parts", "zip_crc_slots", "SPLICING_MODULE"]


class _Sink:
    """Write-only stream recording, in order, the bytes written and the gaps ``torch.save`` seeks over
    under ``skip_data`` (a gap is recorded as its length, an int)."""

    def __init__(self) -> None:
        self.pos = 0
        self.events: list[bytes | int] = []

    def write(self, b: Any) -> int:
        data = bytes(b)
        if data:
            self.events.append(data)
        self.pos += len(data)
        return len(data)

    def seek(self, off: int, whence: int = 0) -> int:
        new = off if whence == 0 else self.pos + off if whence == 1 else -1
        if new < self.pos:
            raise E.PersistError("torch_save_parts: torch.save seeked backwards; unsupported")
        if new > self.pos:
            self.events.append(new - self.pos)
        self.pos = new
        return new

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


class _Null:
    def write(self, b: Any) -> int:
        return len(b)


def _storages_in_save_order(obj: Any) -> list[torch.UntypedStorage]:
    """The storages ``torch.save(obj)`` writes, in its key order (first appearance while pickling,
    deduplicated by the underlying storage, as ``torch.serialization._save`` numbers them)."""
    seen: dict[int, torch.UntypedStorage] = {}

    class _Walker(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            st: Any
            if type(o) is RawPickle:
                return ("raw",)  # holds no storage (and is not picklable as an object)
            if isinstance(o, torch.storage.TypedStorage):
                st = o._untyped_storage
            elif torch.is_storage(o):
                st = o
            else:
                return None
            key = st._cdata
            if key not in seen:
                seen[key] = st
            return ("storage", key)

    _Walker(_Null(), protocol=torch.serialization.DEFAULT_PROTOCOL).dump(obj)
    return list(seen.values())


def _u8(st: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


def _record_storages(pickler: Any) -> Any:
    """The wrapper of ``pickler``'s ``persistent_id`` (torch's, bound: torch's pickler subclasses ours and
    overrides the method) that records each storage it saves, in torch's key order (first appearance,
    deduplicated by storage), in ``_recording.storages``."""
    inner = pickler.persistent_id
    rec: dict[int, torch.UntypedStorage] = {}
    _recording.storages = rec

    def persistent_id(o: Any) -> Any:
        r = inner(o)
        if r is not None:
            st = o._untyped_storage if isinstance(o, torch.storage.TypedStorage) else o
            rec.setdefault(st._cdata, st)
        return r

    return persistent_id


class _RecordingPickler(pickle.Pickler):
    """The base of ``torch.save``'s pickler (through ``pickle_module``): records each storage its
    ``persistent_id`` saves (``_record_storages``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        pickle.Pickler.persistent_id.__set__(self, _record_storages(self))  # type: ignore[attr-defined]


class _SplicingRecordingPickler(SplicingPickler):
    """``_RecordingPickler`` for trees with ``RawPickle`` leaves: the pure-Python pickler, which looks
    ``persistent_id`` up on the instance."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.persistent_id = _record_storages(self)


_recording = threading.local()
_RECORDING_MODULE = types.SimpleNamespace(__name__="pickle", Pickler=_RecordingPickler,
                                          Unpickler=pickle.Unpickler)
_SPLICING_RECORDING_MODULE = types.SimpleNamespace(__name__="pickle", Pickler=_SplicingRecordingPickler,
                                                   Unpickler=pickle.Unpickler)
SPLICING_MODULE = types.SimpleNamespace(__name__="pickle", Pickler=SplicingPickler, Unpickler=pickle.Unpickler)
"""``torch.save(obj, f, pickle_module=SPLICING_MODULE)`` writes a tree with ``RawPickle`` leaves."""


def _save_recording_storages(obj: Any, sink: Any, *, raw_pickles: bool) -> list[torch.UntypedStorage] | None:
    """``torch.save(obj, sink)`` that also returns the storages it saved, in key order, from the same
    pickling pass; None where this Python's pickler does not allow it (the caller walks ``obj`` then)."""
    _recording.storages = None
    try:
        torch.save(obj, sink, pickle_module=_SPLICING_RECORDING_MODULE if raw_pickles else _RECORDING_MODULE)
    except (AttributeError, TypeError) as e:
        if "persistent_id" not in str(e):
            raise
        return None
    rec = _recording.storages
    _recording.storages = None
    return None if rec is None else list(rec.values())


def torch_save_parts(obj: Any, *, raw_pickles: bool = False) -> list[Any]:
    """``torch.save(obj, buffer)`` as parts: bytes, and uint8 views of the storages (any device, no copy)
    where their data goes. ``b"".join`` of the parts' bytes is a ``torch.save`` file of ``obj``.

    The views alias ``obj``'s tensors: snapshot them (``CheckpointEngine.save``) before those change.
    ``raw_pickles``: ``obj`` holds ``RawPickle`` leaves (see the module docstring).

    Raises:
        FlashCheckpointError: this torch writes ``torch.save`` files in a way the split does not expect.
    """
    sink = _Sink()
    with torch.serialization.skip_data():
        storages = _save_recording_storages(obj, sink, raw_pickles=raw_pickles)
        if storages is None:
            sink = _Sink()
            storages = _storages_in_save_order(obj)
            torch.save(obj, sink, pickle_module=SPLICING_MODULE if raw_pickles else pickle)  # type: ignore[arg-type]
    filled = iter([st for st in storages if st.nbytes() > 0])
    parts: list[Any] = []
    pending = bytearray()
    for ev in sink.events:
        if isinstance(ev, bytes):
            pending += ev
            continue
        st = next(filled, None)
        if st is None or st.nbytes() != ev:
            raise FlashCheckpointError(
                f"torch_save_parts: torch {torch.__version__} left a gap of {ev} bytes where flashckpt expected "
                f"{'no storage' if st is None else f'a storage of {st.nbytes()} bytes'}; its torch.save layout "
                "is not the one flashckpt expects")
        if pending:
            parts.append(bytes(pending))
            pending = bytearray()
        parts.append(_u8(st))
    if next(filled, None) is not None:
        raise FlashCheckpointError(f"torch_save_parts: torch {torch.__version__} wrote fewer storages than the "
                                   "object holds; its torch.save layout is not the one flashckpt expects")
    if pending:
        parts.append(bytes(pending))
    return parts


def _u16(b: Any, at: int) -> int:
    return int.from_bytes(b[at:at + 2], "little")


def _u32(b: Any, at: int) -> int:
    return int.from_bytes(b[at:at + 4], "little")


def _zip_layout_error(why: str) -> FlashCheckpointError:
    return FlashCheckpointError(f"zip_crc_slots: {why}; torch {torch.__version__} writes archives in a "
                                "layout flashckpt does not expect")


def _descriptor_slots(parts: list[Any]) -> tuple[dict[bytes, int], dict[int, list[tuple[int, int]]]]:
    """The record name of each storage part ({name: part index}) and its data descriptor's CRC slot
    ({part index: [(bytes part index, offset)]}); turns each descriptor's part into a ``bytearray``."""
    names: dict[bytes, int] = {}
    slots: dict[int, list[tuple[int, int]]] = {}
    for i, p in enumerate(parts):
        if not isinstance(p, torch.Tensor):
            continue
        if i == 0 or i + 1 >= len(parts) or isinstance(parts[i - 1], torch.Tensor) \
                or isinstance(parts[i + 1], torch.Tensor):
            raise _zip_layout_error(f"storage part {i} is not between two headers")
        head, tail = parts[i - 1], parts[i + 1]
        lh = bytes(head).rfind(b"PK\x03\x04")
        if lh < 0:
            raise _zip_layout_error("no local file header before a storage")
        n_name, n_extra = _u16(head, lh + 26), _u16(head, lh + 28)
        if lh + 30 + n_name + n_extra != len(head) or bytes(tail[:4]) != b"PK\x07\x08":
            raise _zip_layout_error("a storage's local header or data descriptor is not where expected")
        names[bytes(head[lh + 30:lh + 30 + n_name])] = i
        parts[i + 1] = bytearray(tail)
        slots[i] = [(i + 1, 4)]
    return names, slots


def _central_directory(end: bytearray, start_of_last: int) -> tuple[int, int]:
    """(entry count, offset in the archive) of the central directory, from the end of central directory
    record in ``end`` (the archive's last part, starting at ``start_of_last``), zip64 included."""
    eocd = bytes(end).rfind(b"PK\x05\x06")
    if eocd < 0:
        raise _zip_layout_error("no end of central directory record")
    count, cd = _u16(end, eocd + 10), _u32(end, eocd + 16)
    if cd == 0xFFFFFFFF or count == 0xFFFF:  # zip64: the locator before the record points at the zip64 record
        loc = eocd - 20
        if bytes(end[loc:loc + 4]) != b"PK\x06\x07":
            raise _zip_layout_error("no zip64 locator")
        z = int.from_bytes(end[loc + 8:loc + 16], "little") - start_of_last
        if bytes(end[z:z + 4]) != b"PK\x06\x06":
            raise _zip_layout_error("no zip64 end of central directory record")
        count = int.from_bytes(end[z + 32:z + 40], "little")
        cd = int.from_bytes(end[z + 48:z + 56], "little")
    return count, cd


def zip_crc_slots(parts: list[Any]) -> dict[int, list[tuple[int, int]]]:
    """Where the CRC-32 of each storage of ``torch_save_parts`` output belongs: {tensor part index:
    [(bytes part index, offset), ...]}, its data descriptor (the record's ``PK\\x07\\x08`` right after the
    data) and its central directory entry. Turns the bytes parts that hold slots into ``bytearray``
    (in place) so they can be filled in.

    Raises:
        FlashCheckpointError: the parts are not laid out as ``torch.save`` writes a zip archive.
    """
    names, slots = _descriptor_slots(parts)
    if not slots:
        return slots
    last = len(parts) - 1
    if isinstance(parts[last], torch.Tensor):
        raise _zip_layout_error("the archive does not end with its directory")
    end = parts[last] = bytearray(parts[last])
    start_of_last = parts_size(parts[:last])
    count, cd = _central_directory(end, start_of_last)
    at = cd - start_of_last
    for _ in range(count):
        if at < 0 or bytes(end[at:at + 4]) != b"PK\x01\x02":
            raise _zip_layout_error("a central directory entry is not where expected")
        n_name, n_extra, n_comment = _u16(end, at + 28), _u16(end, at + 30), _u16(end, at + 32)
        i = names.pop(bytes(end[at + 46:at + 46 + n_name]), -1)
        if i >= 0:
            slots[i].append((last, at + 16))
        at += 46 + n_name + n_extra + n_comment
    if names:
        raise _zip_layout_error("storages missing from the central directory")
    return slots


def parts_size(parts: list[Any]) -> int:
    """Bytes the parts make up when written one after another."""
    return sum(len(p) if isinstance(p, (bytes, bytearray, memoryview)) else p.numel() * p.element_size()
               for p in parts)


class PartsReader(ViewsReader):
    """A seekable read-only stream over parts (bytes and CPU tensors, their bytes in C order), for
    ``torch.load`` without joining the parts into one buffer first."""

    def __init__(self, parts: list[Any]) -> None:
        super().__init__([part_view(p) for p in parts])


def load_parts(parts: list[Any], *, weights_only: bool = True) -> Any:
    """``torch.load`` of a file held as parts, onto the CPU."""
    stream: Any = PartsReader(parts)
    return torch.load(stream, map_location="cpu", weights_only=weights_only)
