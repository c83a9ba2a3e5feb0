"""FlashCkptTrainer and AcceleratorCheckpointer with checkpoints in ``s3://`` (a real S3-compatible server on
loopback, moto; tests/support/s3_fixtures.py), the real transformers / accelerate on a tiny GPT-2 and MLP.

- Trainer: ``FlashCkptConfig(checkpoint_dir="s3://...")`` with a local ``output_dir``: a failure, a resume
  from memory, then (memory released) resumes from the store that match an uninterrupted vanilla run;
  a damaged object falls back to the previous committed step; a vanilla Trainer resumes from a downloaded
  ``checkpoint-N``; retention and the best checkpoint (loaded at the end from the store, kept across a
  resume).
- Accelerate: ``AcceleratorCheckpointer(acc, "s3://...")``: memory and store loads, the fall-back on
  damage, vanilla ``accelerator.load_state`` of a downloaded directory.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from s3_fixtures import moto_server_fixture, s3_fixture, s3_proxied_fixture  # noqa: F401

pytest.importorskip("transformers")

import torch  # noqa: E402
from test_hf import _stopper, accelerate_run, assert_weights_equal, losses, make_trainer, weights  # noqa: E402

N_STEPS = 8  # test_hf's runs: save_steps=3, so steps 3, 6 and 8 are checkpoints


@pytest.fixture(autouse=True)
def _env_for_s3(monkeypatch: pytest.MonkeyPatch) -> None:
    """No downloads; 5 MiB parts (S3's minimum), in this process and in the savers it starts."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("FLASHCKPT_S3_PART_SIZE_MB", "5")
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # recorded, so teardown restores it (accelerate)
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")


def _config(s3: Any, every: int = 1, **kw: Any) -> Any:
    from flashckpt.integrations.hf import FlashCkptConfig

    return FlashCkptConfig(memory_snapshot_steps=every, checkpoint_dir=s3.url, **kw)


def _committed(url: str) -> list[int]:
    from flashckpt.commit.layout import CommitLayout
    from flashckpt.storage.registry import storage_for

    st = storage_for(url)
    try:
        return CommitLayout(url, st).committed_steps()
    finally:
        st.close()


def _download(s3: Any, prefix: str, dest: str) -> str:
    """Every object under ``<bucket>/<prefix>/`` into ``dest`` (what ``aws s3 cp --recursive`` would do)."""
    for key in s3.keys(prefix + "/"):
        path = os.path.join(dest, *key[len(prefix) + 1:].split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(s3.read(key))
    return dest


def _damage(s3: Any, key: str) -> None:
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=b"damaged")


# ------------------------------------------------------------------------------------------ Trainer
def test_trainer_checkpoints_in_s3_resume_from_memory_then_from_the_store(s3: Any, tmp_path: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from flashckpt.integrations.hf import get_last_checkpoint

    monkeypatch.chdir(tmp_path)
    ref = make_trainer(str(tmp_path / "vanilla"), vanilla=True)
    ref.train()
    ref_w, ref_losses = weights(ref.model), losses(ref)
    out = str(tmp_path / "out")

    # A failure after step 5: the store holds step 3 (save_steps=3), memory step 5.
    with pytest.raises(RuntimeError, match="simulated"):
        make_trainer(out, config=_config(s3), callbacks=[_stopper(5, "raise")]).train()
    r = make_trainer(out, config=_config(s3))
    last = r.get_last_checkpoint()
    assert last == f"{s3.url}/checkpoint-5"  # memory's step, never written to the store
    r.train(resume_from_checkpoint=last)
    assert (r.flashckpt_last_resume.source, r.flashckpt_last_resume.step) == ("memory", 5)
    assert_weights_equal(ref_w, weights(r.model))
    assert losses(r, after=5) == {s: v for s, v in ref_losses.items() if s > 5}
    assert {3, 6, 8} <= set(_committed(s3.url))  # and 5 once the failed run's last words persisted it
    keys = s3.keys("run/")
    assert {"run/checkpoint-6/model.safetensors", "run/checkpoint-6/optimizer.pt", "run/checkpoint-6/trainer_state.json",
            "run/.flashckpt/tracker.json"} <= set(keys), keys
    # output_dir holds no checkpoint (and no local "s3:" directory appeared anywhere).
    assert not os.path.isdir(out) or not [n for n in os.listdir(out) if n.startswith("checkpoint-")]
    assert "s3:" not in os.listdir(tmp_path)
    assert get_last_checkpoint(s3.url, verify=True) == f"{s3.url}/checkpoint-8"

    # Memory is released (train() returned): a resume from the store's checkpoint-6 by its URL.
    s = make_trainer(out, config=_config(s3, 0))
    s.train(resume_from_checkpoint=f"{s3.url}/checkpoint-6")
    assert (s.flashckpt_last_resume.source, s.flashckpt_last_resume.step) == ("storage", 6)
    assert_weights_equal(ref_w, weights(s.model))
    assert losses(s, after=6) == {k: v for k, v in ref_losses.items() if k > 6}

    # checkpoint-8 damaged in the store: resume_from_checkpoint=True falls back to checkpoint-6.
    _damage(s3, "run/checkpoint-8/model.safetensors")
    t = make_trainer(out, config=_config(s3, 0))
    assert t.get_last_checkpoint() == f"{s3.url}/checkpoint-6"
    t.train(resume_from_checkpoint=True)
    assert (t.flashckpt_last_resume.source, t.flashckpt_last_resume.step) == ("storage", 6)
    assert_weights_equal(ref_w, weights(t.model))
    assert get_last_checkpoint(s3.url, verify=True) == f"{s3.url}/checkpoint-8"  # saved again, sound

    # A vanilla Trainer resumes from a downloaded checkpoint-3 to the same weights.
    dl = _download(s3, "run/checkpoint-3", str(tmp_path / "dl" / "checkpoint-3"))
    v = make_trainer(str(tmp_path / "v2"), vanilla=True)
    v.train(resume_from_checkpoint=dl)
    assert_weights_equal(ref_w, weights(v.model))
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("flashckpt-hf-resume-")]  # downloads removed


def test_trainer_retention_and_best_checkpoint_in_s3(s3: Any, tmp_path: Any) -> None:
    """save_total_limit=2 with the best checkpoint tracked and loaded at the end: the store keeps the newest
    and the best; the best model is loaded from the store; a resume from the store keeps tracking it."""
    import safetensors.torch as st
    from transformers import TrainerCallback

    kw = dict(save_steps=1, save_total_limit=2, eval_strategy="steps", eval_steps=1, metric_for_best_model="loss",
              greater_is_better=True, load_best_model_at_end=True)
    out = str(tmp_path / "out")
    t = make_trainer(out, config=_config(s3, 0), max_steps=4, **kw)
    t.train()
    best = t.state.best_model_checkpoint
    assert best.startswith(f"{s3.url}/checkpoint-"), best
    best_step = int(best.rsplit("-", 1)[1])
    kept = _committed(s3.url)
    assert kept == sorted({best_step, 4} if best_step != 4 else {3, 4}), kept
    assert sorted({k.split("/")[1] for k in s3.keys("run/checkpoint-")}) == [f"checkpoint-{s}" for s in kept]
    best_w = st.load(s3.read(f"run/checkpoint-{best_step}/model.safetensors"))
    for k, v in best_w.items():
        assert torch.equal(t.model.state_dict()[k], v), k

    class Seen(TrainerCallback):
        best_at_start: str | None = None

        def on_train_begin(self, args, state, control, **kw):
            self.best_at_start = state.best_model_checkpoint

    seen = Seen()
    r = make_trainer(out, config=_config(s3, 0), max_steps=5, callbacks=[seen], **kw)
    r.train(resume_from_checkpoint=True)
    assert (r.flashckpt_last_resume.source, r.flashckpt_last_resume.step) == ("storage", 4)
    assert seen.best_at_start == best  # the Trainer dropped it (no local dir); the adapter restored it


def test_urls_for_output_dir_and_unserved_schemes_are_refused(s3: Any, tmp_path: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from flashckpt import CheckpointDirError
    from flashckpt.integrations.hf import FlashCkptConfig

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(CheckpointDirError, match=r"no storage backend serves 'gs://b/p'.*s3://"):
        FlashCkptConfig(checkpoint_dir="gs://b/p")
    with pytest.raises(CheckpointDirError, match=r"FlashCkptConfig\(checkpoint_dir='s3://b/run'\)"):
        make_trainer("s3://b/run")
    with pytest.raises(ValueError, match="push_to_hub"):
        make_trainer(str(work / "out"), config=_config(s3), push_to_hub=True, hub_model_id="x/y")
    assert os.listdir(work) == [], "a local directory was made for a URL"


# ------------------------------------------------------------------------------------------ Accelerate
def test_accelerate_state_in_s3(s3: Any, tmp_path: Any) -> None:
    from flashckpt import CheckpointCorruptError
    from flashckpt.integrations.hf import AcceleratorCheckpointer, StorageType

    acc, model, opt, sched, step = accelerate_run()

    def state() -> tuple[dict, dict]:
        return weights(model), json.loads(json.dumps(opt.state_dict()["param_groups"]))

    saved = {}
    with AcceleratorCheckpointer(acc, s3.url) as ck:
        for i in (1, 2):
            step()
            where = ck.save_state(f"step_{i}", step=i)  # a path relative to the checkpoint dir
            assert where == f"{s3.url}/step_{i}"
            saved[i] = state()
        acc.save_state(str(tmp_path / "vanilla"))  # the layout to match
        step()
        ck.save_state(f"{s3.url}/step_3", step=3, storage_type=StorageType.MEMORY)
        saved[3] = state()
        step()
        loc = ck.load_state()
        assert (loc.source, loc.step) == ("memory", 3)
        assert_weights_equal(saved[3][0], weights(model))
        ck.wait()
    names = sorted(k.rsplit("/", 1)[1] for k in s3.keys("run/step_2/"))
    assert names == sorted(os.listdir(tmp_path / "vanilla"))

    step()
    # Memory released: from the store, where the end of the `with` block committed step 3 (memory only until
    # then: the saver's last words; the checkpointer attaches once they are done).
    with AcceleratorCheckpointer(acc, s3.url) as ck:
        assert _committed(s3.url) == [1, 2, 3]
        loc = ck.load_state()
        assert (loc.source, loc.step, loc.path) == ("storage", 3, f"{s3.url}/step_3")
        assert_weights_equal(saved[3][0], weights(model))
        assert state()[1] == saved[3][1]
        ck.load_state(f"{s3.url}/step_1")  # an explicit committed checkpoint
        assert_weights_equal(saved[1][0], weights(model))
        _damage(s3, "run/step_3/model.safetensors")
        loc = ck.load_state()  # falls back to the previous committed step
        assert (loc.source, loc.step) == ("storage", 2)
        assert_weights_equal(saved[2][0], weights(model))
        with pytest.raises(CheckpointCorruptError, match="step_3/model.safetensors"):
            ck.load_state(f"{s3.url}/step_3")
        with pytest.raises(ValueError, match="not a committed checkpoint"):
            ck.load_state(f"{s3.url}/step_4")

    step()
    acc.load_state(_download(s3, "run/step_1", str(tmp_path / "dl")))  # vanilla Accelerate reads a download
    assert_weights_equal(saved[1][0], weights(model))


def test_accelerate_refuses_unserved_schemes(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate import Accelerator
    from flashckpt import CheckpointDirError
    from flashckpt.integrations.hf import AcceleratorCheckpointer

    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointDirError, match="no storage backend serves"):
        AcceleratorCheckpointer(Accelerator(cpu=True), "gs://bucket/run")
    assert os.listdir(tmp_path) == []

