"""The DeepSeek-V3 family's registration: published shapes, module, TP plan, weight formats, and the
rules its args obey on a mesh (expert parallel's are parallelisms/ep.py's)."""

from __future__ import annotations

from meshforge.core.errors import Problem
from meshforge.core.topology import ParallelDims

from ..common.moe import Balancing, unpicked_params
from ..common.spec import ModelSpec
from .adapter import ADAPTER
from .model import DeepseekV3Args, DeepseekV3Transformer
from .tp_plan import block_plan, top_level_plan

__all__ = ["SPEC", "DeepseekV3Args", "DeepseekV3Transformer", "active_params", "check"]

# Parameter counts, total and active per token, equal transformers' DeepseekV3ForCausalLM built on
# the meta device from the same config (tests/models/test_deepseek_v3.py); MTP modules are not counted
FLAVORS: dict[str, DeepseekV3Args] = {
    # tiny (235,648 parameters, 161,920 active): low-rank query, 8 experts in 4 groups (top-2 of
    # the best 2), 2 shared, layer 0 dense
    "debug": DeepseekV3Args(
        dim=64,
        n_layers=3,
        n_heads=4,
        vocab_size=256,
        ffn_dim=160,
        max_seq_len=512,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_dim=32,
        n_shared_experts=2,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    ),
    # TorchTitan's deepseek_v3 "16B" (DeepSeek-V2-Lite's shape): 15,706,484,224 parameters,
    # 2,661,150,208 active; softmax routing without groups, top-6 not renormalised; plain RoPE over
    # 4,096 tokens, as TorchTitan trains it (its YaRN starts beyond 4,096: adapter.py)
    "16b": DeepseekV3Args(
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=102400,
        ffn_dim=10944,
        max_seq_len=4096,
        q_lora_rank=0,
        num_experts=64,
        num_experts_per_tok=6,
        moe_dim=1408,
        n_shared_experts=2,
        first_k_dense_replace=1,
        score_func="softmax",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
    ),
    # DeepSeek-V3 (and R1), its config.json: 671,026,404,352 parameters, 37,552,282,624 active (the
    # published 685B adds the MTP module)
    "671b": DeepseekV3Args(
        max_seq_len=163840,
        yarn_factor=40.0,
        yarn_mscale=1.0,
        yarn_mscale_all_dim=1.0,
    ),
    # Kimi K2, its config.json: 1,026,408,209,408 parameters, 32,861,477,888 active
    "kimi_k2": DeepseekV3Args(
        n_heads=64,
        vocab_size=163840,
        max_seq_len=131072,
        rope_theta=50000.0,
        yarn_factor=32.0,
        yarn_beta_fast=1.0,
        yarn_mscale=1.0,
        yarn_mscale_all_dim=1.0,
        num_experts=384,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
    ),
}


def active_params(a: DeepseekV3Args, total: int) -> int:
    """The parameters one token computes with, of a model of `total`: all but the routed experts
    its router did not pick (the shared experts always compute)."""
    return total - unpicked_params(a)


def check(a: DeepseekV3Args, dims: ParallelDims) -> list[Problem]:
    """The router's rules (top-k within the groups it may pick from), MLA's, and the mesh dims not
    wired for MLA yet (tp, cp): refused rather than run untested."""
    problems = []
    group = a.num_experts // a.n_group if a.n_group >= 1 else 0
    if a.n_group < 1 or a.num_experts % a.n_group:
        problems.append(
            Problem("model.n_group", a.n_group, f"must divide num_experts={a.num_experts} into equal groups")
        )
    elif a.n_group > 1 and group < 2:
        problems.append(
            Problem(
                "model.n_group",
                a.n_group,
                f"a group is scored by its two best experts: at most {a.num_experts // 2}",
            )
        )
    if not 1 <= a.topk_group <= max(a.n_group, 1):
        problems.append(
            Problem("model.topk_group", a.topk_group, f"must be between 1 and n_group={a.n_group}")
        )
    elif not 1 <= a.num_experts_per_tok <= a.topk_group * group:
        problems.append(
            Problem(
                "model.num_experts_per_tok",
                a.num_experts_per_tok,
                f"top-k must be between 1 and the {a.topk_group * group} experts of the "
                f"topk_group={a.topk_group} groups a token may pick from",
            )
        )
    if a.score_func not in ("sigmoid", "softmax"):
        problems.append(Problem("model.score_func", a.score_func, "one of sigmoid, softmax"))
    if not Balancing(a.load_balance).routes_with_bias:
        problems.append(
            Problem(
                "model.load_balance",
                a.load_balance,
                "DeepSeek-V3 routes by its correction bias (transformers' e_score_correction_bias) always; "
                "the sequence-wise aux loss is not implemented: set model.load_balance=aux_free",
            )
        )
    if not 0 <= a.first_k_dense_replace <= a.n_layers:
        problems.append(
            Problem("model.first_k_dense_replace", a.first_k_dense_replace, f"must be in 0..{a.n_layers}")
        )
    if a.qk_rope_head_dim % 2:
        problems.append(
            Problem("model.qk_rope_head_dim", a.qk_rope_head_dim, "RoPE rotates pairs: must be even")
        )
    if a.bias_update_rate < 0:
        problems.append(Problem("model.bias_update_rate", a.bias_update_rate, "must be >= 0"))
    for dim, why in (
        ("tp", "MLA's TP plan is not wired yet (models/deepseek_v3/tp_plan.py says why)"),
        ("cp", "context parallel is not wired for MLA (its value heads differ from its key heads)"),
    ):
        if getattr(dims, dim) > 1:
            problems.append(
                Problem(
                    f"mesh.{dim}",
                    getattr(dims, dim),
                    f"deepseek_v3: {why}; set mesh.{dim}=1 (fsdp, ep and pp run)",
                )
            )
    return problems


SPEC = ModelSpec(
    name="deepseek_v3",
    args_type=DeepseekV3Args,
    flavors=FLAVORS,
    build=DeepseekV3Transformer,
    tp_top_level_plan=top_level_plan,
    tp_block_plan=block_plan,
    check=check,
    adapter=ADAPTER,
    jax_twin="meshforge.models.deepseek_v3.jax",
)
