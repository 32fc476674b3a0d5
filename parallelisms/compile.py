"""torch.compile per transformer block: blocks are identical, so one compiled graph is reused."""

from __future__ import annotations

from torch import nn

from meshforge.configs.schema import CompileConfig


def apply_compile(model: nn.Module, cfg: CompileConfig) -> None:
    if not cfg.enabled:
        return
    for block in model.layers.values():
        block.compile(backend=cfg.backend, fullgraph=True)  # in place: module names are kept
