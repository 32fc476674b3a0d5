"""The Qwen3-MoE forward and loss of models/qwen3_moe/model.py as pure functions of a JAX pytree keyed by
the torch parameter names: Qwen3's attention (models/qwen3/jax.py), the dense layers' SwiGLU, and
the mixture of experts computed densely, a parity oracle rather than a fast path: every expert
runs on every token, and each token sums its top-k experts' outputs weighted by the router (the
others weighted by zero). The same numbers as the torch model's dispatch, to rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..common import jax_decoder
from ..common.jax_decoder import apply_rope_half
from ..common.moe import Balancing, is_moe_layer
from .model import Qwen3MoeArgs


def route(p: dict, prefix: str, x: jax.Array, args: Qwen3MoeArgs) -> jax.Array:
    """x (T, D) -> the router's weight of every expert for every token (T, E), zero outside each
    token's top-k: softmax in float32, top-k (chosen with aux_free's `expert_bias` added, weighted
    by the probabilities alone), renormalised when norm_topk_prob, in x's dtype."""
    logits = jax_decoder.linear(x, p[f"{prefix}.router.gate.weight"])
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    chooser = probs
    if Balancing(args.load_balance).routes_with_bias and f"{prefix}.expert_bias" in p:
        chooser = probs + p[f"{prefix}.expert_bias"].astype(jnp.float32)
    _, experts = jax.lax.top_k(chooser, args.num_experts_per_tok)  # (T, k)
    weights = jnp.take_along_axis(probs, experts, axis=-1)
    if args.norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    weights = weights.astype(logits.dtype)
    return (jax.nn.one_hot(experts, args.num_experts, dtype=weights.dtype) * weights[..., None]).sum(axis=1)


def moe(p: dict, prefix: str, x: jax.Array, args: Qwen3MoeArgs) -> jax.Array:
    """The mixture-of-experts feed-forward on x (B, S, D), every expert on every token."""
    b, s, d = x.shape
    tokens = x.reshape(-1, d)
    weights = route(p, prefix, tokens, args)  # (T, E)
    w1, w2, w3 = (p[f"{prefix}.experts.{w}"] for w in ("w1", "w2", "w3"))  # (E, out, in)
    hidden = jax.nn.silu(jnp.einsum("td,ehd->teh", tokens, w1)) * jnp.einsum("td,ehd->teh", tokens, w3)
    out = jnp.einsum("teh,edh->ted", hidden, w2)  # (T, E, D)
    return jnp.einsum("ted,te->td", out, weights).astype(x.dtype).reshape(b, s, d)


def forward(params: dict, tokens: jax.Array, args: Qwen3MoeArgs) -> jax.Array:
    """tokens (B, S) int -> logits (B, S, V), float32."""
    cos, sin = jax_decoder.rope_angles(args, tokens.shape[1])
    h = params["tok_embeddings.weight"][tokens]
    for i in range(args.n_layers):
        pre = f"layers.{i}"
        normed = jax_decoder.rms_norm(h, params[f"{pre}.attention_norm.weight"], args.norm_eps)
        h = h + jax_decoder.attention(
            params, f"{pre}.attention", normed, cos, sin, args, rope=apply_rope_half, qk_norm=True
        )
        normed = jax_decoder.rms_norm(h, params[f"{pre}.ffn_norm.weight"], args.norm_eps)
        if is_moe_layer(args, i):
            h = h + moe(params, f"{pre}.moe", normed, args)
        else:
            h = h + jax_decoder.feed_forward(params, f"{pre}.feed_forward", normed)
    h = jax_decoder.rms_norm(h, params["norm.weight"], args.norm_eps)
    out = params.get("output.weight", params["tok_embeddings.weight"])  # tied: the embedding
    return jax_decoder.linear(h, out).astype(jnp.float32)


def token_ce_sum(
    params: dict, tokens: jax.Array, labels: jax.Array, args: Qwen3MoeArgs, ignore_index: int = -100
) -> tuple[jax.Array, jax.Array]:
    """Sum of token cross-entropies over labels != ignore_index, and how many tokens that is."""
    return jax_decoder.token_ce_sum(params, tokens, labels, args, ignore_index, fwd=forward)
