"""The CUDA path (tier ``gpu``; skips on a machine without a GPU).

A snapshot of CUDA tensors is copied device-to-host asynchronously, on a side stream ordered after the work
already queued, straight into its slot of the shared-memory segment, which is page-locked slot by slot
(``cudaHostRegister``; ``flashckpt_core/util/cuda.py``). A restore copies host-to-device straight from the
segment into the model's CUDA tensors (or new ones on the device they were saved from). Checked, with real
processes, real signals and the real frameworks on one GPU:

- bit-exact loads: to the saved device, into existing CUDA tensors in place (pinned and pageable restore),
  tied storage, views, bf16, mixed CPU and CUDA leaves; a new engine after a close; the persisted file
  read by plain ``torch.load``;
- ordering: a snapshot taken right after kernels were queued holds their result, blocking and overlapped;
  an overlapped snapshot holds the values at ``save`` even when training changes them after
  ``wait_snapshot``;
- registration: per slot, never the unreserved spare slot, all of it undone at close;
- a trainer killed with SIGKILL and a new process resuming from memory into its CUDA model;
- FSDP2 (``fully_shard`` on a CUDA mesh, NCCL) through ``FsdpShardCheckpointer``: a restarted process
  resumes from memory and trains on bit for bit;
- ``FlashCkptTrainer`` on the GPU: killed with SIGKILL mid-run, resumed from memory, the final weights equal
  a vanilla Trainer's.

Run: ``bash scripts/gpu.sh`` on a machine with a GPU (``scripts/test.sh -m gpu`` inside the project's venv).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from flashckpt import StorageType
from helpers import assert_same_tree, run_ranks, tree_digest, wait_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DISK, MEMORY = StorageType.DISK, StorageType.MEMORY
TESTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")  # the support code's folder
REPO = os.path.dirname(os.path.dirname(TESTS_DIR))


def _cuda_state(seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(1024, 1024, device="cuda", generator=g)
    return {"model": {"w": w,
                      "b": torch.randn(1024, device="cuda", generator=g).to(torch.bfloat16),
                      "view": torch.randn(64, 64, device="cuda", generator=g).t(),
                      "tied": w},
            "cpu_side": torch.arange(10), "step": seed}


def _child_env(**extra: str) -> dict:
    """The environment of a child Python process that imports flashckpt and the tests' helpers."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TESTS_DIR, os.environ.get("PYTHONPATH", "")]), **extra)


def _to_cpu(sd: dict) -> dict:
    return {"model": {k: v.cpu() for k, v in sd["model"].items()}, "cpu_side": sd["cpu_side"], "step": sd["step"]}


def test_cuda_tensors_snapshot_and_load_bit_exact(make_engine, ckpt_dir):
    eng = make_engine()
    sd = _cuda_state(1)
    eng.save(1, sd, storage_type=MEMORY)
    expected = _to_cpu(sd)
    sd["model"]["w"].add_(1.0)  # training goes on: the snapshot holds the values at save time
    torch.cuda.synchronize()
    got = eng.load_memory(1)
    assert got["model"]["w"].device == sd["model"]["w"].device  # back on the GPU it was saved from
    assert got["model"]["tied"].untyped_storage().data_ptr() == got["model"]["w"].untyped_storage().data_ptr()
    assert got["model"]["view"].stride() == sd["model"]["view"].stride()
    assert_same_tree(_to_cpu(got), expected)
    handler = eng._handler  # the writer's record of registered slots; no public accessor for it
    handler._device.wait_registered()  # page-locked in the background (FLASHCKPT_CUDA_REGISTER=background)
    assert handler._device.registered and all(handler._device.registered.values()), \
        "the slot was not registered as pinned memory"
    eng.close()


