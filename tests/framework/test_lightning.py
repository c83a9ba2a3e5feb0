"""FlashCheckpointIO and FlashMemorySnapshot with the real Lightning 2.6 Trainer (CPU).

The model is a small MLP whose batch of step ``s`` comes from a generator seeded with ``s`` (the
dataloader only paces the loop), so a run interrupted at any step and resumed reaches bit-identical
weights; DDP ranks see the same batch, so two ranks (gradients averaged: (g + g) / 2 == g) reach the
weights of one process. Crash tests run the trainers as real subprocesses killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402
from _fault_helpers import saver_pid, saver_pids, small_tmpfs, wait_for  # noqa: E402
from helpers import assert_same_tree, launch_ranks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lightning as L  # noqa: E402
from flashckpt import PersistError  # noqa: E402
from flashckpt.commit.layout import CommitLayout  # noqa: E402
from flashckpt.integrations.lightning import (  # noqa: E402
    FlashCheckpointIO,
    FlashMemorySnapshot,
    StorageType,
    UnsupportedStrategyError,
    check_strategy,
    find_resume_path,
)
from flashckpt.storage.posix import PosixDiskStorage  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

QUIET: dict[str, Any] = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "accelerator": "cpu"}


# ------------------------------------------------------------------------------------------ the model
class Regressor(L.LightningModule):
    def __init__(self, width: int = 64, inputs: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(inputs, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + self.global_step)
        x = torch.randn(8, self.hparams["inputs"], generator=g)
        return torch.nn.functional.mse_loss(self.net(x), x.sum(1, keepdim=True))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(10)), batch_size=1)


def new_model(**kw: int) -> Regressor:
    torch.manual_seed(0)
    return Regressor(**kw)


class KillAt(Callback):
    """SIGKILLs this process at the end of step ``step`` (after the callbacks listed before it)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class StartStep(Callback):
    """Records the global step training (re)started from."""

    start: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = trainer.global_step


