"""Tensor-parallel plans for Qwen3-MoE: Qwen3's for attention and the dense layers' feed-forward;
the MoE feed-forward is not split over tp (its experts are split over ep instead).

Every tp rank runs the MoE on the whole sequence: under sequence parallel its input is gathered
(Shard(1) -> Replicate) and its output cut back (Replicate -> Shard(1), a local slice whose backward
all-gathers the identical gradients), so the router and experts see plain tensors and compute the
same values and gradients on every tp rank (TorchTitan's etp = tp without expert TP).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInputOutput

from ..qwen3.tp_plan import block_plan as qwen3_block_plan
from ..qwen3.tp_plan import top_level_plan

__all__ = ["block_plan", "top_level_plan"]


def block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """One block, FQNs relative to it: a dense block takes the `feed_forward.*` entries, a sparse
    one the `moe` entry (apply_tp plans what a block has)."""
    plan = qwen3_block_plan(sequence_parallel)
    if sequence_parallel:
        plan["moe"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
            use_local_output=True,
        )
    return plan
