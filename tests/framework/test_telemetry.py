"""Checkpointing's figures in the tools people watch, under the real frameworks: the HF Trainer with
``report_to="tensorboard"`` (the event file read back with TensorBoard's own reader) and Lightning with its
``CSVLogger`` (the metrics file read back): the pause of every checkpoint, the persist time and the durable
step, at the training steps they belong to."""

from __future__ import annotations

import csv
import glob
import os
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("lightning")
pytest.importorskip("tensorboard")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from flashckpt.integrations.hf import FlashCkptConfig  # noqa: E402
from flashckpt.integrations.lightning import FlashCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from test_hf import make_trainer  # noqa: E402
from test_lightning import Regressor  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


class _WaitAt(TrainerCallback):
    """At the end of step ``at``, waits for the commits in flight (the next snapshot's figures then hold the
    durable step): the run's only synchronization."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.trainer: Any = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.at:
            self.trainer.flashckpt_wait()


def test_hf_trainer_reports_pause_persist_time_and_durable_step_to_tensorboard(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, logs = str(tmp_path / "out"), str(tmp_path / "tb")
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", logs)  # transformers 5: the TensorBoard callback's dir
    wait = _WaitAt(4)
    trainer = make_trainer(out, callbacks=[wait], config=FlashCkptConfig(memory_snapshot_steps=1), max_steps=6,
                           save_steps=3, report_to=["tensorboard"])
    wait.trainer = trainer
    trainer.train()
    trainer.flashckpt_close()
    (events,) = glob.glob(os.path.join(logs, "**", "events.out.tfevents.*"), recursive=True)
    acc = EventAccumulator(events)
    acc.Reload()
    tags = acc.Tags()["scalars"]
    # The Trainer's TensorBoard callback files training figures under "train/", ours with them.
    assert {"train/flashckpt/pause_s", "train/flashckpt/durable_step", "train/flashckpt/persist_s",
            "train/flashckpt/snapshot_mb"} <= set(tags), tags
    pauses = {e.step: e.value for e in acc.Scalars("train/flashckpt/pause_s")}
    assert sorted(pauses) == [1, 2, 3, 4, 5, 6] and all(0 < v < 30 for v in pauses.values()), pauses
    durable = {e.step: e.value for e in acc.Scalars("train/flashckpt/durable_step")}
    assert durable.get(4) == 3.0 and max(durable.values()) in (3.0, 6.0), durable  # step 3 committed by step 4
    persist = [e.value for e in acc.Scalars("train/flashckpt/persist_s")]
    assert persist and all(v > 0 for v in persist), persist
    assert "loss" in tags or "train/loss" in tags, tags  # the Trainer's own figures are there as before
    assert not any("flashckpt" in k for h in trainer.state.log_history for k in h)  # its history stays its own


class _LWaitAt(Callback):
    def __init__(self, io: FlashCheckpointIO, at: int) -> None:
        self.io, self.at = io, at

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.at:
            assert self.io.engine is not None
            self.io.engine.wait()


class _Logging(Regressor):
    """The test model, logging its loss (its logger is in use: flashckpt adds its figures there)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss


def test_lightning_reports_pause_persist_time_and_durable_step_to_the_modules_logger(tmp_path: Any) -> None:
    ckpt = str(tmp_path / "ckpt")
    io = FlashCheckpointIO(ckpt)
    logger = CSVLogger(str(tmp_path / "logs"), name="run")
    trainer = L.Trainer(max_steps=6, devices=1, accelerator="cpu", plugins=[io], logger=logger,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                        callbacks=[_LWaitAt(io, 4), ModelCheckpoint(dirpath=ckpt, every_n_train_steps=2, save_top_k=-1)])
    torch.manual_seed(0)
    trainer.fit(_Logging())
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("flashckpt/pause_s")]
    steps = [int(r["step"]) for r in rows]
    assert steps == [2, 4, 6], rows
    assert all(0 < float(r["flashckpt/pause_s"]) < 30 for r in rows), rows
    by = {int(r["step"]): r for r in rows}
    assert float(by[4]["flashckpt/durable_step"]) == 0.0, by[4]  # the first save (engine step 0) is committed
    assert float(by[4]["flashckpt/persist_s"]) > 0, by[4]