def weights(model: L.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_weights(steps: int) -> dict[str, torch.Tensor]:
    model = new_model()
    L.Trainer(max_steps=steps, devices=1, enable_checkpointing=False, **QUIET).fit(model)
    return weights(model)


# ------------------------------------------------------------------------------------------ rank functions
def train_rank(ckpt: str, steps: int, kill_at: int = -1, devices: int = 1, every: int = 10) -> dict:
    """One rank of a run with FlashCheckpointIO (launched by ``launch_ranks``): resumes from
    ``resume_path()``, saves every ``every`` steps (top 2 by step, plus last.ckpt) and snapshots every
    step; with ``kill_at`` it SIGKILLs itself after the snapshot of that step."""
    torch.set_num_threads(1)
    io = FlashCheckpointIO(ckpt)
    resume = io.resume_path()
    start = StartStep()
    callbacks = [FlashMemorySnapshot(every_n_train_steps=1), start]
    if kill_at >= 0:
        callbacks.append(KillAt(kill_at))
    callbacks.append(ModelCheckpoint(dirpath=ckpt, every_n_train_steps=every, save_top_k=2, monitor="step",
                                     mode="max", save_last=True))
    model = new_model()
    strategy = "ddp" if devices > 1 else "auto"
    trainer = L.Trainer(max_steps=steps, devices=devices, strategy=strategy, plugins=[io], callbacks=callbacks,
                        **QUIET)
    trainer.fit(model, ckpt_path=resume)
    out = os.path.join(ckpt, f"final_rank{trainer.global_rank}.pt")
    torch.save(weights(model), out)
    return {"resume": resume, "start": start.start, "load": list(io.last_load or ()), "final": out}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def crash_and_resume(tmp_path, ckpt: str, devices: int, kill_at: int, steps: int,
                     resume_devices: int | None = None) -> list[dict]:
    """Runs ``train_rank`` on ``devices`` ranks until they kill themselves at ``kill_at``, then again (on
    ``resume_devices`` ranks when given: a job that comes back with another number of ranks)."""
    # The saver the crashed run started keeps its snapshots this long for the restart (the default
    # test grace can run out while the restarted ranks import Lightning on a busy machine).
    env = {"MASTER_PORT": str(free_port()), "FLASHCKPT_SAVER_GRACE_S": "300"}
    crashed = launch_ranks(train_rank, devices, str(tmp_path / "crash"), dist=False, env=env,
                           args={"ckpt": ckpt, "steps": steps, "kill_at": kill_at, "devices": devices})
    try:
        wait_for(lambda: all(p.poll() is not None for p in crashed.procs), 120, "the ranks to kill themselves")
    finally:
        crashed.kill()
    assert [p.returncode for p in crashed.procs] == [-signal.SIGKILL] * devices, crashed.logs()
    env = {"MASTER_PORT": str(free_port())}
    again = resume_devices or devices
    return launch_ranks(train_rank, again, str(tmp_path / "resume"), dist=False, env=env,
                        args={"ckpt": ckpt, "steps": steps, "devices": again}).wait(180)


def assert_resumed_from_memory(results: list[dict], ckpt: str, step: int, steps: int) -> None:
    want = reference_weights(steps)
    snapshot = os.path.join(ckpt, "last-flash.ckpt")
    for r, res in enumerate(results):
        assert res["resume"] == snapshot, res
        assert res["start"] == step, f"rank {r} restarted at step {res['start']}, not {step}"
        assert res["load"] == ["memory", snapshot], f"rank {r} loaded {res['load']}"
        got = torch.load(res["final"], weights_only=True)
        for k in want:
            assert torch.equal(got[k], want[k]), f"rank {r}: {k} differs from the uninterrupted run"


# ------------------------------------------------------------------------------------------ tests
def test_native_files_top_k_and_vanilla_resume(tmp_path) -> None:
    """ModelCheckpoint with fast saves (every step), save_top_k and both save_last modes: exactly the
    expected files remain; their content is what Lightning's own TorchCheckpointIO writes; a Trainer
    without the plugin resumes from them; flashckpt's records hold only the live checkpoints."""
    steps = 12
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")

    def callbacks(root: str) -> list[Callback]:
        return [ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max",
                                save_last="link"),
                ModelCheckpoint(dirpath=os.path.join(root, "copies"), every_n_train_steps=3, save_top_k=1,
                                monitor="step", mode="max", save_last=True)]

    io = FlashCheckpointIO(ours)
    model = new_model(width=256)
    L.Trainer(max_steps=steps, devices=1, plugins=[io], callbacks=[*callbacks(ours), FlashMemorySnapshot(2)],
              **QUIET).fit(model)
    assert io.engine is None  # teardown closed it
    vanilla = new_model(width=256)
    L.Trainer(max_steps=steps, devices=1, callbacks=callbacks(theirs), **QUIET).fit(vanilla)

    top = ["epoch=1-step=11.ckpt", "epoch=1-step=12.ckpt"]
    # The checkpoint dir looks exactly as vanilla Lightning leaves it: flashckpt's records live beside it.
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs)) == sorted(["copies", "last.ckpt", *top])
    assert os.readlink(os.path.join(ours, "last.ckpt")) == top[1]
    assert sorted(os.listdir(os.path.join(ours, "copies"))) == ["epoch=1-step=12.ckpt", "last.ckpt"]
    assert sorted(os.listdir(os.path.join(theirs, "copies"))) == ["epoch=1-step=12.ckpt", "last.ckpt"]
    # One flashckpt record per live file: records of removed and overwritten saves are gone.
    records = os.listdir(os.path.join(CommitLayout(ours, PosixDiskStorage()).meta, "steps"))
    assert len(records) == 4, records

    for name in [*top, "copies/last.ckpt", "copies/epoch=1-step=12.ckpt"]:
        mine = torch.load(os.path.join(ours, name), weights_only=True)
        ref = torch.load(os.path.join(theirs, name), weights_only=True)
        assert sorted(mine) == sorted(ref), name
        for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "epoch", "global_step",
                    "hyper_parameters", "pytorch-lightning_version"):
            assert_same_tree(ref[key], mine[key], f"{name}[{key!r}]")

    # A Trainer without flashckpt resumes from our checkpoint, through the symlink save_last="link" made.
    resumed = new_model(width=256)
    start = StartStep()
    trainer = L.Trainer(max_steps=steps + 3, devices=1, enable_checkpointing=False, callbacks=[start], **QUIET)
    trainer.fit(resumed, ckpt_path=os.path.join(ours, "last.ckpt"))
    assert (start.start, trainer.global_step) == (steps, steps + 3)
    assert Regressor.load_from_checkpoint(os.path.join(ours, top[0])).hparams["width"] == 256


