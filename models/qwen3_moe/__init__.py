"""The Qwen3-MoE family's registration: published shapes, module, TP plans, weight formats, JAX
twin, and the rules its args obey on a mesh (expert parallel included)."""

from __future__ import annotations

from meshforge.core.errors import Problem
from meshforge.core.topology import ParallelDims

from ..common.moe import LOAD_BALANCE, unpicked_params
from ..common.spec import ModelSpec
from ..qwen3 import check as check_qwen3
from .adapter import ADAPTER
from .model import Qwen3MoeArgs, Qwen3MoeTransformer
from .tp_plan import block_plan, top_level_plan

# Shapes of the published config.json files (parameter counts, total and active: checked against
# transformers' Qwen3MoeForCausalLM built from the same config, tests/models/test_moe_hf.py)
FLAVORS: dict[str, Qwen3MoeArgs] = {
    # tiny: 8 experts, top-2, layer 0 dense (both kinds of block in one model), untied
    "debug": Qwen3MoeArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=256,
        ffn_dim=160,
        num_experts=8,
        num_experts_per_tok=2,
        moe_dim=48,
        mlp_only_layers=(0,),
        rope_theta=10000.0,
        max_seq_len=512,
        tie_embeddings=False,
    ),
    # Qwen3-30B-A3B: 30,532,122,624 parameters, 3,353,032,704 active per token
    "30b-a3b": Qwen3MoeArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        ffn_dim=6144,
        moe_dim=768,
        num_experts=128,
        num_experts_per_tok=8,
        tie_embeddings=False,
    ),
    # Qwen3-235B-A22B: 235,093,634,560 parameters, 22,190,763,520 active per token
    "235b-a22b": Qwen3MoeArgs(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        ffn_dim=12288,
        moe_dim=1536,
        num_experts=128,
        num_experts_per_tok=8,
        tie_embeddings=False,
    ),
}


def total_params(a: Qwen3MoeArgs) -> int:
    """Every parameter of the model (the embedding once when tied), without building it."""
    attention = a.dim * a.head_dim * 2 * (a.n_heads + a.kv_heads) + 2 * a.head_dim  # q, k, v, o, QK-norm
    sparse = a.n_moe_layers
    ffn = (a.n_layers - sparse) * 3 * a.dim * a.ffn_dim + sparse * a.num_experts * (
        a.dim + 3 * a.dim * a.moe_dim
    )
    embeddings = a.vocab_size * a.dim * (1 if a.tie_embeddings else 2)
    return embeddings + a.n_layers * (attention + 2 * a.dim) + ffn + a.dim


def active_params(a: Qwen3MoeArgs) -> int:
    """The parameters one token computes with: all but the (E - k) experts its router did not
    pick in each sparse layer (the "A3B" of Qwen3-30B-A3B)."""
    return total_params(a) - unpicked_params(a)


def check(a: Qwen3MoeArgs, dims: ParallelDims) -> list[Problem]:
    """Qwen3's rules and the router's (top-k within the experts, a known balancing, its weights'
    signs); expert parallel's are parallelisms/ep.py's (`check_ep`)."""
    problems = check_qwen3(a, dims)
    if not 1 <= a.num_experts_per_tok <= a.num_experts:
        problems.append(
            Problem(
                "model.num_experts_per_tok",
                a.num_experts_per_tok,
                f"top-k must be between 1 and num_experts={a.num_experts}",
            )
        )
    if a.load_balance not in LOAD_BALANCE:
        problems.append(Problem("model.load_balance", a.load_balance, f"one of {', '.join(LOAD_BALANCE)}"))
    if a.decoder_sparse_step < 1:
        problems.append(Problem("model.decoder_sparse_step", a.decoder_sparse_step, "must be >= 1"))
    outside = [i for i in a.mlp_only_layers if not 0 <= i < a.n_layers]
    if outside:
        problems.append(
            Problem(
                "model.mlp_only_layers", list(a.mlp_only_layers), f"layer ids must be in 0..{a.n_layers - 1}"
            )
        )
    if a.router_aux_loss_coef < 0:
        problems.append(Problem("model.router_aux_loss_coef", a.router_aux_loss_coef, "must be >= 0"))
    if a.bias_update_rate < 0:
        problems.append(Problem("model.bias_update_rate", a.bias_update_rate, "must be >= 0"))
    return problems


SPEC = ModelSpec(
    name="qwen3_moe",
    args_type=Qwen3MoeArgs,
    flavors=FLAVORS,
    build=Qwen3MoeTransformer,
    tp_top_level_plan=top_level_plan,
    tp_block_plan=block_plan,
    check=check,
    adapter=ADAPTER,
    jax_twin="meshforge.models.qwen3_moe.jax",
)
