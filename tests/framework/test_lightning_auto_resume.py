"""Lightning's ``fit`` resumes without a script change on a restart, and says so in one line (#34).

- Under ``flashckpt-run --max_restarts 1``, a script calling ``trainer.fit(model)`` with no ``ckpt_path``
  (``_lightning_fit_script.py``: a memory snapshot every step, ``ModelCheckpoint`` every 10) is SIGKILLed after
  step 13 (step 10 on disk, 13 in memory only): the restarted worker resumes at step 13 from memory, ends with
  the weights of an uninterrupted run, and logs exactly one WARNING line; with ``FLASHCKPT_AUTO_RESUME=0`` it
  starts again at step 0.
- In one process (``TORCHELASTIC_RESTART_COUNT`` set as the launcher sets it in a restarted worker): a
  ``ckpt_path`` the script passes wins, ``FlashCheckpointIO(auto_resume=False)`` turns it off, a bad value is
  refused, and ``pytorch_lightning``'s classes resume the same way.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
from _fault_helpers import FaultEnv, fault_env_fixture, run_restarting  # noqa: F401

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from flashckpt import errors as E  # noqa: E402
from flashckpt.integrations.lightning import FlashCheckpointIO, FlashMemorySnapshot  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from test_lightning import QUIET, StartStep, new_model, reference_weights  # noqa: E402

pytestmark = pytest.mark.framework

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support",
                      "_lightning_fit_script.py")
LINE = "FlashCheckpointIO: resumed from"


@pytest.mark.parametrize("knob", [None, "0"], ids=["on", "off"])
def test_a_restarted_worker_fits_from_the_newest_snapshot_by_itself(fault_env: FaultEnv, knob: str | None) -> None:
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    # killed after step 13 on its first attempt; FLASHCKPT_AUTO_RESUME as given
    results, text = run_restarting(fault_env, SCRIPT, "--ckpt", ckpt, "--steps", "16", "--kill_at", "13",
                                   **({} if knob is None else {"FLASHCKPT_AUTO_RESUME": knob}))
    assert len(results) == 1, text[-6000:]  # the first attempt was killed
    r = results[0]
    lines = [line for line in text.splitlines() if LINE in line or "no checkpoint to resume from" in line]
    snapshot = os.path.join(ckpt, "last-flash.ckpt")
    if knob is None:
        assert (r["start"], r["ckpt_path"], r["load"]) == (13, snapshot, ["memory", snapshot]), text[-6000:]
        assert len(lines) == 1, text[-6000:]
        assert f"resumed from memory at step 13, 0 steps lost ({snapshot})" in lines[0], lines
    else:
        assert (r["start"], r["ckpt_path"], r["load"]) == (0, None, []), text[-6000:]
        assert lines == [], lines
    got = torch.load(r["final"], weights_only=True)
    want = reference_weights(16)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs from the uninterrupted run"


def test_the_plugin_alone_resumes_a_restarted_fit(fault_env: FaultEnv) -> None:
    """No ``FlashMemorySnapshot``: Lightning's ``callbacks_factory`` entry point (pyproject.toml) gives the
    restarted worker's Trainer the callback that resumes it, from the newest checkpoint ModelCheckpoint saved
    through the plugin (step 10, in memory: killed after step 13); a first start gets no callback at all."""
    ckpt = os.path.join(fault_env.tmp, "ckpt")
    results, text = run_restarting(fault_env, SCRIPT, "--ckpt", ckpt, "--steps", "16", "--kill_at", "13",
                                   "--plugin_only")
    assert len(results) == 1, text[-6000:]
    r = results[0]
    lines = [line for line in text.splitlines() if LINE in line]
    want = os.path.join(ckpt, "epoch=0-step=10.ckpt")
    assert (r["start"], r["ckpt_path"], r["load"]) == (10, want, ["memory", want]), text[-6000:]
    assert len(lines) == 1 and f"resumed from memory at step 10, 0 steps lost ({want})" in lines[0], lines
    got = torch.load(r["final"], weights_only=True)
    ref = reference_weights(16)
    for k in ref:
        assert torch.equal(got[k], ref[k]), f"{k} differs from the uninterrupted run"
    from flashckpt.integrations._lightning_classes import callbacks_factory
    assert callbacks_factory() == []  # this process is no restarted worker


def _fit(ckpt: str, steps: int, io: Any, **fit_kw: Any) -> tuple[int | None, Any]:
    """Fits ``steps`` steps with ``io``, a snapshot every step, ModelCheckpoint every 2 steps (all kept, named by
    step): the step training started at and the Trainer's ckpt_path."""
    start = StartStep()
    trainer = L.Trainer(max_steps=steps, devices=1, plugins=[io], **QUIET, callbacks=[
        FlashMemorySnapshot(every_n_train_steps=1), start,
        ModelCheckpoint(dirpath=ckpt, every_n_train_steps=2, save_top_k=-1, filename="{step}")])
    trainer.fit(new_model(), **fit_kw)
    return start.start, trainer.ckpt_path


def test_what_the_script_chose_wins_and_the_argument_turns_it_off(tmp_path, monkeypatch, caplog) -> None:
    ckpt = str(tmp_path / "ckpt")
    assert _fit(ckpt, 5, FlashCheckpointIO(ckpt))[0] == 0  # a first start (no TORCHELASTIC_RESTART_COUNT)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # as in a worker the launcher restarted
    # That run ended, its saver persisted the newest snapshot (step 5) and let its memory go.
    newest = os.path.join(ckpt, "last-flash.ckpt")
    with caplog.at_level("WARNING", logger="flashckpt.integrations.lightning"):
        assert _fit(ckpt, 6, FlashCheckpointIO(ckpt)) == (5, newest)
    assert [m for m in caplog.messages if LINE in m] == [
        f"FlashCheckpointIO: resumed from storage at step 5, 0 steps lost ({newest}) (a restarted worker; "
        "FLASHCKPT_AUTO_RESUME=0 turns this off)"]
    caplog.clear()
    older = os.path.join(ckpt, "step=2.ckpt")
    assert _fit(ckpt, 7, FlashCheckpointIO(ckpt), ckpt_path=older) == (2, older)  # the script's path
    assert _fit(ckpt, 3, FlashCheckpointIO(ckpt, auto_resume=False)) == (0, None)
    assert not [m for m in caplog.messages if LINE in m], caplog.messages
    with pytest.raises(E.InvalidArgumentError, match=r"FlashCheckpointIO\(auto_resume\) is 'no': give True, False, or None"):
        FlashCheckpointIO(ckpt, auto_resume="no")  # type: ignore[arg-type]


def test_pytorch_lightning_resumes_the_same_way(tmp_path, monkeypatch) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from flashckpt.integrations.lightning import PLFlashCheckpointIO, PLFlashMemorySnapshot

    class PLModel(pl.LightningModule):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.first: int | None = None

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            self.first = self.global_step if self.first is None else self.first
            return self.net(torch.ones(2, 4)).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8)), batch_size=1)

    ckpt = str(tmp_path / "pl")
    for steps, restarts, first in ((3, "0", 0), (5, "1", 3)):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restarts)
        model = PLModel()
        pl.Trainer(max_steps=steps, plugins=[PLFlashCheckpointIO(ckpt)], callbacks=[PLFlashMemorySnapshot()],
                   enable_checkpointing=False, **QUIET).fit(model)
        assert model.first == first, (steps, model.first)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
