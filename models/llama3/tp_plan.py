"""Tensor-parallel plans for Llama 3: the decoder's own (models/common/tp_plan.py), whose
blocks are Llama 3's."""

from __future__ import annotations

from ..common.tp_plan import block_plan, top_level_plan

__all__ = ["block_plan", "top_level_plan"]
