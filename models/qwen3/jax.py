"""The Qwen3 forward and loss of models/qwen3/model.py as pure functions of a JAX pytree keyed
by the torch parameter names: the shared JAX decoder (models/common/jax_decoder.py) with QK-norm
and RoPE over (i, i + head_dim/2) pairs."""

from __future__ import annotations

import jax

from ..common import jax_decoder
from ..common.jax_decoder import apply_rope_half
from .model import Qwen3Args


def forward(params: dict, tokens: jax.Array, args: Qwen3Args) -> jax.Array:
    """tokens (B, S) int -> logits (B, S, V), float32."""
    return jax_decoder.forward(params, tokens, args, rope=apply_rope_half, qk_norm=True)


def token_ce_sum(
    params: dict, tokens: jax.Array, labels: jax.Array, args: Qwen3Args, ignore_index: int = -100
):
    """Sum of token cross-entropies over labels != ignore_index, and how many tokens that is."""
    return jax_decoder.token_ce_sum(params, tokens, labels, args, ignore_index, fwd=forward)
