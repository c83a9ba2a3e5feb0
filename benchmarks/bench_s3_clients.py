"""S3 client libraries (and local S3 servers) side by side: one object in memory, uploaded and downloaded.

    python -m benchmarks.bench_s3_clients [--server seaweedfs] [--size-gib 1] [--rounds 3]
        [--clients flashckpt,flashckpt_unsigned,flashckpt_direct,boto3_parts,boto3_tm,obstore,s3torch]
        [--servers moto,seaweedfs,s3rver,localbucket] [--out bench_out/]

Informational only: it never passes or fails; it prints markdown tables and writes the samples as JSON to
``<out>/bench_s3_clients.json``. Two parts:

* ``--servers``: the local S3-compatible servers (``benchmarks._s3server``) against each other, each with
  the same plain boto3 client (``boto3_parts``: our own parallel parts), to pick the fastest server;
* ``--clients`` against ``--server``: every client uploads the same ``--size-gib`` GiB object from memory
  (64 MiB parts, 8 at once, as ``S3Options``' defaults) and downloads it into memory, rounds interleaved
  (the order rotated per round); reported: median MB/s and the client process's CPU seconds per GB
  (``getrusage``: every thread, the native ones of obstore and s3torchconnector included), and the
  server's. Every download is checked against the source (not timed); objects are deleted between rounds.

Clients:

* ``flashckpt``: ``S3Storage.write_parts`` / ``read_into`` (boto3's low-level client, our parallel parts,
  zero-copy bodies, xxh3 + CRC-32 computed on the way, as the persist worker uploads);
* ``flashckpt_unsigned``: the same with ``payload_signing_enabled=False`` (no SigV4 SHA-256 of the payload:
  what botocore does on https when it computes the checksum itself; see docs/storage.md);
* ``flashckpt_direct``: downloads through http.client's ``readinto`` straight into the buffer (a proposed
  change to ``S3Storage.read_into``; urllib3 2's ``readinto`` reads a new ``bytes`` and copies it);
* ``boto3_parts``: boto3's low-level client, parallel ``upload_part`` with memoryview bodies and parallel
  ranged ``get_object(...).read()`` copied into the buffer: the plain recipe, no hashing of our own;
* ``boto3_tm``: boto3's transfer manager, ``upload_fileobj(BytesIO)`` / ``download_fileobj(BytesIO)``
  with ``TransferConfig(64 MiB, 8 threads)``, botocore's default checksums;
* ``obstore``: ``obstore.put`` (64 MiB chunks, 8 at once) / ``obstore.get_ranges`` (64 MiB ranges, no
  coalescing);
* ``s3torchconnector``: AWS's CRT-based client (``S3Client.put_object`` writer / sequential reader).

Bounds: client and server share this machine's cores (2 here), so every figure is bounded by both; over
http botocore SHA-256-hashes each payload for SigV4 (a read, not a copy), on https with a checksum it
does not. Clients that return new buffers pay first-touch page faults on each download (costly on a VM).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import io
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flashckpt.storage.s3.io import Body  # noqa: E402

from benchmarks._common import (  # noqa: E402
    REPO_ROOT,
    Samples,
    cores,
    loadavg_note,
    logger,
    machine_info,
    markdown_table,
    rotated,
    write_json,
)
from benchmarks._s3server import SERVERS, LocalS3, start_server  # noqa: E402

log = logger("bench_s3_clients")

MIB = 1 << 20
PART = 64 * MIB
THREADS = 8
CLIENTS = ("flashckpt", "flashckpt_unsigned", "flashckpt_direct", "boto3_parts", "boto3_tm", "obstore", "s3torch")


def cpu_s() -> float:
    """User + system CPU seconds of this process so far (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def versions() -> dict[str, str]:
    """Versions of the client libraries that are importable."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("boto3", "botocore", "s3transfer", "urllib3", "obstore", "s3torchconnector",
                 "s3torchconnectorclient", "aiobotocore", "awscrt", "moto"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


# ------------------------------------------------------------------------------------------ clients
class Client:
    """One client library: ``upload(key, data)`` and ``download(key, size)`` (returns the bytes-like)."""

    name = ""

    def __init__(self, srv: LocalS3) -> None:
        self.srv = srv

    def upload(self, key: str, data: memoryview) -> None:
        raise NotImplementedError

    def download(self, key: str, size: int) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        return None


class FlashCkpt(Client):
    """``S3Storage.write_parts`` / ``read_into`` into a reused (prefaulted) buffer."""

    name = "flashckpt S3Storage (boto3 client, own parts)"

    def __init__(self, srv: LocalS3, *, unsigned: bool = False) -> None:
        super().__init__(srv)
        from flashckpt.storage.s3.backend import S3Storage
        from flashckpt.storage.s3.options import S3Options

        self.st = S3Storage(S3Options(endpoint_url=srv.endpoint, addressing_style="path", part_size_mb=PART // MIB,
                                      concurrency=THREADS))
        if unsigned:
            from botocore.config import Config

            self.name = "flashckpt S3Storage, payload_signing_enabled=False"
            import boto3
            from flashckpt.storage.s3.io import make_client

            for kind in ("meta", "data"):  # the backend's clients, with the signing changed
                c = make_client(self.st.options, kind)
                cfg = c.meta.config.merge(Config(s3={"addressing_style": "path", "payload_signing_enabled": False}))
                c.close()
                self.st._clients[kind] = boto3.session.Session().client(
                    "s3", endpoint_url=srv.endpoint, region_name="us-east-1", aws_access_key_id=srv.access_key,
                    aws_secret_access_key=srv.secret_key, config=cfg)
        self.buf: bytearray | None = None

    def upload(self, key: str, data: memoryview) -> None:
        self.st.write_parts(f"s3://{self.srv.bucket}/{key}", [data])

    def download(self, key: str, size: int) -> Any:
        if self.buf is None or len(self.buf) != size:
            self.buf = bytearray(size)
            self.buf[::4096] = b"\0" * len(self.buf[::4096])  # prefault (not timed: the first call is a warm-up)
        self.st.read_into(f"s3://{self.srv.bucket}/{key}", 0, memoryview(self.buf))
        return self.buf

    def close(self) -> None:
        self.st.close()


class FlashCkptDirect(FlashCkpt):
    """``S3Storage.read_into`` changed to read each range from http.client straight into the buffer
    (``HTTPResponse.readinto``: one copy, socket to buffer) instead of urllib3's ``readinto``, which reads a
    new ``bytes`` of the range and copies it (two copies, the first into fresh memory). A proposed change
    to ``flashckpt_core/storage/s3/backend.py``, measured here; uploads as ``flashckpt``."""

    name = "flashckpt S3Storage, reads via http.client readinto (proposed)"

    def download(self, key: str, size: int) -> Any:
        if self.buf is None or len(self.buf) != size:
            self.buf = bytearray(size)
            self.buf[::4096] = b"\0" * len(self.buf[::4096])
        out = memoryview(self.buf)
        client, bucket = self.st.client, self.srv.bucket

        def fetch(at: int) -> None:
            dst = out[at:min(at + PART, size)]
            r = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={at}-{at + len(dst) - 1}")
            raw = r["Body"]._raw_stream  # urllib3's response; ._fp: http.client's, which reads into a buffer
            got = 0
            while got < len(dst):
                k = raw._fp.readinto(dst[got:])
                if not k:
                    raise OSError(f"short read at {at + got}")
                got += k
            raw.release_conn()  # the body is consumed: the connection goes back to the pool

        with cf.ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(fetch, range(0, size, PART)))
        return self.buf


class Boto3Parts(Client):
    """boto3's low-level client with our own parallel parts (memoryview bodies; reads copied into a buffer)."""

    name = "boto3 client, own parallel parts"

    def __init__(self, srv: LocalS3) -> None:
        super().__init__(srv)
        self.c = srv.client(max_pool_connections=2 * THREADS, request_checksum_calculation="when_required",
                            response_checksum_validation="when_required")
        self.pool = cf.ThreadPoolExecutor(THREADS)
        self.buf: bytearray | None = None

    def upload(self, key: str, data: memoryview) -> None:
        b = self.srv.bucket
        up = self.c.create_multipart_upload(Bucket=b, Key=key)["UploadId"]

        def part(i: int) -> dict[str, Any]:
            body = Body([data[i * PART:(i + 1) * PART]])  # botocore takes no memoryview: a file-like over it
            r = self.c.upload_part(Bucket=b, Key=key, UploadId=up, PartNumber=i + 1, Body=body)
            return {"PartNumber": i + 1, "ETag": r["ETag"]}

        parts = list(self.pool.map(part, range(-(-len(data) // PART))))
        self.c.complete_multipart_upload(Bucket=b, Key=key, UploadId=up, MultipartUpload={"Parts": parts})

    def download(self, key: str, size: int) -> Any:
        if self.buf is None or len(self.buf) != size:
            self.buf = bytearray(size)
            self.buf[::4096] = b"\0" * len(self.buf[::4096])
        out = memoryview(self.buf)

        def get(at: int) -> None:
            end = min(at + PART, size)
            r = self.c.get_object(Bucket=self.srv.bucket, Key=key, Range=f"bytes={at}-{end - 1}")
            out[at:end] = r["Body"].read()

        list(self.pool.map(get, range(0, size, PART)))
        return self.buf

    def close(self) -> None:
        self.pool.shutdown()


class Boto3TransferManager(Client):
    """``upload_fileobj`` / ``download_fileobj`` with BytesIO and a TransferConfig like our options."""

    name = "boto3 transfer manager (upload_fileobj/download_fileobj)"

    def __init__(self, srv: LocalS3) -> None:
        super().__init__(srv)
        from boto3.s3.transfer import TransferConfig

        self.c = srv.client(max_pool_connections=2 * THREADS)
        self.cfg = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=THREADS,
                                  use_threads=True)

    def upload(self, key: str, data: memoryview) -> None:
        self.c.upload_fileobj(io.BytesIO(data), self.srv.bucket, key, Config=self.cfg)

    def download(self, key: str, size: int) -> Any:
        f = io.BytesIO()
        self.c.download_fileobj(self.srv.bucket, key, f, Config=self.cfg)
        return f.getbuffer()


class Obstore(Client):
    """obstore (Rust object_store): ``put`` in 64 MiB chunks, ``get_ranges`` of 64 MiB (no coalescing)."""

    name = "obstore put / get_ranges"

    def __init__(self, srv: LocalS3) -> None:
        super().__init__(srv)
        from obstore.store import S3Store

        self.store = S3Store(srv.bucket, endpoint=srv.endpoint, access_key_id=srv.access_key,
                             secret_access_key=srv.secret_key, region="us-east-1", virtual_hosted_style_request=False,
                             client_options={"allow_http": True, "timeout": "300s"})

    def upload(self, key: str, data: memoryview) -> None:
        import obstore

        obstore.put(self.store, key, data, chunk_size=PART, max_concurrency=THREADS)

    def download(self, key: str, size: int) -> Any:
        import obstore

        starts = list(range(0, size, PART))
        ends = [min(s + PART, size) for s in starts]
        return obstore.get_ranges(self.store, key, starts=starts, ends=ends, coalesce=0)


class S3Torch(Client):
    """s3torchconnector's CRT client: a writer fed 64 MiB memoryviews, the sequential reader's ``read()``."""

    name = "s3torchconnector (CRT)"

    def __init__(self, srv: LocalS3) -> None:
        super().__init__(srv)
        from s3torchconnector._s3client import S3Client, S3ClientConfig

        self.c = S3Client("us-east-1", endpoint=srv.endpoint,
                          s3client_config=S3ClientConfig(part_size=PART, force_path_style=True))

    def upload(self, key: str, data: memoryview) -> None:
        with self.c.put_object(self.srv.bucket, key) as w:
            for at in range(0, len(data), PART):
                w.write(data[at:at + PART])

    def download(self, key: str, size: int) -> Any:
        return self.c.get_object(self.srv.bucket, key).read()


def make_client(name: str, srv: LocalS3) -> Client:
    if name == "flashckpt":
        return FlashCkpt(srv)
    if name == "flashckpt_unsigned":
        return FlashCkpt(srv, unsigned=True)
    if name == "flashckpt_direct":
        return FlashCkptDirect(srv)
    if name == "boto3_parts":
        return Boto3Parts(srv)
    if name == "boto3_tm":
        return Boto3TransferManager(srv)
    if name == "obstore":
        return Obstore(srv)
    if name == "s3torch":
        return S3Torch(srv)
    raise ValueError(f"--clients: unknown client {name!r} (known: {', '.join(CLIENTS)})")


# ------------------------------------------------------------------------------------------ measuring
def measure(S: Samples, key: str, srv: LocalS3, fn: Callable[[], Any]) -> Any:
    """Runs ``fn`` once; records wall seconds, this process's and the server's CPU seconds."""
    c0, s0, t0 = cpu_s(), srv.cpu_s(), time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    S.add(f"{key}.s", dt)
    S.add(f"{key}.cpu", cpu_s() - c0)
    S.add(f"{key}.server_cpu", srv.cpu_s() - s0)
    return out


def run_clients(srv: LocalS3, names: list[str], data: memoryview, rounds: int, S: Samples, prefix: str,
                errors: dict[str, str]) -> dict[str, str]:
    """Every client in ``names`` uploads and downloads ``data``, ``rounds`` times interleaved (plus one
    unmeasured warm-up each). Returns the clients' display names; failures go to ``errors``."""
    import xxhash

    os.environ.update(srv.env())  # the clients that read the AWS configuration (S3Storage, the CRT) find it

    want = xxhash.xxh3_64_hexdigest(data)
    clients: dict[str, Client] = {}
    for n in names:
        try:
            clients[n] = make_client(n, srv)
        except Exception as e:  # not installed, or refuses the endpoint
            errors[f"{prefix}{n}"] = f"{type(e).__name__}: {e}"
            log(f"{n}: cannot be set up: {errors[f'{prefix}{n}']}")
    labels = {n: c.name for n, c in clients.items()}
    try:
        for r in range(rounds + 1):
            for n in rotated(list(clients), r):
                c = clients[n]
                if f"{prefix}{n}" in errors:
                    continue
                key = f"clients/{n}-{r}"
                k = f"{prefix}{n}"
                try:
                    if r == 0:  # warm-up: connections, buffers, the server's first volume
                        c.upload(key, data)
                        got = c.download(key, len(data))
                    else:
                        measure(S, f"{k}.up", srv, functools.partial(c.upload, key, data))
                        got = measure(S, f"{k}.down", srv, functools.partial(c.download, key, len(data)))
                    check = _digest(got)
                    del got
                    if check != want:
                        errors[k] = f"round {r}: the download does not match the upload ({check} != {want})"
                except Exception as e:
                    errors[k] = f"round {r}: {type(e).__name__}: {str(e)[:500]}"
                    log(f"{n} failed: {errors[k]}")
                finally:
                    srv.empty_bucket("clients/")
            if r:
                log(f"{prefix or srv.kind}: round {r}/{rounds} done")
    finally:
        for c in clients.values():
            c.close()
    return labels


def _digest(got: Any) -> str:
    import xxhash

    h = xxhash.xxh3_64()
    for piece in (got if isinstance(got, list) else [got]):
        h.update(memoryview(piece).cast("B"))
    return h.hexdigest()


def reference_costs(data: memoryview) -> dict[str, float]:
    """CPU seconds per GB of the per-byte work the clients may do, on this machine (one thread)."""
    import hashlib
    import zlib

    import xxhash
    from flashckpt.storage.s3.io import crc32

    gb = len(data) / 1e9
    out = {}
    for name, fn in (("sha256 (SigV4 payload hash)", lambda: hashlib.sha256(data).digest()),
                     ("crc32 (isal, ours)", lambda: crc32(data)),
                     ("crc32 (zlib)", lambda: zlib.crc32(data)),
                     ("xxh3-64", lambda: xxhash.xxh3_64_hexdigest(data)),
                     ("memcpy into a reused buffer", lambda: bytearray(data)),
                     ("memcpy into fresh memory (first touch)", lambda: bytes(data))):
        if name.startswith("memcpy into a reused"):
            buf = bytearray(len(data))
            view = memoryview(buf)  # (bytearray[:] = memoryview would copy the source into a new bytes first)
            view[:] = data  # touches every page first
            t0 = time.perf_counter()
            view[:] = data
            out[name] = (time.perf_counter() - t0) / gb
            del view, buf
            continue
        t0 = time.perf_counter()
        fn()
        out[name] = (time.perf_counter() - t0) / gb
    return out


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_s3_clients", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", default="seaweedfs", choices=SERVERS, help="the server the clients run against")
    p.add_argument("--servers", default="", help="compare these servers first (comma-separated; '' skips)")
    p.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated, of: " + ", ".join(CLIENTS))
    p.add_argument("--size-gib", type=float, default=1.0, help="the object's size in GiB")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds (medians), after one warm-up")
    p.add_argument("--data-dir", default="", help="where the servers keep their data (default: the temp dir)")
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "bench_out"), help="directory for the JSON")
    return p.parse_args(argv)


def _rate(S: Samples, key: str, nbytes: int) -> str:
    s = S.median(f"{key}.s")
    return f"{nbytes / s / 1e6:.0f}" if s == s else "failed"


def _per_gb(S: Samples, key: str, nbytes: int) -> str:
    c = S.median(key)
    return f"{c / (nbytes / 1e9):.2f}" if c == c else ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import numpy as np

    nbytes = int(args.size_gib * (1 << 30)) // MIB * MIB
    log(f"making a {nbytes / 2**30:.2f} GiB object of random bytes ...")
    data = memoryview(np.random.default_rng(0).bytes(nbytes))
    load0 = os.getloadavg()[0]
    S = Samples()
    errors: dict[str, str] = {}
    servers = [s for s in args.servers.split(",") if s]
    info = machine_info()
    info.update(versions=versions(), size_bytes=nbytes, part_bytes=PART, threads=THREADS, rounds=args.rounds,
                cores=cores())
    server_versions: dict[str, str] = {}
    tables = []

    refs = reference_costs(data)
    tables.append("Per-byte work on this machine, one thread, CPU seconds per GB:\n\n" + markdown_table(
        ["operation", "s/GB"], [[k, f"{v:.3f}"] for k, v in refs.items()]))

    for kind in servers:
        try:
            with start_server(kind, data_dir=args.data_dir, log=log) as srv:
                server_versions[kind] = srv.version
                run_clients(srv, ["boto3_parts"], data, args.rounds, S, f"server.{kind}.", errors)
        except Exception as e:
            errors[f"server.{kind}"] = f"{type(e).__name__}: {e}"
            log(f"{kind}: {errors[f'server.{kind}']}")
    if servers:
        rows = []
        for kind in servers:
            k = f"server.{kind}.boto3_parts"
            if f"{k}.up.s" not in S:
                rows.append([kind, server_versions.get(kind, "?"), "failed", "failed", "", "",
                             errors.get(k, errors.get(f"server.{kind}", ""))[:120]])
                continue
            rows.append([kind, server_versions.get(kind, "?"), _rate(S, f"{k}.up", nbytes), _rate(S, f"{k}.down", nbytes),
                         _per_gb(S, f"{k}.up.server_cpu", nbytes),
                         _per_gb(S, f"{k}.down.server_cpu", nbytes), errors.get(k, "")])
        tables.append(f"Servers, {nbytes / 2**30:.2f} GiB object, boto3 low-level client with {THREADS} parallel "
                      f"{PART // MIB} MiB parts / ranges (median of {args.rounds}):\n\n" + markdown_table(
                          ["server", "version", "upload MB/s", "ranged download MB/s", "server CPU s/GB up",
                           "server CPU s/GB down", "error"], rows, "llrrrrl"))

    names = [n for n in args.clients.split(",") if n]
    labels: dict[str, str] = {}
    if names:
        with start_server(args.server, data_dir=args.data_dir, log=log) as srv:
            server_versions[args.server] = srv.version
            labels = run_clients(srv, names, data, args.rounds, S, "", errors)
        rows = []
        for n in names:
            if f"{n}.up.s" not in S:
                rows.append([labels.get(n, n), "failed", "failed", "", "", "", "", errors.get(n, "")[:160]])
                continue
            rows.append([labels[n], _rate(S, f"{n}.up", nbytes), _rate(S, f"{n}.down", nbytes),
                         _per_gb(S, f"{n}.up.cpu", nbytes), _per_gb(S, f"{n}.down.cpu", nbytes),
                         _per_gb(S, f"{n}.up.server_cpu", nbytes), _per_gb(S, f"{n}.down.server_cpu", nbytes),
                         errors.get(n, "")[:160]])
        tables.append(f"Clients against {args.server} {server_versions[args.server]}, {nbytes / 2**30:.2f} GiB object "
                      f"from memory, {PART // MIB} MiB parts, {THREADS} at once (median of {args.rounds} interleaved "
                      "rounds; CPU: seconds per GB moved):\n\n" + markdown_table(
                          ["client", "upload MB/s", "download MB/s", "client CPU up", "client CPU down",
                           "server CPU up", "server CPU down", "error"], rows, "lrrrrrrl"))
    busy = loadavg_note(load0, cores())
    if busy:
        tables.append("Note: " + busy)
    vs = info["versions"]
    tables.append("Versions: " + ", ".join(f"{k} {v}" for k, v in sorted({**vs, **server_versions}.items())))
    for t in tables:
        print(t + "\n")
    out = os.path.join(args.out, "bench_s3_clients.json")
    write_json(out, {"command": " ".join(["python -m benchmarks.bench_s3_clients"] + sys.argv[1:]), "machine": info,
                     "servers": server_versions, "labels": labels, "errors": errors, "reference_s_per_gb": refs,
                     "samples": S.data, "tables": tables})
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
