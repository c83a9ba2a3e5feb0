"""FlashCkptTrainer and AcceleratorCheckpointer with the real transformers / accelerate / peft on a tiny GPT-2
built from config (2 layers, hidden 32), synthetic data, no downloads.

- continuity: a vanilla Trainer runs N steps; FlashCkptTrainer runs N/2 in a subprocess that is killed
  with SIGKILL (last words off, so storage holds an older step than memory); a new FlashCkptTrainer
  resumes from memory and finishes: identical final weights and identical logged losses. The persisted
  checkpoint has the vanilla file set, and a vanilla Trainer resumes from it to the same weights.
  A malformed or uncommitted ``checkpoint-N`` is never picked.
- save_total_limit with a save every step and best-model tracking; save_total_limit=1 with a best
  checkpoint while the last persist is held (the Trainer's end-of-training deletion never races it);
  ``trainer.get_last_checkpoint()`` resuming from memory; DDP and DeepSpeed ZeRO-2 on 2 gloo
  ranks (resume from memory after a failure; one launch for both); PEFT/LoRA; the Accelerate helper;
  FSDP refused.

Run as a script (``python test_hf.py crash OUT KILL_AT``) this file is the training process the
kill -9 test kills.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest
from helpers import run_ranks, wait_for

pytest.importorskip("transformers")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

# save_pretrained's progress bar would start tqdm's monitor thread, which outlives the test that started
# it (the suite fails tests that leak threads); the bar itself stays.
tqdm.monitor_interval = 0

TESTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")  # the support code's folder
REPO = os.path.dirname(os.path.dirname(TESTS_DIR))
N_STEPS = 8
VOCAB = 64


# ------------------------------------------------------------------------------------------ building blocks
@pytest.fixture(autouse=True)
def _hf_env(monkeypatch):
    """No downloads; DeepSpeed on CPU. Accelerate's CUDA probe may leave PYTORCH_NVML_BASED_CUDA_CHECK set."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # recorded, so teardown restores it
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")


def _env() -> None:
    torch.set_num_threads(1)  # bit-identical math across processes


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, VOCAB, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg)  # lm_head is tied to the token embedding


def train_args(out: str, **kw):
    from transformers import TrainingArguments

    base = dict(max_steps=N_STEPS, per_device_train_batch_size=4, save_strategy="steps", save_steps=3,
                logging_steps=1, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
                dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(out, **base)


def make_trainer(out: str, *, vanilla: bool = False, model=None, callbacks=(), config=None, **kw):
    from flashckpt.integrations.hf import FlashCkptConfig, FlashCkptTrainer
    from transformers import Trainer

    _env()
    args = train_args(out, **kw)
    eval_ds = _Data(8, seed=2) if kw.get("eval_strategy", "no") != "no" else None
    common = dict(model=model if model is not None else tiny_gpt2(), args=args, train_dataset=_Data(),
                  eval_dataset=eval_ds, callbacks=list(callbacks))
    if vanilla:
        return Trainer(**common)
    return FlashCkptTrainer(**common, flashckpt_config=config or FlashCkptConfig(memory_snapshot_steps=1))


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_weights_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def losses(trainer, after: int = 0) -> dict:
    return {h["step"]: (h["loss"], h["grad_norm"]) for h in trainer.state.log_history
            if "loss" in h and h["step"] > after}


def _stopper(at: int, how: str):
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        """Fails the run at the beginning of step at+1: step ``at`` and its snapshot are complete."""

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == at:
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"simulated failure after step {at}")

    return Stop()


def layout(out: str) -> Any:
    from flashckpt.commit.layout import CommitLayout
    from flashckpt.storage.posix import PosixDiskStorage

    return CommitLayout(out, PosixDiskStorage())


def committed(out: str) -> list[int]:
    return layout(out).committed_steps()


def checkpoint_dirs(out: str) -> list[str]:
    return sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))


