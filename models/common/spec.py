"""What a model family registers about itself, so that adding a family touches `models/`
and a recipe only (docs/DESIGN.md lists the steps)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn

from meshforge.core.errors import Problem
from meshforge.core.topology import ParallelDims


@dataclass(frozen=True)
class ModelSpec:
    """A model family: its shapes, its module, its parallel plans, its formats and its rules.

    `interop` is the family's weight-format module (HF and TorchTitan names, any row
    permutation, config.json both ways); `jax_twin` names the module holding the family's
    forward as pure JAX functions (imported only when JAX is installed).
    """

    name: str
    args_type: type  # the family's args dataclass (one type per family)
    flavors: dict[str, Any]  # flavor -> args with the published shape
    build: Callable[[Any], nn.Module]  # args -> the model (on whatever device is current)
    tp_top_level_plan: Callable[[bool, bool], dict]  # (sequence_parallel, loss_parallel) -> FQN -> style
    tp_block_plan: Callable[[bool], dict]  # (sequence_parallel) -> block-relative FQN -> style
    check: Callable[[Any, ParallelDims], list[Problem]]  # the family's own rules for args on a mesh
    interop: ModuleType
    jax_twin: str

    def hf_mismatch(self, folder: Path, args: Any) -> list[str]:
        """What differs between an HF folder's config.json and `args` (empty if they match);
        FileNotFoundError when the folder has no config.json."""
        folder = Path(folder)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder} is not an HF model folder (no config.json)")
        return self.interop.check_compatible(self.interop.read_hf_args(folder), args)
