"""A training script shaped like transformers' ``examples/pytorch/language-modeling/run_clm.py`` (5.x) with only
the Trainer class swapped for ``FlashCkptTrainer``: its logging set-up (stdout; the root logger at WARNING;
transformers' verbosity from ``--log_level``, whose default, passive, keeps the INFO run_clm sets first), ``TrainingArguments`` from the command line, and
``trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)`` (None unless
``--resume_from_checkpoint`` is given, then a string). A tiny GPT-2 built from config and synthetic data
stand in for the model and dataset downloads.

``--kill_at N`` SIGKILLs the worker once step N's memory snapshot is taken, on the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` 0). The last line is ``RESULT {json}``: the first step trained, the last,
and where ``train`` resumed from.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, TrainerCallback, TrainingArguments

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ScriptArguments:
    kill_at: int = 0
    memory_snapshot_steps: int = 1


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        self.x = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class _Probe(TrainerCallback):
    """Records the first step trained; kills the worker at the start of the step after ``kill_at`` (its
    memory snapshot is taken at the end of step ``kill_at``)."""

    def __init__(self, kill_at: int) -> None:
        self.kill_at = kill_at
        self.first: int | None = None

    def on_step_begin(self, args, state, control, **kw):
        if self.first is None:
            self.first = state.global_step + 1
        if self.kill_at and state.global_step == self.kill_at and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    from flashckpt.integrations.hf import FlashCkptConfig, FlashCkptTrainer

    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    script_args, training_args = parser.parse_args_into_dataclasses()
    # run_clm's logging set-up, as it is
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    probe = _Probe(script_args.kill_at)
    trainer = FlashCkptTrainer(model=model, args=training_args, train_dataset=_Data(), callbacks=[probe],
                               flashckpt_config=FlashCkptConfig(memory_snapshot_steps=script_args.memory_snapshot_steps))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    r = trainer.flashckpt_last_resume
    print("RESULT " + json.dumps({"first": probe.first, "last": trainer.state.global_step,
                                  "source": r.source if r else None, "step": r.step if r else None}), flush=True)


if __name__ == "__main__":
    main()
