"""The packages' public names are imported on first use, all through one helper (``_lazy.lazy_attributes``)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAZY = ("flashckpt", "flashckpt.saver", "flashckpt.storage", "flashckpt.patches.megatron")


def test_no_hand_written_module_getattr():
    """A module-level ``__getattr__`` is the helper's, never a table of its own."""
    found = []
    for path in sorted(p for d in ("flashckpt_core", "integrations", "patches") for p in (ROOT / d).rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name in ("__getattr__", "__dir__"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


@pytest.mark.parametrize("name", LAZY)
def test_every_public_name_resolves(name):
    mod = importlib.import_module(name)
    for attr in mod.__all__:
        assert getattr(mod, attr) is not None
        assert attr in dir(mod)
    with pytest.raises(AttributeError, match=f"module {name!r} has no attribute 'no_such_name'"):
        mod.no_such_name  # noqa: B018


def test_names_import_their_module_on_first_use():
    code = ("import sys, flashckpt, flashckpt.saver, flashckpt.storage.base\n"
            "assert 'flashckpt.engine.engine' not in sys.modules and 'flashckpt.saver.server' not in sys.modules\n"
            "from flashckpt import StorageType, InvalidArgumentError\n"
            "assert 'torch' not in sys.modules, 'StorageType and the errors need no torch'\n"
            "flashckpt.CheckpointEngine\n"
            "assert 'flashckpt.engine.engine' in sys.modules and 'CheckpointEngine' in vars(flashckpt)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_lightning_classes_resolve():
    """In a process of its own: importing Lightning sets environment variables (a leak for a test here)."""
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("lightning is not installed")
    code = ("import flashckpt.integrations.lightning as m\n"
            "assert 'FlashCheckpointIO' not in vars(m)\n"
            "for name in m.__all__:\n"
            "    assert getattr(m, name) is not None and name in dir(m), name\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
