"""The HF Trainer's checkpoint folders as flashckpt sees them: which ``checkpoint-N`` to resume from
(``get_last_checkpoint``), the Trainer's retention (``save_total_limit`` and the best checkpoint), and a
memory snapshot (or a download from a store) laid out for the Trainer's own loaders (``MemoryView``).

Imports torch, safetensors (lazily) and flashckpt's core; not transformers (``flashckpt.integrations.hf``
does). Nothing here is collective; one training thread.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from flashckpt import CheckpointEngine, FileSet
from flashckpt import errors as E
from flashckpt.commit.layout import CommitLayout
from flashckpt.commit.retention import CheckpointDeletionStrategy
from flashckpt.engine.engine import local_dir
from flashckpt.engine.routing import step_of
from flashckpt.format.files import FileEntry
from flashckpt.integrations._kit_files import SnapshotDir, committed_step_of, fetch_step, scratch_root
from flashckpt.storage import locations, registry
from flashckpt.storage.registry import storage_for

__all__ = ["get_last_checkpoint", "last_checkpoint", "checkpoint_step", "checkpoint_location", "TrainerRetention",
           "MemoryView", "materialize", "fetch_view", "check_committed", "delete_all_but", "local_output_dir", "PREFIX", "TRAINER_STATE", "OPTIMIZER", "SCHEDULER"]


log = logging.getLogger(__name__)

PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
CHECKPOINT_RE = re.compile(rf"^{PREFIX}-(\d+)$")
SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
TRAINER_STATE = "trainer_state.json"
WEIGHTS = "model.safetensors"


def checkpoint_step(path: str) -> int | None:
    return step_of(locations.basename(path) if locations.is_url(path) else path, CHECKPOINT_RE)


def checkpoint_location(d: str) -> str:
    """A checkpoint location as the engine names it: a local path absolute, a URL normalized (a URL that no
    storage backend serves is refused, naming those installed)."""
    loc = registry.checkpoint_location(d, "FlashCkptTrainer")
    return loc if locations.is_url(loc) else os.path.abspath(loc)


def get_last_checkpoint(folder: str, *, verify: bool = False, storage_options: dict[str, Any] | None = None) -> str | None:
    """The newest ``checkpoint-N`` in ``folder`` that is safe to resume from, or None.

    In a folder written by flashckpt only committed checkpoints count (never one still being persisted,
    nor the remains of one a crash interrupted); with ``verify`` their checksums are checked too, falling
    back to older ones. In a folder flashckpt never wrote to (a vanilla Trainer's), the newest
    ``checkpoint-N`` holding a ``trainer_state.json`` (the file the Trainer writes last). ``folder`` may
    be the URL of a store (``s3://bucket/run``, with the backend's ``storage_options``); there only
    committed checkpoints count, and the answer is their URL.
    """
    folder = registry.checkpoint_location(folder, "get_last_checkpoint")
    storage = storage_for(folder, storage_options)
    try:
        return last_checkpoint(folder, CommitLayout(folder, storage), verify)
    finally:
        storage.close()


def last_checkpoint(folder: str, layout: CommitLayout, verify: bool) -> str | None:
    # Records that describe an earlier directory of this name (deleted since) are not this folder's.
    records = layout.records_in_use()
    committed = layout.committed_steps() if records else []
    if committed or (records and layout.uncommitted_steps()):
        for step in reversed(committed):
            try:
                base = layout.base(step, 0)
            except E.CheckpointCorruptError as e:  # a damaged manifest: fall back to the previous step
                log.warning("get_last_checkpoint(%s): step %d: %s", folder, step, e)
                continue
            if not base or checkpoint_step(base) is None or not (layout.storage.isdir(base) if locations.is_url(base)
                                                          else os.path.isdir(base)):
                continue
            if verify:
                problems = layout.verify(step)
                if problems:
                    log.warning("get_last_checkpoint(%s): %s is damaged (%s); trying an older one", folder, base,
                                "; ".join(problems[:3]))
                    continue
            return base
        return None
    if locations.is_url(folder) or not os.path.isdir(folder):
        return None
    found = [(s, n) for n in os.listdir(folder) if (s := checkpoint_step(n)) is not None
             and os.path.isfile(os.path.join(folder, n, TRAINER_STATE))]
    return os.path.join(folder, max(found)[1]) if found else None


class TrainerRetention(CheckpointDeletionStrategy):
    """``save_total_limit`` as the Trainer applies it: keep the newest ``limit`` committed checkpoints,
    and always the newest one and the best one (``state.best_model_checkpoint``)."""

    def __init__(self, limit: int, best_step: Callable[[], int | None]) -> None:
        self.limit = limit
        self.best_step = best_step

    def steps_to_delete(self, committed_steps: Sequence[int]) -> list[int]:
        steps = sorted(committed_steps)
        if len(steps) <= self.limit:
            return []
        protected = {steps[-1]}
        best = self.best_step()
        if best in steps:
            protected.add(best)
        keep = max(self.limit, len(protected))
        doomed: list[int] = []
        remaining = len(steps)
        for s in steps:
            if remaining <= keep:
                break
            if s not in protected:
                doomed.append(s)
                remaining -= 1
        return doomed


# ---------------------------------------------------------------------------------------------- memory view
class MemoryView(SnapshotDir):
    """A memory snapshot laid out for the Trainer: small files written into ``dir``; the model weights
    and optimizer state (when the Trainer's plain path loads them) kept as tensors. Also a committed
    checkpoint downloaded from a store (every file in ``dir``).

    ``best``: the ``best_model_checkpoint`` of its ``trainer_state.json`` when that is in a store (the copy
    in ``dir`` says None: the Trainer drops a best checkpoint it cannot find locally; it is restored after
    the Trainer read the state)."""

    def __init__(self, root: str, name: str, step: int, origin: str) -> None:
        super().__init__(root, name, prefix="flashckpt-hf-resume-")
        self.step = step
        self.origin = origin
        self.weights: dict[str, torch.Tensor] | None = None
        self.optimizer: Any = None
        self.best: str | None = None

    def hide_stored_best(self) -> None:
        """Moves a ``best_model_checkpoint`` in a store out of the copy's ``trainer_state.json`` into ``best``."""
        path = self.path(TRAINER_STATE)
        if not os.path.isfile(path):
            return
        with open(path) as f:
            state = json.load(f)
        best = state.get("best_model_checkpoint")
        if isinstance(best, str) and locations.is_url(best):
            self.best, state["best_model_checkpoint"] = best, None
            with open(path, "w") as f:
                json.dump(state, f, indent=2, sort_keys=True)

    def close(self) -> None:
        self.weights = self.optimizer = None
        super().close()


def safetensors_tensors(e: FileEntry) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors entry of a memory snapshot (no copy when the parts line up)."""
    import safetensors.torch as st

    parts = e.data if isinstance(e.data, list) else [e.data]
    head = parts[0] if parts and isinstance(parts[0], bytes) else b""
    if len(head) >= 8:
        n = int.from_bytes(head[:8], "little")
        header = json.loads(head[8:8 + n]) if len(head) >= 8 + n else None
        if header is not None:
            header.pop("__metadata__", None)
            names = sorted(header, key=lambda k: (header[k]["data_offsets"][0], header[k]["data_offsets"][1], k))
            body = parts[1:]
            if len(body) == len(names) and all(isinstance(t, torch.Tensor) for t in body):
                out = {}
                for name, t in zip(names, body, strict=True):
                    h = header[name]
                    if list(t.shape) != h["shape"] or t.numel() * t.element_size() != h["data_offsets"][1] - h["data_offsets"][0]:
                        break
                    out[name] = t
                else:
                    return out
    joined = b"".join(p if isinstance(p, bytes) else p.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                      for p in parts)
    return st.load(joined)


def materialize(files: FileSet, root: str, name: str, origin: str, step: int, *,
                 direct: Callable[[str], bool] = lambda _n: False) -> MemoryView:
    """Writes the set's files into a private ``<root>/.../<name>``, except those ``direct`` keeps."""
    view = MemoryView(root, name, step, origin)
    try:
        weights: dict[str, torch.Tensor] = {}
        for n, e in files.items():
            if e.kind == "tracker":
                continue
            if direct(n) and n == OPTIMIZER:
                view.optimizer = e.data if e.format == "torch" else torch.load(io.BytesIO(files.raw_bytes(n)),
                                                                               weights_only=True)
            elif direct(n) and (n == WEIGHTS or SHARD_RE.match(n)):
                weights.update(safetensors_tensors(e))
            else:
                view.write(n, e)
        view.weights = weights or None
    except BaseException:
        view.close()
        raise
    return view


def fetch_view(engine: CheckpointEngine, path: str, step: int | None, scratch_dir: str | None, *, what: str) -> MemoryView:
    """The committed checkpoint ``path`` of the engine's store (``step``: its step, None to look it up),
    downloaded into a private directory under ``scratch_dir`` and checked against its manifest."""
    layout = engine.layout
    if not locations.inside(path, engine.checkpoint_dir, strict=True):
        raise E.InvalidArgumentError(f"{what}: outside the checkpoint dir {engine.checkpoint_dir}; flashckpt reads "
                                     "checkpoints of its own checkpoint dir from a store (download this one and "
                                     "pass its local path)")
    step = committed_step_of(layout, path) if step is None else step
    if step is None:
        raise E.InvalidArgumentError(f"{what}: not a committed checkpoint of {engine.checkpoint_dir} (being "
                                     f"persisted, or never saved); committed steps: {layout.committed_steps()}")
    view = MemoryView(scratch_root(scratch_dir), locations.basename(path), step, path)
    try:
        fetch_step(view, layout, step, path)
        view.hide_stored_best()
    except BaseException:
        view.close()
        raise
    log.info("event=download step=%d path=%s into=%s", step, path, view.dir)
    return view


def check_committed(engine: CheckpointEngine, run_dir: str, want: str, resume: str) -> int | None:
    """The step of ``resume_from_checkpoint=<path>`` (``want`` normalized); refused when it is a checkpoint of
    ``run_dir`` that is not committed."""
    step = checkpoint_step(want)
    if locations.parent(want) == run_dir and step is not None:
        layout = engine.layout
        if step in layout.uncommitted_steps() and step not in layout.committed_steps():
            raise E.InvalidArgumentError(f"resume_from_checkpoint={resume!r}: this checkpoint is not committed (it is "
                                         "still being persisted, or a crash interrupted it); pass "
                                         "resume_from_checkpoint=True to resume from the newest committed or "
                                         "in-memory one")
    return step


def delete_all_but(engine: CheckpointEngine, keep: int | None) -> None:
    """Deletes every committed step but ``keep`` (the newest included: the Trainer deletes it too
    when it is not the best), then points the tracker at what is left. Nothing may be in flight."""
    doomed = engine.delete_steps([s for s in engine.committed_steps() if s != keep], newest=True)
    if doomed:
        log.info("event=retention deleted=%s (save_total_limit=1 at the end of training: only the best is kept)",
                 doomed)


def local_output_dir(output_dir: str) -> str:
    """The absolute local dir of ``output_dir``; URLs (``s3://...``) are refused with what to do."""
    if locations.is_url(os.fspath(output_dir)):
        raise E.CheckpointDirError(
            f"FlashCkptTrainer(args.output_dir={os.fspath(output_dir)!r}): the output dir holds the Trainer's logs "
            "and final model and must be a local directory (a URL would become a local 's3:' directory). Put "
            "the checkpoints in the store with FlashCkptTrainer(..., flashckpt_config=FlashCkptConfig("
            f"checkpoint_dir={os.fspath(output_dir)!r})) and give a local output_dir (or mount the store and "
            "pass the mount's path)")
    return os.path.abspath(local_dir(output_dir, "FlashCkptTrainer(args.output_dir)"))
