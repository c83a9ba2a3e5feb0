"""What a training process has imported, recorded for the warm workers of ``flashckpt-run``.

The launcher (``flashckpt.launch``) names a private directory in ``FLASHCKPT_WARM_MODULES_DIR`` for its
workers; after its first snapshot a worker writes there, once, the names of the modules it imported
(``record_modules``, called by the engine), and the launcher's next warm worker of the same local rank
imports them ahead (``flashckpt.launch.warm``). The record lives down here, beside the other process-level
utilities, so that the engine writes it without importing the launcher: nothing here imports above
``flashckpt.config``. Without the variable (no launcher), ``record_modules`` does nothing.

Concurrency: each process writes its own local rank's file, replacing it atomically.
"""

from __future__ import annotations

import json
import os
import sys

from flashckpt.config import knob

__all__ = ["modules_file", "record_modules"]

_recorded = False


def modules_file(directory: str, local_rank: int | str) -> str:
    """The file in ``directory`` holding the module names recorded by the worker of ``local_rank``."""
    return os.path.join(directory, f"local_rank_{local_rank}.json")


def record_modules() -> None:
    """In a worker of ``flashckpt-run``: writes the names of the modules this process has imported, once
    (the engine calls it after the first snapshot, when training is set up), for the next warm worker of
    its local rank to import ahead (torch imports much lazily: DDP's first construction alone imports
    torch._dynamo, 800 modules, 1-1.5 s here)."""
    global _recorded
    if _recorded:  # every save calls this: one flag test after the first
        return
    _recorded = True
    directory = knob("warm_modules_dir")
    if not directory:
        return
    names = [n for n, m in list(sys.modules.items()) if m is not None and not n.startswith("__")]
    path = modules_file(directory, os.environ.get("LOCAL_RANK", "0"))
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(names, f)
        os.replace(tmp, path)
    except OSError:
        pass
