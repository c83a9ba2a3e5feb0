"""A saver's life: it starts cleanly or not at all, and it does not outlive its use.

- A full runtime file system at start gives a clear ENOSPC error and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from _fault_helpers import saver_pids, small_tmpfs, wait_for
from helpers import leftovers

from flashckpt_core import CheckpointEngine, SaverError, SharedMemoryError, StorageType


def _fill(directory: str) -> None:
    """Fills the file system of ``directory``: its blocks, then its inodes."""
    with contextlib.suppress(OSError), open(os.path.join(directory, "fill"), "wb") as f:
        while True:
            f.write(b"\0" * (1 << 16))
    with contextlib.suppress(OSError):
        for i in range(100000):
            open(os.path.join(directory, f"inode{i}"), "wb").close()


def _no_saver_left(rt: str) -> None:
    wait_for(lambda: not saver_pids(rt), 10, f"no saver left under {rt}")


def test_full_runtime_fs_at_start_says_enospc_and_leaves_no_process(tmp_path, monkeypatch, ckpt_dir) -> None:
    """/dev/shm full of data: the engine starts (a load needs no space), a snapshot fails with ENOSPC and
    the bytes it needs, and no saver stays behind. Before the fix the saver's start failed writing its pid
    file ("see <empty log>") while the forked daemon kept serving."""
    mnt = str(tmp_path / "shm")
    with small_tmpfs(mnt, "1m"):
        rt = os.path.join(mnt, "rt")
        os.mkdir(rt, 0o700)
        with open(os.path.join(mnt, "fill"), "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (1 << 16))
        monkeypatch.setenv("FLASHCKPT_RUNTIME_DIR", rt)
        try:
            eng = CheckpointEngine(ckpt_dir)
            try:
                with pytest.raises(SharedMemoryError, match=r"ENOSPC.*") as ei:
                    eng.save(1, {"w": torch.zeros(1 << 20)}, storage_type=StorageType.MEMORY)
                assert "needs" in str(ei.value) and "bytes" in str(ei.value)
            finally:
                eng.close()
        finally:
            _no_saver_left(rt)
        wait_for(lambda: leftovers(rt) == [], 10, "the saver to remove its runtime dir")


def test_runtime_fs_out_of_inodes_at_start_is_a_clear_error(tmp_path, monkeypatch, ckpt_dir) -> None:
    """No inode left for the saver's socket, locks or log: a SaverError that says ENOSPC and where, not
    an OSError or a pointer to a log that could not be written; no process left."""
    mnt = str(tmp_path / "shm")
    with small_tmpfs(mnt, "1m,nr_inodes=16"):
        rt = os.path.join(mnt, "rt")
        os.mkdir(rt, 0o700)
        _fill(rt)
        monkeypatch.setenv("FLASHCKPT_RUNTIME_DIR", rt)
        try:
            with pytest.raises(SaverError) as ei:
                CheckpointEngine(ckpt_dir)
            msg = str(ei.value)
            assert "no space left in" in msg and "ENOSPC" in msg and rt in msg, msg
        finally:
            _no_saver_left(rt)


def test_saver_that_cannot_bind_reports_why_and_exits(tmp_path, monkeypatch, ckpt_dir) -> None:
    """Inodes for the job dir, its lock and log, but none for the socket: the daemon's own start fails.
    Its reason reaches the trainer over the start-up pipe, and it exits, removing its runtime dir."""
    mnt = str(tmp_path / "shm")
    with small_tmpfs(mnt, "1m,nr_inodes=16"):
        rt = os.path.join(mnt, "rt")
        os.mkdir(rt, 0o700)
        _fill(rt)
        from flashckpt_core.config import job_key

        # Free exactly the inodes the spawner needs: the job dir, its spawn lock and its log.
        for i in range(3):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(rt, f"inode{i}"))
        monkeypatch.setenv("FLASHCKPT_RUNTIME_DIR", rt)
        try:
            with pytest.raises(SaverError) as ei:
                CheckpointEngine(ckpt_dir)
            msg = str(ei.value)
            assert "could not start" in msg and "ENOSPC" in msg, msg
        finally:
            _no_saver_left(rt)
        wait_for(lambda: not os.path.exists(os.path.join(rt, job_key(ckpt_dir))), 10,
                 "the failed saver to remove its runtime dir")
