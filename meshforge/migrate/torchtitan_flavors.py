"""TorchTitan 0.2's Llama 3 and Qwen3-MoE flavors, the data `migrate/torchtitan.py` maps a job's
flavor by: TorchTitan's (model.name, model.flavor) -> (meshforge's family, its args in meshforge's
names)."""

from __future__ import annotations

# TorchTitan 0.2's Llama 3 flavors over its TransformerModelArgs defaults, in meshforge's names
# (every flavor applies Llama 3.1 RoPE scaling: factor 8 from an original context of 8192)
_ARGS = dict(
    vocab_size=128256,
    multiple_of=256,
    ffn_dim_multiplier=None,
    norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling_factor=8.0,
    rope_original_max_seq_len=8192,
)
LLAMA3_FLAVORS = {
    "debugmodel": dict(
        _ARGS, dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048, rope_theta=500000.0
    ),
    "8B": dict(
        _ARGS,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_theta=500000.0,
    ),
    "70B": dict(
        _ARGS,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_theta=500000.0,
    ),
    "405B": dict(
        _ARGS,
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
        rope_theta=500000.0,
    ),
}

# TorchTitan 0.2's Qwen3 MoE flavors (torchtitan/models/qwen3/__init__.py at v0.2.0): every block
# sparse, softmax top-k renormalised (route_norm), no shared experts, scores applied after the
# experts, untied; MoEArgs.load_balance_coeff = 1e-3 keeps an expert bias, but 0.2's qwen3 train
# spec registers no hook that moves it (build_optimizers; fixed after 0.2 by pytorch/torchtitan#3666)
# and there is no aux loss: the bias stays 0, which is aux_free with a rate of 0. Its dense
# Qwen3 flavors (debugmodel, 0.6B, ...) are not imported.
_MOE_ARGS = dict(
    vocab_size=151936,
    head_dim=128,
    norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_embeddings=False,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    load_balance="aux_free",
    bias_update_rate=0.0,
)
QWEN3_MOE_FLAVORS = {
    "debugmodel_moe": dict(
        _MOE_ARGS,
        vocab_size=2048,
        dim=256,
        n_layers=8,
        n_heads=16,
        n_kv_heads=8,
        ffn_dim=3072,
        moe_dim=768,
        num_experts=64,
        num_experts_per_tok=8,
    ),
    "30B-A3B": dict(
        _MOE_ARGS,
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        ffn_dim=6144,
        moe_dim=768,
        num_experts=128,
        num_experts_per_tok=8,
    ),
    # rope_theta 5e6 as TorchTitan's flavor has it (meshforge's 235b-a22b, from config.json: 1e6)
    "235B-A22B": dict(
        _MOE_ARGS,
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        ffn_dim=12288,
        moe_dim=1536,
        num_experts=128,
        num_experts_per_tok=8,
        rope_theta=5000000.0,
    ),
}
# TorchTitan's model.name -> (meshforge's family, TorchTitan's flavors of it that import)
FAMILIES = {"llama3": ("llama3", LLAMA3_FLAVORS), "qwen3": ("qwen3_moe", QWEN3_MOE_FLAVORS)}
