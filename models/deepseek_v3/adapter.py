"""DeepSeek-V3's weights in other formats: HuggingFace `DeepseekV3ForCausalLM` (transformers 5.25's
names and config.json; TorchTitan and MaxText: none yet, their converters refuse it by name).

MLA's projections keep their rows: with `rope_interleave` (DeepSeek's own weights) transformers
rotates (even, odd) pairs as we do, without it halves as we then do. The routed experts are stored
as Qwen3-MoE's (one tensor per expert, or transformers' fused in-memory layout, read too); the
router's correction bias is `mlp.gate.e_score_correction_bias`, our `moe.expert_bias`.
"""

from __future__ import annotations

import dataclasses

from meshforge.core.errors import IncompatibleWeights

from ..common import hf_config as _hf_config
from ..common.adapter import StateDictAdapter
from ..common.hf_config import check_keys, expect, refuse, rope_of
from ..common.hf_names import DECODER_LAYER, HFNames
from ..qwen3_moe.adapter import HF_EXPERTS, HF_FUSED
from .model import DeepseekV3Args

FAMILY = "deepseek_v3"
HF_LAYER = {
    **{k: v for k, v in DECODER_LAYER.items() if not k.startswith("attention.w")},
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}

# config.json keys read (besides those of every decoder) and the ones derived from them
KEYS = {
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "intermediate_size",
    "hidden_act",
    "attention_bias",
    "attention_dropout",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_interleave",
    "n_routed_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "n_shared_experts",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
    "output_router_logits",  # what HF returns, not what it computes
    "num_key_value_heads",  # unused by transformers' MLA (every head its own key and value)
    "head_dim",  # transformers derives it: qk_rope_head_dim (checked)
    "qk_head_dim",  # derived: qk_nope_head_dim + qk_rope_head_dim (checked)
    # transformers' DeepseekV3ForCausalLM builds no MTP module and skips their weights on load:
    # its logits (and ours) are the main model's whatever this says
    "num_nextn_predict_layers",
    "num_mtp_layers",
}
YARN_KEYS = {
    "rope_type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
}
# how a model is trained, not what its weights compute
TRAINING_FIELDS = ("router_aux_loss_coef", "load_balance", "bias_update_rate", "grouped_mm")


def yarn_args(cfg: dict) -> dict:
    """The RoPE fields of DeepseekV3Args: plain, or YaRN with its keys; anything else refused."""
    rope = rope_of(cfg, default_theta=10000.0)
    out = {"rope_theta": float(rope["rope_theta"]), "yarn_factor": None}
    if rope["rope_type"] == "default":
        return out
    if rope["rope_type"] != "yarn":
        raise refuse("rope_type", rope["rope_type"], "DeepSeek-V3 reads plain RoPE or yarn only")
    unknown = sorted(set(rope) - YARN_KEYS)
    if unknown:
        raise refuse(
            f"rope_parameters.{unknown[0]}",
            rope[unknown[0]],
            f"not implemented in meshforge's YaRN (reads {', '.join(sorted(YARN_KEYS))}): remove it",
        )
    if rope.get("factor") is None or rope.get("original_max_position_embeddings") is None:
        raise refuse("rope_parameters", rope, "yarn needs factor and original_max_position_embeddings")
    return {
        **out,
        "yarn_factor": float(rope["factor"]),
        "yarn_original_max_seq_len": int(rope["original_max_position_embeddings"]),
        "yarn_beta_fast": float(rope.get("beta_fast") or 32),
        "yarn_beta_slow": float(rope.get("beta_slow") or 1),
        "yarn_mscale": float(rope.get("mscale") or 0.0),
        "yarn_mscale_all_dim": float(rope.get("mscale_all_dim") or 0.0),
    }


