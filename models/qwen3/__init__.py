"""The Qwen3 (dense) family's registration: published shapes, module, TP plans, weight
formats, JAX twin, and the rules its args obey on a mesh."""

from __future__ import annotations

from meshforge.core.errors import Problem
from meshforge.core.topology import ParallelDims

from ..common.checks import check_heads_on_mesh
from ..common.spec import ModelSpec
from .adapter import ADAPTER
from .model import Qwen3Args, Qwen3Attention, Qwen3Transformer
from .tp_plan import block_plan, top_level_plan

__all__ = ["SPEC", "Qwen3Args", "Qwen3Attention", "Qwen3Transformer", "check"]

# Shapes of the published Qwen3 config.json files (parameter counts: tests/models/test_hf_checkpoints.py
# checks ours against transformers' Qwen3ForCausalLM built from the same config)
FLAVORS: dict[str, Qwen3Args] = {
    # tiny, untied, n_heads x head_dim != dim (as in the real flavors): CPU tests and parity
    "debug": Qwen3Args(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=256,
        ffn_dim=160,
        rope_theta=10000.0,
        max_seq_len=512,
        tie_embeddings=False,
    ),
    # Qwen3-0.6B: 596,049,920 parameters (tied)
    "0.6b": Qwen3Args(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072),
    # Qwen3-1.7B: 1,720,574,976 parameters (tied)
    "1.7b": Qwen3Args(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=6144),
    # Qwen3-4B: 4,022,468,096 parameters (tied)
    "4b": Qwen3Args(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=9728),
    # Qwen3-8B: 8,190,735,360 parameters (untied)
    "8b": Qwen3Args(
        dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=12288, tie_embeddings=False
    ),
}


def check(a: Qwen3Args, dims: ParallelDims) -> list[Problem]:
    """The rules of every decoder (models/common/checks.py); head_dim is explicit, so dim is free."""
    problems = []
    if a.head_dim % 2:
        problems.append(Problem("model.head_dim", a.head_dim, "RoPE rotates pairs: head_dim must be even"))
    return problems + check_heads_on_mesh(a, dims)


SPEC = ModelSpec(
    name="qwen3",
    args_type=Qwen3Args,
    flavors=FLAVORS,
    build=Qwen3Transformer,
    tp_top_level_plan=top_level_plan,
    tp_block_plan=block_plan,
    check=check,
    adapter=ADAPTER,
    jax_twin="meshforge.models.qwen3.jax",
)
