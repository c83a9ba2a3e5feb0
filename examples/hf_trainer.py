"""A tiny causal LM trained with FlashCkptTrainer on CPU: checkpoints in memory, persisted in the background.

    python examples/hf_trainer.py --out /tmp/hf_run --crash-at 7    # killed with SIGKILL after step 7
    python examples/hf_trainer.py --out /tmp/hf_run --resume        # resumes from memory at step 7

The model is a 2-layer GPT-2 built from config (no downloads), the data synthetic. Every step is
snapshotted into shared memory (``memory_snapshot_steps=1``); every 5th step is also persisted as a
vanilla ``checkpoint-N/`` (``save_steps=5``), keeping the newest two (``save_total_limit=2``). After the
kill, flashckpt's saver keeps the snapshots (and persists the newest one), so the resumed run continues
from step 7, not from the persisted step 5. The second command finishes in a few seconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from flashckpt.integrations.hf import FlashCkptConfig, FlashCkptTrainer, get_last_checkpoint  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    """Random token sequences (a fixed seed, so reruns see the same data)."""

    def __init__(self, n: int = 256, length: int = 32, vocab: int = 128) -> None:
        self.x = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class CrashAt(TrainerCallback):
    """SIGKILLs this process once step ``step`` and its snapshot are done (a hard crash, no clean-up)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == self.step:
            print(f"killing the trainer after step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/flashckpt_hf_example")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--crash-at", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(a.out, max_steps=a.steps, per_device_train_batch_size=8, learning_rate=1e-3,
                             save_strategy="steps", save_steps=5, save_total_limit=2, logging_steps=1,
                             report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    trainer = FlashCkptTrainer(model=model, args=args, train_dataset=Tokens(),
                               callbacks=[CrashAt(a.crash_at)] if a.crash_at else [],
                               flashckpt_config=FlashCkptConfig(memory_snapshot_steps=1))
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    if trainer.flashckpt_last_resume is not None:
        r = trainer.flashckpt_last_resume
        print(f"resumed from {r.source} at step {r.step} ({r.path})")
    print(f"done at step {trainer.state.global_step}; newest committed checkpoint: {get_last_checkpoint(a.out)}")


if __name__ == "__main__":
    main()
