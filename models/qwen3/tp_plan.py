"""Tensor-parallel plans for Qwen3: the decoder's, plus the per-head QK-norms.

q and k leave their colwise projections as local head shards, (B, S, H/tp, hd). Their
norms' weights are shared by every head, so each rank's gradient is a partial sum:
`SequenceParallel(sequence_dim=2)` reads the local tensor as Shard(2) (heads) of the global
one and keeps the weight a Replicate DTensor, whose gradient DTensor reduces over tp.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from ..common.tp_plan import block_plan as decoder_block_plan
from ..common.tp_plan import top_level_plan

__all__ = ["block_plan", "top_level_plan"]


def block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """One transformer block, FQNs relative to the block."""
    return {
        **decoder_block_plan(sequence_parallel),
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    }
