"""flashckpt for Megatron: drop-in ``save_checkpoint`` / ``load_checkpoint`` with a ``storage_type``.

Megatron-LM users change one import in their training script::

    from flashckpt.patches.megatron import save_checkpoint, load_checkpoint, StorageType

and may pass ``storage_type=StorageType.MEMORY`` to ``save_checkpoint`` every few iterations (a snapshot
in host shared memory, a pause of a memory copy); ``StorageType.DISK`` (the default) also persists it in
the background, in Megatron-LM's own layout (``iter_XXXXXXX/``, ``latest_checkpointed_iteration.txt``
written once the iteration is committed). ``load_checkpoint`` resumes from memory when memory holds the
newest iteration. Both wrap Megatron-LM's own functions (see ``flashckpt.patches.megatron._lm``) and need a
Megatron-LM checkout on the path; ``finalize()`` at the end of training waits for the persists.

With megatron-core alone, ``flashckpt.patches.megatron.dist_ckpt`` provides ``save`` / ``load`` for
``megatron.core.dist_checkpointing`` and ``FlashCkptSaveStrategy`` (a ``sharded_strategy``).
"""

from __future__ import annotations

from flashckpt import StorageType
from flashckpt.util.lazy import lazy_attributes

__all__ = ["save_checkpoint", "load_checkpoint", "StorageType", "configure", "get_checkpointer", "finalize",
           "MegatronCheckpointer", "FlashCkptSaveStrategy"]

# The functions import megatron-core (slow) on first use, not when ``StorageType`` is imported.
__getattr__, __dir__ = lazy_attributes(__name__, {
    "save_checkpoint": "._lm", "load_checkpoint": "._lm", "configure": "._lm", "get_checkpointer": "._lm",
    "finalize": "._lm", "MegatronCheckpointer": ".dist_ckpt", "FlashCkptSaveStrategy": ".dist_ckpt"})
