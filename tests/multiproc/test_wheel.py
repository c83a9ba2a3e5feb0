"""The built wheel, installed, not the checkout: `python -m build` makes a wheel whose only top-level
package is ``flashckpt``; installed into a fresh venv it imports every public name and starts its saver
(``python -m flashckpt.saver...``) from the installed files, from a directory outside the checkout.

The fresh venv gets the wheel itself (``pip install --no-deps --no-index``), and its dependencies (torch,
the frameworks) from this test's venv through a ``.pth`` file holding that site-packages directory as a
plain path line. A plain line only puts the directory on ``sys.path``; the ``.pth`` files inside it, among
them the checkout's editable install (its import hook mapping flashckpt_core/ to flashckpt), are not
processed. So the fresh interpreter can import flashckpt only from the wheel; the test checks that it does
(and that the checkout's finder is absent). Installing torch and four frameworks into each fresh venv would
cost minutes of CI for no other check.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_IN_FRESH_VENV = r'''
import importlib, os, sys, time
import torch
import flashckpt
prefix = sys.prefix
assert flashckpt.__file__.startswith(prefix), flashckpt.__file__
assert not [f for f in sys.meta_path if "editable" in type(f).__module__.lower()], sys.meta_path
try:
    import flashckpt_core
except ImportError:
    pass
else:
    raise AssertionError("flashckpt_core importable: " + flashckpt_core.__file__)
for name in flashckpt.__all__:
    assert getattr(flashckpt, name) is not None, name
modules = ["flashckpt.integrations.ddp", "flashckpt.integrations.fsdp", "flashckpt.integrations.dcp",
           "flashckpt.integrations.hf", "flashckpt.integrations.accelerate", "flashckpt.integrations.lightning",
           "flashckpt.integrations.deepspeed", "flashckpt.patches.megatron", "flashckpt.patches.megatron.dist_ckpt"]
for mod in modules:
    m = importlib.import_module(mod)
    assert m.__file__.startswith(prefix), m.__file__
    for name in m.__all__:
        assert getattr(m, name) is not None, (mod, name)
print("IMPORTED", len(modules))

from flashckpt import CheckpointEngine, StorageType
sd = {"w": torch.arange(1000, dtype=torch.float32), "step": 7}
eng = CheckpointEngine(sys.argv[1])
eng.save(7, sd, storage_type=StorageType.DISK)
eng.wait()
savers = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"-m" in argv and any(a.startswith(b"flashckpt.saver") for a in argv) and \
                any(a.startswith(os.environ["FLASHCKPT_RUNTIME_DIR"].encode()) for a in argv):
            savers.append([a.decode() for a in argv if a])
assert len(savers) == 1, savers
assert savers[0][0] == sys.executable, (savers[0][0], sys.executable)
spec = importlib.util.find_spec(savers[0][savers[0].index("-m") + 1])
assert spec.origin.startswith(prefix), spec.origin
eng.close()
again = CheckpointEngine(sys.argv[1])
got = again.load()
assert torch.equal(got["w"], sd["w"]) and got["step"] == 7
again.close()
print("SAVER", savers[0][0], spec.origin)
'''


def test_the_wheel_installs_one_top_level_package_that_works_on_its_own(tmp_path, runtime_dir):
    pytest.importorskip("build")
    dist = tmp_path / "dist"
    egg_info = os.path.join(REPO, "flashckpt.egg-info")  # setuptools writes it into the source tree
    had_egg_info = os.path.exists(egg_info)
    try:
        out = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), REPO],
                             capture_output=True, text=True, timeout=600)
    finally:
        if not had_egg_info:  # else it would shadow the editable install's metadata (entry points) here
            shutil.rmtree(egg_info, ignore_errors=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (wheel,) = dist.glob("flashckpt-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert z.read(top_level).decode().split() == ["flashckpt"]
    assert all(n.startswith(("flashckpt/", "flashckpt-")) for n in names), [n for n in names if not n.startswith("flashckpt")]
    assert "flashckpt/saver/__init__.py" in names or "flashckpt/saver.py" in names
    assert "flashckpt/csrc/fastpath.cpp" in names and "flashckpt/py.typed" in names

    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = str(venv / "bin" / "python")
    out = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    fresh_site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(fresh_site, "_flashckpt_test_deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")  # a plain path line: its .pth files stay unprocessed

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([py, "-c", _IN_FRESH_VENV, str(work / "ckpt")], cwd=str(work), env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "IMPORTED 9" in out.stdout and f"SAVER {py}" in out.stdout, out.stdout
