"""Storage as an extension point: one resolver picks the backend of a checkpoint dir by its URL scheme
(``file://`` and plain paths: the POSIX backend; others: registered in code or through the entry-point
group ``flashckpt.storage.base``), and every part (engine, saver, persist worker, CLI) gets its storage there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from flashckpt import CheckpointStorage, InvalidArgumentError, InvalidArgumentTypeError, StorageType
from flashckpt.storage.locations import local_dir, url_scheme
from flashckpt.storage.posix import PosixDiskStorage
from flashckpt.storage.registry import ENTRY_POINT_GROUP, register_storage, storage_for
from helpers import assert_same_tree


def test_plain_paths_and_file_urls_get_the_posix_backend():
    for url in ("/data/ckpt", "relative/ckpt", "file:///data/ckpt", "FILE:///data/ckpt"):
        assert url_scheme(url) == "file"
        assert type(storage_for(url)) is PosixDiskStorage
    assert storage_for("/x").supports_rename and storage_for("/x").local_path("/x/a") == "/x/a"
    assert local_dir("file:///data/my%20ckpt") == "/data/my ckpt" and local_dir("rel/d") == "rel/d"


def test_the_file_backend_is_registered_in_the_entry_point_group():
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == "file"]
    assert ep.load() is PosixDiskStorage


def test_an_unknown_scheme_names_the_installed_backends_and_the_group():
    with pytest.raises(InvalidArgumentError) as ei:
        storage_for("gs://bucket/run1")
    msg = str(ei.value)
    assert "gs://" in msg and "installed: file://" in msg and repr(ENTRY_POINT_GROUP) in msg


class _ReadOnlyView(CheckpointStorage):
    """A backend of our own, registered in code: reads through the POSIX backend, refuses every write."""

    def __init__(self, root: str) -> None:
        self.root, self._posix = root, PosixDiskStorage()

    @classmethod
    def from_url(cls, url: str) -> _ReadOnlyView:
        return cls(url.split("://", 1)[1])

    def write_file(self, path, fill):
        raise PermissionError(path)

    def write_bytes(self, path, data):
        raise PermissionError(path)

    def read_bytes(self, path):
        return self._posix.read_bytes(path)

    def exists(self, path):
        return self._posix.exists(path)

    def listdir(self, path):
        return self._posix.listdir(path)

    def remove(self, path):
        raise PermissionError(path)

    def remove_tree(self, path):
        raise PermissionError(path)

    def checksum(self, path):
        return self._posix.checksum(path)


def test_a_backend_registered_in_code_serves_its_scheme_and_reads_without_a_local_path(tmp_path):
    with pytest.raises(InvalidArgumentTypeError):
        register_storage("bad", dict)  # type: ignore[arg-type]
    register_storage("roview", _ReadOnlyView)
    s = storage_for(f"roview://{tmp_path}")
    assert isinstance(s, _ReadOnlyView) and s.root == str(tmp_path) and not s.supports_rename
    f = tmp_path / "t.pt"
    torch.save({"w": torch.arange(4)}, f)
    with s.open_read(str(f)) as stream:  # no local path: the default stream reads through the backend
        assert torch.equal(torch.load(stream, weights_only=True)["w"], torch.arange(4))
    with pytest.raises(PermissionError):
        s.write_bytes(str(tmp_path / "x"), b"x")


def test_file_urls_work_wherever_plain_paths_do(make_engine, ckpt_dir):
    url = "file://" + ckpt_dir
    eng = make_engine(url)
    sd = {"w": torch.randn(8), "step": 3}
    eng.save(3, sd, storage_type=StorageType.DISK)
    eng.wait(60)
    eng.close()
    again = make_engine(url)
    assert_same_tree(again.load(), sd)
    again.close()
    cli = [sys.executable, "-m", "flashckpt.cli"]
    for cmd in (["ls", url], ["verify", url]):
        out = subprocess.run(cli + cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ))
        assert out.returncode == 0 and "3" in out.stdout, (cmd, out.stdout, out.stderr)
    out = subprocess.run(cli + ["ls", "gs://bucket/run"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "gs://" in out.stderr and "flashckpt.storage" in out.stderr, out.stderr