@pytest.mark.parametrize("mode", ["staged", "register", "pageable"])
def test_load_into_cuda_tensors_in_place(make_engine, monkeypatch, mode):
    monkeypatch.setenv("FLASHCKPT_CUDA_LOAD", mode)
    monkeypatch.setattr("flashckpt.util.cuda.STAGE_BYTES", 1 << 20)  # several staging rounds for a 4 MB tensor
    eng = make_engine()
    sd = _cuda_state(1)
    eng.save(1, sd, storage_type=MEMORY)
    expected = _to_cpu(sd)
    into = _cuda_state(2)
    ptrs = {k: v.data_ptr() for k, v in into["model"].items()}
    got = eng.load(into=into)
    assert eng.last_load.source == "memory"
    for k in ("w", "b"):  # contiguous and matching: filled in place, returned in place
        assert got["model"][k] is into["model"][k] and into["model"][k].data_ptr() == ptrs[k]
        assert torch.equal(into["model"][k].cpu(), expected["model"][k])
    assert_same_tree(_to_cpu(got), expected)
    # a CPU snapshot goes straight into a CUDA tensor too
    eng.save(2, {"x": torch.arange(1000, dtype=torch.float64)}, storage_type=MEMORY)
    target = {"x": torch.zeros(1000, dtype=torch.float64, device="cuda")}
    out = eng.load(into=target)
    assert out["x"] is target["x"] and torch.equal(target["x"].cpu(), torch.arange(1000, dtype=torch.float64))
    eng.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_snapshot_is_ordered_after_queued_kernels(make_engine, overlap):
    eng = make_engine(overlap=overlap)
    big = torch.zeros(64 << 20, device="cuda")  # 256 MB
    eng.save(1, {"big": big}, storage_type=MEMORY)  # the segment exists and its slots are registered
    eng.save(2, {"big": big}, storage_type=MEMORY)
    eng.wait_snapshot()
    eng._handler._device.wait_registered()  # save 3 is DMA straight into the slot (one native batch)
    for _ in range(200):  # tens of milliseconds of kernels still queued when save() is called
        big.add_(1.0)
    eng.save(3, {"big": big}, storage_type=MEMORY)  # copies queued after the additions, not before
    eng.wait_snapshot()
    big.add_(1.0)  # after wait_snapshot the snapshot no longer reads the tensor
    got = eng.load_memory(3)
    assert torch.equal(got["big"], torch.full_like(big, 200.0))
    eng.close()


