"""Tensor-parallel plans for the shared decoder: module FQN -> ParallelStyle, as literal dicts.

Megatron-style: q/k/v and w1/w3 split by output columns, wo and w2 by input rows, so each
block needs one all-reduce (or, with sequence parallel, an all-gather before and a
reduce-scatter after) per sub-layer. With sequence parallel, norms and the residual stream
stay sharded along the sequence (dim 1) between those regions.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)


def top_level_plan(sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """Embeddings, final norm and output head."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=seq,
            # loss parallel: logits stay sharded over the vocab, cross-entropy runs on shards
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    return plan


def block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """One transformer block, FQNs relative to the block."""
    if not sequence_parallel:
        return {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
        }
    return {
        "attention_norm": SequenceParallel(),
        # gather the sequence before attention; freqs_cis (2nd arg) is a plain tensor
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
