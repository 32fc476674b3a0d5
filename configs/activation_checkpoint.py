"""Activation checkpointing's section and its policy: which blocks are checkpointed (every
`period`-th by layer id), whether per op (what is saved) or by the compiler's budget.

The mode string is read here alone: every other module asks an `ACPolicy` (`ac_policy(cfg)`,
or `ACPolicy(mode)` for a mode a sweep or tune axis names) what it does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from .fields import F

MODES = ("none", "full", "selective", "op", "memory_budget")

# per-op AC keeps the outputs of these (TorchTitan's default list): matmuls, attention, TP's and
# Ulysses' collectives
SAC_SAVE_OPS = (
    "aten.mm aten.addmm aten.bmm aten.linear aten.max aten._scaled_dot_product_flash_attention "
    "aten._scaled_dot_product_efficient_attention aten._scaled_dot_product_cudnn_attention "
    "aten._scaled_dot_product_flash_attention_for_cpu aten._scaled_dot_product_attention_math "
    "_c10d_functional.reduce_scatter_tensor _c10d_functional.all_to_all_single"
).split()


@dataclass
class ActivationCheckpointConfig:
    mode: str = F(
        "none",
        "none | full | selective (every Nth block) | op (per op, every block: the outputs of the ops "
        "in op_save are kept, but every second matmul's, and the rest recomputed: TorchTitan's SAC) | "
        "memory_budget (compiled blocks: the compiler chooses what to recompute within memory_budget)",
    )
    selective_every: int = F(2, "with mode=selective: checkpoint every Nth transformer block")
    op_save: List[str] = F(
        SAC_SAVE_OPS,
        "with mode=op: the ops (namespace.name, their default overload) whose outputs are kept",
    )
    memory_budget: float = F(
        0.5,
        "with mode=memory_budget: the share of a compiled block's activations kept for backward, 0-1 "
        "(torch's min-cut partitioner recomputes the cheapest rest: 1 keeps all, 0 recomputes what it can)",
    )


# a setting each mode alone reads: set under another mode it is inert (recipe/inert.py)
READ_BY = {
    "selective_every": ("selective", "checkpoints no Nth block"),
    "op_save": ("op", "keeps no op's outputs"),
    "memory_budget": ("memory_budget", "gives the compiler no budget"),
}


@dataclass(frozen=True)
class ACPolicy:
    """What a mode of activation checkpointing does, so no caller compares its string."""

    mode: str
    every: int = 1  # selective's period
    save_ops: tuple[str, ...] = ()
    budget: float = 1.0

    @property
    def enabled(self) -> bool:
        """Whether anything is recomputed (by a wrapper or by the compiler)."""
        return self.mode != "none"

    @property
    def wraps_blocks(self) -> bool:
        """Whether blocks' forwards are wrapped in checkpoint (full, selective, per op)."""
        return self.mode in ("full", "selective", "op")

    @property
    def per_op(self) -> bool:
        """Checkpointed per op: the outputs of `save_ops` are kept, the rest recomputed."""
        return self.mode == "op"

    @property
    def by_compiler(self) -> bool:
        """No wrapper: torch.compile's partitioner recomputes within `budget`."""
        return self.mode == "memory_budget"

    @property
    def period(self) -> int:
        """The blocks repeat their checkpointing every `period` blocks (by layer id): 1 but under
        selective AC, whose every `every`-th block is checkpointed."""
        return self.every if self.mode == "selective" else 1

    def checkpoints(self, layer_id: int) -> bool:
        """Whether the block with this layer id runs under checkpoint."""
        return self.wraps_blocks and layer_id % self.period == 0

    def reads(self, name: str) -> bool:
        """Whether this mode reads the section's setting `name` (the others' are inert)."""
        return name not in READ_BY or READ_BY[name][0] == self.mode

    @property
    def compiler_budget(self) -> float:
        """The share of a compiled block's activations the partitioner keeps (1: all)."""
        return self.budget if self.by_compiler else 1.0


def ac_policy(cfg: ActivationCheckpointConfig) -> ACPolicy:
    """The policy a recipe's [activation_checkpoint] section spells."""
    return ACPolicy(cfg.mode, cfg.selective_every, tuple(cfg.op_save), cfg.memory_budget)