def test_removal_waits_for_pending_persist(tmp_path, runtime_dir) -> None:
    """remove_checkpoint of a path whose persist has not finished removes it only after the persist,
    so it never reappears (the saver is stopped with SIGSTOP right after a 32 MB persist was requested,
    which holds that persist); a path saved again after its removal stays, with the newer content."""
    root = str(tmp_path / "ckpt")
    a, c, keep = (os.path.join(root, n) for n in ("a.ckpt", "c.ckpt", "keep.ckpt"))
    io = FlashCheckpointIO(root)

    def ckpt(v: int, numel: int = 1000) -> dict:
        return {"state_dict": {"w": torch.full((numel,), float(v))}, "global_step": v}

    try:
        io.save_checkpoint(ckpt(0), keep)
        pid = saver_pid(runtime_dir, io.engine.job_dir)
        io.save_checkpoint(ckpt(1, 8 << 20), a)
        os.kill(pid, signal.SIGSTOP)
        try:
            io.remove_checkpoint(a)  # reads storage only: no request to the stopped saver
        finally:
            os.kill(pid, signal.SIGCONT)
        io.save_checkpoint(ckpt(2), c)
        io.remove_checkpoint(c)
        io.save_checkpoint(ckpt(3), c)  # saved again after its removal: it stays
        io.save_checkpoint(ckpt(4), keep, storage_options=StorageType.MEMORY)  # memory only, until the end
        io.teardown()
    finally:
        io.teardown()
    # Every end of an engine keeps the newest state (#30): the saver's last words, after the teardown's
    # goodbye, persist the memory-only save of keep.ckpt, newer than its last commit.
    wait_for(lambda: not saver_pids(runtime_dir), 60, "the saver's last words and exit")
    assert sorted(os.listdir(root)) == ["c.ckpt", "keep.ckpt"]
    assert torch.load(c, weights_only=True)["global_step"] == 3
    assert torch.load(keep, weights_only=True)["global_step"] == 4
    print(f"removals that waited for their persist: {io.deferred_removals}")


@pytest.mark.parametrize("inside_except", [False, True])
def test_teardown_surfaces_persist_error(tmp_path, inside_except: bool) -> None:
    """The last save does not fit on the (8 MiB tmpfs) checkpoint dir: trainer.fit raises the
    PersistError from teardown, also when fit runs inside an ``except`` block (an exception being
    handled that is not fit's own); the earlier checkpoint is intact; no partial file is left."""
    root = str(tmp_path / "small")
    with small_tmpfs(root, "8m"):
        model = new_model(width=6000, inputs=64)  # ~4.8 MB per checkpoint: one fits, two do not
        io = FlashCheckpointIO(root)
        trainer = L.Trainer(max_steps=4, devices=1, plugins=[io], **QUIET, callbacks=[
            ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)])
        with pytest.raises(PersistError, match="No space left on device"):
            if not inside_except:
                trainer.fit(model)
            try:
                raise KeyError("unrelated")
            except KeyError:
                trainer.fit(model)
        assert io.engine is None
        files = sorted(os.listdir(root))
        assert files == [".flashckpt", "epoch=0-step=2.ckpt"], files  # a mount point keeps its records inside
        first = torch.load(os.path.join(root, "epoch=0-step=2.ckpt"), weights_only=True)
        assert first["global_step"] == 2


def test_kill9_resume_from_memory_single_process(tmp_path) -> None:
    """Killed with SIGKILL at step 23 (last disk checkpoint: step 20): the restarted process resumes
    from the memory snapshot of step 23 and ends with the weights of an uninterrupted run."""
    ckpt = str(tmp_path / "ckpt")
    results = crash_and_resume(tmp_path, ckpt, devices=1, kill_at=23, steps=30)
    assert_resumed_from_memory(results, ckpt, 23, 30)
    assert sorted(f for f in os.listdir(ckpt) if f.endswith(".ckpt")) == [
        "epoch=1-step=20.ckpt", "epoch=2-step=30.ckpt", "last-flash.ckpt", "last.ckpt"]


