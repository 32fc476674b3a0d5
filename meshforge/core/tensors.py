"""What a rank holds of a tensor, whatever shards it."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t
