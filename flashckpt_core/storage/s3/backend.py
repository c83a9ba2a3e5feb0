"""The S3 backend: checkpoint dirs at ``s3://bucket/prefix`` on AWS S3 or any S3-compatible store.

Writes stream from shared memory: ``write_parts`` cuts a file's parts (the snapshot's tensors, in place,
and the bytes around them) into multipart-upload parts without copying them (each upload part's body
reads views of the snapshot; the socket gets the bytes straight from shared memory), uploads several
parts at once, computes the file's xxh3 and the zip CRC-32s on the way and sends each part's CRC-32 as its
S3 checksum. Small files go in one PutObject. A file is visible once its upload completes; a failed or
interrupted one is aborted (``tidy`` aborts what a killed saver left).

Faults (see ``Retry``): 503 SlowDown, 500s, throttling, timeouts and broken connections are retried
with exponential backoff and full jitter, honouring ``Retry-After``, within a deadline per file; a
throttled upload halves its parallel parts (and grows them back by one per success). A request that makes
no progress is abandoned within its bound and retried: metadata requests within ``meta_timeout_s``, data
requests within a bound scaled to the part size (``io.make_client``: a client per kind); the first request
of an outage logs one warning (``io.Reachability``). A lost reply to CompleteMultipartUpload is checked
before anything is redone: the object's ETag is compared with the one its parts make. botocore's own
retries are off (one policy, ours).

Configuration: the standard AWS configuration (environment, profile, ``AWS_ENDPOINT_URL``), plus
``S3Options`` fields (``options``) given as ``storage_options`` (``CheckpointEngine(storage_options=...)``) or as
``FLASHCKPT_S3_*`` environment variables (``config.S3Knobs``; ``S3Options.from_env``). boto3 is imported on first use.

One concept, so one module (~520 lines): the ``CheckpointStorage`` methods of one backend over S3; its
options are in ``options`` and its client I/O (retries, throttling, bodies) in ``io``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, BinaryIO

import xxhash
from flashckpt import errors as E
from flashckpt.storage import locations
from flashckpt.storage.base import CheckpointStorage, FileRecord
from flashckpt.storage.s3 import io as s3io
from flashckpt.storage.s3.io import Body, Reachability, Retry, b64_crc, chunks, crc32, error_code, make_client, status
from flashckpt.storage.s3.options import S3Options

__all__ = ["S3Storage"]

log = logging.getLogger(__name__)

_MIB = 1 << 20
_PIECE = _MIB  # hashing granularity (cache-sized)
_SMALL = _MIB  # a PutObject up to this size is a metadata request (a commit record, a marker)


# ------------------------------------------------------------------------------------------ the backend
class S3Storage(CheckpointStorage):
    """Checkpoint dirs at ``s3://bucket/prefix`` (see the module docstring)."""

    supports_rename = False
    access_hint = ("check the AWS configuration (credentials, region, AWS_ENDPOINT_URL or storage_options endpoint_url) "
                   "and that the bucket exists")

    def __init__(self, options: S3Options | None = None) -> None:
        self.options = options or S3Options.from_env()
        self._clients: dict[str, Any] = {}
        self._client_lock = threading.Lock()
        self.reach = Reachability(self.options.endpoint_url)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> S3Storage:
        return cls(S3Options.from_env(**options))

    # -- the client ----------------------------------------------------------------------------------
    @property
    def client(self) -> Any:
        """The boto3 S3 client of metadata requests (bounded by ``meta_timeout_s``; thread-safe; made on
        first use, with botocore's retries off: ours decide)."""
        return self._client_for("meta")

    @property
    def data_client(self) -> Any:
        """The client of data requests (parts, ranged GETs; bounded by ``S3Options.timeout_s("data")``)."""
        return self._client_for("data")

    def _client_for(self, kind: str) -> Any:
        client = self._clients.get(kind)
        if client is None:
            with self._client_lock:
                client = self._clients.get(kind)
                if client is None:
                    client = self._clients[kind] = make_client(self.options, kind)
                    self.reach.endpoint = str(client.meta.endpoint_url)
        return client

    @staticmethod
    def _split(path: str) -> tuple[str, str]:
        head, key = locations.split_url(path)
        if not head.startswith("s3://") or head == "s3://":
            raise E.InvalidArgumentError(f"{path!r} is not an s3://bucket/key URL")
        return head[len("s3://"):], key.lstrip("/")

    def first_contact(self) -> contextlib.AbstractContextManager[None]:
        """Requests inside give up after ``S3Options.first_contact_s`` (three metadata bounds)."""
        return s3io.within(self.options.first_contact_s, "a first contact with the store: 3 x storage option meta_timeout_s")

    def _retry(self, what: str) -> Retry:
        return Retry(self.options, what, self.reach)

    # -- writing -------------------------------------------------------------------------------------
    def write_bytes(self, path: str, data: bytes) -> FileRecord:
        return self._put(path, data, exclusive=False)

    def write_new(self, path: str, data: bytes) -> FileRecord:
        """PutObject with ``If-None-Match: *`` (``conditional_writes``): FileExistsError when it exists."""
        if not self.options.conditional_writes:
            return super().write_new(path, data)
        return self._put(path, data, exclusive=True)

    def _put(self, path: str, data: bytes, *, exclusive: bool) -> FileRecord:
        bucket, key = self._split(path)
        kw: dict[str, Any] = {"Bucket": bucket, "Key": key, "Body": data}
        if self.options.checksums:
            kw["ChecksumCRC32"] = b64_crc(crc32(data))
        if exclusive:
            kw["IfNoneMatch"] = "*"
        client = self.client if len(data) <= _SMALL else self.data_client
        tries = [0]

        def put() -> Any:
            tries[0] += 1
            try:
                return client.put_object(**kw)
            except Exception as e:
                if exclusive and (status(e) == 412 or error_code(e) == "PreconditionFailed"):
                    # A retry after a lost reply finds our own first write: read back what is there.
                    if tries[0] > 1 and self._holds(path, data):
                        return {}
                    raise E.AlreadyExistsError(17, "created by another writer", path) from None
                raise

        self._retry(path).call("PutObject", put)
        return FileRecord(path, len(data), xxhash.xxh3_64_hexdigest(data))

    def _holds(self, path: str, data: bytes) -> bool:
        try:
            return self.read_bytes(path) == data
        except (OSError, E.FlashCheckpointError):
            return False

    def close(self) -> None:
        """Closes the client's connections (the next request opens new ones)."""
        with self._client_lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    def write_file(self, path: str, fill: Callable[[str], tuple[int, str] | None]) -> FileRecord:
        """A local temp file ``fill`` writes, uploaded (for writers that can only write a file)."""
        import tempfile

        fd, tmp = tempfile.mkstemp(prefix="flashckpt-s3-")
        os.close(fd)
        try:
            fill(tmp)
            with open(tmp, "rb") as f:
                import mmap

                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    return self.write_parts(path, [b""])
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    try:
                        return self.write_parts(path, [memoryview(mm)])
                    finally:
                        import gc

                        gc.collect()  # drop views of the map before it closes
        finally:
            os.unlink(tmp)

    def write_parts(self, path: str, parts: Sequence[Any], *,
                    crc_slots: dict[int, list[tuple[int, int]]] | None = None) -> FileRecord:
        bucket, key = self._split(path)
        o = self.options
        part_size = o.part_size_mb * _MIB
        h = xxhash.xxh3_64()
        retry = self._retry(path)
        cut = chunks(parts, part_size, crc_slots, h)
        first, first_crc = next(cut)
        second = next(cut, None)
        if second is None:  # one part: PutObject
            body = Body(first)
            kw: dict[str, Any] = {"Bucket": bucket, "Key": key, "Body": body, "ContentLength": len(body)}
            if o.checksums:
                kw["ChecksumCRC32"] = b64_crc(first_crc)
            client = self.client if len(body) <= _SMALL else self.data_client

            def put() -> Any:
                body.seek(0)
                return client.put_object(**kw)

            retry.call("PutObject", put)
            return FileRecord(path, len(body), h.hexdigest())
        upload = self._create_upload(bucket, key, retry)
        try:
            size = self._upload_parts(bucket, key, upload, [(first, first_crc), second], cut, retry)
        except BaseException:
            self._abort(bucket, key, upload)
            raise
        return FileRecord(path, size, h.hexdigest())

    def _create_upload(self, bucket: str, key: str, retry: Retry) -> str:
        kw: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if self.options.checksums:
            kw["ChecksumAlgorithm"] = "CRC32"
        return str(retry.call("CreateMultipartUpload", lambda: self.client.create_multipart_upload(**kw))["UploadId"])

    def _upload_parts(self, bucket: str, key: str, upload: str, head: list[Any],
                      rest: Iterator[tuple[list[memoryview], int]], retry: Retry) -> int:
        """Uploads every part (at most ``retry.allowed`` at once), then completes the upload; returns the
        size. The parts' bodies are views of the snapshot: nothing is copied before the socket."""
        done: dict[int, dict[str, Any]] = {}
        size = 0
        pending: set[Future[Any]] = set()
        number = 0

        def one(n: int, views: list[memoryview], crc: int) -> None:
            body = Body(views)
            kw: dict[str, Any] = {"Bucket": bucket, "Key": key, "UploadId": upload, "PartNumber": n, "Body": body,
                                  "ContentLength": len(body)}
            if self.options.checksums:
                kw["ChecksumCRC32"] = b64_crc(crc)

            def send() -> Any:
                body.seek(0)
                return self.data_client.upload_part(**kw)

            r = retry.call(f"UploadPart {n}", send)
            entry = {"PartNumber": n, "ETag": r["ETag"]}
            if self.options.checksums:
                entry["ChecksumCRC32"] = kw["ChecksumCRC32"]
            done[n] = entry

        def all_parts() -> Iterator[tuple[list[memoryview], int]]:
            yield from head
            yield from rest

        with ThreadPoolExecutor(self.options.concurrency, thread_name_prefix="flashckpt-s3-put") as pool:
            for views, crc in all_parts():
                while len(pending) >= retry.allowed:
                    finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for f in finished:
                        f.result()  # the first failure stops the file
                number += 1
                size += sum(len(v) for v in views)
                pending.add(pool.submit(one, number, views, crc))
            for f in pending:
                f.result()
        parts = [done[n] for n in sorted(done)]
        self._complete(bucket, key, upload, parts, retry)
        if retry.throttled:
            log.warning("s3://%s/%s: the store throttled %d request(s); parallel parts went down to %d",
                        bucket, key, retry.throttled, retry.allowed)
        return size

    def _complete(self, bucket: str, key: str, upload: str, parts: list[dict[str, Any]], retry: Retry) -> None:
        """CompleteMultipartUpload; a reply lost after the store completed it (the retry finds the upload
        gone) is accepted once the object's ETag is the one these parts make."""
        expected = self._multipart_etag(parts)
        attempts = {"n": 0}

        def complete() -> Any:
            attempts["n"] += 1
            try:
                return self.data_client.complete_multipart_upload(
                    Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts})
            except Exception as e:
                if attempts["n"] > 1 and error_code(e) == "NoSuchUpload" and self._etag(bucket, key) == expected:
                    log.info("s3://%s/%s: CompleteMultipartUpload's reply was lost; the object is complete", bucket, key)
                    return {}
                raise

        retry.call("CompleteMultipartUpload", complete)

    @staticmethod
    def _multipart_etag(parts: list[dict[str, Any]]) -> str:
        md5 = hashlib.md5(usedforsecurity=False)
        for p in parts:
            md5.update(bytes.fromhex(str(p["ETag"]).strip('"')))
        return f'"{md5.hexdigest()}-{len(parts)}"'

    def _etag(self, bucket: str, key: str) -> str | None:
        try:
            return str(self.client.head_object(Bucket=bucket, Key=key).get("ETag"))
        except Exception:
            return None

    def _abort(self, bucket: str, key: str, upload: str) -> None:
        try:
            self._retry(f"s3://{bucket}/{key}").call(
                "AbortMultipartUpload", lambda: self.client.abort_multipart_upload(Bucket=bucket, Key=key,
                                                                                    UploadId=upload))
        except Exception as e:  # `flashckpt gc` (tidy) aborts it later
            log.error("s3://%s/%s: could not abort the failed upload %s: %s", bucket, key, upload, e)

    def move(self, src: str, dst: str) -> None:
        """CopyObject (server side), then delete ``src``; ``dst`` appears whole."""
        sb, sk = self._split(src)
        db, dk = self._split(dst)
        self._retry(dst).call("CopyObject", lambda: self.data_client.copy_object(
            Bucket=db, Key=dk, CopySource={"Bucket": sb, "Key": sk}))
        self.remove(src)

    # -- reading -------------------------------------------------------------------------------------
    def read_bytes(self, path: str) -> bytes:
        bucket, key = self._split(path)

        def get() -> bytes:
            try:
                return bytes(self.client.get_object(Bucket=bucket, Key=key)["Body"].read())
            except Exception as e:
                if error_code(e) in ("NoSuchKey", "404") or status(e) == 404:
                    raise E.CheckpointNotFoundError(2, "no such object", path) from None
                raise

        return bytes(self._read_retry(path).call("GetObject", get))

    def _read_retry(self, path: str) -> Retry:
        return Retry(self.options, f"reading {path}", self.reach)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Ranged GETs (``concurrency`` at once, ``part_size_mb`` each) straight into ``out``."""
        self.read_scatter(path, [(offset, out)])

    def read_scatter(self, path: str, segments: Sequence[tuple[int, memoryview]]) -> None:
        """Ranged GETs of up to ``part_size_mb`` each, ``concurrency`` at once, each filling the segments it
        covers in order (the bytes go from the socket into the segments' memory). A GET that breaks off is
        fetched again whole (``ResponseStreamingError`` and resets are transient)."""
        bucket, key = self._split(path)
        step = self.options.part_size_mb * _MIB
        gets: list[list[tuple[int, memoryview]]] = []  # contiguous runs, each at most ``step`` bytes
        run: list[tuple[int, memoryview]] = []
        run_end = run_n = 0
        for offset, out in sorted(segments, key=lambda s: s[0]):
            view = out.cast("B") if out.format != "B" or out.ndim != 1 else out
            at = 0
            while at < len(view):
                pos = offset + at
                if run and (pos != run_end or run_n >= step):  # not contiguous, or full: a new GET
                    gets.append(run)
                    run, run_n = [], 0
                k = min(len(view) - at, step - run_n)
                run.append((pos, view[at:at + k]))
                run_n += k
                run_end = pos + k
                at += k
        if run:
            gets.append(run)
        retry = self._read_retry(path)

        def fetch(pieces: list[tuple[int, memoryview]]) -> None:
            first, last = pieces[0][0], pieces[-1][0] + len(pieces[-1][1]) - 1

            def get() -> None:
                r = self.data_client.get_object(Bucket=bucket, Key=key, Range=f"bytes={first}-{last}")
                stream = r["Body"]
                # urllib3's response reads into the buffers itself: from the socket to the segments
                raw = getattr(stream, "_raw_stream", None)
                for at, dst in pieces:
                    got = 0
                    while got < len(dst):
                        if raw is not None and hasattr(raw, "readinto"):
                            k = raw.readinto(dst[got:])
                        else:
                            chunk = stream.read(len(dst) - got)
                            dst[got:got + len(chunk)] = chunk
                            k = len(chunk)
                        if not k:
                            raise E.CheckpointCorruptError(f"{path}: the store sent too few bytes at offset {at + got}")
                        got += k
                stream.close()

            retry.call(f"GetObject bytes={first}-{last}", get)

        if len(gets) <= 1:
            for g in gets:
                fetch(g)
            return
        with ThreadPoolExecutor(min(self.options.concurrency, len(gets)), thread_name_prefix="flashckpt-s3-get") as pool:
            for f in [pool.submit(fetch, g) for g in gets]:
                f.result()

    def open_read(self, path: str) -> BinaryIO:
        """The whole object, fetched with parallel ranged GETs into one buffer."""
        buf = bytearray(self.size(path))
        self.read_into(path, 0, memoryview(buf))
        return io.BytesIO(buf)

    def exists(self, path: str) -> bool:
        bucket, key = self._split(path)

        def head() -> bool:
            try:
                self.client.head_object(Bucket=bucket, Key=key)
                return True
            except Exception as e:
                if status(e) == 404 or error_code(e) in ("404", "NoSuchKey", "NotFound"):
                    return False
                raise

        return bool(self._read_retry(path).call("HeadObject", head))

    def size(self, path: str) -> int:
        bucket, key = self._split(path)

        def head() -> int:
            try:
                return int(self.client.head_object(Bucket=bucket, Key=key)["ContentLength"])
            except Exception as e:
                if status(e) == 404 or error_code(e) in ("404", "NoSuchKey", "NotFound"):
                    raise E.CheckpointNotFoundError(2, "no such object", path) from None
                raise

        return int(self._read_retry(path).call("HeadObject", head))

    def _list(self, path: str, *, delimiter: bool) -> Iterator[dict[str, Any]]:
        bucket, key = self._split(path)
        prefix = key.rstrip("/") + "/" if key else ""
        token = None
        while True:
            kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
            if delimiter:
                kw["Delimiter"] = "/"
            if token:
                kw["ContinuationToken"] = token
            page = self._read_retry(path).call("ListObjectsV2", functools.partial(self.client.list_objects_v2, **kw))
            yield page
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    def listdir(self, path: str) -> list[str]:
        _bucket, key = self._split(path)
        prefix = key.rstrip("/") + "/" if key else ""
        names = set()
        for page in self._list(path, delimiter=True):
            names |= {c["Prefix"][len(prefix):].rstrip("/") for c in page.get("CommonPrefixes", [])}
            names |= {o["Key"][len(prefix):] for o in page.get("Contents", []) if o["Key"] != prefix}
        return sorted(n for n in names if n)

    def isdir(self, path: str) -> bool:
        bucket, key = self._split(path)
        prefix = key.rstrip("/") + "/" if key else ""
        page = self._read_retry(path).call("ListObjectsV2", lambda: self.client.list_objects_v2(
            Bucket=bucket, Prefix=prefix, MaxKeys=1))
        return bool(page.get("KeyCount") or page.get("Contents"))

    def checksum(self, path: str) -> tuple[int, str]:
        """(size, xxh3) of the object, read back in ranges (the whole object crosses the network)."""
        n = self.size(path)
        h = xxhash.xxh3_64()
        step = self.options.part_size_mb * _MIB
        buf = bytearray(min(n, step * self.options.concurrency) or 1)
        at = 0
        while at < n:
            k = min(len(buf), n - at)
            view = memoryview(buf)[:k]
            self.read_into(path, at, view)
            h.update(view)
            at += k
        return n, h.hexdigest()

    # -- removing ------------------------------------------------------------------------------------
    def remove(self, path: str) -> None:
        bucket, key = self._split(path)
        self._retry(path).call("DeleteObject", lambda: self.client.delete_object(Bucket=bucket, Key=key))

    def remove_many(self, paths: Sequence[str]) -> None:
        """DeleteObjects, 1000 keys a request."""
        by_bucket: dict[str, list[str]] = {}
        for p in paths:
            b, k = self._split(p)
            by_bucket.setdefault(b, []).append(k)
        for bucket, keys in by_bucket.items():
            for i in range(0, len(keys), 1000):
                batch = [{"Key": k} for k in keys[i:i + 1000]]
                r = self._retry(f"s3://{bucket}").call("DeleteObjects", functools.partial(
                    self.data_client.delete_objects, Bucket=bucket, Delete={"Objects": batch, "Quiet": True}))
                errors = r.get("Errors") or []
                if errors:
                    raise E.PersistError(f"s3://{bucket}: {len(errors)} object(s) not deleted, e.g. "
                                         f"{errors[0].get('Key')}: {errors[0].get('Code')} {errors[0].get('Message')}")

    def remove_tree(self, path: str) -> None:
        bucket, _key = self._split(path)
        keys = [f"s3://{bucket}/{o['Key']}" for page in self._list(path, delimiter=False)
                for o in page.get("Contents", [])]
        if self.exists(path):
            keys.append(path)
        self.remove_many(keys)

    # -- the backend's own upkeep --------------------------------------------------------------------
    def tidy(self, root: str, *, dry_run: bool = False) -> list[str]:
        """Aborts the unfinished multipart uploads under ``root`` (left by a saver killed mid-upload)."""
        bucket, key = self._split(root)
        prefix = key.rstrip("/") + "/" if key else ""
        out = []
        kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        while True:
            page = self._read_retry(root).call("ListMultipartUploads",
                                               functools.partial(self.client.list_multipart_uploads, **kw))
            for u in page.get("Uploads", []):
                if not dry_run:
                    self._abort(bucket, u["Key"], u["UploadId"])
                out.append(f"s3://{bucket}/{u['Key']}: an unfinished upload ({u['UploadId'][:16]}...), aborted")
            if not page.get("IsTruncated"):
                return out
            kw["KeyMarker"], kw["UploadIdMarker"] = page.get("NextKeyMarker"), page.get("NextUploadIdMarker")
