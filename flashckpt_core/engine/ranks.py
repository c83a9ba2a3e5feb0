"""Where this process sits in the job: ``RankInfo``.

Read from torch.distributed when it is initialized, else from torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``/``NODE_RANK``), else one rank. Frozen
data: safe on any thread. Imports only torch (lazily).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["RankInfo"]


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int

    @staticmethod
    def current() -> RankInfo:
        """From torch.distributed when it is initialized, else from torchrun's environment, else 1 rank."""
        import torch.distributed as dist

        env = os.environ
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
        # Without torchrun's variables all ranks are taken to be on one node.
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        node_rank = int(env.get("GROUP_RANK", env.get("NODE_RANK", 0)))
        return RankInfo(rank, world, local_rank, local_world, node_rank)
