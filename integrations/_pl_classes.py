"""``flashckpt.integrations.lightning``'s classes on ``pytorch_lightning`` (imported there on first use of their names;
their bodies are ``_lightning_io._FlashIOImpl`` and that module's ``_MemorySnapshotImpl``; the ``lightning`` ones are beside)."""

from flashckpt.integrations._lightning_io import _FlashIOImpl
from flashckpt.integrations.lightning import _AutoResumeImpl, _MemorySnapshotImpl, restarted_worker_callbacks
from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.callbacks import Callback

__all__ = ["PLFlashCheckpointIO", "PLFlashMemorySnapshot"]


class PLFlashCheckpointIO(_FlashIOImpl, CheckpointIO, tree="pytorch_lightning", torch_io=TorchCheckpointIO):
    pass


class PLFlashMemorySnapshot(_MemorySnapshotImpl, Callback, tree="pytorch_lightning"):
    pass


class PLFlashAutoResume(_AutoResumeImpl, Callback, tree="pytorch_lightning"):
    """Added by Lightning to every Trainer of a restarted worker (``callbacks_factory``): see ``_AutoResumeImpl``."""


def callbacks_factory() -> list[Callback]:
    """The ``pytorch_lightning.callbacks_factory`` entry point (pyproject.toml): ``PLFlashAutoResume`` in a restarted worker."""
    return restarted_worker_callbacks(PLFlashAutoResume)
