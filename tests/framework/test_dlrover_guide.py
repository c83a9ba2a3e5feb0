"""DLRover's Flash Checkpoint guide (docs/blogs/flash_checkpoint.md in intelligent-machine-learning/dlrover),
each snippet run as written with only the import path changed (docs/migrating-from-dlrover.md lists them):

- DDP: ``DdpCheckpointer(checkpoint_dir)``, ``save_checkpoint(step, state_dict, ckpt_path, storage_type=...)``
  with ``ckpt_path = os.path.join(checkpoint_dir, f"checkpoint-{iter_num}.pt")``, ``load_checkpoint()``.
- FSDP (FSDP1, ``SHARDED_STATE_DICT``): ``FsdpShardCheckpointer``, ``ckpt_dir = os.path.join(checkpoint_dir,
  str(step))``, ``get_storage_reader()`` with ``dist_cp.load_state_dict`` and
  ``load_sharded_optimizer_state_dict``; plus the guide's custom ``CheckpointDeletionStrategy``.
- DeepSpeed: ``DeepSpeedCheckpointer(model, checkpoint_dir, deletion_strategy=KeepStepIntervalStrategy(
  keep_interval=..., checkpoint_dir=checkpoint_dir))``, ``save_checkpoint(checkpoint_dir, tag=step,
  storage_type=...)``, ``load_checkpoint(checkpoint_dir)``.
- Megatron-LM: the three imports and the call's shape (the flow itself: tests/framework/test_megatron.py).

Every rank runs in its own process (tests/support/helpers.py, gloo); ``checkpoint_dir`` is relative to the working
directory (``../work/s01``), as training scripts often give it. The second phase of each runs in fresh
processes.
"""

from __future__ import annotations

import importlib.util
import inspect
import os

import pytest
from helpers import run_ranks

pytestmark = pytest.mark.multiproc

# Relative to each phase's working directory (tmp_path/save, tmp_path/load): the same directory.
CHECKPOINT_DIR = "../work/s01"


def _digest(*trees) -> str:
    from helpers import tree_digest

    return tree_digest(*trees)


def _batch(step: int):
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(3, 4, generator=g)


def _listing(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if n != ".flashckpt")


# ------------------------------------------------------------------------------------------ DDP
def _ddp_model():
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def ddp_guide_save(steps: int, save_memory_interval: int, save_storage_interval: int) -> dict:
    # from dlrover.trainer.torch.flash_checkpoint.ddp import (
    from flashckpt.integrations.ddp import (
        DdpCheckpointer,
        StorageType,
    )

    checkpoint_dir = CHECKPOINT_DIR
    model, optimizer = _ddp_model()
    checkpointer = DdpCheckpointer(checkpoint_dir)
    digests = {}
    for iter_num in range(1, steps + 1):
        step = iter_num
        model(_batch(step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        # --- the guide's snippet
        state_dict = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
        }
        # The path of storage.
        ckpt_path = os.path.join(checkpoint_dir, f"checkpoint-{iter_num}.pt")

        # Save the checkpoint to the memory which is very fast.
        if iter_num % save_memory_interval == 0:
            checkpointer.save_checkpoint(
                step, state_dict, ckpt_path, storage_type=StorageType.MEMORY
            )

        # Asynchronously persist the checkpoint to the storage which will not
        # pause training.
        if iter_num % save_storage_interval == 0:
            checkpointer.save_checkpoint(
                step, state_dict, ckpt_path, storage_type=StorageType.DISK
            )
        # --- end of snippet
        digests[step] = _digest(model.state_dict(), optimizer.state_dict())
    checkpointer.wait_latest_checkpoint()
    checkpointer.close()
    return {"digests": digests}


def ddp_guide_load() -> dict:
    from flashckpt.integrations.ddp import DdpCheckpointer

    checkpoint_dir = CHECKPOINT_DIR
    model, optimizer = _ddp_model()
    checkpointer = DdpCheckpointer(checkpoint_dir)
    # --- the guide's snippet
    ckpt_dict = checkpointer.load_checkpoint()
    model.load_state_dict(ckpt_dict["model"])
    optimizer.load_state_dict(ckpt_dict["optimizer"])
    # --- end of snippet
    out = {"step": ckpt_dict["step"], "digest": _digest(model.state_dict(), optimizer.state_dict()),
           "files": _listing(checkpoint_dir)}
    checkpointer.close()
    return out


def test_ddp_snippet(tmp_path):
    saved = run_ranks(ddp_guide_save, 2, str(tmp_path / "save"), args={"steps": 8, "save_memory_interval": 2, "save_storage_interval": 4})
    loaded = run_ranks(ddp_guide_load, 2, str(tmp_path / "load"))
    for r in loaded:
        assert r["step"] == 8
        assert r["digest"] == saved[0]["digests"]["8"]
        # The files lie where ckpt_path names them (relative to the cwd), not doubled under the checkpoint dir.
        assert r["files"] == ["checkpoint-4.pt", "checkpoint-8.pt"]


# ------------------------------------------------------------------------------------------ FSDP
def _fsdp_model():
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)),
                 device_id=torch.device("cpu"), use_orig_params=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _fsdp_digest(model, optimizer) -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return _digest(model.state_dict(), FSDP.optim_state_dict(model, optimizer))


