"""The Llama 3 family's registration: published shapes, module, TP plans, weight formats,
JAX twin, and the rules its args obey on a mesh."""

from __future__ import annotations

from meshforge.core.errors import Problem, nearest
from meshforge.core.topology import ParallelDims

from ..common.checks import check_heads_on_mesh
from ..common.spec import ModelSpec
from .adapter import ADAPTER
from .model import LlamaArgs, Transformer
from .tp_plan import block_plan, top_level_plan

FLAVORS: dict[str, LlamaArgs] = {
    # tiny: trains on a CPU in seconds; 4 layers so pp=2 x 2 virtual stages still works
    "debug": LlamaArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=256,
        multiple_of=32,
        rope_theta=10000.0,
        rope_scaling_factor=None,
        max_seq_len=512,
    ),
    # Llama-3.2-1B: 1,235,814,400 parameters (tied embeddings)
    "1b": LlamaArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_theta=500000.0,
        rope_scaling_factor=32.0,
        max_seq_len=131072,
        tie_embeddings=True,
    ),
    # Llama-3.2-3B: 3,212,749,824 parameters (tied embeddings)
    "3b": LlamaArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.0,
        rope_theta=500000.0,
        rope_scaling_factor=32.0,
        max_seq_len=131072,
        tie_embeddings=True,
    ),
    # Llama-3.1-8B: 8,030,261,248 parameters
    "8b": LlamaArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        rope_scaling_factor=8.0,
        max_seq_len=131072,
    ),
    # Llama-3.1-70B: 70,553,706,496 parameters
    "70b": LlamaArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        rope_scaling_factor=8.0,
        max_seq_len=131072,
    ),
}


def check(a: LlamaArgs, dims: ParallelDims) -> list[Problem]:
    """Llama fixes head_dim = dim / n_heads; then the rules of every decoder (models/common/checks.py)."""
    problems = []
    if a.dim % a.n_heads:
        valid = [a.n_heads * k for k in range(1, a.dim // a.n_heads + 2)]
        problems.append(
            Problem(
                "model.dim",
                a.dim,
                f"must be divisible by n_heads={a.n_heads}; nearest valid: {nearest(a.dim, valid)}",
            )
        )
    return problems + check_heads_on_mesh(a, dims)


SPEC = ModelSpec(
    name="llama3",
    args_type=LlamaArgs,
    flavors=FLAVORS,
    build=Transformer,
    tp_top_level_plan=top_level_plan,
    tp_block_plan=block_plan,
    check=check,
    adapter=ADAPTER,
    jax_twin="meshforge.models.llama3.jax",
)
