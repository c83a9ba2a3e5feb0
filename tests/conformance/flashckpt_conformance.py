"""pytest plugin: runs a framework's own checkpoint tests with flashckpt's adapter swapped in.

Loaded by ``tests/conformance/run.py`` with ``-p flashckpt_conformance`` for the "ours" run of a suite
(``FLASHCKPT_CONFORMANCE_SUITE`` = ``hf`` or ``lightning``); the "vanilla" run does not load it.

- ``hf``: ``transformers.Trainer`` is ``flashckpt.integrations.hf.FlashCkptTrainer`` before any test module is
  imported (``from transformers import Trainer`` in the upstream files then binds ours). transformers
  replaces its module object in ``sys.modules`` when ``Trainer`` is first imported, so the name is set on
  the module object that is current after that import, and the swap is checked in every collected
  module.
- ``lightning``: every ``lightning.pytorch.Trainer`` built without a ``CheckpointIO`` of its own (in
  ``plugins`` or on an explicit strategy) gets ``FlashCheckpointIO()`` appended to its plugins.

The swap is verified, not assumed: a test during which a Trainer was built without our adapter fails at
teardown, and the run's counts (Trainers built with ours, without it) are written as JSON to
``FLASHCKPT_CONFORMANCE_STATS`` for the runner, which refuses a run in which ours was never used.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest

SUITE = os.environ.get("FLASHCKPT_CONFORMANCE_SUITE", "")
_stats = {"ours": 0, "own_checkpoint_io": 0, "not_ours": 0, "tests_with_ours": 0}
_in_test: dict[str, Any] = {"ours": 0, "not_ours": []}


def _swap_hf() -> None:
    from flashckpt.integrations.hf import FlashCkptTrainer
    from transformers import Trainer as _vanilla  # noqa: F401  (imports transformers.trainer: the module swap)

    mod = sys.modules["transformers"]
    mod.Trainer = FlashCkptTrainer  # type: ignore[attr-defined]
    from transformers import Trainer

    if Trainer is not FlashCkptTrainer:
        raise RuntimeError("conformance: `from transformers import Trainer` does not give FlashCkptTrainer")
    base = FlashCkptTrainer.__mro__[1]
    orig_init = base.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        if isinstance(self, FlashCkptTrainer):
            _in_test["ours"] += 1
        else:
            _in_test["not_ours"].append(type(self).__qualname__)

    base.__init__ = __init__  # type: ignore[method-assign]


def _swap_lightning() -> None:
    from flashckpt.integrations.lightning import FlashCheckpointIO
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import Strategy

    orig_init = Trainer.__init__

    def has_own_io(kwargs: dict[str, Any]) -> bool:
        plugins = kwargs.get("plugins")
        plugins = plugins if isinstance(plugins, (list, tuple)) else [plugins] if plugins is not None else []
        if any(isinstance(p, CheckpointIO) for p in plugins):
            return True
        strategy = kwargs.get("strategy")
        return isinstance(strategy, Strategy) and getattr(strategy, "_checkpoint_io", None) is not None

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        own = has_own_io(kwargs)
        if not own:
            plugins = kwargs.get("plugins")
            plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins] if plugins is not None else []
            kwargs["plugins"] = [*plugins, FlashCheckpointIO()]
        orig_init(self, *args, **kwargs)
        if own:
            _stats["own_checkpoint_io"] += 1
        elif isinstance(self.strategy.checkpoint_io, FlashCheckpointIO):
            _in_test["ours"] += 1
        else:
            _in_test["not_ours"].append(f"{type(self.strategy).__name__} uses {type(self.strategy.checkpoint_io)}")

    Trainer.__init__ = __init__  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    if SUITE == "hf":
        _swap_hf()
    elif SUITE == "lightning":
        _swap_lightning()
    else:
        raise pytest.UsageError(f"FLASHCKPT_CONFORMANCE_SUITE={SUITE!r}: 'hf' or 'lightning'")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if SUITE != "hf":
        return
    from flashckpt.integrations.hf import FlashCkptTrainer

    for item in items:
        mod = getattr(item, "module", None)
        bound = getattr(mod, "Trainer", None)
        if bound is not None and bound is not FlashCkptTrainer:
            raise pytest.UsageError(f"conformance: {mod.__name__}.Trainer is {bound!r}, not FlashCkptTrainer")


@pytest.fixture(autouse=True)
def _flashckpt_swap_took() -> Any:
    _in_test["ours"] = 0
    _in_test["not_ours"] = []
    yield
    _stats["ours"] += _in_test["ours"]
    _stats["not_ours"] += len(_in_test["not_ours"])
    _stats["tests_with_ours"] += _in_test["ours"] > 0
    if _in_test["not_ours"]:
        pytest.fail(f"conformance: Trainer(s) built without flashckpt's adapter: {_in_test['not_ours']}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("FLASHCKPT_CONFORMANCE_STATS")
    if out:
        with open(out, "w") as f:
            json.dump(_stats, f)
