"""The toy decoder's JAX twin: the shared JAX decoder with rotate-half RoPE."""

from __future__ import annotations

import jax

from meshforge.models.common import jax_decoder
from meshforge.models.common.jax_decoder import apply_rope_half


def forward(params: dict, tokens: jax.Array, args) -> jax.Array:
    return jax_decoder.forward(params, tokens, args, rope=apply_rope_half)


def token_ce_sum(params: dict, tokens: jax.Array, labels: jax.Array, args, ignore_index: int = -100):
    return jax_decoder.token_ce_sum(params, tokens, labels, args, ignore_index, fwd=forward)
