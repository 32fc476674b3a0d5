"""Tensor (and sequence, and loss) parallelism from the model family's literal TP plans."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from meshforge.configs.schema import TPConfig
from meshforge.models import ModelSpec


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, cfg: TPConfig, spec: ModelSpec) -> None:
    """Shard `model` (possibly one pipeline stage) over `tp_mesh` by `spec`'s plans."""
    top = spec.tp_top_level_plan(cfg.sequence_parallel, cfg.loss_parallel)
    # a pipeline stage may lack the embeddings or the head: plan only what is there
    top = {fqn: style for fqn, style in top.items() if getattr(model, fqn, None) is not None}
    parallelize_module(model, tp_mesh, top)
    if model.args.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # one parameter again: the plan gave the output its own. The embedding (rowwise over the
        # vocabulary) and the output (colwise over it) both shard the weight's vocab dim: Shard(0)
        model.output.weight = model.tok_embeddings.weight
    plan = spec.tp_block_plan(cfg.sequence_parallel)
    for block in model.layers.values():
        block_plan = {fqn: style for fqn, style in plan.items() if _applies(block, fqn)}
        parallelize_module(block, tp_mesh, block_plan)


# a block holds one of these (a MoE family's sparse and dense blocks): its plan names both. Any other
# entry is planned on every block, so a misspelt one still fails as torch fails it
FEED_FORWARDS = ("feed_forward", "moe")


def _applies(block: nn.Module, fqn: str) -> bool:
    head = fqn.split(".")[0]
    return head not in FEED_FORWARDS or hasattr(block, head)
