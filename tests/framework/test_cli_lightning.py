"""``flashckpt ls`` of a dir the Lightning adapter wrote shows Lightning's training steps (#34): flashckpt's
own step of such a dir counts saves (one per ``.ckpt`` written), so the rows also carry the global step and
epoch that Lightning put in each file's name (``epoch=E-step=S.ckpt``)."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
from _fault_helpers import run_cli  # noqa: E402
from flashckpt.integrations.lightning import FlashCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from test_lightning import QUIET, new_model  # noqa: E402


def test_ls_of_a_lightning_dir_shows_the_training_steps(tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    every = ModelCheckpoint(dirpath=ckpt, every_n_train_steps=3, save_top_k=-1, save_last=True)
    L.Trainer(max_steps=12, devices=1, plugins=[FlashCheckpointIO(ckpt)], callbacks=[every], **QUIET).fit(new_model())
    names = sorted(n for n in os.listdir(ckpt) if n.endswith(".ckpt") and n != "last.ckpt")
    assert names == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt", "epoch=0-step=9.ckpt", "epoch=1-step=12.ckpt"]

    r = run_cli(None, "ls", ckpt, "--json")  # type: ignore[arg-type]
    assert r.returncode == 0, r.stderr
    rows = [row for row in json.loads(r.stdout) if row["files"] and row["files"] != ["last.ckpt"]]
    got = {(row["training_step"], row["epoch"]): row["files"] for row in rows}
    assert got == {(3, 0): [names[0]], (6, 0): [names[1]], (9, 0): [names[2]], (12, 1): [names[3]]}, rows
    # last.ckpt (a copy, save_last=True) names no step: the step Lightning put in the file is shown
    (last,) = [row for row in json.loads(r.stdout) if row["files"] == ["last.ckpt"]]
    assert (last["training_step"], last["epoch"]) == (12, 1), last

    r = run_cli(None, "ls", ckpt)  # type: ignore[arg-type]
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines[0].split()[:3] == ["STEP", "TRAINING", "STEP"], r.stdout
    files = [line for line in lines[1:] if ".ckpt" in line]  # (the others: snapshots in memory, no files)
    assert [line.split()[1:4] for line in files] == [["3", "(epoch", "0)"], ["6", "(epoch", "0)"], ["9", "(epoch", "0)"],
                                                     ["12", "(epoch", "1)"], ["12", "(epoch", "1)"]], r.stdout
    assert files[-1].endswith("last.ckpt"), r.stdout
