"""torch.compile per transformer block: blocks are identical, so one compiled graph is reused.

A mixture-of-experts block compiles its attention and runs the rest eager: the MoE's routing
decides how many rows each expert (and, under ep, each rank) gets, shapes a full graph cannot hold,
and it keeps the step's statistics on the host (models/common/moe.py); a norm module alone has no frame
of ours to compile (torch.nn's are skipped)."""

from __future__ import annotations

from torch import nn

from meshforge.configs.schema import CompileConfig


def apply_compile(model: nn.Module, cfg: CompileConfig) -> None:
    if not cfg.enabled:
        return
    for block in model.layers.values():
        part = block.attention if hasattr(block, "moe") else block
        part.compile(backend=cfg.backend, fullgraph=True)  # in place: module names are kept
