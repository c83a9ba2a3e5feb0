"""``flashckpt.integrations.lightning``'s classes on ``pytorch_lightning`` (imported there on first use of their names;
their bodies are ``_lightning_io._FlashIOImpl`` and that module's ``_MemorySnapshotImpl``; the ``lightning`` ones are beside)."""

from flashckpt.integrations._lightning_io import _FlashIOImpl
from flashckpt.integrations.lightning import _MemorySnapshotImpl
from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.callbacks import Callback

__all__ = ["PLFlashCheckpointIO", "PLFlashMemorySnapshot"]


class PLFlashCheckpointIO(_FlashIOImpl, CheckpointIO, tree="pytorch_lightning", torch_io=TorchCheckpointIO):
    pass


class PLFlashMemorySnapshot(_MemorySnapshotImpl, Callback, tree="pytorch_lightning"):
    pass
