"""The S3 backend (flashckpt.storage.s3.backend) against a real S3-compatible server on loopback (moto), directly
and through a fault-injecting proxy of ours: streamed multipart uploads of a file's parts (tensors viewed
in place, zip CRC-32s filled in on the way), reads, listings, deletes, conditional records, and every
fault the issue names (503 SlowDown with Retry-After, 500, connections reset mid-body, a lost reply to
CompleteMultipartUpload, a 200 carrying an error, a store slower than the deadline): nothing torn is ever
visible, nothing is lost, no upload is left open."""

from __future__ import annotations

import io
import os
import zipfile
from typing import Any

import pytest
import torch
import xxhash
from flashckpt import PersistError
from flashckpt.format.torchfile import torch_save_parts, zip_crc_slots
from flashckpt.storage.registry import storage_for
from flashckpt.storage.s3.backend import S3Storage
from flashckpt.storage.s3.options import S3Options
from s3_fixtures import moto_server_fixture, s3_fixture, s3_proxied_fixture  # noqa: F401
from s3_proxy import Fault

MIB = 1 << 20


def _storage(**kw: Any) -> S3Storage:
    return S3Storage(S3Options.from_env(**{"part_size_mb": 5, "concurrency": 4, **kw}))


@pytest.fixture
def backend() -> Any:
    made: list[S3Storage] = []

    def make(**kw: Any) -> S3Storage:
        s = _storage(**kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _state(mb: float, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    n = int(mb * MIB) // 4
    return {"w": torch.randn(n, generator=g), "b": torch.arange(1000, dtype=torch.int64), "step": seed,
            "half": torch.randn(3000, generator=g).to(torch.bfloat16)}


def _torch_file(storage: S3Storage, url: str, state: dict[str, Any]) -> Any:
    parts = torch_save_parts(state)
    slots = zip_crc_slots(parts)
    return storage.write_parts(url, parts, crc_slots=slots)


def _read(s3: Any, key: str) -> bytes:
    return bytes(s3.read(key))


def test_s3_urls_resolve_to_the_backend_with_options(s3: Any) -> None:
    st = storage_for(s3.url, {"part_size_mb": 8})
    try:
        assert isinstance(st, S3Storage) and st.options.part_size_mb == 8 and not st.supports_rename
    finally:
        st.close()
    with pytest.raises(ValueError, match="unknown for s3://"):
        storage_for(s3.url, {"no_such": 1})
    with pytest.raises(ValueError, match="part_size_mb >= 5"):
        storage_for(s3.url, {"part_size_mb": 1})


def test_a_torch_file_streams_in_parts_and_is_a_valid_zip_with_its_checksum(s3: Any, backend: Any) -> None:
    """A 12 MiB torch.save file in 5 MiB parts: the object is torch.save's file byte for byte but the
    serialization id, its zip CRC-32s are right (filled in while streaming), its xxh3 is the record's."""
    st = backend()
    state = _state(12, seed=1)
    rec = _torch_file(st, f"{s3.url}/a/model.pt", state)
    data = _read(s3, "run/a/model.pt")
    assert rec.size == len(data) and rec.xxh3 == xxhash.xxh3_64_hexdigest(data)
    assert zipfile.ZipFile(io.BytesIO(data)).testzip() is None  # every CRC-32 is right
    got = torch.load(io.BytesIO(data), weights_only=True)
    assert all(torch.equal(got[k], state[k]) for k in ("w", "b", "half")) and got["step"] == 1
    uploads = [r for r in s3.multipart_uploads()]
    assert uploads == []


def test_parts_on_part_boundaries_and_small_files(s3: Any, backend: Any) -> None:
    st = backend()
    exact = [bytes([i]) * (5 * MIB) for i in range(2)]  # exactly two parts: no empty third one
    rec = st.write_parts(f"{s3.url}/exact.bin", exact)
    assert rec.size == 10 * MIB and _read(s3, "run/exact.bin") == b"".join(exact)
    assert st.write_parts(f"{s3.url}/empty.bin", [b""]).size == 0 and _read(s3, "run/empty.bin") == b""
    small = st.write_parts(f"{s3.url}/small.bin", [b"ab", torch.arange(4, dtype=torch.uint8), b"cd"])
    assert _read(s3, "run/small.bin") == b"ab\x00\x01\x02\x03cd" and small.size == 8


def test_reads_listings_and_deletes(s3: Any, backend: Any) -> None:
    st = backend()
    for name in ("d/x.bin", "d/sub/y.bin", "d/sub/z.bin", "e.bin"):
        st.write_bytes(f"{s3.url}/{name}", name.encode() * 1000)
    assert st.listdir(s3.url) == ["d", "e.bin"] and st.listdir(f"{s3.url}/d") == ["sub", "x.bin"]
    assert st.isdir(f"{s3.url}/d") and not st.isdir(f"{s3.url}/e.bin") and not st.isdir(f"{s3.url}/nothing")
    assert st.exists(f"{s3.url}/e.bin") and not st.exists(f"{s3.url}/d")
    assert st.size(f"{s3.url}/e.bin") == 5000
    out = bytearray(100)
    st.read_into(f"{s3.url}/d/x.bin", 7, memoryview(out))
    assert bytes(out) == (b"d/x.bin" * 1000)[7:107]
    assert st.checksum(f"{s3.url}/e.bin") == (5000, xxhash.xxh3_64_hexdigest(b"e.bin" * 1000))
    with pytest.raises(FileNotFoundError):
        st.read_bytes(f"{s3.url}/missing")
    st.remove_tree(f"{s3.url}/d")
    assert s3.keys("run/") == ["run/e.bin"]
    st.remove_many([f"{s3.url}/e.bin", f"{s3.url}/never-was"])
    assert s3.keys("run/") == []


def test_records_are_created_only_once(s3: Any, backend: Any) -> None:
    st = backend()
    st.write_new(f"{s3.url}/m.json", b"1")
    with pytest.raises(FileExistsError):
        st.write_new(f"{s3.url}/m.json", b"2")
    assert _read(s3, "run/m.json") == b"1"


# ------------------------------------------------------------------------------------------ faults
def test_throttling_slows_the_upload_down_and_it_completes(s3_proxied: Any, backend: Any) -> None:
    """503 SlowDown with Retry-After on three parts: each is retried after the wait asked for, the
    upload completes, and the backend halved its parallel parts."""
    st = backend(concurrency=4)
    s3_proxied.proxy.set_faults([Fault("slowdown", op="UploadPart", times=3, retry_after_s=1)])
    state = _state(22, seed=2)
    rec = _torch_file(st, f"{s3_proxied.url}/t.pt", state)
    assert len([r for r in s3_proxied.proxy.records("UploadPart") if r.fault == "slowdown"]) == 3
    data = _read(s3_proxied, "run/t.pt")
    assert xxhash.xxh3_64_hexdigest(data) == rec.xxh3
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True)["w"], state["w"])
    assert s3_proxied.multipart_uploads() == []


