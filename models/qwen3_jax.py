"""The Qwen3 forward and loss of models/qwen3.py as pure functions of a JAX pytree keyed
by the torch parameter names: Llama's JAX decoder (models/llama_jax.py) with QK-norm and
RoPE over (i, i + head_dim/2) pairs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshforge.models import llama_jax
from meshforge.models.qwen3 import Qwen3Args


def apply_rope_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate (i, i + hd/2) pairs, as HF's q * cos + rotate_half(q) * sin."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]  # (1, S, 1, hd/2)
    return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(x.dtype)


def forward(params: dict, tokens: jax.Array, args: Qwen3Args) -> jax.Array:
    """tokens (B, S) int -> logits (B, S, V), float32."""
    return llama_jax.forward(params, tokens, args, rope=apply_rope_half, qk_norm=True)


def token_ce_sum(
    params: dict, tokens: jax.Array, labels: jax.Array, args: Qwen3Args, ignore_index: int = -100
):
    """Sum of token cross-entropies over labels != ignore_index, and how many tokens that is."""
    return llama_jax.token_ce_sum(params, tokens, labels, args, ignore_index, fwd=forward)
