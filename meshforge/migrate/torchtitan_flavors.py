"""TorchTitan 0.2's Llama 3 flavors, the data `migrate/torchtitan.py` maps a job's flavor by."""

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