def tree_equal(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(map(str, b))} != {sorted(map(str, a))}"
        for k in a:
            tree_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            tree_equal(x, y, f"{where}[{i}]")
    elif type(a).__module__ == "numpy":
        import numpy as np

        assert np.array_equal(a, b), where
    else:
        assert a == b, f"{where}: {b!r} != {a!r}"


def assert_same_checkpoint(ours: str, vanilla: str) -> None:
    """Same files; the same tensors, optimizer, scheduler, RNG and trainer state."""
    import safetensors.torch as st

    files = lambda d: sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)  # noqa: E731
    assert files(ours) == files(vanilla)
    for name in files(vanilla):
        a, b = os.path.join(vanilla, name), os.path.join(ours, name)
        if name.endswith(".safetensors"):
            tree_equal(st.load_file(a), st.load_file(b), name)
            with st.safe_open(a, "pt") as fa, st.safe_open(b, "pt") as fb:
                assert fa.metadata() == fb.metadata()
        elif name.endswith(".json"):
            with open(a) as fa, open(b) as fb:
                assert json.load(fa) == json.load(fb), name
        elif name in ("optimizer.pt", "scheduler.pt"):
            tree_equal(torch.load(a, weights_only=True), torch.load(b, weights_only=True), name)
        elif name.startswith("rng_state"):
            tree_equal(torch.load(a, weights_only=False), torch.load(b, weights_only=False), name)


# ------------------------------------------------------------------------------------------ the crashing run
def _crash_main(out: str, kill_at: int) -> None:
    trainer = make_trainer(out, callbacks=[_stopper(kill_at, "kill")])
    trainer.train()
    raise SystemExit("the run was supposed to be killed")


# ------------------------------------------------------------------------------------------ tests
def test_continuity_kill9_resume_from_memory_and_vanilla_format(tmp_path):
    """N steps vanilla == N/2 steps, kill -9, resume from memory, finish (weights and losses)."""
    ref_dir, out = str(tmp_path / "vanilla"), str(tmp_path / "flash")
    ref = make_trainer(ref_dir, vanilla=True)
    ref.train()
    ref_w, ref_losses = weights(ref.model), losses(ref)
    assert len(ref_losses) == N_STEPS

    env = dict(os.environ, FLASHCKPT_LAST_WORDS="0", PYTHONPATH=os.pathsep.join([REPO, TESTS_DIR]))
    half = N_STEPS // 2
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "crash", out, str(half)], env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=240)
    assert p.returncode == -signal.SIGKILL, p.stdout.decode()[-3000:] + p.stderr.decode()[-3000:]
    # Storage holds step 3 (save_steps=3; the saver finishes that persist after the kill); memory holds
    # step 4, newer, and only memory.
    wait_for(lambda: committed(out) == [3], 60, "the in-flight persist of step 3 to commit")
    assert_same_checkpoint(os.path.join(out, "checkpoint-3"), os.path.join(ref_dir, "checkpoint-3"))

    # A partial checkpoint dir (what a crash mid-write of a vanilla save leaves) is never picked.
    bad = os.path.join(out, "checkpoint-99")
    os.makedirs(bad)
    with open(os.path.join(bad, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 99}, f)
    with open(os.path.join(bad, "model.safetensors"), "wb") as f:
        f.write(b"\0" * 10)
    from flashckpt.integrations.hf import get_last_checkpoint

    assert get_last_checkpoint(out) == os.path.join(out, "checkpoint-3")

    resumed = make_trainer(out)
    resumed.train(resume_from_checkpoint=True)
    loc = resumed.flashckpt_last_resume
    assert (loc.source, loc.step) == ("memory", half)
    assert_weights_equal(ref_w, weights(resumed.model))
    assert losses(resumed, after=half) == {s: v for s, v in ref_losses.items() if s > half}
    assert committed(out) == [3, 6, 8]
    assert get_last_checkpoint(out, verify=True) == os.path.join(out, "checkpoint-8")
    assert_same_checkpoint(os.path.join(out, "checkpoint-6"), os.path.join(ref_dir, "checkpoint-6"))

    # A vanilla Trainer resumes from the persisted checkpoint to the same weights.
    vanilla = make_trainer(str(tmp_path / "v2"), vanilla=True)
    vanilla.train(resume_from_checkpoint=os.path.join(out, "checkpoint-6"))
    assert_weights_equal(ref_w, weights(vanilla.model))


