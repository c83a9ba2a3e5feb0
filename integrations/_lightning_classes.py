"""``flashckpt.integrations.lightning``'s classes on ``lightning`` (imported there on first use of their names;
their bodies are ``_lightning_io._FlashIOImpl`` and that module's ``_MemorySnapshotImpl``; the ``pytorch_lightning`` ones are beside)."""

from flashckpt.integrations._lightning_io import _FlashIOImpl
from flashckpt.integrations.lightning import _AutoResumeImpl, _MemorySnapshotImpl, restarted_worker_callbacks
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback

__all__ = ["FlashCheckpointIO", "FlashMemorySnapshot"]


class FlashCheckpointIO(_FlashIOImpl, CheckpointIO, tree="lightning", torch_io=TorchCheckpointIO):
    pass


class FlashMemorySnapshot(_MemorySnapshotImpl, Callback, tree="lightning"):
    pass


class FlashAutoResume(_AutoResumeImpl, Callback, tree="lightning"):
    """Added by Lightning to every Trainer of a restarted worker (``callbacks_factory``): see ``_AutoResumeImpl``."""


def callbacks_factory() -> list[Callback]:
    """The ``lightning.callbacks_factory`` entry point (pyproject.toml): ``FlashAutoResume`` in a restarted worker."""
    return restarted_worker_callbacks(FlashAutoResume)