@pytest.mark.multiproc
def test_ddp_two_ranks_kill9_resume_from_memory(tmp_path) -> None:
    """DDP on 2 gloo ranks: only global rank 0 saves; both ranks are killed after the snapshot of step
    13 (last disk checkpoint: step 10); both resume from memory and reach the reference weights."""
    ckpt = str(tmp_path / "ckpt")
    results = crash_and_resume(tmp_path, ckpt, devices=2, kill_at=13, steps=20)
    assert_resumed_from_memory(results, ckpt, 13, 20)
    assert sorted(f for f in os.listdir(ckpt) if f.endswith(".ckpt")) == [
        "epoch=1-step=10.ckpt", "epoch=3-step=20.ckpt", "last-flash.ckpt", "last.ckpt"]


@pytest.mark.multiproc
def test_ddp_job_that_comes_back_with_one_rank_resumes_from_memory(tmp_path) -> None:
    """DDP on 2 ranks killed after the snapshot of step 13; the job comes back with 1 rank: Lightning's
    checkpoint is replicated state (rank 0's), which any number of ranks takes, so it resumes step 13 from
    memory and trains on to the end."""
    ckpt = str(tmp_path / "ckpt")
    (res,) = crash_and_resume(tmp_path, ckpt, devices=2, kill_at=13, steps=16, resume_devices=1)
    snapshot = os.path.join(ckpt, "last-flash.ckpt")
    assert (res["resume"], res["start"], res["load"]) == (snapshot, 13, ["memory", snapshot]), res


def test_wrong_setups_fail_clearly(tmp_path) -> None:
    """Strategies that bypass CheckpointIO, a missing plugin, a path outside the checkpoint dir and a
    plugin of the other Lightning package are refused with errors that say what to do."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    with pytest.raises(UnsupportedStrategyError, match="state_dict_type='full'"):
        check_strategy(FSDPStrategy(state_dict_type="sharded"))
    check_strategy(FSDPStrategy(state_dict_type="full"))
    with pytest.raises(UnsupportedStrategyError, match="save_distributed_checkpoint=False"):
        check_strategy(ModelParallelStrategy())

    trainer = L.Trainer(max_steps=1, devices=1, callbacks=[FlashMemorySnapshot()], **QUIET)
    with pytest.raises(UnsupportedStrategyError, match=r"plugins=\[FlashCheckpointIO"):
        trainer.fit(new_model())

    io = FlashCheckpointIO(str(tmp_path / "a"))
    with pytest.raises(Exception, match="outside"):
        io.save_checkpoint({"w": torch.zeros(1)}, str(tmp_path / "b" / "x.ckpt"))
    io.teardown()
    with pytest.raises(TypeError, match="StorageType.MEMORY"):
        io.save_checkpoint({"w": torch.zeros(1)}, str(tmp_path / "a" / "x.ckpt"), storage_options={"x": 1})
    io.teardown()

    pl = pytest.importorskip("pytorch_lightning")
    from flashckpt.integrations.lightning import PLFlashCheckpointIO, PLFlashMemorySnapshot

    with pytest.raises(Exception, match="PLFlashCheckpointIO"):
        pl.Trainer(plugins=[FlashCheckpointIO()], logger=False, accelerator="cpu")
    # The pytorch_lightning tree works with a pytorch_lightning Trainer.

    class PLRegressor(pl.LightningModule):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            return self.net(torch.ones(2, 4)).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(4)), batch_size=1)

    root = str(tmp_path / "pl")
    pio = PLFlashCheckpointIO(root)
    pl.Trainer(max_steps=2, plugins=[pio], callbacks=[PLFlashMemorySnapshot(),
                                                      pl.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=1)],
               **QUIET).fit(PLRegressor())
    assert sorted(os.listdir(root)) == ["epoch=0-step=2.ckpt"]


# ------------------------------------------------------------------------------------------ as vanilla does
class RaiseAt(Callback):
    """Raises RuntimeError("boom at <step>") at the end of training step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"boom at {self.step}")


