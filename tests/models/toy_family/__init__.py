"""A toy family for tests/models/test_toy_family.py: a Mistral-shaped decoder (explicit head_dim,
rotate-half RoPE, no QK-norm) built only from models/common/. Everything about it is in this
folder; the test adds it with one `register(SPEC)` line."""

from __future__ import annotations

from meshforge.models.common.checks import check_heads_on_mesh
from meshforge.models.common.spec import ModelSpec
from meshforge.models.common.tp_plan import block_plan, top_level_plan

from .adapter import ADAPTER
from .model import ToyArgs, ToyTransformer

FLAVORS = {
    "debug": ToyArgs(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=256, ffn_dim=80)
}

SPEC = ModelSpec(
    name="toy",
    args_type=ToyArgs,
    flavors=FLAVORS,
    build=ToyTransformer,
    tp_top_level_plan=top_level_plan,
    tp_block_plan=block_plan,
    check=check_heads_on_mesh,
    adapter=ADAPTER,
    jax_twin="toy_family.jax",
)
