"""The direct-I/O file writer and the torch.save split it persists: the bytes on disk are torch.save's
(but for the archive's random serialization id), the zip CRC-32s verify, the checksum is the file's."""

from __future__ import annotations

import io
import os
import zipfile

import pytest
import torch
import xxhash
from flashckpt.format.filewriter import BUFFER_BYTES, write_parts
from flashckpt.format.torchfile import torch_save_parts, zip_crc_slots


def _zip_records(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert z.testzip() is None  # every record's CRC-32 matches its data
        return {n: z.read(n) for n in z.namelist() if not n.endswith("serialization_id")}


def _torch_save_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _persist(path: str, obj: object) -> tuple[int, str]:
    parts = torch_save_parts(obj)
    return write_parts(path, parts, crc_slots=zip_crc_slots(parts))


@pytest.mark.parametrize("where", ["disk", "shm"])
def test_torch_file_is_torch_save(tmp_path: str, where: str) -> None:
    """Several buffers' worth, an unaligned tail, empty and scalar tensors, shared storages; on a disk
    file system (direct I/O) and on tmpfs (no O_DIRECT: buffered)."""
    big = torch.randn(BUFFER_BYTES // 4 * 2 + 12345)
    obj = {"big": big, "view": big[7:99], "empty": torch.zeros(0), "scalar": torch.tensor(3, dtype=torch.int16),
           "bf16": torch.randn(1001).to(torch.bfloat16), "nested": [torch.arange(5), {"s": "text"}]}
    root = str(tmp_path) if where == "disk" else "/dev/shm"
    path = os.path.join(root, f"flashckpt-test-writer-{os.getpid()}.pt")
    try:
        size, digest = _persist(path, obj)
        with open(path, "rb") as f:
            data = f.read()
    finally:
        if os.path.exists(path):
            os.unlink(path)
    assert size == len(data) and digest == xxhash.xxh3_64_hexdigest(data)
    ref = _torch_save_bytes(obj)
    assert len(data) == len(ref)
    assert _zip_records(data) == _zip_records(ref)
    got = torch.load(io.BytesIO(data))
    assert torch.equal(got["big"], big) and torch.equal(got["view"], big[7:99])
    assert got["view"].untyped_storage().data_ptr() == got["big"].untyped_storage().data_ptr()
    assert got["scalar"].dtype == torch.int16 and got["nested"][1] == {"s": "text"}


def test_zlib_crc_fallback(tmp_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ISA-L (a platform with no ``isal`` wheel) the standard library's CRC-32 gives the same file."""
    import zlib

    import flashckpt.format.filewriter as fw

    obj = {"a": torch.randn(3 << 18), "b": torch.arange(1000)}  # 3 MiB: several copy pieces
    monkeypatch.setattr(fw, "_crc32", zlib.crc32)
    path = os.path.join(str(tmp_path), "zlib.pt")
    _persist(path, obj)
    with open(path, "rb") as f:
        assert _zip_records(f.read()) == _zip_records(_torch_save_bytes(obj))


def test_split_without_recording_pickler(tmp_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the pickler cannot record storages in torch.save's own pass, a second walk orders them."""
    import flashckpt.format.torchfile as tf

    monkeypatch.setattr(tf, "_save_recording_storages", lambda obj, sink, raw_pickles: None)
    a = torch.randn(100)
    obj = {"x": a, "y": [a[3:], torch.ones(7, dtype=torch.float64)], "z": torch.arange(3)}
    path = os.path.join(str(tmp_path), "two-pass.pt")
    _persist(path, obj)
    with open(path, "rb") as f:
        assert _zip_records(f.read()) == _zip_records(_torch_save_bytes(obj))


def test_zip64_archive(tmp_path: str) -> None:
    """More records than a plain zip's directory counts (65,535): torch.save writes zip64 records; the
    CRC-32s are found through them."""
    obj = [torch.full((2,), float(i)) for i in range(66_000)]
    path = os.path.join(str(tmp_path), "many.pt")
    _persist(path, obj)
    with open(path, "rb") as f:
        data = f.read()
    assert b"PK\x06\x06" in data[-200:]  # a zip64 end of central directory record
    assert _zip_records(data) == _zip_records(_torch_save_bytes(obj))


def test_raw_parts_and_non_contiguous_tensors(tmp_path: str) -> None:
    t = torch.arange(24, dtype=torch.int32).reshape(4, 6)
    parts: list[object] = [b"head", t.t(), bytearray(b"mid"), memoryview(b"tail"), torch.zeros(0)]
    path = os.path.join(str(tmp_path), "raw.bin")
    size, digest = write_parts(path, parts)
    with open(path, "rb") as f:
        data = f.read()
    assert data == b"head" + t.t().contiguous().numpy().tobytes() + b"midtail"
    assert (size, digest) == (len(data), xxhash.xxh3_64_hexdigest(data))
    assert write_parts(path, []) == (0, xxhash.xxh3_64_hexdigest(b""))
    assert os.path.getsize(path) == 0


def test_bounce_buffers_are_reused(tmp_path: str) -> None:
    """Consecutive writes take the same bounce buffers (no fresh pages to fault in and zero per persist);
    each file is still exactly the bytes it should be, with no leftovers of the previous one."""
    import flashckpt.format.filewriter as fw

    first = os.path.join(str(tmp_path), "a.pt")
    second = os.path.join(str(tmp_path), "b.pt")
    _persist(first, {"x": torch.full((3 << 20,), 7.0)})  # 12 MiB: one buffer filled most of the way
    kept = {id(b) for b, _ in fw._POOL._free}
    assert len(kept) >= 3
    small = {"y": torch.arange(100)}
    _persist(second, small)  # shorter: any stale byte of the first write would show
    assert {id(b) for b, _ in fw._POOL._free} == kept
    with open(second, "rb") as f:
        assert _zip_records(f.read()) == _zip_records(_torch_save_bytes(small))
