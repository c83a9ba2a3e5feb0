"""Pause per Lightning checkpoint: FlashCheckpointIO against TorchCheckpointIO and AsyncCheckpointIO.

One process, one model, interleaved rounds: in each round a fresh ``Trainer`` per plugin trains a few
steps of the same LightningModule (an MLP stack sized to ``--state-mb`` of weights + AdamW moments)
and calls ``trainer.save_checkpoint`` every ``--every`` steps, exactly as ``ModelCheckpoint`` does,
keeping the newest two files. Reported per plugin (median over all saves of all rounds):

- pause: wall time of ``trainer.save_checkpoint`` (Lightning's ``dump_checkpoint`` plus the plugin);
- durable: the extra time ``teardown`` waits until the last checkpoint is on storage;
- for flashckpt also the pause of a memory-only snapshot (``FlashMemorySnapshot``'s kind of save).

Usage: ``python -m benchmarks.bench_lightning [--state-mb 600] [--rounds 3] [--dir /tmp/x]``.
Informational only; never a test.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import lightning as L  # noqa: E402
from flashckpt.integrations.lightning import FlashCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO  # noqa: E402


class Stack(L.LightningModule):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.width = width
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x = torch.randn(2, self.width)
        return self.net(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(10_000)), batch_size=1)


class TimedSaves(Callback):
    """Saves every ``every`` steps like ModelCheckpoint (keeping the newest two) and times each save."""

    def __init__(self, root: str, every: int, memory: FlashCheckpointIO | None = None) -> None:
        self.root, self.every, self.memory = root, every, memory
        self.pauses: list[float] = []
        self.files: list[str] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step % self.every:
            return
        path = os.path.join(self.root, f"step={trainer.global_step}.ckpt")
        t0 = time.perf_counter()
        if self.memory is not None:
            with self.memory.memory_only():
                trainer.save_checkpoint(path)
        else:
            trainer.save_checkpoint(path)
            self.files.append(path)
            if len(self.files) > 2:
                trainer.strategy.remove_checkpoint(self.files.pop(0))
        self.pauses.append(time.perf_counter() - t0)


def run_one(kind: str, args: argparse.Namespace, root: str) -> tuple[list[float], float]:
    """Trains ``args.steps`` steps with plugin ``kind``; returns (pauses, seconds teardown waited)."""
    torch.manual_seed(0)
    model = Stack(args.width, args.layers)
    if kind == "torch":
        io: Any = TorchCheckpointIO()
    elif kind == "async":
        io = AsyncCheckpointIO(TorchCheckpointIO())
    else:
        io = FlashCheckpointIO(root)
    saves = TimedSaves(root, args.every, io if kind == "flash-memory" else None)
    waited = [0.0]

    class TimeTeardown(Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            t0 = time.perf_counter()
            trainer.strategy.checkpoint_io.teardown()
            waited[0] = time.perf_counter() - t0

    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, plugins=[io],
                        callbacks=[saves, TimeTeardown()])
    trainer.fit(model)
    return saves.pauses[1:] if len(saves.pauses) > 1 else saves.pauses, waited[0]  # the first save allocates


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-mb", type=float, default=600.0, help="weights + AdamW moments, fp32 (MB)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--dir", default="", help="checkpoint parent dir (default: a temp dir under /tmp)")
    p.add_argument("--json", default="", help="also write the figures to this file")
    args = p.parse_args(argv)
    args.width = 1024
    args.layers = max(1, round(args.state_mb * 1e6 / 12 / (args.width * args.width + args.width)))
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):  # one line per fit otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    base = tempfile.mkdtemp(prefix="bench-lightning-", dir=args.dir or None)
    kinds = ["torch", "async", "flash", "flash-memory"]
    pauses: dict[str, list[float]] = {k: [] for k in kinds}
    durable: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for r in range(args.rounds):
            for k in (kinds if r % 2 == 0 else kinds[::-1]):  # interleaved, alternating order
                root = os.path.join(base, f"{k}-{r}")
                ps, waited = run_one(k, args, root)
                pauses[k] += ps
                durable[k].append(waited)
                shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    mb = args.layers * (args.width * args.width + args.width) * 12 / 1e6
    print(f"Lightning {L.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs; checkpoint of "
          f"{mb:.0f} MB (weights + AdamW), {args.rounds} rounds x {args.steps // args.every - 1} timed saves "
          f"per plugin; files in {args.dir or tempfile.gettempdir()}")
    print(f"{'plugin':<34} {'pause median':>13} {'min':>8} {'max':>8} {'teardown wait':>14}")
    names = {"torch": "TorchCheckpointIO (default)", "async": "AsyncCheckpointIO(TorchCheckpointIO)",
             "flash": "FlashCheckpointIO (persisted)", "flash-memory": "FlashCheckpointIO memory-only"}
    out = {}
    for k in kinds:
        v = pauses[k]
        out[k] = {"pause_median_s": statistics.median(v), "pause_min_s": min(v), "pause_max_s": max(v),
                  "teardown_wait_median_s": statistics.median(durable[k]), "n": len(v)}
        print(f"{names[k]:<34} {statistics.median(v) * 1e3:>11.1f}ms {min(v) * 1e3:>6.1f}ms {max(v) * 1e3:>6.1f}ms "
              f"{statistics.median(durable[k]) * 1e3:>12.1f}ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"state_mb": mb, "rounds": args.rounds, "results": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