def test_checkpoint_saved_on_exception_is_on_storage_when_fit_raises(tmp_path) -> None:
    """ModelCheckpoint(save_on_exception=True): when fit raises, the checkpoint written on the way out
    (step=5.ckpt) and the step checkpoints are complete files before the exception reaches the caller,
    and the snapshots stay in memory for a restart (a new plugin loads step=5.ckpt from memory)."""
    root = str(tmp_path / "ckpt")
    io = FlashCheckpointIO(root)
    trainer = L.Trainer(max_steps=20, devices=1, plugins=[io], **QUIET, callbacks=[
        ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, save_on_exception=True,
                        filename="{step}"), RaiseAt(5)])
    with pytest.raises(RuntimeError, match="boom at 5"):
        trainer.fit(new_model(width=512))
    assert io.engine is None
    exc = os.path.join(root, "step=5.ckpt")
    got = torch.load(exc, weights_only=True)  # on storage already, complete
    assert got["global_step"] == 5
    assert sorted(f for f in os.listdir(root) if f.endswith(".ckpt")) == ["step=2.ckpt", "step=4.ckpt", "step=5.ckpt"]
    assert torch.load(os.path.join(root, "step=4.ckpt"), weights_only=True)["global_step"] == 4
    # Kept in memory for a restart (crash semantics); loading from it also lets the saver go.
    again = FlashCheckpointIO(root)
    try:
        sd = again.load_checkpoint(exc)
        assert again.last_load == ("memory", exc)
        assert_same_tree(got["state_dict"], sd["state_dict"])
    finally:
        again.teardown()


def test_error_while_waiting_on_the_way_out_does_not_replace_the_exception(tmp_path) -> None:
    """The checkpoint written on the way out of a failing fit does not fit on the (8 MiB tmpfs) dir:
    fit raises the user's exception, with the persist error logged and added to it as a note; the
    earlier checkpoint is intact and no partial or empty file is left."""
    root = str(tmp_path / "small")
    with small_tmpfs(root, "8m"):
        io = FlashCheckpointIO(root)
        trainer = L.Trainer(max_steps=20, devices=1, plugins=[io], **QUIET, callbacks=[
            ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, save_on_exception=True),
            RaiseAt(3)])
        with pytest.raises(RuntimeError, match="boom at 3") as info:
            trainer.fit(new_model(width=6000, inputs=64))  # ~4.8 MB per checkpoint: one fits, two do not
        notes = " ".join(getattr(info.value, "__notes__", []))
        assert "PersistError" in notes and "No space left on device" in notes, notes
        assert sorted(f for f in os.listdir(root) if f.endswith(".ckpt")) == ["epoch=0-step=2.ckpt"]
        assert torch.load(os.path.join(root, "epoch=0-step=2.ckpt"), weights_only=True)["global_step"] == 2
        again = FlashCheckpointIO(root)
        again.load_checkpoint(os.path.join(root, "epoch=0-step=2.ckpt"))
        again.teardown()  # lets the saver that kept the snapshots go


def test_save_outside_fit_is_on_storage_on_return(tmp_path, runtime_dir) -> None:
    """trainer.save_checkpoint after fit (no teardown follows) returns once the file is on storage, as
    torch.save does; the plugin's saver goes once the plugin is dropped."""
    import gc

    root = str(tmp_path / "ckpt")
    io = FlashCheckpointIO(root)
    trainer = L.Trainer(max_steps=2, devices=1, plugins=[io], enable_checkpointing=False, **QUIET)
    trainer.fit(new_model(width=512))
    for name in ("a.ckpt", "sub/b.ckpt"):
        path = os.path.join(root, name)
        trainer.save_checkpoint(path)
        assert torch.load(path, weights_only=True)["global_step"] == 2  # complete on return
    assert io.engine is not None and saver_pids(runtime_dir)
    del trainer, io
    gc.collect()
    wait_for(lambda: not saver_pids(runtime_dir), 30, "the dropped plugin's saver to exit")


