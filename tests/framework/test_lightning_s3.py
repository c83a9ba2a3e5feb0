"""FlashCheckpointIO with ``ModelCheckpoint(dirpath="s3://...")`` and the real Lightning 2.6 Trainer (CPU),
against a real S3-compatible server on loopback (moto; tests/support/s3_fixtures.py).

s3fs cannot be installed beside boto3/botocore 1.44 (aiobotocore pins botocore below it), so fsspec's
``s3://`` is served read-only by flashckpt's backend (``flashckpt.integrations._lightning_fs``) and the
plugin saves, loads and removes the checkpoints itself. A run fails after step 7, resumes from memory,
then (memory released) from the store, matching an uninterrupted run; ``save_top_k`` removals reach the
store; a damaged object falls back to the previous committed checkpoint; a vanilla Trainer resumes from a
downloaded ``.ckpt``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from s3_fixtures import moto_server_fixture, s3_fixture, s3_proxied_fixture  # noqa: F401

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from _fault_helpers import saver_pids, wait_for  # noqa: E402
from flashckpt import CheckpointCorruptError, CheckpointDirError  # noqa: E402
from flashckpt.integrations.lightning import FlashCheckpointIO, FlashMemorySnapshot  # noqa: E402
from lightning.fabric.utilities.cloud_io import get_filesystem  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from test_lightning import QUIET, StartStep, new_model, reference_weights, weights  # noqa: E402

STEPS = 12


@pytest.fixture(autouse=True)
def _small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHCKPT_S3_PART_SIZE_MB", "5")


class FailAt(Callback):
    """Raises at the end of step ``step`` (after the snapshot of that step)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"simulated failure after step {self.step}")


def _run(url: str, *, resume: bool, fail_at: int = -1, steps: int = STEPS) -> tuple[FlashCheckpointIO, Any, StartStep]:
    torch.set_num_threads(1)
    io = FlashCheckpointIO(url)
    start = StartStep()
    callbacks: list[Callback] = [FlashMemorySnapshot(every_n_train_steps=1), start,
                                 ModelCheckpoint(dirpath=url, every_n_train_steps=2, save_top_k=2, monitor="step",
                                                 mode="max", filename="{step}")]
    if fail_at >= 0:
        callbacks.append(FailAt(fail_at))
    model = new_model()
    trainer = L.Trainer(max_steps=steps, devices=1, plugins=[io], callbacks=callbacks, **QUIET)
    trainer.fit(model, ckpt_path=io.resume_path() if resume else None)
    return io, model, start


def _ckpts(s3: Any) -> list[str]:
    return sorted(k.split("/", 1)[1] for k in s3.keys("run/") if not k.startswith("run/.flashckpt/"))


def test_model_checkpoint_in_s3_resume_from_memory_then_from_the_store(s3: Any, tmp_path: Any, runtime_dir: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    want = reference_weights(STEPS)
    with pytest.raises(RuntimeError, match="simulated failure after step 7"):
        _run(s3.url, resume=False, fail_at=7)
    # save_top_k=2 removed step=2 from the store (through the saver); the newest snapshot (step 7) is in
    # memory and persisted by the failed run's last words as last-flash.ckpt.
    wait_for(lambda: "last-flash.ckpt" in _ckpts(s3), 60, "the last words to persist last-flash.ckpt")
    assert _ckpts(s3) == ["last-flash.ckpt", "step=4.ckpt", "step=6.ckpt"]

    io, model, start = _run(s3.url, resume=True)  # from memory
    assert start.start == 7 and io.last_load == ("memory", f"{s3.url}/last-flash.ckpt")
    for k in want:
        assert torch.equal(weights(model)[k], want[k]), k
    assert _ckpts(s3) == ["last-flash.ckpt", "step=10.ckpt", "step=12.ckpt"]  # the restored top-k was rotated

    fs = get_filesystem(s3.url)  # Lightning's own view of the dir: the checkpoints, not flashckpt's records
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(s3.url, detail=False)) == _ckpts(s3)
    with pytest.raises(PermissionError, match="read-only"):
        fs.open(f"{s3.url}/other.yaml", "w")

    # A vanilla Trainer resumes from a downloaded step=10.ckpt to the same weights.
    local = tmp_path / "step=10.ckpt"
    local.write_bytes(s3.read("run/step=10.ckpt"))
    vanilla = new_model()
    L.Trainer(max_steps=STEPS, devices=1, enable_checkpointing=False, **QUIET).fit(vanilla, ckpt_path=str(local))
    for k in want:
        assert torch.equal(weights(vanilla)[k], want[k]), k

    # Memory released (the run returned and its saver exited): resumes come from the store. step=12.ckpt
    # damaged: resume_path() falls back to the previous committed checkpoint, step=10.ckpt.
    wait_for(lambda: not saver_pids(runtime_dir), 60, "the saver to exit")
    s3.client().put_object(Bucket=s3.bucket, Key="run/step=12.ckpt", Body=b"damaged")
    probe = FlashCheckpointIO(s3.url)
    assert probe.resume_path() == f"{s3.url}/step=10.ckpt"
    with pytest.raises(CheckpointCorruptError, match="does not match its manifest"):
        probe.load_checkpoint(f"{s3.url}/step=12.ckpt")
    io, model, start = _run(s3.url, resume=True)
    assert start.start == 10 and io.last_load == ("storage", f"{s3.url}/step=10.ckpt")
    for k in want:
        assert torch.equal(weights(model)[k], want[k]), k
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("flashckpt-lightning-")]  # downloads removed
    assert "s3:" not in os.listdir(tmp_path)


def test_unserved_schemes_are_refused_and_others_stay_lightnings(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointDirError, match="no storage backend serves 'gs://b/p'"):
        FlashCheckpointIO("gs://b/p")
    with pytest.raises(CheckpointDirError, match="no storage backend serves"):
        FlashMemorySnapshot(dirpath="gs://b/p")
    assert os.listdir(tmp_path) == []
