"""The S3 test infrastructure itself (tests/support/s3_fixtures.py, tests/support/s3_proxy.py), with plain boto3: a real
client against a real moto server, directly and through the fault proxy.

Each fault is checked as botocore sees it (what it retries, what reaches the caller) and as the server
sees it (what took effect), so that the S3 backend's tests can rely on the proxy doing what it says.
"""

from __future__ import annotations

import http.client
import io
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from s3_fixtures import (  # noqa: F401
    MotoServer,
    ProxiedS3Env,
    S3Env,
    make_client,
    moto_server_fixture,
    s3_fixture,
    s3_proxied_fixture,
)
from s3_proxy import OPERATIONS, Fault, FaultProxy, classify

MIB = 1 << 20
PART = 5 * MIB  # S3's smallest part but the last
NO_RETRY = {"total_max_attempts": 1}


def blob(n: int, seed: int = 0) -> bytes:
    """``n`` deterministic bytes that differ from one offset to the next."""
    return bytes((i * 31 + seed) & 0xFF for i in range(256)) * (n // 256) + bytes(n % 256)


def multipart(client: Any, s3: S3Env, key: str, parts: list[bytes]) -> tuple[str, list[dict[str, Any]]]:
    """Creates an upload of ``key`` and uploads ``parts``; returns the upload id and the part list."""
    upload_id = client.create_multipart_upload(Bucket=s3.bucket, Key=key)["UploadId"]
    done = []
    for n, data in enumerate(parts, 1):
        etag = client.upload_part(Bucket=s3.bucket, Key=key, UploadId=upload_id, PartNumber=n,
                                  Body=io.BytesIO(data))["ETag"]
        done.append({"ETag": etag, "PartNumber": n})
    return upload_id, done


def complete(client: Any, s3: S3Env, key: str, upload_id: str, parts: list[dict[str, Any]]) -> str:
    return str(client.complete_multipart_upload(Bucket=s3.bucket, Key=key, UploadId=upload_id,
                                                MultipartUpload={"Parts": parts})["ETag"])


# ------------------------------------------------------------------------------------------ plain paths
def test_requests_are_classified_by_s3_operation() -> None:
    cases = [
        ("PUT", "/b/k", "", {}, "PutObject"),
        ("PUT", "/b/a/k", "partNumber=2&uploadId=u", {}, "UploadPart"),
        ("PUT", "/b/k", "partNumber=2&uploadId=u", {"x-amz-copy-source": "b/x"}, "UploadPartCopy"),
        ("PUT", "/b/k", "", {"x-amz-copy-source": "b/x"}, "CopyObject"),
        ("POST", "/b/k", "uploads", {}, "CreateMultipartUpload"),
        ("POST", "/b/k", "uploadId=u", {}, "CompleteMultipartUpload"),
        ("DELETE", "/b/k", "uploadId=u", {}, "AbortMultipartUpload"),
        ("DELETE", "/b/k", "", {}, "DeleteObject"),
        ("POST", "/b", "delete", {}, "DeleteObjects"),
        ("GET", "/b/k", "", {}, "GetObject"),
        ("GET", "/b/k", "uploadId=u", {}, "ListParts"),
        ("HEAD", "/b/k", "", {}, "HeadObject"),
        ("GET", "/b", "list-type=2&prefix=run%2F", {}, "ListObjectsV2"),
        ("GET", "/b", "uploads&prefix=x", {}, "ListMultipartUploads"),
        ("PUT", "/b", "", {}, "CreateBucket"),
        ("PUT", "/b/k", "tagging", {}, "Other"),
        ("GET", "/", "", {}, "Other"),
    ]
    for method, path, query, headers, op in cases:
        assert classify(method, path, query, headers)[0] == op, (method, path, query)
        assert op in OPERATIONS
    assert classify("GET", "/bkt/run/step%201/a.bin", "")[1:] == ("bkt", "run/step 1/a.bin")


def test_a_fault_rule_names_known_kinds_and_operations() -> None:
    with pytest.raises(ValueError, match="kind"):
        Fault("lose_everything")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown operation"):
        Fault("slowdown", op="PutObjects")
    with pytest.raises(ValueError, match="times"):
        Fault("slowdown", times=0)
    with pytest.raises(ValueError, match="probability"):
        Fault("slowdown", probability=0.0)


# ------------------------------------------------------------------------------------------ no faults
def test_objects_and_multipart_uploads_pass_through_the_proxy(s3_proxied: ProxiedS3Env) -> None:
    s3, proxy = s3_proxied, s3_proxied.proxy
    c = s3.client()
    small, big = blob(1000), blob(2 * MIB + 17, seed=3)
    c.put_object(Bucket=s3.bucket, Key="run/small", Body=small)
    c.put_object(Bucket=s3.bucket, Key="run/big", Body=io.BytesIO(big))
    assert c.get_object(Bucket=s3.bucket, Key="run/big")["Body"].read() == big
    assert c.get_object(Bucket=s3.bucket, Key="run/big", Range="bytes=100-1099")["Body"].read() == big[100:1100]
    assert c.head_object(Bucket=s3.bucket, Key="run/small")["ContentLength"] == 1000
    parts = [blob(PART, seed=1), blob(PART, seed=2), blob(123, seed=4)]
    upload_id, done = multipart(c, s3, "run/multi", parts)
    assert s3.multipart_uploads() == [("run/multi", upload_id)]
    listed = c.list_multipart_uploads(Bucket=s3.bucket)["Uploads"]
    assert [(u["Key"], u["UploadId"]) for u in listed] == [("run/multi", upload_id)]
    complete(c, s3, "run/multi", upload_id, done)
    assert s3.read("run/multi") == b"".join(parts) and s3.multipart_uploads() == []
    listing = c.list_objects_v2(Bucket=s3.bucket, Prefix="run/")
    assert [o["Key"] for o in listing["Contents"]] == ["run/big", "run/multi", "run/small"]
    c.delete_objects(Bucket=s3.bucket, Delete={"Objects": [{"Key": "run/small"}, {"Key": "run/big"}]})
    c.delete_object(Bucket=s3.bucket, Key="run/multi")
    assert s3.keys() == []

    assert proxy.counts() == {"PutObject": 2, "GetObject": 2, "HeadObject": 1, "CreateMultipartUpload": 1,
                              "UploadPart": 3, "ListMultipartUploads": 1, "CompleteMultipartUpload": 1,
                              "ListObjectsV2": 1, "DeleteObjects": 1, "DeleteObject": 1}
    records = proxy.records()
    assert all(r.fault is None and r.status == r.upstream_status and r.status is not None and r.status < 300
               for r in records)
    assert [r.request_bytes for r in proxy.records("UploadPart")] == [len(p) for p in parts]
    assert [r.ranged for r in proxy.records("GetObject")] == [False, True]
    assert {r.path for r in records} >= {f"/{s3.bucket}/run/big", f"/{s3.bucket}"}  # path-style


def test_the_environment_leads_a_plain_client_and_a_subprocess_to_the_bucket(s3: S3Env) -> None:
    import boto3

    assert os.environ["AWS_ENDPOINT_URL"] == s3.endpoint == s3.env["AWS_ENDPOINT_URL"]
    plain = boto3.session.Session().client("s3")  # nothing but the environment
    try:
        assert plain.meta.config.s3["addressing_style"] == "path"
        assert plain.meta.region_name == "us-east-1"
        plain.put_object(Bucket=s3.bucket, Key="run/from-test", Body=b"parent")
    finally:
        plain.close()
    script = ("import boto3, sys\n"
              "c = boto3.client('s3')\n"
              "data = c.get_object(Bucket=sys.argv[1], Key='run/from-test')['Body'].read()\n"
              "c.put_object(Bucket=sys.argv[1], Key='run/from-child', Body=data + b' and child')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | s3.env
    subprocess.run([sys.executable, "-c", script, s3.bucket], env=env, check=True, timeout=60,
                   stdin=subprocess.DEVNULL)
    assert s3.keys("run/") == ["run/from-child", "run/from-test"]
    assert s3.read("run/from-child") == b"parent and child"


def test_expect_100_continue_is_answered_before_the_body_or_instead_of_it(s3_proxied: ProxiedS3Env) -> None:
    s3, proxy = s3_proxied, s3_proxied.proxy

    def put_head(key: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
        sock.sendall(f"PUT /{s3.bucket}/{key} HTTP/1.1\r\nHost: 127.0.0.1:{proxy.port}\r\n"
                     "Authorization: AWS4-HMAC-SHA256 Credential=testing/20250101/us-east-1/s3/aws4_request, "
                     "SignedHeaders=host, Signature=0\r\nx-amz-content-sha256: UNSIGNED-PAYLOAD\r\n"
                     "Content-Length: 5\r\nExpect: 100-continue\r\n\r\n".encode())
        return sock

    with put_head("run/continued") as sock:
        reader = sock.makefile("rb")
        assert reader.readline() == b"HTTP/1.1 100 Continue\r\n" and reader.readline() == b"\r\n"
        sock.sendall(b"hello")
        assert reader.readline().startswith(b"HTTP/1.1 200")
        reader.close()
    assert s3.read("run/continued") == b"hello"

    proxy.set_faults([Fault("slowdown", op="PutObject")])
    with put_head("run/refused") as sock:
        reader = sock.makefile("rb")
        head = reader.readline()
        headers = {}
        while (line := reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.lower()] = value.strip()
        body = reader.read(int(headers["content-length"]))
        assert head.startswith(b"HTTP/1.1 503") and headers["retry-after"] == "1"
        assert headers["connection"] == "close" and b"<Code>SlowDown</Code>" in body
        assert reader.read() == b""  # the proxy closed: the withheld body is never read
        reader.close()
    assert proxy.records("PutObject")[-1].request_bytes == 0 and "run/refused" not in s3.keys()


class _ChunkedUpstream(BaseHTTPRequestHandler):
    """A non-S3 upstream that answers every GET with a chunked body (moto answers with lengths)."""

    protocol_version = "HTTP/1.1"
    BODY = blob(300_000, seed=9)

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(0, len(self.BODY), 70_000):
            piece = self.BODY[i:i + 70_000]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: object) -> None:
        pass


class _QuietServer(ThreadingHTTPServer):
    """Joins its connection threads on close; a client that hangs up mid-answer is no error here."""

    daemon_threads = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


@pytest.fixture
def chunked_upstream() -> Iterator[str]:
    server = _QuietServer(("127.0.0.1", 0), _ChunkedUpstream)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="chunked-upstream")
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()  # joins its connection threads
        thread.join()


def test_chunked_bodies_pass_both_ways(s3_proxied: ProxiedS3Env, chunked_upstream: str) -> None:
    s3, proxy = s3_proxied, s3_proxied.proxy
    data = [blob(70_000, seed=i) for i in range(5)]
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        conn.request("PUT", f"/{s3.bucket}/run/chunked", body=iter(data), encode_chunked=True, headers={
            "Authorization": "AWS4-HMAC-SHA256 Credential=testing/20250101/us-east-1/s3/aws4_request, "
                             "SignedHeaders=host, Signature=0", "x-amz-content-sha256": "UNSIGNED-PAYLOAD"})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
    finally:
        conn.close()
    assert s3.read("run/chunked") == b"".join(data)
    assert proxy.records("PutObject")[-1].request_bytes == 350_000

    with FaultProxy(chunked_upstream) as relay:
        conn = http.client.HTTPConnection("127.0.0.1", relay.port, timeout=30)
        try:
            for _ in range(2):  # twice on one connection: the chunked framing ends where it should
                conn.request("GET", "/b/k")
                resp = conn.getresponse()
                assert resp.chunked and resp.read() == _ChunkedUpstream.BODY
            relay.set_faults([Fault("reset_response", after_bytes=1000)])
            conn.request("GET", "/b/k")
            resp = conn.getresponse()
            with pytest.raises((http.client.IncompleteRead, ConnectionError)):
                resp.read()
        finally:
            conn.close()
        assert [r.fault for r in relay.records()] == [None, None, "reset_response"]


# ------------------------------------------------------------------------------------------ faults
def test_slowdown_is_a_503_that_botocore_retries(s3_proxied: ProxiedS3Env) -> None:
    s3, proxy = s3_proxied, s3_proxied.proxy
    proxy.set_faults([Fault("slowdown", op="PutObject", retry_after_s=2)])
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError) as raised:
        s3.client(retries=NO_RETRY).put_object(Bucket=s3.bucket, Key="run/a", Body=b"x")
    err = raised.value.response
    assert err["Error"]["Code"] == "SlowDown" and err["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert err["ResponseMetadata"]["HTTPHeaders"]["retry-after"] == "2"

    proxy.set_faults([Fault("slowdown", op="PutObject")])  # one: each retry waits rand(0, 2^i) s
    proxy.clear()
    s3.client(retries={"mode": "standard"}).put_object(Bucket=s3.bucket, Key="run/a", Body=b"x")
    assert [(r.fault, r.status, r.upstream_status) for r in proxy.records()] == [
        ("slowdown", 503, None), (None, 200, 200)]
    assert s3.read("run/a") == b"x" and proxy.pending() == []


def test_error500_is_answered_without_forwarding_and_retried(s3_proxied: ProxiedS3Env) -> None:
    s3, proxy = s3_proxied, s3_proxied.proxy
    s3.client(direct=True).put_object(Bucket=s3.bucket, Key="run/a", Body=b"abc")
    proxy.set_faults([Fault("error500", op="GetObject")])
    assert s3.client().get_object(Bucket=s3.bucket, Key="run/a")["Body"].read() == b"abc"
    assert [(r.op, r.fault, r.status, r.upstream_status) for r in proxy.records()] == [
        ("GetObject", "error500", 500, None), ("GetObject", None, 200, 200)]


def test_a_reset_in_the_request_body_is_retried_with_the_whole_body(s3_proxied: ProxiedS3Env) -> None:
    s3, proxy = s3_proxied, s3_proxied.proxy
    proxy.set_faults([Fault("reset_request", op="UploadPart", key="multi", after_bytes=MIB)])
    c = s3.client()
    parts = [blob(2 * MIB, seed=5)]
    upload_id, done = multipart(c, s3, "run/multi", parts)
    complete(c, s3, "run/multi", upload_id, done)
    assert s3.read("run/multi") == b"".join(parts)
    assert [(r.fault, r.status, r.upstream_status, r.request_bytes) for r in proxy.records("UploadPart")] == [
        ("reset_request", None, None, MIB), (None, 200, 200, 2 * MIB)]


def test_a_reset_in_a_get_body_reaches_the_reader_and_other_resets_are_retried(s3_proxied: ProxiedS3Env) -> None:
    from botocore.exceptions import ResponseStreamingError

    s3, proxy = s3_proxied, s3_proxied.proxy
    data = blob(MIB, seed=7)
    c = s3.client()
    proxy.set_faults([Fault("reset_response", op="PutObject")])  # no body: cut in the middle of the head
    c.put_object(Bucket=s3.bucket, Key="run/a", Body=data)
    assert [(r.fault, r.upstream_status) for r in proxy.records("PutObject")] == [("reset_response", 200),
                                                                                   (None, 200)]
    proxy.set_faults([Fault("reset_response", op="GetObject", ranged=False, after_bytes=1000)])
    body = c.get_object(Bucket=s3.bucket, Key="run/a")["Body"]  # the head was complete: the call returns
    with pytest.raises(ResponseStreamingError):
        body.read()
    rest = c.get_object(Bucket=s3.bucket, Key="run/a", Range="bytes=1000-")["Body"].read()  # resume
    assert data[:1000] + rest == data
    assert [(r.fault, r.ranged) for r in proxy.records("GetObject")] == [("reset_response", False), (None, True)]


@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
def test_a_lost_complete_reply_took_effect_and_the_retry_succeeds(s3_proxied: ProxiedS3Env, reset: bool) -> None:
    from botocore.exceptions import ConnectionClosedError

    s3, proxy = s3_proxied, s3_proxied.proxy
    parts = [blob(5000, seed=8)]  # one part, the last, may be small
    once = s3.client(retries=NO_RETRY)
    upload_id, done = multipart(once, s3, "run/once", parts)
    proxy.set_faults([Fault("lost_reply", op="CompleteMultipartUpload", reset=reset)])
    with pytest.raises(ConnectionClosedError):
        complete(once, s3, "run/once", upload_id, done)
    assert s3.read("run/once") == b"".join(parts) and s3.multipart_uploads() == []  # completed all the same

    upload_id, done = multipart(s3.client(), s3, "run/retried", parts)
    proxy.set_faults([Fault("lost_reply", op="CompleteMultipartUpload", reset=reset)])
    proxy.clear()
    etag = complete(s3.client(), s3, "run/retried", upload_id, done)
    assert [(r.fault, r.status, r.upstream_status) for r in proxy.records()] == [
        ("lost_reply", None, 200), (None, 200, 200)]  # moto completes idempotently: no NoSuchUpload
    assert etag.endswith('-1"') and s3.read("run/retried") == b"".join(parts)


def test_a_lost_reply_to_a_conditional_put_comes_back_as_precondition_failed(s3_proxied: ProxiedS3Env) -> None:
    from botocore.exceptions import ClientError

    s3, proxy = s3_proxied, s3_proxied.proxy
    proxy.set_faults([Fault("lost_reply", op="PutObject")])
    with pytest.raises(ClientError) as raised:
        s3.client().put_object(Bucket=s3.bucket, Key="run/record", Body=b"mine", IfNoneMatch="*")
    assert raised.value.response["Error"]["Code"] == "PreconditionFailed"
    assert s3.read("run/record") == b"mine"  # the first attempt wrote it; its retry found it there
    assert [(r.fault, r.status, r.upstream_status) for r in proxy.records()] == [
        ("lost_reply", None, 200), (None, 412, 412)]


def test_an_error_in_a_200_complete_is_retried_by_botocore(s3_proxied: ProxiedS3Env) -> None:
    from botocore.exceptions import ClientError

    s3, proxy = s3_proxied, s3_proxied.proxy
    parts = [blob(3000, seed=10)]
    upload_id, done = multipart(s3.client(), s3, "run/a", parts)
    proxy.set_faults([Fault("error_in_200", op="CompleteMultipartUpload")])
    proxy.clear()
    complete(s3.client(), s3, "run/a", upload_id, done)
    assert [(r.fault, r.status, r.upstream_status) for r in proxy.records()] == [
        ("error_in_200", 200, 200), (None, 200, 200)]

    once = s3.client(retries=NO_RETRY)
    upload_id, done = multipart(once, s3, "run/b", parts)
    proxy.set_faults([Fault("error_in_200", op="CompleteMultipartUpload")])
    with pytest.raises(ClientError) as raised:
        complete(once, s3, "run/b", upload_id, done)
    assert raised.value.response["Error"]["Code"] == "InternalError"
    assert s3.read("run/b") == b"".join(parts)  # though the client was told it failed


def test_a_slow_body_arrives_whole(s3_proxied: ProxiedS3Env) -> None:
    s3, proxy = s3_proxied, s3_proxied.proxy
    data = blob(64 * 1024, seed=12)
    proxy.set_faults([Fault("slow_body", op="PutObject", rate=4 * MIB, direction="request"),
                      Fault("slow_body", op="GetObject", rate=4 * MIB)])
    c = s3.client()
    c.put_object(Bucket=s3.bucket, Key="run/a", Body=data)
    assert c.get_object(Bucket=s3.bucket, Key="run/a")["Body"].read() == data
    assert [(r.op, r.fault, r.status) for r in proxy.records()] == [("PutObject", "slow_body", 200),
                                                                    ("GetObject", "slow_body", 200)]


def test_rules_match_by_key_and_range_fire_a_number_of_times_and_draw_from_a_seeded_rng(
        s3_proxied: ProxiedS3Env) -> None:
    from botocore.exceptions import ClientError

    s3, proxy = s3_proxied, s3_proxied.proxy
    c = s3.client(retries=NO_RETRY)
    for key in ("run/a", "run/b"):
        c.put_object(Bucket=s3.bucket, Key=key, Body=b"0123456789")

    def outcomes(n: int, **get: Any) -> list[bool]:
        """For ``n`` GETs of run/a: whether each failed."""
        failed = []
        for _ in range(n):
            try:
                c.get_object(Bucket=s3.bucket, Key="run/a", **get)["Body"].read()
                failed.append(False)
            except ClientError:
                failed.append(True)
        return failed

    proxy.set_faults([Fault("error500", op="GetObject", key="/b", times=None),
                      Fault("error500", op="GetObject", ranged=True, times=2)])
    assert outcomes(2) == [False, False]  # neither the key nor the range matches
    assert outcomes(3, Range="bytes=0-1") == [True, True, False]
    with pytest.raises(ClientError):
        c.get_object(Bucket=s3.bucket, Key="run/b")
    assert [(f.key, n) for f, n in proxy.pending()] == [("/b", None)]

    proxy.set_faults([Fault("error500", op="GetObject", probability=0.5, times=None)], seed=42)
    first = outcomes(16)
    proxy.set_faults([Fault("error500", op="GetObject", probability=0.5, times=None)], seed=42)
    assert outcomes(16) == first and 0 < sum(first) < 16


def test_a_buckets_teardown_leaves_no_upload_object_or_bucket(moto_server: MotoServer) -> None:
    from botocore.exceptions import ClientError

    env = S3Env(moto_server.endpoint, moto_server.endpoint, "fct-teardown-check", {})
    env._create()
    c = env.client()
    for i in range(3):
        c.put_object(Bucket=env.bucket, Key=f"run/{i}", Body=b"x")
    c.create_multipart_upload(Bucket=env.bucket, Key="run/open")
    assert len(env.keys()) == 3 and len(env.multipart_uploads()) == 1
    env._destroy()
    check = make_client(moto_server.endpoint)
    try:
        with pytest.raises(ClientError, match="NoSuchBucket"):
            check.list_objects_v2(Bucket=env.bucket)
    finally:
        check.close()


def test_close_ends_open_keep_alive_connections(s3: S3Env) -> None:
    proxy = FaultProxy(s3.endpoint)
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        conn.request("GET", f"/{s3.bucket}?list-type=2")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200 and proxy.connections() == 1  # kept alive
        proxy.close()
        assert proxy.connections() == 0
        assert not [t for t in threading.enumerate() if t.name.startswith(f"s3-proxy-{proxy.port}")]
    finally:
        conn.close()
        proxy.close()