def test_resume_never_picks_uncommitted_or_partial_checkpoints(tmp_path):
    """A checkpoint still being persisted is refused as an explicit resume path; resume=True and
    get_last_checkpoint skip it and a malformed checkpoint dir, and pick the newest committed one."""
    out = str(tmp_path / "flash")
    t = make_trainer(out, max_steps=2, save_steps=1, config=_config(0))
    t.train()
    assert committed(out) == [1, 2]
    t2 = make_trainer(out, max_steps=3, save_steps=1, config=_config(0))
    t2.flashckpt_engine()  # its saver is up: what follows looks like a persist of step 5 in flight
    steps_dir = layout(out).step_dir(5)
    os.makedirs(steps_dir)
    with open(os.path.join(steps_dir, "intent_rank_0.json"), "w") as f:
        json.dump({"rank": 0, "paths": ["checkpoint-5/trainer_state.json"]}, f)
    for step in (5, 99):  # 99: a malformed dir flashckpt knows nothing about
        os.makedirs(os.path.join(out, f"checkpoint-{step}"))
        with open(os.path.join(out, f"checkpoint-{step}", "trainer_state.json"), "w") as f:
            json.dump({"global_step": step}, f)
    from flashckpt.integrations.hf import get_last_checkpoint

    assert get_last_checkpoint(out) == os.path.join(out, "checkpoint-2")
    with pytest.raises(ValueError, match="not committed"):
        t2.train(resume_from_checkpoint=os.path.join(out, "checkpoint-5"))
    assert committed(out) == [1, 2]  # nothing lost
    t3 = make_trainer(out, max_steps=3, save_steps=1, config=_config(0))
    t3.train(resume_from_checkpoint=True)
    assert (t3.flashckpt_last_resume.source, t3.flashckpt_last_resume.step) == ("storage", 2)
    assert t3.state.global_step == 3 and committed(out) == [1, 2, 3]


def _config(every: int):
    from flashckpt.integrations.hf import FlashCkptConfig

    return FlashCkptConfig(memory_snapshot_steps=every)


def test_output_dir_lists_what_a_vanilla_trainer_writes(tmp_path):
    """The output dir and every checkpoint dir in it hold exactly the entries a vanilla Trainer's do:
    flashckpt's records live beside the output dir."""
    ours, theirs = str(tmp_path / "flash"), str(tmp_path / "vanilla")
    make_trainer(theirs, vanilla=True, save_total_limit=2).train()
    make_trainer(ours, save_total_limit=2).train()
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs)) == ["checkpoint-6", "checkpoint-8"]
    for name in os.listdir(theirs):
        assert sorted(os.listdir(os.path.join(ours, name))) == sorted(os.listdir(os.path.join(theirs, name))), name
    assert committed(ours) == [6, 8] and layout(ours).meta == str(tmp_path / ".flashckpt" / "flash")


def test_an_object_store_url_as_output_dir_is_refused_before_training(tmp_path, monkeypatch):
    """``output_dir="s3://..."`` is refused with what to do when the Trainer is built (the output dir keeps
    the logs and the final model and stays local; checkpoints go to a store through
    ``FlashCkptConfig(checkpoint_dir=...)``, see tests/framework/test_hf_s3.py), and nothing is written locally (it
    used to be written to ``./s3:/bucket/run``)."""
    from flashckpt import CheckpointDirError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointDirError, match=r"must be a local directory.*checkpoint_dir='s3://bucket/run'"):
        make_trainer("s3://bucket/run")
    assert os.listdir(tmp_path) == []


