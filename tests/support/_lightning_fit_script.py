"""A Lightning training script that runs unchanged under ``flashckpt-run``: ``FlashCheckpointIO`` in the
Trainer's plugins, ``FlashMemorySnapshot`` every step and ``ModelCheckpoint`` every 10 steps (top 2 and
``last.ckpt``), and ``trainer.fit(model)`` with no ``ckpt_path``, the same on every attempt. The model is
``test_lightning``'s ``Regressor`` (bit-exact across a resume).

``--kill_at N`` SIGKILLs the worker at the end of step N (after its memory snapshot), on the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` 0). The last line is ``RESULT {json}``: the global step training started at,
the Trainer's ``ckpt_path``, the plugin's ``last_load`` and the file the final weights were saved to.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "framework"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from flashckpt.integrations.lightning import FlashCheckpointIO, FlashMemorySnapshot  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from test_lightning import QUIET, StartStep, new_model, weights  # noqa: E402


class _KillOnFirstAttempt(Callback):
    """SIGKILLs the worker at the end of step ``step`` of the launcher's first attempt."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--kill_at", type=int, default=0)
    p.add_argument("--plugin_only", action="store_true",
                   help="no FlashMemorySnapshot: the plugin alone (ModelCheckpoint every 5 steps)")
    a = p.parse_args()
    torch.set_num_threads(1)
    io = FlashCheckpointIO(a.ckpt)
    start = StartStep()
    callbacks = [FlashMemorySnapshot(every_n_train_steps=1), start, _KillOnFirstAttempt(a.kill_at),
                 ModelCheckpoint(dirpath=a.ckpt, every_n_train_steps=10, save_top_k=2, monitor="step", mode="max",
                                 save_last=True)]
    if a.plugin_only:
        callbacks = [start, _KillOnFirstAttempt(a.kill_at),
                     ModelCheckpoint(dirpath=a.ckpt, every_n_train_steps=5, save_top_k=2, monitor="step", mode="max")]
    model = new_model()
    trainer = L.Trainer(max_steps=a.steps, devices=1, plugins=[io], callbacks=callbacks, **QUIET)
    trainer.fit(model)
    final = os.path.join(os.path.dirname(a.ckpt), f"final-{os.environ.get('TORCHELASTIC_RESTART_COUNT')}.pt")
    torch.save(weights(model), final)
    print("RESULT " + json.dumps({"start": start.start, "ckpt_path": trainer.ckpt_path,
                                  "load": list(io.last_load or ()), "final": final}), flush=True)


if __name__ == "__main__":
    main()