def test_direct_save_is_on_storage_when_the_process_exits(tmp_path) -> None:
    """A process that calls FlashCheckpointIO.save_checkpoint itself and exits without teardown (as
    ddp_spawn's worker does) finds its file complete on storage the moment it has exited."""
    import subprocess
    import textwrap

    root = str(tmp_path / "ckpt")
    path = os.path.join(root, "direct.ckpt")
    code = textwrap.dedent(f"""
        import torch
        from flashckpt.integrations.lightning import FlashCheckpointIO
        io = FlashCheckpointIO({root!r})
        io.save_checkpoint({{"state_dict": {{"w": torch.arange(4 << 20, dtype=torch.float32)}}, "global_step": 7}},
                           {path!r})
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    got = torch.load(path, weights_only=True)
    assert got["global_step"] == 7 and torch.equal(got["state_dict"]["w"], torch.arange(4 << 20, dtype=torch.float32))


def test_version_counter_sees_files_still_persisting(tmp_path) -> None:
    """ModelCheckpoint picks "-v<N>" names by whether a file exists: a name that repeats while its
    first save is still persisting gets a new version, as with vanilla, never an overwrite; a rerun
    of the same Trainer continues the versions."""
    root = str(tmp_path / "ckpt")
    mc = ModelCheckpoint(dirpath=root, save_top_k=-1, monitor="step", mode="max", filename="test",
                         every_n_train_steps=1)
    trainer = L.Trainer(max_steps=3, devices=1, plugins=[FlashCheckpointIO(root)], callbacks=[mc], **QUIET)
    trainer.fit(new_model(width=512))
    trainer.fit_loop.epoch_loop.max_steps = 5
    trainer.fit(new_model(width=512))
    want = {"test.ckpt": 1, "test-v1.ckpt": 2, "test-v2.ckpt": 3, "test-v3.ckpt": 4, "test-v4.ckpt": 5}
    assert {os.path.basename(p) for p in mc.best_k_models} == set(want)
    assert sorted(f for f in os.listdir(root) if f.endswith(".ckpt")) == sorted(want)
    for name, step in want.items():
        assert torch.load(os.path.join(root, name), weights_only=True)["global_step"] == step, name


def test_storage_options_that_are_not_ours_go_to_lightning(tmp_path) -> None:
    """storage_options flashckpt does not take are handed to Lightning's TorchCheckpointIO, which
    refuses them as it does without the plugin; the message also says what flashckpt takes."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    root = str(tmp_path / "ckpt")
    io = FlashCheckpointIO(root)
    trainer = L.Trainer(max_steps=1, devices=1, plugins=[io], enable_checkpointing=False, **QUIET)
    trainer.fit(new_model())
    path = os.path.join(root, "x.ckpt")
    for options in ("my instance storage options", {"x": 1}):
        with pytest.raises(TypeError) as ours:
            trainer.save_checkpoint(path, storage_options=options)
        with pytest.raises(TypeError) as vanilla:
            TorchCheckpointIO().save_checkpoint({}, path, storage_options=options)
        assert str(vanilla.value) in str(ours.value) and "StorageType.MEMORY" in str(ours.value)
        assert not os.path.exists(path)
    trainer.save_checkpoint(path, storage_options=StorageType.DISK)
    assert torch.load(path, weights_only=True)["global_step"] == 1
    io.teardown()


def test_urls_are_saved_by_lightnings_torch_io(tmp_path, caplog) -> None:
    """A ModelCheckpoint on an fsspec URL (memory://) saves through Lightning's TorchCheckpointIO (one
    warning), next to a local one that flashckpt persists; training resumes from the URL. A memory-only
    snapshot of a URL is refused with what to do."""
    import uuid

    import fsspec

    url = f"memory://flashckpt-test-{uuid.uuid4().hex}"
    root = str(tmp_path / "ckpt")
    io = FlashCheckpointIO(root)
    fs = fsspec.filesystem("memory")
    try:
        with caplog.at_level("WARNING", logger="flashckpt.integrations.lightning"):
            L.Trainer(max_steps=4, devices=1, plugins=[io], **QUIET, callbacks=[
                ModelCheckpoint(dirpath=url, every_n_train_steps=2, save_top_k=-1, filename="{step}"),
                ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, filename="{step}", monitor="step",
                                mode="max")]).fit(new_model())
        assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(url, detail=False)) == ["step=2.ckpt", "step=4.ckpt"]
        assert sorted(os.listdir(root)) == ["step=2.ckpt", "step=4.ckpt"]
        assert io.resume_path() == os.path.join(root, "step=4.ckpt")  # flashckpt's own record
        assert len([r for r in caplog.records if "TorchCheckpointIO" in r.getMessage()]) == 1
        start = StartStep()
        L.Trainer(max_steps=6, devices=1, plugins=[FlashCheckpointIO(root)], enable_checkpointing=False,
                  callbacks=[start], **QUIET).fit(new_model(), ckpt_path=f"{url}/step=4.ckpt")
        assert start.start == 4
        with pytest.raises(Exception, match="FlashMemorySnapshot\\(dirpath="):
            io.save_checkpoint({"w": torch.zeros(1)}, f"{url}/snap.ckpt", storage_options=StorageType.MEMORY)
    finally:
        if fs.exists(url):
            fs.rm(url, recursive=True)