def test_save_total_limit_fast_saves_and_best_model(tmp_path):
    """A save every step with save_total_limit=2 and the best checkpoint tracked: the newest and the best
    survive, every surviving dir is committed, and the best model is loaded at the end. (The metric is the
    eval loss with greater_is_better=True, so the "best" step is usually an old one that must be kept.)"""
    import safetensors.torch as st

    out = str(tmp_path / "flash")
    t = make_trainer(out, save_steps=1, save_total_limit=2, eval_strategy="steps", eval_steps=1,
                     metric_for_best_model="loss", greater_is_better=True, load_best_model_at_end=True,
                     config=_config(0))
    t.train()
    best = t.state.best_model_checkpoint
    best_step = int(best.rsplit("-", 1)[1])
    kept = committed(out)
    # As the Trainer rotates: the newest and the best are protected, then the newest up to the limit.
    assert kept == sorted({best_step, N_STEPS} if best_step != N_STEPS else {N_STEPS - 1, N_STEPS}), kept
    assert checkpoint_dirs(out) == sorted(f"checkpoint-{s}" for s in kept)
    best_w = st.load_file(os.path.join(best, "model.safetensors"))
    for k, v in best_w.items():
        assert torch.equal(t.model.state_dict()[k], v), k


def _hold_last_persist(runtime_dir: str, last: int, fallback_s: float):
    """A callback that waits for the persists in flight, then freezes the saver's persist worker
    (SIGSTOP) at the end of step ``last``, before that step's save, and lets it go on (SIGCONT) in ``on_train_end`` (called after the Trainer's
    end-of-training clean-up) or ``fallback_s`` after that save, whichever comes first. So the last
    checkpoint's persist is still under way while the Trainer finishes, however fast the disk is."""
    import threading

    from helpers import child_pids, saver_pids
    from transformers import TrainerCallback

    class Hold(TrainerCallback):
        def __init__(self) -> None:
            self.frozen: list[int] = []
            self.trainer = None  # the FlashCkptTrainer it is given to
            self.timer: threading.Timer | None = None
            self.lock = threading.Lock()
            self.released_by = ""

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == last:
                # The earlier persists first: one frozen with its slot pinned would block the next save.
                self.trainer.flashckpt_wait()
                (saver,) = saver_pids(runtime_dir)
                self.frozen = child_pids(saver)
                assert self.frozen, "the saver has no persist worker to freeze"
                for pid in self.frozen:
                    os.kill(pid, signal.SIGSTOP)

        def on_save(self, args, state, control, **kw):
            if state.global_step == last and self.frozen:
                self.timer = threading.Timer(fallback_s, self.release, ("the fallback timer",))
                self.timer.start()

        def on_train_end(self, args, state, control, **kw):
            self.release("on_train_end")

        def release(self, by: str) -> None:
            with self.lock:
                frozen, self.frozen = self.frozen, []
                if frozen and not self.released_by:
                    self.released_by = by
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)

        def close(self) -> None:
            self.release("close")
            if self.timer is not None:
                self.timer.cancel()
                self.timer.join()

    return Hold()


