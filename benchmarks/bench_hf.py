"""How long the HuggingFace Trainer pauses per checkpoint: FlashCkptTrainer against the vanilla Trainer
saving the same checkpoint, in the same run.

    python -m benchmarks.bench_hf [--layers 8 --hidden 768 --vocab 8192] [--rounds 5]
    python benchmarks/bench_hf.py ...

One training run of a GPT-2 built from config (no downloads) on synthetic data. At every one of its
``--rounds`` checkpoints the same trainer state is saved twice, in alternating order: by
``FlashCkptTrainer._save_checkpoint`` (into shared memory; persisted in the background) and by
``transformers.Trainer._save_checkpoint`` (the vanilla writer, into a sibling directory). The pause is
the wall time of that call, what the training loop waits for. The vanilla writer's pause ends when its
files are in the page cache, not on the disk (it never fsyncs); the ``+ sync`` column adds an
``os.sync()`` to show what durability costs it. A memory-only snapshot (``memory_snapshot_steps``)
pauses as long as the flashckpt column. The first checkpoint (the segment is allocated, the saver
spawned) is reported separately. Informational only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks._common import fmt_bytes, fmt_time, markdown_table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir on the repo's disk)")
    a = p.parse_args(argv)

    from flashckpt.integrations.hf import FlashCkptConfig, FlashCkptTrainer
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    base = a.dir or tempfile.mkdtemp(prefix="bench_hf-", dir=os.path.join(os.path.dirname(__file__), ".."))
    flash_dir, vanilla_dir = os.path.join(base, "flash"), os.path.join(base, "vanilla")
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=a.layers, n_embd=a.hidden, n_head=max(1, a.hidden // 64), vocab_size=a.vocab,
                     n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    pauses: dict[str, list[float]] = {"flash": [], "vanilla": [], "vanilla_sync": []}
    first: dict[str, float] = {}

    class Bench(FlashCkptTrainer):
        """Saves every checkpoint both ways, alternating which goes first."""

        vanilla = False

        def _get_output_dir(self, trial: Any) -> str:
            return vanilla_dir if self.vanilla else super()._get_output_dir(trial)

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            order = ("flash", "vanilla") if len(pauses["flash"]) % 2 == 0 else ("vanilla", "flash")
            for kind in order:
                self.vanilla = kind == "vanilla"
                t0 = time.perf_counter()
                if self.vanilla:
                    Trainer._save_checkpoint(self, model, trial)
                    dt = time.perf_counter() - t0
                    os.sync()
                    synced = time.perf_counter() - t0
                else:
                    super()._save_checkpoint(model, trial)
                    dt = time.perf_counter() - t0
                self.vanilla = False
                if kind not in first:
                    first[kind] = dt
                    continue
                pauses[kind].append(dt)
                if kind == "vanilla":
                    pauses["vanilla_sync"].append(synced)

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 10_000

        def __getitem__(self, i: int) -> dict:
            x = torch.randint(0, a.vocab, (32,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": x, "labels": x}

    class Wait(TrainerCallback):
        """Lets the previous persist finish before the next checkpoint (a realistic save interval)."""

        def on_step_begin(self, args, state, control, **kw):
            if trainer._flash is not None:
                trainer._flash.wait()

    args = TrainingArguments(flash_dir, max_steps=a.rounds + 1, save_steps=1, per_device_train_batch_size=2,
                             report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=1000,
                             save_total_limit=2)
    trainer = Bench(model=model, args=args, train_dataset=Data(), callbacks=[Wait()],
                    flashckpt_config=FlashCkptConfig())
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    ck = os.path.join(vanilla_dir, f"checkpoint-{a.rounds + 1}")
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ck) for f in fs)
    med = {k: statistics.median(v) for k, v in pauses.items()}
    print(f"GPT-2 {a.layers} layers x {a.hidden}, vocab {a.vocab}: {n_params / 1e6:.1f} M params, checkpoint "
          f"{fmt_bytes(size)} (model.safetensors + optimizer.pt + ...), {len(pauses['flash'])} rounds "
          f"interleaved, medians; transformers {__import__('transformers').__version__}, torch {torch.__version__}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, run {total:.0f} s")
    print(markdown_table(
        ["checkpoint writer", "pause per checkpoint (median)", "min", "max", "first checkpoint"],
        [["FlashCkptTrainer (memory; persisted in background)", fmt_time(med["flash"]), fmt_time(min(pauses["flash"])),
          fmt_time(max(pauses["flash"])), fmt_time(first.get("flash", float("nan")))],
         ["vanilla Trainer (page cache)", fmt_time(med["vanilla"]), fmt_time(min(pauses["vanilla"])),
          fmt_time(max(pauses["vanilla"])), fmt_time(first.get("vanilla", float("nan")))],
         ["vanilla Trainer + os.sync()", fmt_time(med["vanilla_sync"]), fmt_time(min(pauses["vanilla_sync"])),
          fmt_time(max(pauses["vanilla_sync"])), ""]]))
    print(f"speed-up of the pause: {med['vanilla'] / med['flash']:.1f}x (page cache), "
          f"{med['vanilla_sync'] / med['flash']:.1f}x (durable)")
    if a.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