def test_resume_from_another_dir_then_save_in_a_new_one(tmp_path) -> None:
    """A plugin without checkpoint_dir that first loads a checkpoint of another directory (a resume
    from a failed run whose saver still holds it in memory) and then saves into a new directory: it
    loads from memory and its saves are flash checkpoints of the new directory (they were refused)."""
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    trainer = L.Trainer(max_steps=20, devices=1, plugins=[FlashCheckpointIO()], **QUIET, callbacks=[
        ModelCheckpoint(dirpath=first, every_n_train_steps=2, save_top_k=-1, filename="{step}"), RaiseAt(5)])
    with pytest.raises(RuntimeError, match="boom at 5"):
        trainer.fit(new_model())
    io = FlashCheckpointIO()
    start = StartStep()
    L.Trainer(max_steps=8, devices=1, plugins=[io], **QUIET, callbacks=[
        start, ModelCheckpoint(dirpath=second, every_n_train_steps=2, save_top_k=-1, filename="{step}")]).fit(
        new_model(), ckpt_path=os.path.join(first, "step=4.ckpt"))
    assert start.start == 4 and io.last_load == ("memory", os.path.join(first, "step=4.ckpt"))
    assert sorted(f for f in os.listdir(second) if f.endswith(".ckpt")) == ["step=6.ckpt", "step=8.ckpt"]
    assert find_resume_path(second) == os.path.join(second, "step=8.ckpt")  # flashckpt's commit record
    assert sorted(f for f in os.listdir(first) if f.endswith(".ckpt")) == ["step=2.ckpt", "step=4.ckpt"]


def test_paths_outside_the_plugins_dir_and_missing_files_as_vanilla(tmp_path, caplog) -> None:
    """Without checkpoint_dir, a save outside the first save's directory goes to Lightning's
    TorchCheckpointIO (one warning) instead of failing the run; a missing checkpoint is reported
    under the name it was given."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    io = FlashCheckpointIO()
    trainer = L.Trainer(max_steps=4, devices=1, plugins=[io], **QUIET, callbacks=[
        ModelCheckpoint(dirpath=a, every_n_train_steps=2, save_top_k=-1, filename="{step}"),
        ModelCheckpoint(dirpath=b, every_n_train_steps=2, save_top_k=-1, filename="{step}", monitor="step",
                        mode="max")])
    with caplog.at_level("WARNING", logger="flashckpt.integrations.lightning"):
        trainer.fit(new_model())
    for d in (a, b):
        assert sorted(f for f in os.listdir(d) if f.endswith(".ckpt")) == ["step=2.ckpt", "step=4.ckpt"], d
        assert torch.load(os.path.join(d, "step=4.ckpt"), weights_only=True)["global_step"] == 4
    assert find_resume_path(a) == os.path.join(a, "step=4.ckpt") and find_resume_path(b) is None
    assert len([r for r in caplog.records if "is outside" in r.getMessage()]) == 1
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found: not existing$"):
        L.Trainer(max_steps=5, devices=1, plugins=[FlashCheckpointIO()], **QUIET).fit(new_model(), ckpt_path="not existing")