def test_save_total_limit_1_with_best_never_races_a_persist(tmp_path, runtime_dir, monkeypatch):
    """save_total_limit=1 with a best checkpoint (not the newest): at the end of training the Trainer
    deletes every checkpoint but the best. The last checkpoint's persist is held (its worker SIGSTOPped)
    until that clean-up ran or 4 s passed: the end state must still be the vanilla Trainer's, file for
    file, with only the best step committed. (Unfixed, the clean-up ran before the persist wrote
    ``checkpoint-8``: it survived, or was deleted half-written and train() raised a PersistError.)"""
    monkeypatch.setenv("FLASHCKPT_PERSIST_WORKER_IDLE_S", "600")  # the worker is there to freeze at step 8
    kw = dict(save_steps=1, save_total_limit=1, eval_strategy="steps", eval_steps=1, metric_for_best_model="loss",
              greater_is_better=True)  # the eval loss falls: the best is an early step
    ref_dir, out = str(tmp_path / "vanilla"), str(tmp_path / "flash")
    ref = make_trainer(ref_dir, vanilla=True, **kw)
    ref.train()
    best = os.path.basename(ref.state.best_model_checkpoint)
    assert best != f"checkpoint-{N_STEPS}" and checkpoint_dirs(ref_dir) == [best]

    hold = _hold_last_persist(runtime_dir, N_STEPS, 4.0)
    t = hold.trainer = make_trainer(out, callbacks=[hold], config=_config(0), **kw)
    try:
        t.train()
    finally:
        hold.close()
    assert t.state.best_model_checkpoint == os.path.join(out, best)
    assert checkpoint_dirs(out) == [best]
    assert committed(out) == [int(best.rsplit("-", 1)[1])]
    ours, theirs = os.path.join(out, best), os.path.join(ref_dir, best)
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    import safetensors.torch as st

    tree_equal(st.load_file(os.path.join(theirs, "model.safetensors")), st.load_file(os.path.join(ours, "model.safetensors")))
    for d in (ours, theirs):  # the same state but for the run dir and eval timings
        with open(os.path.join(d, "trainer_state.json")) as f:
            state = json.load(f)
        state["best_model_checkpoint"] = os.path.basename(state["best_model_checkpoint"])
        state["log_history"] = [{k: v for k, v in h.items() if "runtime" not in k and "per_second" not in k}
                                for h in state["log_history"]]
        if d == ours:
            ours_state = state
    assert ours_state == state
    from flashckpt.integrations.hf import get_last_checkpoint

    assert get_last_checkpoint(out, verify=True) == os.path.join(out, best)
    assert hold.released_by == "the fallback timer"  # train() waited for the held persist before the clean-up


def test_get_last_checkpoint_method_resumes_from_memory(tmp_path):
    """The DLRover idiom ``trainer.train(resume_from_checkpoint=trainer.get_last_checkpoint())``: None in
    an empty dir; after a failure at step 5 (storage: step 3, memory: step 5) the path of
    ``checkpoint-5``, from which train() resumes from memory, matching an uninterrupted vanilla run; once
    everything is committed and memory released, the newest committed checkpoint."""
    ref = make_trainer(str(tmp_path / "vanilla"), vanilla=True)
    ref.train()
    out = str(tmp_path / "flash")
    fresh = make_trainer(out)
    assert fresh.get_last_checkpoint() is None
    fresh.flashckpt_close()
    with pytest.raises(RuntimeError, match="simulated"):
        make_trainer(out, callbacks=[_stopper(5, "raise")]).train()
    r = make_trainer(out)
    last = r.get_last_checkpoint()
    assert last == os.path.join(out, "checkpoint-5")
    r.train(resume_from_checkpoint=last)
    assert (r.flashckpt_last_resume.source, r.flashckpt_last_resume.step) == ("memory", 5)
    assert_weights_equal(weights(ref.model), weights(r.model))
    assert losses(r, after=5) == losses(ref, after=5)
    after = make_trainer(out)
    assert after.get_last_checkpoint() == os.path.join(out, f"checkpoint-{N_STEPS}")
    after.flashckpt_close()
    on_vanilla = make_trainer(str(tmp_path / "vanilla"))  # a directory only a vanilla Trainer wrote to
    assert on_vanilla.get_last_checkpoint() == os.path.join(str(tmp_path / "vanilla"), f"checkpoint-{N_STEPS}")
    on_vanilla.flashckpt_close()


