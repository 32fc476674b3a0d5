"""The optimizers a recipe names in optimizer.name: one file each, one line here to register.
Each builder takes the parameter groups, the parameters' names (by id) and [optimizer]; each
module's `steady_state` is the state its step leaves a parameter (the traced estimate's)."""

from __future__ import annotations

import torch

from . import adamw, lion, muon, sgd

OPTIMIZERS = {
    "adamw": adamw.build,
    "sgd": sgd.build,
    "lion": lion.build,
    "muon": muon.build,
}


def steady_state(opt: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> dict:
    """The state `opt`'s step leaves `p` (of `group`), made without a step."""
    for module in (muon, lion, sgd):  # subclasses first: Muon is none of torch's
        if isinstance(opt, module.OPTIMIZER):
            return module.steady_state(group, p)
    return adamw.steady_state(group, p)
