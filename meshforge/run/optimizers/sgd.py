"""SGD with momentum and Nesterov: torch.optim.SGD as it is."""

from __future__ import annotations

import torch

from meshforge.configs.schema import OptimizerConfig

OPTIMIZER = torch.optim.SGD


def build(
    groups: list[dict], names: dict[int, str], cfg: OptimizerConfig, implementation=None, quiet: bool = False
) -> torch.optim.Optimizer:
    s = cfg.sgd
    return torch.optim.SGD(
        groups,
        lr=cfg.lr,
        momentum=s.momentum,
        dampening=s.dampening,
        nesterov=s.nesterov,
        weight_decay=cfg.weight_decay,
        foreach=False,  # DTensor and plain parameters may be mixed (TP without sequence parallel)
    )


def steady_state(group: dict, p: torch.Tensor) -> dict:
    """One momentum buffer (none without momentum)."""
    return {
        "momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)
        if group["momentum"]
        else None
    }