def fsdp_guide_save(steps: int, save_memory_interval: int, save_storage_interval: int) -> dict:
    import warnings

    # from dlrover.python.common.storage import CheckpointDeletionStrategy
    from flashckpt import CheckpointDeletionStrategy

    # from dlrover.trainer.torch.flash_checkpoint.fsdp import (
    from flashckpt.integrations.fsdp import (
        FsdpShardCheckpointer,
        StorageType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    warnings.filterwarnings("ignore", category=FutureWarning)
    checkpoint_dir = CHECKPOINT_DIR

    # The guide's custom strategy: only __init__ and clean_up; this one keeps the multiples of 4.
    class CustomStrategy(CheckpointDeletionStrategy):

        def __init__(self, *args, **kwargs):
            self.keep_interval = kwargs["keep_interval"]
            self.checkpoint_dir = kwargs["checkpoint_dir"]

        def clean_up(self, step, delete_func):
            """
            Clean up the checkpoint of step.

            Arguments:
                step (int): the iteration step of a checkpoint.
                delete_func: A function to remove a directory, the argument
                    is a directory of a folder.
            """
            if step % self.keep_interval != 0:
                delete_func(os.path.join(self.checkpoint_dir, str(step)))

    model, optimizer = _fsdp_model()
    checkpointer = FsdpShardCheckpointer(
        checkpoint_dir, deletion_strategy=CustomStrategy(keep_interval=4, checkpoint_dir=checkpoint_dir))
    digests = {}
    for step in range(1, steps + 1):
        model(_batch(step)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        # --- the guide's snippet
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state_dict = {
                "model": model.state_dict(),
                "optim": FSDP.optim_state_dict(model, optimizer),
                "step": step,
            }
            # The path of storage.
            ckpt_dir = os.path.join(checkpoint_dir, str(step))

            # Save the checkpoint to the memory which is very fast.
            if step % save_memory_interval == 0:
                checkpointer.save_checkpoint(
                    step, state_dict, ckpt_dir, storage_type=StorageType.MEMORY
                )

            # Asynchronously persist the checkpoint to the storage which will not
            # pause training.
            if step % save_storage_interval == 0:
                checkpointer.save_checkpoint(
                    step, state_dict, ckpt_dir, storage_type=StorageType.DISK
                )
        # --- end of snippet
        digests[step] = _fsdp_digest(model, optimizer)
    checkpointer.wait_latest_checkpoint()
    checkpointer.wait_latest_checkpoint()  # the deletions the last commit scheduled
    checkpointer.close()
    return {"digests": digests}


def fsdp_guide_load() -> dict:
    import warnings

    import torch.distributed.checkpoint as dist_cp
    from flashckpt.integrations.fsdp import FsdpShardCheckpointer
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    warnings.filterwarnings("ignore", category=FutureWarning)
    checkpoint_dir = CHECKPOINT_DIR
    model, optimizer = _fsdp_model()
    # --- the guide's snippet
    checkpointer = FsdpShardCheckpointer(checkpoint_dir)

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {
            "model": model.state_dict(),
            "step": 0,
        }
        storage_reader = checkpointer.get_storage_reader()
        if not storage_reader:
            return {"step": None}
        dist_cp.load_state_dict(
            state_dict=state_dict,
            storage_reader=storage_reader,
        )
        model.load_state_dict(state_dict["model"])

        optim_state = load_sharded_optimizer_state_dict(
            model_state_dict=state_dict["model"],
            optimizer_key="optim",
            storage_reader=storage_reader,
        )

        flattened_osd = FSDP.optim_state_dict_to_load(
            model, optimizer, optim_state["optim"]
        )
        optimizer.load_state_dict(flattened_osd)
    # --- end of snippet
    out = {"step": state_dict["step"], "digest": _fsdp_digest(model, optimizer), "files": _listing(checkpoint_dir)}
    checkpointer.close()
    return out


def test_fsdp_snippets_and_the_custom_deletion_strategy(tmp_path):
    saved = run_ranks(fsdp_guide_save, 2, str(tmp_path / "save"), args={"steps": 8, "save_memory_interval": 1, "save_storage_interval": 2})
    loaded = run_ranks(fsdp_guide_load, 2, str(tmp_path / "load"))
    for rank, r in enumerate(loaded):
        assert r["step"] == 8
        assert r["digest"] == saved[rank]["digests"]["8"]
        # Commits 2, 4, 6, 8: clean_up(2) after 4, clean_up(4) after 6, clean_up(6) after 8; 4 and 8 stay.
        assert r["files"] == ["4", "8"]


# ------------------------------------------------------------------------------------------ DeepSpeed
DS_ENV = {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}


def _ds_model():
    import deepspeed
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)  # a torch optimizer: no DeepSpeed op to build
    world = torch.distributed.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 3, "train_batch_size": 3 * world, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 1}}
    model, *_ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    return model