def rope_config(a: DeepseekV3Args) -> dict:
    """config.json's RoPE keys for `a` (YaRN's included), in the installed transformers' format."""
    rope = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.yarn_factor is not None:
        rope = {
            "rope_type": "yarn",
            "rope_theta": a.rope_theta,
            "factor": a.yarn_factor,
            "original_max_position_embeddings": a.yarn_original_max_seq_len,
            "beta_fast": a.yarn_beta_fast,
            "beta_slow": a.yarn_beta_slow,
            "mscale": a.yarn_mscale,
            "mscale_all_dim": a.yarn_mscale_all_dim,
        }
    if _hf_config.transformers_major() >= 5:
        return {"rope_parameters": rope}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if a.yarn_factor is not None else None
    return {"rope_theta": a.rope_theta, "rope_scaling": scaling}


# TorchTitan's deepseek_v3 "16B" (torchtitan/models/deepseek_v3/__init__.py) in our args' names: its
# DeepSeekV3ModelArgs defaults (softmax routing, not renormalised, route_scale 1, one expert group).
# Plain RoPE: TorchTitan sizes RoPE to the training sequence and stretches it by YaRN only when that
# exceeds original_seq_len (4,096), which its 16B job (seq_len 4,096) does not. Its other flavors
# (debugmodel, 236B, 671B) are not imported: their MLA sizes are not recipe fields
TORCHTITAN_FLAVORS = {
    "16B": dict(
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=102400,
        ffn_dim=10944,
        max_seq_len=4096,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
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
        yarn_factor=None,
        load_balance="aux_free",
        bias_update_rate=0.001,
    )
}
TORCHTITAN_BALANCING = (
    "deepseek_v3: TorchTitan balances its experts by the router bias (load_balance_coeff = 1e-3, moved "
    "by an optimizer hook) and adds no aux loss: model.load_balance = aux_free, bias_update_rate = 1e-3 "
    "(TorchTitan also subtracts the update's mean from every bias: the same expert choices)"
)


