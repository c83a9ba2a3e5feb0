"""A small GPT-like LightningModule trained on CPU with FlashCheckpointIO and FlashMemorySnapshot.

    python examples/lightning_train.py --steps 40 --checkpoint_dir /tmp/flashckpt-lightning \\
        --crash_at_step 23                       # dies with SIGKILL after step 23
    python examples/lightning_train.py --steps 40 --checkpoint_dir /tmp/flashckpt-lightning
                                                 # resumes at step 23, from shared memory

``ModelCheckpoint`` persists every ``--save_every`` steps (the newest two, and ``last.ckpt``);
``FlashMemorySnapshot`` snapshots every ``--snapshot_every`` steps to shared memory only. The run
resumes from ``FlashCheckpointIO.resume_path()``: the newest checkpoint in memory or on storage. The
data of step ``s`` comes from a generator seeded with ``s`` and the model has no dropout, so a run
that crashed and resumed ends with the weights of one that did not (``--reference`` trains one
without checkpointing and prints its digest). ``--devices 2`` runs DDP on two CPU processes.
``--crash_at_step`` kills the process only if it did not resume (so the second command goes through).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
from flashckpt.integrations.lightning import FlashCheckpointIO, FlashMemorySnapshot  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402


class TinyGPT(L.LightningModule):
    """Token and position embeddings, pre-norm transformer blocks, an LM head; AdamW with warm-up."""

    def __init__(self, vocab: int = 2048, d: int = 128, layers: int = 2, heads: int = 4, ctx: int = 32,
                 batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.mask: torch.Tensor
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        return self.head(self.ln(self.blocks(x, mask=self.mask[:t, :t], is_causal=True)))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        hp: Any = self.hparams
        g = torch.Generator().manual_seed(self.global_step)  # the data of a step depends on the step only
        x = torch.randint(0, hp.vocab, (hp.batch_size, hp.ctx + 1), generator=g)
        logits = self(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, hp.vocab), x[:, 1:].reshape(-1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        # The batches come from training_step; the loader only paces the loop.
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(1000)), batch_size=1)


class Report(Callback):
    """Records where training started, and kills the process after ``crash_at`` (when not resumed)."""

    def __init__(self, crash_at: int) -> None:
        self.crash_at = crash_at
        self.start = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.crash_at and self.start == 0:
            print(f"crashing (SIGKILL) after step {self.crash_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        t = v.detach().contiguous()
        h.update(k.encode())
        h.update(ctypes.string_at(t.data_ptr(), t.nbytes))
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--checkpoint_dir", default="/tmp/flashckpt-lightning")
    p.add_argument("--save_every", type=int, default=10, help="ModelCheckpoint interval (persisted)")
    p.add_argument("--snapshot_every", type=int, default=1, help="FlashMemorySnapshot interval (memory only)")
    p.add_argument("--crash_at_step", type=int, default=-1)
    p.add_argument("--devices", type=int, default=1, help="2: DDP on two CPU processes (gloo)")
    p.add_argument("--reference", action="store_true", help="train without checkpointing; print the digest")
    p.add_argument("--fresh", action="store_true", help="ignore existing checkpoints")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT()
    report = Report(args.crash_at_step)
    common: dict[str, Any] = {"max_steps": args.steps, "accelerator": "cpu", "devices": args.devices, "logger": False,
              "enable_progress_bar": False, "enable_model_summary": False,
              "strategy": "ddp" if args.devices > 1 else "auto"}
    if args.reference:
        trainer = L.Trainer(enable_checkpointing=False, callbacks=[report], **common)
        trainer.fit(model)
        if trainer.is_global_zero:
            print(json.dumps({"reference_digest": digest(model), "steps": trainer.global_step}))
        return 0

    ckpt_io = FlashCheckpointIO(args.checkpoint_dir)
    resume = None if args.fresh else ckpt_io.resume_path()
    callbacks = [
        FlashMemorySnapshot(every_n_train_steps=args.snapshot_every), report,
        ModelCheckpoint(dirpath=args.checkpoint_dir, every_n_train_steps=args.save_every, save_top_k=2,
                        monitor="step", mode="max", save_last=True),
    ]
    trainer = L.Trainer(plugins=[ckpt_io], callbacks=callbacks, **common)
    t0 = time.perf_counter()
    trainer.fit(model, ckpt_path=resume)
    if trainer.is_global_zero:
        print(json.dumps({"resumed_from": resume, "load": ckpt_io.last_load and ckpt_io.last_load[0],
                          "start_step": report.start, "steps": trainer.global_step,
                          "seconds": round(time.perf_counter() - t0, 2), "digest": digest(model),
                          "files": sorted(f for f in os.listdir(args.checkpoint_dir) if f.endswith(".ckpt"))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
