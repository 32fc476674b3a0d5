"""Tensor-parallel plan for DeepSeek-V3 (TorchTitan's `apply_non_moe_tp` for deepseek_v3): MLA's
per-head projections split by heads (wq or wq_b, wkv_b by columns, wo by rows); the latent
projections (wq_a, wkv_a) and their norms, whose outputs every head reads, stay whole on every rank.
The dense layers' feed-forward is the shared decoder's; the MoE runs on the whole sequence as
Qwen3-MoE's does (models/qwen3_moe/tp_plan.py), its experts split over ep instead.

Not usable yet, so the family's check refuses mesh.tp > 1: the latent projections run on plain
tensors while the attention's input is a DTensor under sequence parallel (torch refuses the mix),
and the rotary key `wkv_a` makes reaches every head, so its gradient must be summed over the tp
ranks (TorchTitan wraps wkv_a, wq_a and the norms as replicated DTensors, `NoParallel`, for that).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from ..common.tp_plan import top_level_plan

__all__ = ["block_plan", "top_level_plan"]


def block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """One block, FQNs relative to it (apply_tp plans what a block has: wq or wq_b, feed_forward
    or moe)."""
    if not sequence_parallel:
        return {
            "attention.wq": ColwiseParallel(),
            "attention.wq_b": ColwiseParallel(),
            "attention.wkv_b": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
        }
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wq_b": ColwiseParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
        "moe": PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        ),
    }