# ------------------------------------------------------------------------------------------ PEFT
def test_lora_resume_from_memory(tmp_path):
    """A PEFT LoRA model (tiny Llama): the checkpoint holds the adapter files, not the base weights; a
    failure after step 3 and a resume from memory match a vanilla uninterrupted run."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    def lora_model():
        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32)
        return peft.get_peft_model(LlamaForCausalLM(cfg), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    def adapter(m) -> dict:
        return {k: v.detach().clone() for k, v in m.state_dict().items() if "lora_" in k}

    kw = dict(max_steps=4, save_steps=2, learning_rate=1e-2)
    u = make_trainer(str(tmp_path / "u"), model=lora_model(), vanilla=True, **kw)
    u.train()
    out = str(tmp_path / "i")
    with pytest.raises(RuntimeError, match="simulated"):
        make_trainer(out, model=lora_model(), callbacks=[_stopper(3, "raise")], **kw).train()
    r = make_trainer(out, model=lora_model(), **kw)
    r.train(resume_from_checkpoint=True)
    assert (r.flashckpt_last_resume.source, r.flashckpt_last_resume.step) == ("memory", 3)
    assert_weights_equal(adapter(u.model), adapter(r.model))
    files = sorted(os.listdir(os.path.join(out, "checkpoint-2")))
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    assert "model.safetensors" not in files and "optimizer.pt" in files


# ------------------------------------------------------------------------------------------ Accelerate
def accelerate_run():
    """A seeded MLP, AdamW and a StepLR prepared by a CPU ``Accelerator``: (acc, model, opt, sched, step), where
    ``step()`` runs one training step."""
    from accelerate import Accelerator

    _env()
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    model, opt, sched = acc.prepare(model, opt, sched)

    def step() -> None:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()

    return acc, model, opt, sched, step


def test_accelerate_save_load_state(tmp_path):
    from flashckpt.integrations.hf import AcceleratorCheckpointer, StorageType

    acc, model, opt, sched, step = accelerate_run()

    ckdir = str(tmp_path / "ck")
    with AcceleratorCheckpointer(acc, ckdir) as ck:
        step()
        disk = ck.save_state(os.path.join(ckdir, "step_1"), step=1)
        acc.save_state(str(tmp_path / "vanilla"))  # the layout to match
        step()
        ck.save_state(os.path.join(ckdir, "step_2"), step=2, storage_type=StorageType.MEMORY)
        want = weights(model)
        want_opt = copy.deepcopy(opt.state_dict())
        step()
        loc = ck.load_state()
        assert (loc.source, loc.step) == ("memory", 2)
        assert_weights_equal(want, weights(model))
        tree_equal(want_opt, opt.state_dict())
        ck.wait()
    assert sorted(os.listdir(disk)) == sorted(os.listdir(tmp_path / "vanilla"))
    acc.load_state(disk)  # vanilla Accelerate reads it


# ------------------------------------------------------------------------------------------ 2 ranks: DDP, DeepSpeed
def ddp_worker(base: str) -> dict:
    """2 gloo ranks: a vanilla Trainer uninterrupted vs FlashCkptTrainer failing after step 3 (storage has
    step 2) and resuming from memory: same final weights and losses on both ranks."""
    import hashlib

    def digest(model) -> str:
        h = hashlib.sha256()
        for k, v in sorted(model.state_dict().items()):
            h.update(k.encode())
            h.update(v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    kw = dict(max_steps=4, save_steps=2, per_device_train_batch_size=2)
    u = make_trainer(os.path.join(base, "u"), vanilla=True, **kw)
    u.train()
    out = os.path.join(base, "i")
    try:
        make_trainer(out, callbacks=[_stopper(3, "raise")], **kw).train()
        raise AssertionError("the run should have failed")
    except RuntimeError as e:
        assert "simulated failure" in str(e)
    r = make_trainer(out, **kw)
    r.train(resume_from_checkpoint=True)
    loc = r.flashckpt_last_resume
    ck = os.path.join(out, "checkpoint-2")
    return {"u": digest(u.model), "r": digest(r.model), "source": loc.source, "step": loc.step,
            "files": sorted(os.listdir(ck)), "losses_u": losses(u, 3), "losses_r": losses(r, 3)}


def deepspeed_worker(base: str) -> dict:
    """ZeRO-2 through the Trainer on CPU (a torch optimizer, so no op is compiled): a failure after step 3
    (storage has step 2) and a resume from memory, against a vanilla Trainer with DeepSpeed resuming from
    the step-2 checkpoint flashckpt persisted: both must finish with the same weights and losses."""
    from flashckpt.integrations.hf import FlashCkptTrainer
    from transformers import Trainer

    ds = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}

    def build(out, callbacks=(), cls=FlashCkptTrainer):
        _env()
        model = tiny_gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
        kw = {"flashckpt_config": _config(1)} if cls is FlashCkptTrainer else {}
        return cls(model=model, args=train_args(out, max_steps=4, save_steps=2, per_device_train_batch_size=2,
                                                deepspeed=ds),
                   train_dataset=_Data(), optimizers=(opt, None), callbacks=list(callbacks), **kw)

    def same(a, b) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values(),
                                                     strict=True))

    out = os.path.join(base, "i")
    try:
        build(out, [_stopper(3, "raise")]).train()
        raise AssertionError("the run should have failed")
    except RuntimeError as e:
        assert "simulated failure" in str(e)
    r = build(out)
    r.train(resume_from_checkpoint=True)
    v = build(os.path.join(base, "v"), cls=Trainer)
    v.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    ck = os.path.join(out, "checkpoint-2")
    files = sorted(os.path.relpath(os.path.join(d, f), ck) for d, _, fs in os.walk(ck) for f in fs)
    return {"same": same(v, r), "source": r.flashckpt_last_resume.source, "step": r.flashckpt_last_resume.step,
            "files": files, "losses_v": losses(v, 3), "losses_r": losses(r, 3)}


def two_rank_worker(base: str) -> dict:
    """The DDP scenario, then the DeepSpeed one, in the same two processes (one start-up for both)."""
    out = {"ddp": ddp_worker(os.path.join(base, "ddp")), "ds": None}
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return out
    out["ds"] = deepspeed_worker(os.path.join(base, "ds"))
    return out


@pytest.mark.multiproc
def test_two_ranks_ddp_and_deepspeed_zero2(tmp_path):
    """DDP and DeepSpeed ZeRO-2 through the Trainer on 2 gloo ranks (CPU): resume from memory after a
    failure matches an uninterrupted vanilla run; one checkpoint-N holds every rank's files."""
    res = run_ranks(two_rank_worker, 2, str(tmp_path / "w"), args={"base": str(tmp_path)}, timeout=400,
                    env={"HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": REPO,
                         "MASTER_PORT": str(29500 + os.getpid() % 1000)})
    ddp = [r["ddp"] for r in res]
    for r in ddp:
        assert r["u"] == r["r"] and (r["source"], r["step"]) == ("memory", 3)
        assert r["losses_u"] == r["losses_r"] and len(r["losses_r"]) == 1
    assert ddp[0]["u"] == ddp[1]["u"]
    assert ddp[0]["files"] == ["config.json", "generation_config.json", "model.safetensors", "optimizer.pt",
                               "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json",
                               "training_args.bin"]
    if res[0]["ds"] is None:
        pytest.skip("deepspeed is not installed (the DDP part passed)")
    for r in (x["ds"] for x in res):
        assert (r["source"], r["step"]) == ("memory", 3)
        assert r["same"] and r["losses_v"] == r["losses_r"] and len(r["losses_r"]) == 1
    files = res[0]["ds"]["files"]
    for name in ("global_step2/mp_rank_00_model_states.pt", "global_step2/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt", "latest", "model.safetensors",
                 "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json"):
        assert name in files, (name, files)