def test_overlapped_training_snapshots_equal_the_state_at_save(make_engine):
    """An overlapped save every step, the optimizer step fenced by wait_snapshot: each snapshot is
    exactly the state at its save() (the reference clones taken at the same point)."""
    eng = make_engine(overlap=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = {}
    for step in range(1, 6):
        x = torch.randn(64, 512, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        sd = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
        eng.save(step, sd, storage_type=DISK if step == 3 else MEMORY)
        expected[step] = tree_digest(sd)
        eng.wait_snapshot()
        opt.step()
        opt.zero_grad(set_to_none=True)
    eng.wait()
    assert tree_digest(eng.load_memory(5)) == expected[5]
    on_disk = torch.load(eng.step_path(3), map_location="cuda", weights_only=True)
    assert tree_digest(on_disk) == expected[3]
    eng.close()


def test_registration_is_per_slot_and_undone_at_close(make_engine):
    eng = make_engine()
    handler = eng._handler
    for step in range(1, 4):
        eng.save(step, {"w": torch.full((1 << 20,), float(step), device="cuda")}, storage_type=MEMORY)
    seg = handler._seg
    handler._device.wait_registered()
    registered = {slot for (path, slot) in handler._device.registered if path == seg.path}
    from flashckpt.format.segment import FLAG_UNRESERVED

    # memory saves only: the writer alternates between the reserved slots; the spare stays unregistered
    spare = [i for i in range(seg.nslots) if seg.header(i).flags & FLAG_UNRESERVED]
    assert registered and not registered & set(spare)
    eng.close()
    assert not handler._device.registered


@pytest.mark.parametrize("register", ["background", "bounce", "refused", "inline"])
def test_first_snapshots_of_a_slot_not_page_locked_yet_are_copied_once_it_is(make_engine, monkeypatch, register):
    """A snapshot into a slot still being page-locked in the background leaves its copies to the snapshot
    thread, which waits for the lock there and copies straight into the slot; ``bounce``
    (FLASHCKPT_CUDA_UNLOCKED=bounce) takes them through two pinned bounce buffers (here 1 MiB, so a 16 MB state
    takes many rounds of both), and where the driver refuses the lock (``refused``: its answer replaced by a
    refusal, which a healthy driver never gives here) every snapshot takes the bounce buffers. Each snapshot is the state at its save, bit for
    bit; once locked, the slot's copies are one DMA (an event). ``inline`` registers on the training thread."""
    monkeypatch.setenv("FLASHCKPT_CUDA_REGISTER", "inline" if register == "inline" else "background")
    monkeypatch.setenv("FLASHCKPT_CUDA_UNLOCKED", "bounce" if register == "bounce" else "wait")
    monkeypatch.setattr("flashckpt.memory.device.BOUNCE_BYTES", 1 << 20)
    from flashckpt.memory import device as _device

    if register == "refused":
        monkeypatch.setattr(_device.DeviceCopies, "_register", lambda self, key, addr, n, dev: False)
    eng = make_engine(overlap=True)
    handler = eng._handler
    g = torch.Generator(device="cuda").manual_seed(3)
    sd = {"big": torch.randn(3 << 20, device="cuda", generator=g),  # 12 MB: split across bounce rounds
          "small": [torch.randn(i + 1, device="cuda", generator=g) for i in range(300)],
          "half": torch.randn(1000, 333, device="cuda", generator=g).half(), "step": 0}
    routes = []
    orig = type(handler._device).copy

    def spy(self, *a, **k):
        out = orig(self, *a, **k)
        routes.append(type(out).__name__)
        return out

    monkeypatch.setattr(type(handler._device), "copy", spy)
    for step in range(1, 7):
        for _ in range(50):  # kernels still queued at save(): the copies are ordered after them
            sd["big"].mul_(1.0001)
        sd["step"] = step
        eng.save(step, sd, storage_type=MEMORY)
        expected = tree_digest(sd)
        eng.wait_snapshot()
        sd["big"].add_(1.0)  # after wait_snapshot the snapshot no longer reads the tensors
        for t in sd["small"]:
            t.add_(1.0)
        assert tree_digest(eng.load_memory(step)) == expected, f"step {step} ({routes[-1]})"
        if step == 2:
            handler._device.wait_registered()
    if register == "inline":
        assert set(routes) == {"Event"}, routes
    elif register in ("background", "bounce"):
        assert routes[0] == _device._Unlocked.__name__ and routes[-1] == "Event", routes
    else:  # never locked: every snapshot through the bounce buffers
        assert set(routes) == {_device._Unlocked.__name__} and not any(handler._device.registered.values()), routes
    assert register == "refused" or all(handler._device.registered.values())
    eng.close()
    assert not handler._device.registered


@pytest.mark.parametrize("unlocked", ["wait", "bounce"])
def test_a_first_overlapped_snapshot_is_planned_in_the_background_after_the_callers_stream(make_engine, monkeypatch,
                                                                                            unlocked):
    """An overlapped snapshot that needs a new plan (the first, or a new structure; FLASHCKPT_CUDA_DEFER, on by
    default) leaves the plan, the segment and the queueing of its copies to the snapshot thread: its copies still
    follow the kernels queued before save() on the caller's own stream, a DISK save right after it (which asks
    the saver while the snapshot thread may) works, and every snapshot is the state at its save (each read
    back while memory still holds it: two slots keep the newest two)."""
    from flashckpt.util import native as _native

    if _native.get() is None:
        pytest.skip("the native fast path is not built here (flashckpt native --build)")
    monkeypatch.setenv("FLASHCKPT_CUDA_UNLOCKED", unlocked)
    eng = make_engine(overlap=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        big = torch.zeros(16 << 20, device="cuda")
        small = [torch.full((i + 1,), float(i), device="cuda") for i in range(500)]
        for _ in range(100):  # still queued on the caller's stream when save() returns
            big.add_(1.0)
        eng.save(1, {"big": big, "small": small}, storage_type=MEMORY)
        assert eng._handler.pending_bytes >= big.nbytes
        eng.wait_snapshot()
        got = eng.load_memory(1)
        assert torch.equal(got["big"], torch.full_like(big, 100.0))
        assert all(torch.equal(a, b) for a, b in zip(got["small"], small, strict=True))
        big.add_(1.0)
        eng.save(2, {"big": big, "small": small}, storage_type=DISK)
        eng.wait_snapshot()
        big.add_(1.0)
        eng.save(3, {"big": big, "small": small, "new": torch.ones(3, device="cuda")}, storage_type=MEMORY)  # new plan
        eng.wait_snapshot()
    eng.wait()
    torch.cuda.synchronize()
    got = eng.load_memory(3)
    assert torch.equal(got["big"], torch.full_like(big, 102.0)) and torch.equal(got["new"].cpu(), torch.ones(3))
    assert all(torch.equal(a, b) for a, b in zip(got["small"], small, strict=True))
    on_disk = torch.load(eng.step_path(2), map_location="cuda", weights_only=True)
    assert torch.equal(on_disk["big"], torch.full_like(big, 101.0))
    eng.close()


def test_a_save_of_900_cuda_tensors_queues_its_copies_in_one_native_call(make_engine):
    """The GPT-like state of the benchmark's shape, small: 879 CUDA tensors whose copies the native fast
    path queues in one C++ call once the slots are page-locked; every snapshot bit exact."""
    from flashckpt.util import native as _native

    if _native.get() is None:
        pytest.skip("the native fast path is not built here (flashckpt native --build)")
    eng = make_engine()
    handler = eng._handler
    g = torch.Generator(device="cuda").manual_seed(5)
    model = {f"p{i}": torch.randn(17 + i % 7, 33, device="cuda", generator=g) for i in range(293)}
    state = {i: {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
             for i, p in enumerate(model.values())}
    sd = {"model": model, "optimizer": {"state": state}}
    for step in range(1, 5):
        eng.save(step, sd, storage_type=MEMORY)
        handler._device.wait_registered()
        assert tree_digest(eng.load_memory(step)) == tree_digest(sd)
        for p in model.values():
            p.add_(0.5)
    assert handler._plan is not None and len(handler._plan.device_copies) == 879
    assert len(handler._plan.device_copies_packed) == 879 * 3 * 8
    eng.close()


@pytest.mark.parametrize("prestage", ["1", "0"])
def test_a_new_engine_prestages_the_newest_cuda_snapshot_and_loads_it_from_the_locked_slot(make_engine, monkeypatch,
                                                                                            prestage):
    """A new engine on a job whose newest snapshot holds CUDA tensors page-locks that slot in the background
    (FLASHCKPT_CUDA_PRESTAGE, on by default); load(into=...) then copies straight from it, bit exact, and the
    page-locking goes once read. Off: nothing is pre-staged and the load is as exact."""
    monkeypatch.setenv("FLASHCKPT_CUDA_PRESTAGE", prestage)
    eng = make_engine()
    sd = _cuda_state(4)
    eng.save(1, _cuda_state(9), storage_type=MEMORY)
    eng.save(2, sd, storage_type=MEMORY)
    expected = _to_cpu(sd)
    eng.close(release=False)
    again = make_engine()
    reader = again._reader
    if prestage == "1":
        assert len(reader._prestaged) == 1
        secs = reader.prestaged()
        assert secs is not None and secs >= 0
        (path, slot), p = next(iter(reader._prestaged.items()))
        assert reader._readers[path].header(slot).step == 2
    else:
        assert not reader._prestaged and reader.prestaged() is None
    into = _cuda_state(5)
    got = again.load(into=into)
    assert (again.last_load.source, again.last_load.step) == ("memory", 2)
    assert got["model"]["w"] is into["model"]["w"]
    assert_same_tree(_to_cpu(got), expected)
    assert not reader._prestaged  # unregistered once read (in the background)
    again.close()


_TRAINER = textwrap.dedent("""
    import os, sys, torch
    from flashckpt import CheckpointEngine, StorageType
    ckpt, mode = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048).cuda()
    eng = CheckpointEngine(ckpt)
    if mode == "crash":
        with torch.no_grad():
            model.weight.mul_(3.0)
        eng.save(7, {"model": model.state_dict(), "step": 7}, storage_type=StorageType.MEMORY)
        torch.save(model.state_dict(), os.path.join(os.path.dirname(ckpt), "expected.pt"))
        os.kill(os.getpid(), 9)
    into = {"model": model.state_dict()}
    sd = eng.load(into=into)
    exp = torch.load(os.path.join(os.path.dirname(ckpt), "expected.pt"), map_location="cuda", weights_only=True)
    ok = all(torch.equal(model.state_dict()[k], exp[k]) for k in exp)
    print("RESUMED", eng.last_load.source, eng.last_load.step, sd["step"], ok, model.weight.is_cuda, flush=True)
    eng.close()
""")


def test_kill9_then_a_new_process_resumes_from_memory_into_its_cuda_model(tmp_path, runtime_dir):
    ckpt = str(tmp_path / "ckpt")
    env = _child_env(FLASHCKPT_JOB_ID="gpu-kill9", FLASHCKPT_LAST_WORDS="0")
    p = subprocess.run([sys.executable, "-c", _TRAINER, ckpt, "crash"], env=env, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=180)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    p = subprocess.run([sys.executable, "-c", _TRAINER, ckpt, "resume"], env=env, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "RESUMED memory 7 7 True True" in p.stdout, p.stdout + p.stderr
    from helpers import saver_pids

    wait_for(lambda: not saver_pids(runtime_dir), 60, "the saver to exit after the last goodbye")


# ------------------------------------------------------------------------------------------ FSDP2 on CUDA
def fsdp_cuda_worker(ckpt_dir: str, steps: int, resume: bool, release: bool) -> dict:
    """FSDP2 on one GPU (NCCL, world 1): trains ``steps`` steps with a memory snapshot every step, or
    resumes first and trains on; returns the digest after every step. ``release=False`` leaves the
    snapshots to the saver, as a crash would."""
    import datetime

    import torch.distributed as dist
    from flashckpt.integrations.fsdp import FsdpShardCheckpointer
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="file://" + os.path.join(os.path.dirname(ckpt_dir), f"rdzv-{os.getpid()}"),
                            rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        mesh = init_device_mesh("cuda", (1,))
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ckpt = FsdpShardCheckpointer(ckpt_dir)
        out: dict = {"digests": {}}
        start = 1
        if resume:
            extra = ckpt.load_checkpoint(model, opt)
            out["resumed"] = [ckpt.last_load.source, ckpt.last_load.step, extra.get("step")]
            start = int(extra["step"]) + 1
        for step in range(start, steps + 1):
            g = torch.Generator(device="cuda").manual_seed(step)
            x = torch.randn(16, 64, device="cuda", generator=g)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            msd, osd = get_state_dict(model, opt)
            ckpt.save_checkpoint(step, {"model": msd, "optim": osd, "step": step}, f"step_{step}",
                                 storage_type=MEMORY)
            out["digests"][step] = tree_digest({"model": msd, "optim": osd})
        ckpt.close(release=release)
        return out
    finally:
        dist.destroy_process_group()


def test_fsdp2_on_cuda_resumes_from_memory_bit_exact(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    env = {"FLASHCKPT_JOB_ID": "gpu-fsdp"}
    ref = run_ranks(fsdp_cuda_worker, 1, str(tmp_path / "ref"), dist=False, env={"FLASHCKPT_JOB_ID": "gpu-ref"},
                    args={"ckpt_dir": str(tmp_path / "refckpt"), "steps": 5, "resume": False, "release": True})[0]
    first = run_ranks(fsdp_cuda_worker, 1, str(tmp_path / "a"), dist=False, env=env,
                      args={"ckpt_dir": ckpt, "steps": 3, "resume": False, "release": False})[0]
    again = run_ranks(fsdp_cuda_worker, 1, str(tmp_path / "b"), dist=False, env=env,
                      args={"ckpt_dir": ckpt, "steps": 5, "resume": True, "release": True})[0]
    assert again["resumed"] == ["memory", 3, 3]
    assert first["digests"]["3"] == ref["digests"]["3"]
    assert again["digests"]["5"] == ref["digests"]["5"]


# ------------------------------------------------------------------------------------------ HF Trainer on CUDA
def test_hf_trainer_on_gpu_kill9_resumes_from_memory(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    framework = os.path.join(os.path.dirname(TESTS_DIR), "framework")  # test_hf's folder, whoever collected first
    if framework not in sys.path:
        monkeypatch.syspath_prepend(framework)
    import test_hf as hf

    ref_dir, out = str(tmp_path / "vanilla"), str(tmp_path / "flash")
    ref = hf.make_trainer(ref_dir, vanilla=True, use_cpu=False)
    ref.train()
    assert next(ref.model.parameters()).is_cuda
    ref_w = hf.weights(ref.model)
    env = _child_env(FLASHCKPT_LAST_WORDS="0", FLASHCKPT_JOB_ID="gpu-hf")
    half = hf.N_STEPS // 2
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "hf-crash", out, str(half)],
                       env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stdout.decode()[-3000:] + p.stderr.decode()[-3000:]
    monkeypatch.setenv("FLASHCKPT_JOB_ID", "gpu-hf")
    resumed = hf.make_trainer(out, use_cpu=False)
    resumed.train(resume_from_checkpoint=True)
    loc = resumed.flashckpt_last_resume
    assert (loc.source, loc.step) == ("memory", half)
    hf.assert_weights_equal(ref_w, hf.weights(resumed.model))


if __name__ == "__main__" and sys.argv[1] == "hf-crash":
    sys.path[:0] = [TESTS_DIR, os.path.join(os.path.dirname(TESTS_DIR), "framework")]
    import test_hf as hf

    trainer = hf.make_trainer(sys.argv[2], use_cpu=False, callbacks=[hf._stopper(int(sys.argv[3]), "kill")])
    trainer.train()
    raise SystemExit("the run was supposed to be killed")