def test_throttling_never_fails_a_file_before_its_deadline(s3_proxied: Any, backend: Any) -> None:
    """More SlowDowns than ``max_attempts`` allows failures: throttling counts against the deadline only."""
    st = backend(max_attempts=2)
    s3_proxied.proxy.set_faults([Fault("slowdown", op="PutObject", times=5, retry_after_s=0)])
    st.write_bytes(f"{s3_proxied.url}/x", b"payload")
    assert _read(s3_proxied, "run/x") == b"payload"
    assert len([r for r in s3_proxied.proxy.records("PutObject") if r.fault == "slowdown"]) == 5
    s3_proxied.proxy.set_faults([Fault("error500", op="PutObject", times=5)])
    with pytest.raises(PersistError, match="failed 2 time"):  # other failures count
        st.write_bytes(f"{s3_proxied.url}/y", b"payload")


@pytest.mark.parametrize("fault", [
    Fault("error500", op="UploadPart", times=2),
    Fault("reset_request", op="UploadPart", times=2, after_bytes=100_000),
    Fault("reset_response", op="UploadPart", times=1),
    Fault("lost_reply", op="CompleteMultipartUpload", times=1),
    Fault("error_in_200", op="CompleteMultipartUpload", times=1),
    Fault("error500", op="PutObject", times=2),
], ids=lambda f: f"{f.kind}-{f.op}")
def test_transient_faults_are_retried_and_nothing_torn_is_visible(s3_proxied: Any, backend: Any, fault: Fault) -> None:
    st = backend()
    s3_proxied.proxy.set_faults([fault])
    big = fault.op != "PutObject"
    parts = [os.urandom(12 * MIB if big else 1000)]
    rec = st.write_parts(f"{s3_proxied.url}/f.bin", parts)
    assert _read(s3_proxied, "run/f.bin") == parts[0] and rec.xxh3 == xxhash.xxh3_64_hexdigest(parts[0])
    assert any(r.fault for r in s3_proxied.proxy.records()), "the fault was never applied"
    assert s3_proxied.multipart_uploads() == []