class DeepseekV3Adapter(StateDictAdapter):
    names = HFNames(HF_LAYER, lambda name, args: None, "DeepSeek-V3", stacked=HF_EXPERTS, fused=HF_FUSED)
    hf_model_type = "deepseek_v3"
    torchtitan_model = "deepseek_v3"
    torchtitan_flavors = TORCHTITAN_FLAVORS
    torchtitan_notes = (TORCHTITAN_BALANCING,)
    torchtitan_rope_until = {"16B": 4096}  # TorchTitan's YaRN (factor 40, mscale 0.7) starts beyond it

    def hf_config(self, a: DeepseekV3Args, dtype: str = "float32") -> dict:
        """config.json of the equivalent HF DeepseekV3ForCausalLM (no MTP module)."""
        if a.score_func != "sigmoid":  # transformers' router has no softmax scoring
            raise IncompatibleWeights(
                f"model.score_func = {a.score_func!r}: transformers' DeepseekV3 routes by sigmoid scores "
                "only, so the exported model would compute other logits; export a model trained with "
                "score_func = sigmoid (the debug, 671b and kimi_k2 flavors), or keep this one in "
                "meshforge or TorchTitan format (--to torchtitan)"
            )
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": self.hf_model_type,
            "hidden_size": a.dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_heads,
            "vocab_size": a.vocab_size,
            "intermediate_size": a.ffn_dim,
            "rms_norm_eps": a.norm_eps,
            "max_position_embeddings": a.max_seq_len,
            "tie_word_embeddings": a.tie_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "q_lora_rank": a.q_lora_rank or None,
            "kv_lora_rank": a.kv_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim,
            "rope_interleave": a.rope_interleave,
            "n_routed_experts": a.num_experts,
            "num_experts_per_tok": a.num_experts_per_tok,
            "moe_intermediate_size": a.moe_dim,
            "n_shared_experts": a.n_shared_experts,
            "first_k_dense_replace": a.first_k_dense_replace,
            "n_group": a.n_group,
            "topk_group": a.topk_group,
            "routed_scaling_factor": a.routed_scaling_factor,
            "norm_topk_prob": a.norm_topk_prob,
            "num_nextn_predict_layers": 0,
            "torch_dtype": dtype,
            **rope_config(a),
        }

    def args_from_hf_config(self, cfg: dict) -> DeepseekV3Args:
        """DeepseekV3Args of a config.json transformers wrote; absent keys take DeepseekV3Config's
        defaults, and every key that would change the math and that we do not implement is
        refused by name (so are a softmax router, which transformers' DeepSeek-V3 has not, and
        groups that do not split the experts)."""
        expect(cfg, "model_type", (FAMILY,), f"not a {FAMILY} checkpoint: use the family of its model_type")
        check_keys(cfg, KEYS, FAMILY)
        expect(cfg, "hidden_act", ("silu",), "the FFN is SwiGLU: only silu is implemented")
        expect(cfg, "attention_bias", (False,), "MLA projections with biases are not implemented")
        expect(cfg, "attention_dropout", (0.0, 0), "attention dropout is not implemented")
        get = cfg.get
        n = get("n_routed_experts", get("num_local_experts", 256))
        n_group, topk_group = get("n_group") or 1, get("topk_group") or 1
        k = get("num_experts_per_tok") or 8
        if not isinstance(n, int) or n < 1:
            raise refuse("n_routed_experts", n, "DeepSeek-V3 needs routed experts (>= 1)")
        if not isinstance(n_group, int) or n_group < 1 or n % n_group:
            raise refuse("n_group", n_group, f"must divide n_routed_experts = {n} into equal groups")
        if n_group > 1 and n // n_group < 2:
            raise refuse("n_group", n_group, f"a group is scored by its best two experts: at most {n // 2}")
        if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
            raise refuse("topk_group", topk_group, f"must be between 1 and n_group = {n_group}")
        if not 1 <= k <= n:
            raise refuse("num_experts_per_tok", k, f"top-k must be between 1 and n_routed_experts = {n}")
        if k > topk_group * (n // n_group):
            raise refuse(
                "num_experts_per_tok",
                k,
                f"more than the {topk_group * (n // n_group)} experts of topk_group groups",
            )
        nope, rope = get("qk_nope_head_dim", 128), get("qk_rope_head_dim", 64)
        for key, value in (("head_dim", rope), ("qk_head_dim", nope + rope)):
            if get(key, value) != value:
                raise refuse(key, get(key), f"transformers derives it as {value} from the qk_*_head_dim keys")
        return DeepseekV3Args(
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            vocab_size=cfg["vocab_size"],
            ffn_dim=get("intermediate_size", 18432),
            norm_eps=get("rms_norm_eps", 1e-6),
            max_seq_len=get("max_position_embeddings", 4096),
            tie_embeddings=get("tie_word_embeddings", False),
            q_lora_rank=get("q_lora_rank", 1536) or 0,
            kv_lora_rank=get("kv_lora_rank", 512),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=get("v_head_dim", 128),
            rope_interleave=bool(get("rope_interleave", True)),
            **yarn_args(cfg),
            num_experts=n,
            num_experts_per_tok=k,
            moe_dim=get("moe_intermediate_size", 2048),
            n_shared_experts=get("n_shared_experts", 1),
            first_k_dense_replace=get("first_k_dense_replace", 3),
            score_func="sigmoid",
            n_group=n_group,
            topk_group=topk_group,
            routed_scaling_factor=float(get("routed_scaling_factor", 2.5)),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
        )

    def check_compatible(self, checkpoint_args: DeepseekV3Args, recipe_args: DeepseekV3Args) -> list[str]:
        """Every field but the training ones and the RoPE table's length must match."""
        skip = {*TRAINING_FIELDS, "max_seq_len"}
        return [
            f"{f.name}: checkpoint {getattr(checkpoint_args, f.name)}, recipe {getattr(recipe_args, f.name)}"
            for f in dataclasses.fields(checkpoint_args)
            if f.name not in skip and getattr(checkpoint_args, f.name) != getattr(recipe_args, f.name)
        ]


ADAPTER = DeepseekV3Adapter()
