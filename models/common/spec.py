"""What a model family registers about itself, so that adding a family touches its folder
(models/<family>/), one registry line and a recipe only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from meshforge.core.errors import Problem
from meshforge.core.topology import ParallelDims

from .adapter import StateDictAdapter


@dataclass(frozen=True)
class ModelSpec:
    """A model family: its shapes, its module, its parallel plans, its formats and its rules.

    `adapter` is the family's weights in other formats (HF names and config.json both ways,
    TorchTitan names and flavors, MaxText's tree: models/common/adapter.py); `jax_twin` names
    the module holding the family's forward as pure JAX functions (imported only when JAX is
    installed).
    """

    name: str
    args_type: type  # the family's args dataclass (one type per family)
    flavors: dict[str, Any]  # flavor -> args with the published shape
    build: Callable[[Any], nn.Module]  # args -> the model (on whatever device is current)
    tp_top_level_plan: Callable[[bool, bool], dict]  # (sequence_parallel, loss_parallel) -> FQN -> style
    tp_block_plan: Callable[[bool], dict]  # (sequence_parallel) -> block-relative FQN -> style
    check: Callable[[Any, ParallelDims], list[Problem]]  # the family's own rules for args on a mesh
    adapter: StateDictAdapter
    jax_twin: str

    def hf_mismatch(self, folder: Path, args: Any) -> list[str]:
        """What differs between an HF folder's config.json and `args` (empty if they match);
        FileNotFoundError when the folder has no config.json."""
        folder = Path(folder)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder} is not an HF model folder (no config.json)")
        return self.adapter.check_compatible(self.adapter.read_hf_args(folder), args)
