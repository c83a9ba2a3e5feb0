"""The CUDA path (tier ``gpu``; skips on a machine without a GPU): a snapshot of CUDA tensors is copied
device-to-host asynchronously into the shared-memory segment, registered as pinned memory
(``cudaHostRegister``), on a side stream; training may change the tensors once ``save`` has returned. Checked: bit-exact loads (to CPU, into CUDA tensors, and from a
new engine after a close), the persisted file readable by plain ``torch.load``, and that the segment was
registered and is unregistered at close. Run: ``scripts/test.sh -m gpu`` on a machine with a GPU.
"""

from __future__ import annotations

import pytest
import torch
from flashckpt import StorageType
from helpers import assert_same_tree

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DISK, MEMORY = StorageType.DISK, StorageType.MEMORY


def _cuda_state(seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {"model": {"w": torch.randn(1024, 1024, device="cuda", generator=g),
                      "b": torch.randn(1024, device="cuda", generator=g).to(torch.bfloat16),
                      "view": torch.randn(64, 64, device="cuda", generator=g).t()},
            "cpu_side": torch.arange(10), "step": seed}


def test_cuda_tensors_snapshot_and_load_bit_exact(make_engine, ckpt_dir):
    eng = make_engine()
    sd = _cuda_state(1)
    eng.save(1, sd, storage_type=MEMORY)
    expected = {"model": {k: v.cpu() for k, v in sd["model"].items()}, "cpu_side": sd["cpu_side"], "step": 1}
    sd["model"]["w"].add_(1.0)  # training goes on: the snapshot holds the values at save time
    torch.cuda.synchronize()
    got = eng.load_memory(1)
    assert_same_tree(got, expected)
    handler = eng._handler  # the writer's record of registered segments; no public accessor for it
    assert handler._cuda_registered, "the segment was not registered as pinned memory"

    into = _cuda_state(2)
    eng.load(into=into)
    assert into["model"]["w"].is_cuda
    assert torch.equal(into["model"]["w"].cpu(), expected["model"]["w"])
    assert torch.equal(into["model"]["view"].cpu(), expected["model"]["view"])


def test_cuda_snapshot_persists_a_file_plain_torch_load_reads(make_engine, ckpt_dir):
    eng = make_engine()
    sd = _cuda_state(3)
    eng.save(3, sd, storage_type=DISK)
    eng.wait()
    path = eng.step_path(3)
    on_disk = torch.load(path, map_location="cpu", weights_only=True)
    assert torch.equal(on_disk["model"]["w"], sd["model"]["w"].cpu())
    handler = eng._handler
    eng.close()
    assert not handler._cuda_registered, "the segment stayed registered after close"
    again = make_engine()
    assert_same_tree(again.load(), on_disk)
