"""Overlapped snapshots: save() returns before the copy is done, wait_snapshot() fences the optimizer step,
and what lands in memory and on storage is exactly the state at save() time."""

from __future__ import annotations

import torch
from flashckpt import StorageType
from helpers import assert_same_tree

DISK, MEMORY = StorageType.DISK, StorageType.MEMORY


def tiny_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def snapshot_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


def clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return type(x)((k, clone(v)) for k, v in x.items())
    if isinstance(x, list):
        return [clone(v) for v in x]
    return x


def train(engine, steps: int, overlap: bool) -> list[dict]:
    """Trains with a snapshot every step (DISK every 3rd); returns the state at each save() call."""
    model, opt = tiny_model(0)
    g = torch.Generator().manual_seed(1)
    expected = []
    for step in range(1, steps + 1):
        x = torch.randn(32, 256, generator=g)
        if step > 1:
            sd = snapshot_of(model, opt, step)
            expected.append(clone(sd))
            engine.save(step, sd, storage_type=DISK if step % 3 == 0 else MEMORY, overlap=overlap)
        loss = model(x).pow(2).mean()  # forward and backward run while the copy may still be going
        loss.backward()
        engine.wait_snapshot()  # the fence: the optimizer step changes the tensors being copied
        opt.step()
        opt.zero_grad()
    engine.wait(60)
    return expected


def test_overlapped_snapshots_hold_the_state_at_save_time(make_engine, ckpt_dir):
    eng = make_engine(max_to_keep=0, overlap=True)
    expected = train(eng, 7, overlap=True)
    loaded = eng.load()
    assert eng.last_load.source == "memory" and eng.last_load.step == 7
    assert_same_tree(loaded, expected[-1])
    assert eng.committed_steps() == [3, 6]
    on_disk = eng.load(f"step_6/rank_{0:05d}.pt")
    assert_same_tree(on_disk, expected[6 - 2])
    eng.close()


def test_overlap_and_blocking_snapshots_are_identical(make_engine, ckpt_dir, tmp_path):
    a = make_engine(str(tmp_path / "a"), max_to_keep=0)
    train(a, 4, overlap=False)
    blocking = a.load()
    a.close()
    b = make_engine(str(tmp_path / "b"), max_to_keep=0)
    train(b, 4, overlap=True)
    overlapped = b.load()
    b.close()
    assert_same_tree(blocking, overlapped)


def test_engine_calls_wait_for_an_overlapped_snapshot(make_engine, ckpt_dir):
    eng = make_engine(max_to_keep=0)
    big = {"w": torch.randn(4 << 20)}  # 16 MiB: the copy takes a while
    want = big["w"].clone()
    eng.save(1, big, storage_type=DISK, overlap=True)
    eng.wait(60)  # waits for the copy, then for the persist it schedules
    assert eng.committed_steps() == [1]
    big["w"].zero_()
    eng.save(2, {"w": torch.ones(3)}, storage_type=MEMORY, overlap=True)
    assert eng.load()["w"].tolist() == [1.0, 1.0, 1.0]  # load waits too
    assert torch.equal(eng.load(f"step_1/rank_{0:05d}.pt")["w"], want)
    eng.save(3, {"w": torch.full((3,), 3.0)}, storage_type=MEMORY, overlap=True)
    eng.close()  # close waits for the copy before detaching


def test_overlapped_snapshot_keeps_the_dropped_state_alive(make_engine, ckpt_dir):
    """The caller may drop its state dict as soon as save(overlap=True) returns: the snapshot holds the
    tensors until its background copy is done with them (the copy reads them by address; a freed
    tensor's memory is reused or unmapped), then lets them go."""
    import gc
    import threading
    import weakref

    eng = make_engine()
    gate = threading.Event()
    real_run = eng._copier.run

    def gated_run(*a, **kw):  # holds the background copy until the test has dropped its references
        assert gate.wait(30)
        return real_run(*a, **kw)

    eng._copier.run = gated_run
    t = torch.arange(300_000, dtype=torch.float32)  # a copier-sized storage and...
    small = torch.full((3,), 7.0)  # ...a small one (the native small-copy path where built)
    refs = [weakref.ref(t), weakref.ref(small)]
    eng.save(1, {"w": t, "s": small}, storage_type=MEMORY, overlap=True)
    del t, small
    gc.collect()
    assert all(r() is not None for r in refs), "the pending snapshot let its source tensors go"
    gate.set()
    eng.wait_snapshot()
    gc.collect()
    assert all(r() is None for r in refs), "the snapshot kept its source tensors after the copy"
    back = eng.load()
    assert torch.equal(back["w"], torch.arange(300_000, dtype=torch.float32))
    assert back["s"].tolist() == [7.0, 7.0, 7.0]
    eng.close()
