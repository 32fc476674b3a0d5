"""Activation checkpointing: recompute a block's activations in backward instead of storing them.

The block's forward is wrapped in place (not the module), so parameter names stay
`layers.N.attention.wq.weight` for checkpoints, TP plans and golden files. What is checkpointed is
the recipe's `ACPolicy` (configs/activation_checkpoint.py): whole blocks (every block, or every
Nth), per op (torch's selective checkpoint contexts keep the outputs of the listed ops, matmuls,
attention, TP's reduce-scatters, but recompute every second matmul and everything else;
TorchTitan's default policy), or no wrapper and a budget (torch.compile's min-cut partitioner keeps
at most that share of each compiled block's activations and recomputes the cheapest rest).
"""

from __future__ import annotations

import torch
import torch._functorch.config as functorch_config
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from meshforge.configs import ACPolicy

MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.linear")  # every second one is recomputed


def apply_ac(model: nn.Module, policy: ACPolicy) -> None:
    """Wrap the forward of every block the policy checkpoints (by layer id), per op where it
    keeps `save_ops`' outputs (but every second matmul's); a compiler budget is set process-wide."""
    # no wrapper for a budget: compile's partitioner reads it, process-wide (1.0, keep all, otherwise)
    functorch_config.activation_memory_budget = policy.compiler_budget
    save = resolve_ops(list(policy.save_ops)) if policy.per_op else None
    for layer_id, block in model.layers.items():
        if policy.checkpoints(int(layer_id)):
            block.forward = _checkpointed(block.forward, save)


def checkpointed_blocks(model: nn.Module, policy: ACPolicy) -> int:
    """How many of `model`'s blocks apply_ac wraps: each run of one pays checkpointing's host work
    (its saved tensors' hooks, the recompute's set-up), which the step-time model prices per block."""
    return sum(policy.checkpoints(int(layer_id)) for layer_id in getattr(model, "layers", {}))


def resolve_ops(names: list[str]) -> set:
    """`namespace.name` -> torch.ops.namespace.name.default; a name torch does not have raises
    (validation reports it first: `unknown_ops`)."""
    return {_op(name) for name in names}


def unknown_ops(names: list[str]) -> list[str]:
    """The names of `names` that are no op of this torch."""
    unknown = []
    for name in names:
        try:
            _op(name)
        except (AttributeError, ValueError):
            unknown.append(name)
    return unknown


def _op(name: str):
    namespace, _, op = name.partition(".")
    if not op:
        raise ValueError(f"{name!r} is not namespace.name")
    return getattr(getattr(torch.ops, namespace), op).default


def _keep_policy(save: set, matmuls: set):
    """TorchTitan's per-op policy: keep the outputs of `save`, but recompute every second of the
    `matmuls` (counted apart in the forward and in the recompute, so both make the same choices)."""
    counts = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in matmuls:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _checkpointed(forward, save: set | None = None):
    """`forward` under non-reentrant checkpointing (per op when `save` is given), as a closure:
    torch.compile(fullgraph=True) of the block traces a closure that calls `checkpoint`, but finds
    no frame to compile in a functools.partial of it (torch 2.13), so AC with compile failed at
    the first step."""

    matmuls = resolve_ops(MATMULS)  # once per block, not per call

    def contexts():
        return create_selective_checkpoint_contexts(_keep_policy(save, matmuls))

    kw = {"context_fn": contexts} if save is not None else {}

    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kw, **kwargs)

    return run