def _state_digest(model, opt) -> str:
    """sha256 of the weights and the optimizer's state, by key (the same whatever the number of ranks)."""
    import hashlib

    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode() + v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for i, st in sorted(opt.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{i}.{k}".encode() + v.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _digests(at: int | None, out: dict):
    """A callback putting the state's digest in ``out``: after step ``at``'s snapshot (None: at the start of a
    resumed training, right after the Trainer loaded its checkpoint)."""
    from transformers import TrainerCallback

    class Digest(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            if at is not None and state.global_step == at:
                out["digest"] = _state_digest(model, optimizer)

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
            if at is None:
                out["digest"], out["step"] = _state_digest(model, optimizer), state.global_step

    return Digest()


def hf_two_ranks_fail_worker(out_dir: str) -> dict:
    """FlashCkptTrainer on 2 gloo ranks (DDP), a snapshot every step, failing after step 3: the snapshots stay."""
    got: dict = {}
    try:
        make_trainer(out_dir, callbacks=[_stopper(3, "raise"), _digests(3, got)], max_steps=4, save_steps=10,
                     per_device_train_batch_size=2).train()
        raise AssertionError("the run should have failed")
    except RuntimeError as e:
        assert "simulated failure" in str(e)
    return got


def hf_one_rank_resume_worker(out_dir: str) -> dict:
    got: dict = {}
    r = make_trainer(out_dir, callbacks=[_digests(None, got)], max_steps=4, save_steps=10,
                     per_device_train_batch_size=2)
    r.train(resume_from_checkpoint=True)
    loc = r.flashckpt_last_resume
    return {**got, "source": loc.source, "resumed": loc.step}


@pytest.mark.multiproc
def test_ddp_job_that_comes_back_with_one_rank_resumes_from_memory(tmp_path):
    """The Trainer with DDP on 2 ranks fails after step 3 (nothing on storage); the job comes back with 1 rank:
    it resumes step 3 from the 2 ranks' snapshots in memory (the union of their files: weights, optimizer,
    scheduler, state, each rank's RNG state), with the weights and optimizer state step 3 had."""
    out = str(tmp_path / "out")
    env = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO, "FLASHCKPT_SAVER_GRACE_S": "120"}
    saved = run_ranks(hf_two_ranks_fail_worker, 2, str(tmp_path / "two"), args={"out_dir": out}, timeout=300,
                      env={**env, "MASTER_PORT": str(29500 + os.getpid() % 1000)})
    (r,) = run_ranks(hf_one_rank_resume_worker, 1, str(tmp_path / "one"), args={"out_dir": out}, timeout=300,
                     env={**env, "MASTER_PORT": str(30500 + os.getpid() % 1000)})
    assert (r["source"], r["resumed"], r["step"]) == ("memory", 3, 3), r
    assert r["digest"] == saved[0]["digest"] == saved[1]["digest"], "the resumed state is not step 3's"


def test_fsdp_is_refused(tmp_path, monkeypatch):
    """accelerate's FSDP does not run on CPU (the Trainer wants several processes and accelerate leaves
    FSDP off on CPU), so it cannot be verified here and FlashCkptTrainer refuses it. FSDP being on is
    simulated (the one stand-in of this file): the accelerator set-up reports FSDP."""
    from flashckpt.integrations.hf import FlashCkptTrainer

    orig = FlashCkptTrainer.create_accelerator_and_postprocess

    def with_fsdp(self):
        orig(self)
        self.is_fsdp_enabled = True

    monkeypatch.setattr(FlashCkptTrainer, "create_accelerator_and_postprocess", with_fsdp)
    with pytest.raises(ValueError, match="FSDP through the Trainer is not supported"):
        make_trainer(str(tmp_path / "f"), max_steps=1)


if __name__ == "__main__":
    if sys.argv[1] == "crash":
        sys.path[:0] = [REPO, TESTS_DIR]
        _crash_main(sys.argv[2], int(sys.argv[3]))
