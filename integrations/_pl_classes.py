"""``flashckpt.integrations.lightning``'s classes on ``pytorch_lightning`` (imported there on first use of their names;
their bodies are that module's ``_FlashIOImpl`` and ``_MemorySnapshotImpl``; the ``lightning`` ones are beside)."""

from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.callbacks import Callback

from .lightning import _FlashIOImpl, _MemorySnapshotImpl

__all__ = ["PLFlashCheckpointIO", "PLFlashMemorySnapshot"]


class PLFlashCheckpointIO(_FlashIOImpl, CheckpointIO, tree="pytorch_lightning", torch_io=TorchCheckpointIO):
    pass


class PLFlashMemorySnapshot(_MemorySnapshotImpl, Callback, tree="pytorch_lightning"):
    pass
