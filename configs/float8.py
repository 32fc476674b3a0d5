"""The [float8] section: the linear layers trained in float8 by torchao (parallelisms/float8.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from .fields import F

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


@dataclass
class Float8Config:
    enabled: bool = F(
        False,
        "train the blocks' linear layers in float8 (torchao's Float8Linear: float8 matmuls, "
        "high-precision weights and optimizer); the output head, MoE routers and experts stay",
    )
    recipe: str = F(
        "rowwise",
        "torchao's scaling: tensorwise (one scale a tensor; a rank scales its activations by their own "
        "amax, so dp layouts round slightly differently) | rowwise (one a row: layout-independent, more "
        "accurate) | rowwise_with_gw_hp (rowwise, the weight gradient's matmul in high precision)",
    )
    exclude: List[str] = F(
        ["output"],
        "module names kept in high precision (a name matches itself and what ends in .name); layers with "
        "a dim not divisible by 16 and MoE routers are always kept",
    )
