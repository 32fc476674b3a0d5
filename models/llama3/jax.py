"""Llama 3's JAX twin: the shared JAX decoder (models/common/jax_decoder.py) as it is, whose
RoPE rotates interleaved pairs with Llama 3 frequency scaling, as models/common/decoder.py."""

from __future__ import annotations

from ..common.jax_decoder import forward, loss_fn, token_ce_sum

__all__ = ["forward", "loss_fn", "token_ce_sum"]