def _ds_digest(model) -> str:
    return _digest(model.module.state_dict(), model.optimizer.state_dict())


def ds_guide_save(steps: int, save_memory_interval: int, save_storage_interval: int) -> dict:
    # from dlrover.python.common.store import KeepStepIntervalStrategy
    from flashckpt import KeepStepIntervalStrategy

    # from dlrover.trainer.torch.flash_checkpoint.deepspeed import (
    from flashckpt.integrations.deepspeed import (
        DeepSpeedCheckpointer,
        StorageType,
    )

    checkpoint_dir = CHECKPOINT_DIR
    model = _ds_model()
    # --- the guide's cleanup-strategy snippet
    strategy = KeepStepIntervalStrategy(keep_interval=4, checkpoint_dir=checkpoint_dir)

    checkpointer = DeepSpeedCheckpointer(model, checkpoint_dir, deletion_strategy=strategy)
    # --- end of snippet
    digests = {}
    for step in range(1, steps + 1):
        loss = model(_batch(step)).pow(2).mean()
        model.backward(loss)
        model.step()
        # --- the guide's snippet
        # Save the checkpoint to the memory which is very fast.
        if step % save_memory_interval == 0:
            checkpointer.save_checkpoint(
                checkpoint_dir,
                tag=step,
                storage_type=StorageType.MEMORY,
            )

        # Asynchronously persist the checkpoint to the storage which will not
        # pause training.
        if step % save_storage_interval == 0:
            checkpointer.save_checkpoint(
                checkpoint_dir, tag=step, storage_type=StorageType.DISK
            )
        # --- end of snippet
        digests[step] = _ds_digest(model)
    checkpointer.wait()
    checkpointer.wait()  # the deletions the last commit scheduled
    checkpointer.close()
    return {"digests": digests}


def ds_guide_load() -> dict:
    from flashckpt.integrations.deepspeed import DeepSpeedCheckpointer

    checkpoint_dir = CHECKPOINT_DIR
    model = _ds_model()
    checkpointer = DeepSpeedCheckpointer(model, checkpoint_dir)
    # --- the guide's snippet
    # Load checkpoint
    checkpointer.load_checkpoint(checkpoint_dir)
    # --- end of snippet
    out = {"step": int(model.global_steps), "digest": _ds_digest(model), "files": _listing(checkpoint_dir)}
    checkpointer.close()
    return out


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_snippets(tmp_path):
    saved = run_ranks(ds_guide_save, 2, str(tmp_path / "save"), env=DS_ENV, timeout=300,
                      args={"steps": 8, "save_memory_interval": 1, "save_storage_interval": 2})
    loaded = run_ranks(ds_guide_load, 2, str(tmp_path / "load"), env=DS_ENV, timeout=300)
    for rank, r in enumerate(loaded):
        assert r["step"] == 8
        assert r["digest"] == saved[rank]["digests"]["8"]
        tags = [n for n in r["files"] if n.isdigit()]
        assert tags == ["4", "8"], r["files"]  # KeepStepIntervalStrategy(keep_interval=4) kept 4 and 8
        assert "latest" in r["files"]


# ------------------------------------------------------------------------------------------ Megatron-LM
def test_megatron_imports_and_call_shape():
    """The guide's imports (``megatron_dist_ckpt.save_checkpoint`` / ``load_checkpoint``, ``megatron.StorageType``)
    and its call ``save_checkpoint(iteration, model, optimizer, opt_param_scheduler, storage_type=StorageType.MEMORY)``;
    the flow itself runs in tests/framework/test_megatron.py (megatron-core, and Megatron-LM's legacy module)."""
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    # from dlrover.trainer.torch.flash_checkpoint.megatron_dist_ckpt import save_checkpoint
    # from dlrover.trainer.torch.flash_checkpoint.megatron_dist_ckpt import load_checkpoint
    # from dlrover.trainer.torch.flash_checkpoint.megatron import StorageType
    from flashckpt.patches.megatron import StorageType, load_checkpoint, save_checkpoint

    inspect.signature(save_checkpoint).bind(100, "model", "optimizer", "opt_param_scheduler",
                                            storage_type=StorageType.MEMORY)
    inspect.signature(load_checkpoint).bind("model", "optimizer", "opt_param_scheduler")
    assert StorageType.MEM is StorageType.MEMORY  # the guide's prose says StorageType.MEM