def test_a_store_slower_than_the_deadline_fails_the_file_cleanly(s3_proxied: Any, backend: Any) -> None:
    """Every part throttled: the file gives up at its deadline with a clear error, its upload is
    aborted and nothing is visible under its key."""
    st = backend(deadline_s=3, max_attempts=50)
    s3_proxied.proxy.set_faults([Fault("slowdown", op="UploadPart", times=None, retry_after_s=1)])
    with pytest.raises(PersistError, match="gave up after 3 s"):
        st.write_parts(f"{s3_proxied.url}/slow.bin", [os.urandom(11 * MIB)])
    s3_proxied.proxy.set_faults([])
    assert s3_proxied.keys("run/") == [] and s3_proxied.multipart_uploads() == []


def test_a_fatal_error_is_not_retried(s3: Any, backend: Any) -> None:
    st = backend()
    with pytest.raises(PersistError, match="NoSuchBucket"):
        st.write_bytes("s3://no-such-bucket-here/x", b"1")


def test_tidy_aborts_unfinished_uploads_under_the_dir(s3: Any, backend: Any) -> None:
    st = backend()
    c = s3.client()
    c.create_multipart_upload(Bucket=s3.bucket, Key="run/step_3/rank_0.pt")
    c.create_multipart_upload(Bucket=s3.bucket, Key="other/x")
    lines = st.tidy(s3.url, dry_run=True)
    assert len(lines) == 1 and "step_3/rank_0.pt" in lines[0] and len(s3.multipart_uploads()) == 2
    st.tidy(s3.url)
    assert [k for k, _ in s3.multipart_uploads()] == ["other/x"]


# ------------------------------------------------------------------------------------------ remote loads
def _tricky_state() -> dict[str, Any]:
    """Dtypes, views, tied tensors, a Parameter, requires_grad, an empty tensor, an OrderedDict with metadata."""
    import collections

    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, 64, generator=g)
    model: Any = collections.OrderedDict(
        [("w", base), ("tied", base), ("row", base[3]), ("t", base.t()), ("p", torch.nn.Parameter(torch.ones(5)))])
    model._metadata = {"": {"version": 1}}
    return {"model": model,
            "dtypes": [torch.randn(33, generator=g).to(d) for d in (torch.bfloat16, torch.float16, torch.float64)]
            + [torch.tensor([True, False]), torch.randn(3, dtype=torch.complex64, generator=g),
               torch.randn(4, generator=g).to(torch.float8_e4m3fn), torch.empty(0, 3)],
            "grad": torch.ones(2, requires_grad=True), "step": 9, "tag": ("a", 2)}


def test_load_remote_equals_torch_load_for_every_kind_of_tensor(s3: Any, backend: Any) -> None:
    from flashckpt.engine.remote_load import load_remote
    from helpers import assert_same_tree

    st = backend()
    state = _tricky_state()
    buf = io.BytesIO()
    torch.save(state, buf)  # a vanilla file, as torch writes it
    data = buf.getvalue()
    st.write_bytes(f"{s3.url}/v.pt", data)
    got = load_remote(st, f"{s3.url}/v.pt", size=len(data), xxh3=xxhash.xxh3_64_hexdigest(data), weights_only=True)
    want = torch.load(io.BytesIO(data), weights_only=True)
    assert_same_tree(got, want)
    m = got["model"]
    assert m["tied"].untyped_storage().data_ptr() == m["w"].untyped_storage().data_ptr()  # still tied
    assert m["row"].untyped_storage().data_ptr() == m["w"].untyped_storage().data_ptr()
    assert isinstance(m["p"], torch.nn.Parameter) and got["grad"].requires_grad and m._metadata == {"": {"version": 1}}
    with pytest.raises(Exception, match="checksum"):
        load_remote(st, f"{s3.url}/v.pt", size=len(data), xxh3="0" * 16, weights_only=True)


def test_load_remote_fills_the_callers_tensors_in_place(s3: Any, backend: Any) -> None:
    from flashckpt.engine.remote_load import load_remote

    st = backend()
    state = {"model": {"a": torch.randn(1000), "b": torch.arange(12).reshape(3, 4)}, "opt": torch.ones(3)}
    rec = _torch_file(st, f"{s3.url}/m.pt", state)
    into = {"model": {"a": torch.zeros(1000), "b": torch.zeros(3, 4, dtype=torch.int64)}, "opt": torch.zeros(2)}
    ptrs = {k: t.data_ptr() for k, t in into["model"].items()}
    got = load_remote(st, f"{s3.url}/m.pt", size=rec.size, xxh3=rec.xxh3, weights_only=True, into=into)
    for k in ("a", "b"):
        assert got["model"][k] is into["model"][k] and into["model"][k].data_ptr() == ptrs[k]
        assert torch.equal(into["model"][k], state["model"][k])
    assert got["opt"] is not into["opt"] and torch.equal(got["opt"], state["opt"])  # shape differs: a new tensor
