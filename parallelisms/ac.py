"""Activation checkpointing: recompute a block's activations in backward instead of storing them.

The block's forward is wrapped in place (not the module), so parameter names stay
`layers.N.attention.wq.weight` for checkpoints, TP plans and golden files.
"""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint

from meshforge.configs.schema import ActivationCheckpointConfig


def apply_ac(model: nn.Module, cfg: ActivationCheckpointConfig) -> None:
    """mode=full: every block; mode=selective: every `selective_every`-th block (by layer id)."""
    if cfg.mode == "none":
        return
    for layer_id, block in model.layers.items():
        if cfg.mode == "full" or int(layer_id) % cfg.selective_every == 0:
            block.forward = _checkpointed(block.forward)


def _checkpointed(forward):
    """`forward` under non-reentrant checkpointing, as a closure: torch.compile(fullgraph=True) of
    the block traces a closure that calls `checkpoint`, but finds no frame to compile in a
    functools.partial of it (torch 2.13), so AC with compile failed at the first step."""

    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    return run
