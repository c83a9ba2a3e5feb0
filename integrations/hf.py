"""FlashCkptTrainer: flash checkpoints for the HuggingFace ``transformers.Trainer`` (and Accelerate).

Replace ``Trainer`` with ``FlashCkptTrainer`` and change nothing else. Every checkpoint the Trainer
would write (``checkpoint-N/`` at ``save_steps``) is copied into host shared memory while training
pauses, then persisted in the background by flashckpt's saver, with exactly the files and formats of a
vanilla ``checkpoint-N/`` (``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``,
``trainer_state.json``, ``training_args.bin``, ``config.json``, ...), so a vanilla ``Trainer`` resumes from
it. ``FlashCkptConfig(memory_snapshot_steps=k)`` adds memory-only snapshots every ``k`` steps in
between; when the process dies, the saver persists the newest one as ``checkpoint-N/``, and
``train(resume_from_checkpoint=True)`` in a restarted process resumes from memory when memory holds a
newer step than storage. ``FlashCkptConfig(checkpoint_dir="s3://bucket/run")`` puts the ``checkpoint-N/``
folders in a store instead of ``output_dir`` (which keeps the logs and the final model); a resume from
there downloads the committed step into a private scratch dir for the Trainer's own loader.

Example::

    trainer = FlashCkptTrainer(model=model, args=args, train_dataset=ds,
                               flashckpt_config=FlashCkptConfig(memory_snapshot_steps=10))
    trainer.train(resume_from_checkpoint=True)   # or a checkpoint path, or nothing

How a checkpoint reaches memory: the Trainer's own save methods (``save_model``,
``_save_optimizer_and_scheduler``, ``_save_scaler``, ``_save_rng_state``, ``TrainerState.save_to_json``)
run with their output aimed at a private scratch directory. While they run, ``torch.save`` and
``safetensors.torch.save_file`` calls that target that directory are captured as tensor trees (nothing is
serialized; the tensors are copied once, into shared memory), and the small files they write there
(JSON, pickles) are read back as bytes. Those calls are patched only for the duration of the save and
pass every other path through unchanged.

Overridden Trainer hooks (all documented in docs/hf.md): ``train``, ``_save_checkpoint``,
``_maybe_log_save_evaluate``, ``_finalize_training``, ``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_best_model``. Added: ``trainer.get_last_checkpoint()`` (the
DLRover Flash Checkpoint API), ``flashckpt_engine``, ``flashckpt_wait``, ``flashckpt_close``.

Accelerate users get the same through ``AcceleratorCheckpointer(accelerator, checkpoint_dir)``:
``save_state`` / ``load_state`` with Accelerate's own layout, memory first.

One concept, so one module (~510 lines): the ``Trainer`` subclass and its config; file lookups,
retention and downloads are in ``_hf_files``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from flashckpt import CheckpointEngine, FileSet, StorageType
from flashckpt import errors as E
from flashckpt.engine.adapter import LOCAL, MEMORY, STORAGE, LoadAttempt, Opened, is_stored, resolve_load
from flashckpt.engine.collective import barrier
from flashckpt.engine.engine import Located
from flashckpt.integrations._hf_files import (
    OPTIMIZER,
    PREFIX,
    SCHEDULER,
    TRAINER_STATE,
    MemoryView,
    TrainerRetention,
    check_committed,
    checkpoint_location,
    checkpoint_step,
    delete_all_but,
    fetch_view,
    get_last_checkpoint,
    last_checkpoint,
    local_output_dir,
    materialize,
)
from flashckpt.integrations._kit_files import (
    Capture,
    all_ranks_files,
    scratch,
    scratch_root,
)
from flashckpt.integrations._kit_resume import auto_resume, resume_flag, resume_line, steps_lost
from flashckpt.integrations.accelerate import AcceleratorCheckpointer
from flashckpt.integrations.telemetry import report_hf
from flashckpt.storage import locations, registry

try:
    import transformers
    from transformers import Trainer
except ImportError as _e:  # pragma: no cover - the extra is missing
    raise ImportError("flashckpt.integrations.hf needs transformers: pip install 'flashckpt[hf]'") from _e

__all__ = ["FlashCkptTrainer", "FlashCkptConfig", "AcceleratorCheckpointer", "get_last_checkpoint",
           "StorageType", "TESTED_TRANSFORMERS"]

log = logging.getLogger(__name__)

TESTED_TRANSFORMERS = "5.23.0"


@dataclasses.dataclass(frozen=True)
class FlashCkptConfig:
    """Options of ``FlashCkptTrainer``.

    Attributes:
        memory_snapshot_steps: also snapshot the full checkpoint into memory (not storage) every this
            many optimizer steps, between the Trainer's ``save_steps`` (0: only at ``save_steps``). A
            snapshot costs a memory copy; after a crash the newest one is persisted as ``checkpoint-N/``
            and a restarted ``train(resume_from_checkpoint=True)`` loads it from memory.
        wait_on_train_end: when ``train()`` returns, every checkpoint it saved is committed on storage
            (as with the vanilla Trainer, whose files are written when it returns). False returns at
            once; the saver still persists them. (With ``save_total_limit=1`` and a best checkpoint
            training waits anyway: the Trainer deletes all but the best one at the end.)
        scratch_dir: where the small files of a checkpoint are staged while it is captured (default
            FLASHCKPT_SCRATCH_DIR, else ``/dev/shm`` when present, else the system temp dir; what a killed
            trainer left there is removed by the next one and by ``flashckpt gc``). Nothing large is written there, except
            for a DeepSpeed resume from memory and a resume from a store (the checkpoint is downloaded
            there; see docs/hf.md).
        checkpoint_dir: where the ``checkpoint-N/`` folders go, instead of ``args.output_dir``: a local
            directory or the URL of a store (``s3://bucket/run``; see docs/storage.md). ``output_dir``
            stays local: the Trainer writes its logs and the final model there. None: ``output_dir``.
        storage_options: options of the store's backend (``s3://``: ``flashckpt.storage.s3.options.S3Options``
            fields such as ``endpoint_url``, ``part_size_mb``); the node's saver gets them too.
        local_dir: a node-local directory (NVMe, a local disk) as the fast tier: a checkpoint saved to
            storage is committed there first (``<local_dir>/checkpoint-N/``) and the node's saver uploads it
            to the checkpoint dir in the background; a resume reads it there when this node's copy holds
            every rank's files of the newest step, else from the checkpoint dir. A trial of a hyperparameter
            search uses its run's subdirectory of it. None: FLASHCKPT_LOCAL_DIR (unset: no local tier).
        local_max_to_keep: checkpoints the local tier keeps (0 keeps all; one not yet uploaded is never
            deleted).
        auto_resume: a worker that ``flashckpt-run`` (or torchrun) restarted after a failure runs
            ``train()`` with no ``resume_from_checkpoint`` as ``train(resume_from_checkpoint=True)``, except
            that nothing to resume from starts at step 1 (the script, e.g. transformers' ``run_clm.py``,
            passes the same arguments on every attempt). None: ``FLASHCKPT_AUTO_RESUME`` (on by default).
    """

    memory_snapshot_steps: int = 0
    wait_on_train_end: bool = True
    scratch_dir: str | None = None
    checkpoint_dir: str | None = None
    storage_options: dict[str, Any] | None = None
    local_dir: str | None = None
    local_max_to_keep: int = 2
    auto_resume: bool | None = None

    def __post_init__(self) -> None:
        auto_resume(self.auto_resume, op="FlashCkptConfig(auto_resume)")  # refuses anything but a bool or None
        if not isinstance(self.memory_snapshot_steps, int) or self.memory_snapshot_steps < 0:
            raise E.InvalidArgumentError(f"FlashCkptConfig(memory_snapshot_steps={self.memory_snapshot_steps!r}): "
                             "must be an integer >= 0 (0 turns memory-only snapshots off)")
        if self.checkpoint_dir is not None:  # a URL no backend serves is refused here, before any training
            registry.checkpoint_location(self.checkpoint_dir, "FlashCkptConfig(checkpoint_dir)")


# ---------------------------------------------------------------------------------------------- trainer
class FlashCkptTrainer(Trainer):
    """``transformers.Trainer`` whose checkpoints go to host memory first and to storage in the background.

    Takes every argument of ``Trainer``, plus:

    Args:
        flashckpt_config: see ``FlashCkptConfig`` (memory-only snapshots between ``save_steps``, ...).

    Raises:
        ValueError: FSDP is enabled (not supported yet, see docs/hf.md), or the Trainer runs on XLA/SageMaker
            model parallelism, or ``push_to_hub`` with checkpoints in a store.
        CheckpointDirError: ``args.output_dir`` is a URL (it must be local: use
            ``FlashCkptConfig(checkpoint_dir="s3://...")`` for the checkpoints).

    The checkpoint dir is the run's output dir (``args.output_dir``), or ``flashckpt_config.checkpoint_dir``
    (a local directory or a store's URL, ``s3://bucket/run``); flashckpt keeps its bookkeeping beside it, in
    ``<parent>/.flashckpt/<name>/`` (see docs/design.md, **Records**; in a store: inside it, in
    ``.flashckpt/``), so the checkpoint dir holds only what the Trainer writes. ``save_total_limit`` and the best checkpoint are
    honoured by flashckpt's retention after each commit, which never deletes a checkpoint still being persisted. Use this module's
    ``get_last_checkpoint`` (not transformers') to find the newest committed checkpoint.

    Thread safety: as the Trainer (one training thread).
    """

    def __init__(self, *args: Any, flashckpt_config: FlashCkptConfig | None = None, **kwargs: Any) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        output_dir = getattr(training_args, "output_dir", None)
        if output_dir:  # a URL is refused before the Trainer makes the dir
            local_output_dir(output_dir)
        stored = flashckpt_config is not None and locations.is_url(flashckpt_config.checkpoint_dir or "")
        if stored and getattr(training_args, "push_to_hub", False):  # before the Trainer creates the Hub repo
            raise E.InvalidArgumentError(
                "FlashCkptTrainer: push_to_hub uploads checkpoint folders from a local directory, and "
                f"FlashCkptConfig(checkpoint_dir={flashckpt_config.checkpoint_dir!r}) puts them in a store; use a "  # type: ignore[union-attr]
                "local checkpoint_dir with push_to_hub")
        super().__init__(*args, **kwargs)
        self.flashckpt_config = flashckpt_config or FlashCkptConfig()
        if self.is_fsdp_enabled or getattr(self, "is_fsdp_xla_enabled", False):
            raise E.InvalidArgumentError(
                "FlashCkptTrainer: FSDP through the Trainer is not supported yet (its sharded checkpoints could "
                "not be verified here: accelerate's FSDP does not run on CPU). Use the vanilla Trainer for FSDP "
                "runs, or flashckpt.integrations.fsdp.FsdpShardCheckpointer in a custom loop.")
        from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available

        if is_torch_xla_available() or is_sagemaker_mp_enabled():
            raise E.InvalidArgumentError("FlashCkptTrainer: XLA and SageMaker model parallelism write checkpoints their own way; "
                             "use the vanilla Trainer there")
        self.flashckpt_last_resume: Located | None = None  # where the last train() resumed from
        self._flash: CheckpointEngine | None = None
        self._flash_view: MemoryView | None = None
        self._flash_disk_steps: set[int] = set()
        self._flash_last_step = -1
        self._flash_run_dir = ""
        # get_last_checkpoint's answer and the engine that gave it, for the next train()
        self._flash_located: tuple[CheckpointEngine, Located] | None = None

    # ------------------------------------------------------------------ engine
    def flashckpt_engine(self, run_dir: str | None = None) -> CheckpointEngine:
        """The engine of ``run_dir`` (default: the checkpoint dir: ``flashckpt_config.checkpoint_dir``, else
        ``args.output_dir``), created on first use."""
        run_dir = checkpoint_location(run_dir) if run_dir else self._flash_checkpoint_dir(getattr(self, "_trial", None))
        if self._flash is not None and self._flash.checkpoint_dir == run_dir:
            return self._flash
        self.flashckpt_close()
        limit = self.args.save_total_limit
        strategy = TrainerRetention(limit, self._flash_best_step) if limit and limit > 0 else None
        self._flash = CheckpointEngine(run_dir, max_to_keep=0, deletion_strategy=strategy, replicated=False,
                                       weights_only=not self.is_deepspeed_enabled,
                                       storage_options=self.flashckpt_config.storage_options,
                                       local_dir=self._flash_local_dir(run_dir),
                                       local_max_to_keep=self.flashckpt_config.local_max_to_keep)
        self._flash_run_dir = self._flash.checkpoint_dir
        return self._flash

    def _flash_local_dir(self, run_dir: str) -> str | None:
        """The local tier of ``run_dir``'s engine: ``flashckpt_config.local_dir``, a trial's run in its
        subdirectory (as under the checkpoint dir); None: FLASHCKPT_LOCAL_DIR decides."""
        given = self.flashckpt_config.local_dir
        if not given:
            return None
        rel = locations.relpath(run_dir, self._flash_checkpoint_dir(None))
        return given if rel in (None, ".") else os.path.join(given, *rel.split("/"))

    @property
    def _flash_reshards(self) -> bool:
        """Whether a step saved by another number of ranks may resume from memory: with replicated weights and
        optimizer (DDP, one process), whose files the Trainer reads whatever the number of ranks (the union of
        the old ranks' files: weights, optimizer, scheduler, state, each rank's RNG state); not with DeepSpeed,
        whose ZeRO partitions it cannot reshard (from storage neither)."""
        return not (self.is_deepspeed_enabled or self.is_fsdp_enabled)

    @property
    def _flash_in_store(self) -> bool:
        return locations.is_url(self.flashckpt_config.checkpoint_dir or "")

    def _flash_checkpoint_dir(self, trial: Any) -> str:
        """Where the ``checkpoint-N/`` folders of ``trial``'s run go: ``flashckpt_config.checkpoint_dir`` (a
        trial of a hyperparameter search in its run's subdirectory, as under ``output_dir``), else the
        run's output dir. Local dirs absolute, URLs normalized."""
        out = local_output_dir(self._get_output_dir(trial=trial))
        given = self.flashckpt_config.checkpoint_dir
        if not given:
            return out
        sub = os.path.relpath(out, local_output_dir(self.args.output_dir or out))
        root = checkpoint_location(given)
        return root if sub == "." else locations.normpath(locations.join(root, *sub.split(os.sep)))

    def flashckpt_wait(self, timeout: float | None = None) -> None:
        """Blocks until every checkpoint saved so far is committed (on every rank); raises a persist error."""
        if self._flash is not None:
            self._flash.wait(timeout)
        barrier()

    def flashckpt_close(self, release: bool = True) -> None:
        """Detaches from the saver (see ``CheckpointEngine.close``); ``train()`` does it when it returns."""
        eng, self._flash = self._flash, None
        self._flash_located = None
        if eng is not None:
            eng.close(release)

    def get_last_checkpoint(self) -> str | None:
        """The newest checkpoint every rank can resume from, for ``train(resume_from_checkpoint=...)``
        (the DLRover Flash Checkpoint idiom ``trainer.train(resume_from_checkpoint=trainer.get_last_checkpoint())``).

        A step that memory holds (at least as new as the newest committed one) gives its
        ``<output_dir>/checkpoint-N`` path, which ``train`` then resumes from memory, even while that
        directory is still being persisted or does not exist (a memory-only snapshot); otherwise the
        newest committed checkpoint whose checksums verify (also when it is newer on the local tier than on
        the checkpoint dir: its ``checkpoint-N`` path there, which ``train`` reads from the local tier); in a
        directory flashckpt never wrote to, the newest vanilla ``checkpoint-N`` with a
        ``trainer_state.json``; else None (start from scratch). Every rank calls it (as ``train``)."""
        run_dir = self._flash_checkpoint_dir(None)
        engine = self.flashckpt_engine(run_dir)
        loc = engine.locate(local=True, reshard=self._flash_reshards)
        if loc.source == "none":
            return last_checkpoint(run_dir, engine.layout, False)
        self._flash_located = (engine, loc)  # train() uses it rather than verifying the checksums again
        return _durable_path(engine, loc)

    def _flash_best_step(self) -> int | None:
        best = self.state.best_model_checkpoint
        if not best or locations.parent(best) != self._flash_run_dir:
            return None
        return checkpoint_step(best)

    # ------------------------------------------------------------------ train
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` (or the string ``"True"`` a command line gives)
        resumes from the newest checkpoint every rank has, in memory or committed on storage; a path resumes
        from it (from memory when memory holds it). None in a worker the launcher restarted resumes as True
        does, or starts at step 1 when there is nothing (``FlashCkptConfig(auto_resume)``). Where it resumed
        from is logged once at WARNING (docs/hf.md, **Logs**).
        A checkpoint in a store (``FlashCkptConfig(checkpoint_dir="s3://...")``; a path may be its URL) is
        downloaded into ``scratch_dir`` and checked against its manifest, and the Trainer reads that copy.

        When it returns (``wait_on_train_end``), every checkpoint it saved is committed. When it raises,
        the snapshots stay in memory for a restart and the newest one is persisted."""
        ok = False
        self._flash_last_step = -1
        self._flash_disk_steps.clear()
        try:
            local_output_dir(self._get_output_dir(trial=trial))  # a URL is refused before any step
            resume_from_checkpoint = resume_flag(resume_from_checkpoint)
            automatic = resume_from_checkpoint is None and auto_resume(self.flashckpt_config.auto_resume,
                                                                       op="FlashCkptConfig(auto_resume)")
            resume = self._flash_resolve(True if automatic else resume_from_checkpoint, trial, automatic=automatic)
            out = super().train(resume_from_checkpoint=resume, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval,
                                **kwargs)
            if self.flashckpt_config.wait_on_train_end:
                self.flashckpt_wait()
            ok = True
            return out
        finally:
            view, self._flash_view = self._flash_view, None
            if view is not None:
                view.close()
            self.flashckpt_close(release=ok)

    def _flash_resolve(self, resume: str | bool | None, trial: Any, *, automatic: bool = False) -> str | None:
        """Where to resume from: a local storage path, a memory view's or a download's directory, or None
        (``automatic``: a restarted worker's resume, which starts afresh when there is nothing)."""
        self.flashckpt_last_resume = None
        if resume is None or resume is False:
            return None
        run_dir = self._flash_checkpoint_dir(trial)
        engine = self.flashckpt_engine(run_dir)
        cached, self._flash_located = self._flash_located, None
        want = None if resume is True else locations.normpath(os.fspath(resume))

        def refuse(loc: Located) -> str:
            return f"{want} is asked for" if want is not None and want != loc.path else ""

        def from_memory(loc: Located, fs: Any) -> Opened:
            self._flash_view = self._flash_memory_view(loc, fs)
            return Opened(self._flash_view.dir, loc.step, loc.path)

        def from_storage(attempt: LoadAttempt) -> Opened | None:
            if want is None:
                return self._flash_newest_stored(engine, run_dir, attempt.stored(), automatic=automatic)
            if attempt.located.source in (LOCAL, MEMORY) and engine.local_dir is not None:
                loc = attempt.stored()  # the newest checkpoint, asked for by its name: from the local tier
                if loc.source == LOCAL and want == _durable_path(engine, loc):
                    return self._flash_newest_stored(engine, run_dir, loc)
            return self._flash_given(engine, run_dir, want, resume)  # type: ignore[arg-type]

        # Every rank locates (they agree on the step), or every rank uses get_last_checkpoint's answer.
        r = resolve_load(engine, op="train(resume_from_checkpoint)", event="resume", logger=log, refuse=refuse,
                         from_memory=from_memory, from_storage=from_storage,
                         locate=lambda: cached[1] if cached is not None and cached[0] is engine
                         else engine.locate(local=True, reshard=self._flash_reshards))
        self.flashckpt_last_resume = Located(r.step, r.source, r.path)
        self._flash_resume_line(engine, automatic)
        out: str = r.value
        return out

    def _flash_resume_line(self, engine: CheckpointEngine, automatic: bool) -> None:
        """The one line a user reads about the resume (world rank 0): where from, and the steps lost against
        the newest snapshot this rank knows of."""
        loc = self.flashckpt_last_resume
        if loc is None or not self.is_world_process_zero():
            return
        resume_line(log, "FlashCkptTrainer", source=loc.source, step=loc.step, path=loc.path,
                    lost=steps_lost(engine, loc.step), automatic=automatic)

    def _flash_newest_stored(self, engine: CheckpointEngine, run_dir: str, loc: Located, *,
                             automatic: bool = False) -> Opened | None:
        """The newest committed checkpoint (``loc``: on the checkpoint dir, or this node's whole copy on the
        local tier), else a vanilla Trainer's newest ``checkpoint-N``; else None when ``automatic``."""
        committed = is_stored(loc)
        path = loc.path if committed else last_checkpoint(run_dir, engine.layout, False)
        if path is None and automatic:
            return None
        if path is None:
            raise E.InvalidArgumentError(f"No valid checkpoint found in output directory ({run_dir}): nothing committed "
                                         "by flashckpt, in memory, or written by a vanilla Trainer")
        step = loc.step if committed else checkpoint_step(path)
        if locations.is_url(path):
            return Opened(self._flash_download(engine, path, loc.step if committed else None).dir,
                          step, path)
        return Opened(path, step, path, source=LOCAL if loc.source == LOCAL else STORAGE)

    def _flash_given(self, engine: CheckpointEngine, run_dir: str, want: str, resume: str) -> Opened:
        """``resume_from_checkpoint=<path>`` (``want`` normalized): refused when it is not committed."""
        step = check_committed(engine, run_dir, want, resume)
        if locations.is_url(want):
            return Opened(self._flash_download(engine, want, None).dir, step, want)
        return Opened(os.fspath(resume), step, want)

    def _flash_download(self, engine: CheckpointEngine, path: str, step: int | None) -> MemoryView:
        """The committed checkpoint ``path`` of the engine's store (``step``: its step, None to look it up),
        downloaded into a private directory under ``scratch_dir`` and checked against its manifest; it is the
        view ``train`` resumes from (removed when ``train`` returns)."""
        view = fetch_view(engine, path, step, self.flashckpt_config.scratch_dir, what=f"resume_from_checkpoint={path!r}")
        self._flash_view = view
        return view

    def _flash_memory_view(self, loc: Located, fs: Any) -> MemoryView:
        files = all_ranks_files(fs)
        plain = not (self.is_deepspeed_enabled or self.is_fsdp_enabled)
        from transformers.modeling_utils import PreTrainedModel

        direct_weights = plain and isinstance(self.model, PreTrainedModel)

        def direct(name: str) -> bool:
            if name == OPTIMIZER:
                return plain
            return direct_weights

        assert loc.step is not None and loc.path is not None  # memory locations have both
        view = materialize(files, scratch_root(self.flashckpt_config.scratch_dir), locations.basename(loc.path),
                            loc.path, loc.step, direct=direct)
        view.hide_stored_best()
        return view

    # ------------------------------------------------------------------ save
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's checkpoint, into memory and persisted in the background."""
        self._flash_save(trial, StorageType.DISK)

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """The Trainer's log/evaluate/save, then a memory-only snapshot when one is due."""
        super()._maybe_log_save_evaluate(*args, **kwargs)
        every = self.flashckpt_config.memory_snapshot_steps
        step = self.state.global_step
        if every and step > 0 and step % every == 0 and step != self._flash_last_step:
            self._flash_save(getattr(self, "_trial", None), StorageType.MEMORY)

    def _finalize_training(self, trial: Any, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's end of training. With ``save_total_limit=1`` and a best checkpoint, that is where
        the Trainer deletes every checkpoint but the best one: here they are committed first and deleted
        through flashckpt, so the deletion never meets a persist and the commit records stay true (the
        Trainer's own deletion then finds only what flashckpt does not track, as it would)."""
        best = self.state.best_model_checkpoint
        if best is not None and self.args.save_total_limit == 1:
            self.flashckpt_wait()  # every rank (a barrier)
            if self.args.process_index == 0 and self._flash is not None:
                delete_all_but(self._flash, self._flash_best_step())
        return super()._finalize_training(trial, *args, **kwargs)

    def _flash_save(self, trial: Any, storage: StorageType) -> None:
        """Builds this rank's files of ``checkpoint-<global_step>`` (what the vanilla Trainer writes) and
        snapshots them; DISK also persists them."""
        from transformers.trainer_utils import SaveStrategy

        step = self.state.global_step
        run_dir = self._flash_checkpoint_dir(trial)
        name = f"{PREFIX}-{step}"
        engine = self.flashckpt_engine(run_dir)
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        fs = FileSet()
        with scratch(scratch_root(self.flashckpt_config.scratch_dir), name, prefix="flashckpt-hf-") as tmp:
            cap = Capture(tmp, fs)
            with cap, _quiet_save_lines(locations.join(run_dir, name) if storage == StorageType.DISK else None):
                self.save_model(tmp, _internal_call=True)
                if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
                    self._flash_update_best(run_dir, step, storage == StorageType.DISK)
                if not self.args.save_only_model:
                    self._save_optimizer_and_scheduler(tmp)
                    self._save_scaler(tmp)
                    self._save_rng_state(tmp)
                if self.args.should_save:
                    self._flash_export_callback_states()
                    self.state.save_to_json(os.path.join(tmp, TRAINER_STATE))
            cap.collect()
            engine.save(step, fs, path=name, storage_type=storage)
        report_hf(self, engine)  # the pause, persist time and durable step to report_to (TensorBoard, W&B)
        self._flash_last_step = step
        if storage == StorageType.DISK:
            self._flash_disk_steps.add(step)
            if self.args.push_to_hub:
                self.flashckpt_wait()  # the Hub gets files, so they must be on storage first
                self._push_from_checkpoint(os.path.join(run_dir, name))  # local (refused in a store)

    def _flash_update_best(self, run_dir: str, step: int, disk: bool) -> None:
        """``state.best_model_checkpoint`` as the Trainer sets it: the best step's checkpoint, once it exists."""
        best = self.state.best_global_step
        if not best:
            return
        path = locations.join(run_dir, f"{PREFIX}-{best}")
        if (disk and best == step) or best in self._flash_disk_steps or (
                best in self.flashckpt_engine(run_dir).committed_steps() if locations.is_url(path)
                else os.path.isdir(path)):
            self.state.best_model_checkpoint = path

    def _flash_export_callback_states(self) -> None:
        """Stores the ``ExportableState`` callbacks' state in ``state.stateful_callbacks`` (as the Trainer does)."""
        from transformers.trainer_callback import ExportableState

        stored: Any = self.state.stateful_callbacks  # a dict by name once the state is initialised
        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(stored[name], list):
                stored[name].append(cb.state())
            else:
                stored[name] = cb.state()

    # ------------------------------------------------------------------ load
    def _flash_view_for(self, path: str | None) -> MemoryView | None:
        v = self._flash_view
        return v if v is not None and path is not None and os.path.abspath(path) == v.dir else None

    def _load_callback_state(self) -> None:
        """Runs right after the Trainer read ``trainer_state.json`` of the checkpoint it resumes from: a best
        checkpoint in a store, which the Trainer drops (it looks for a local directory), is restored."""
        v = self._flash_view
        if v is not None and v.best is not None and self.state.best_model_checkpoint is None:
            self.state.best_model_checkpoint = v.best
        super()._load_callback_state()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Loads the model weights; from memory when resuming from a memory snapshot."""
        view = self._flash_view_for(resume_from_checkpoint)
        if view is None or view.weights is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        model = self.model if model is None else model
        result = model.load_state_dict(view.weights, False)
        view.weights = None
        self._issue_warnings_after_load(result)
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Loads optimizer and scheduler state; the optimizer's from memory when resuming from memory."""
        view = self._flash_view_for(checkpoint)
        if view is None or view.optimizer is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        scheduler = os.path.join(view.dir, SCHEDULER)
        if not os.path.isfile(scheduler):  # as the Trainer: both or neither
            return None
        from transformers.trainer_pt_utils import reissue_pt_warnings

        optimizer: Any = self.optimizer
        lr_scheduler: Any = self.lr_scheduler
        optimizer.load_state_dict(view.optimizer)
        view.optimizer = None
        with warnings.catch_warnings(record=True) as caught:
            lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
        reissue_pt_warnings(caught)
        return None

    def _load_best_model(self) -> None:
        """Waits until the best checkpoint is committed, then loads it as the Trainer does (one in a store
        from a downloaded copy, checked against its manifest)."""
        self.flashckpt_wait()
        best = self.state.best_model_checkpoint
        if best is None or not locations.is_url(best):
            super()._load_best_model()
            return
        with fetch_view(self.flashckpt_engine(locations.parent(best)), best, None, self.flashckpt_config.scratch_dir,
                               what=f"the best checkpoint {best}") as view:
            self.state.best_model_checkpoint = view.dir
            try:
                super()._load_best_model()
            finally:
                self.state.best_model_checkpoint = best


def _check_version() -> None:
    """The overridden hooks are private Trainer methods: say so when another minor release runs."""
    if transformers.__version__.split(".")[:2] != TESTED_TRANSFORMERS.split(".")[:2]:
        log.warning("flashckpt.integrations.hf was tested with transformers %s; this is %s (see docs/hf.md for the "
                    "Trainer hooks it overrides)", TESTED_TRANSFORMERS, transformers.__version__)


_check_version()


@contextlib.contextmanager
def _quiet_save_lines(persisted: str | None) -> Iterator[None]:
    """The Trainer's save methods, writing into the scratch dir, log "Saving model checkpoint to
    /dev/shm/flashckpt-hf-.../checkpoint-N" and the files it saved there at INFO; those lines are shown
    only at DEBUG (transformers' verbosity), and a checkpoint that is persisted (``persisted``: its real
    path) gets the Trainer's own INFO line, with that path, as a vanilla Trainer logs it."""
    from transformers.utils import logging as hf_logging

    trainer_log = hf_logging.get_logger("transformers.trainer")
    if persisted is not None:
        trainer_log.info("Saving model checkpoint to %s", persisted)
    level = hf_logging.get_verbosity()
    if level <= logging.DEBUG:
        yield
        return
    hf_logging.set_verbosity(max(level, logging.WARNING))
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _durable_path(engine: CheckpointEngine, loc: Located) -> str | None:
    """``loc.path``, a step on the local tier named by its path on the checkpoint dir (``checkpoint-N`` under
    the output dir, as the Trainer names it; ``train`` maps it back to the local copy)."""
    if loc.source != LOCAL or not loc.path or engine.local_dir is None:
        return loc.path
    rel = os.path.relpath(loc.path, engine.local_dir)
    return locations.normpath(locations.join(engine.checkpoint_dir, *rel.split(os.sep)))
