"""The shared decoder's forward and loss (models/common/decoder.py), as pure functions of a JAX
pytree; a family's JAX twin (models/<family>/jax.py) composes them.

`params` is a flat dict keyed by the torch parameter names (`layers.0.attention.wq.weight`)
holding arrays in torch's layout (Linear weights are (out, in)), so an exported
checkpoint is the pytree and a DeviceMesh placement maps to a PartitionSpec name by name.
Same math as the torch model: interleaved-pair RoPE with Llama 3 frequency scaling, GQA by
repeating each kv head for its group of query heads, RMSNorm, SwiGLU, causal attention.
Activations run in the parameters' dtype, with softmax, norms and RoPE in float32 as torch does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .decoder import precompute_freqs_cis


def rope_angles(args, seqlen: int) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the torch model's own RoPE table (S, head_dim/2): one source of truth."""
    freqs = precompute_freqs_cis(args)[:seqlen]
    return jnp.asarray(freqs.real.numpy()), jnp.asarray(freqs.imag.numpy())


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """torch.nn.RMSNorm: x / sqrt(mean(x^2) + eps) * weight."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate interleaved (even, odd) pairs, as torch.view_as_complex(x.reshape(..., -1, 2))."""
    x32 = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    even, odd = x32[..., 0], x32[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]  # (1, S, 1, hd/2)
    out = jnp.stack([even * c - odd * s, even * s + odd * c], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def apply_rope_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate (i, i + hd/2) pairs, as HF's q * cos + rotate_half(q) * sin."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]  # (1, S, 1, hd/2)
    return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(x.dtype)


def repeat_kv(x: jax.Array, n_rep: int) -> jax.Array:
    """(B, S, KVH, hd) -> (B, S, KVH * n_rep, hd): query head h reads kv head h // n_rep."""
    return jnp.repeat(x, n_rep, axis=2)


def linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    return x @ weight.T  # torch layout: weight is (out, in)


def attention(
    p: dict, prefix: str, x: jax.Array, cos, sin, args, rope=apply_rope, qk_norm: bool = False
) -> jax.Array:
    """Causal GQA attention; a family may rotate another pair layout (`rope`) and normalise
    every q and k head first (`qk_norm`, Qwen3)."""
    b, s, _ = x.shape
    hd = args.head_dim
    q = linear(x, p[f"{prefix}.wq.weight"]).reshape(b, s, -1, hd)
    k = linear(x, p[f"{prefix}.wk.weight"]).reshape(b, s, -1, hd)
    v = linear(x, p[f"{prefix}.wv.weight"]).reshape(b, s, -1, hd)
    if qk_norm:
        q = rms_norm(q, p[f"{prefix}.q_norm.weight"], args.norm_eps)
        k = rms_norm(k, p[f"{prefix}.k_norm.weight"], args.norm_eps)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    n_rep = q.shape[2] // k.shape[2]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(hd)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1)
    return linear(out, p[f"{prefix}.wo.weight"])


def feed_forward(p: dict, prefix: str, x: jax.Array) -> jax.Array:
    return linear(
        jax.nn.silu(linear(x, p[f"{prefix}.w1.weight"])) * linear(x, p[f"{prefix}.w3.weight"]),
        p[f"{prefix}.w2.weight"],
    )


def forward(params: dict, tokens: jax.Array, args, **attention_kw) -> jax.Array:
    """tokens (B, S) int -> logits (B, S, V), float32. `attention_kw` (rope, qk_norm) lets
    a family swap its attention (models/qwen3/jax.py)."""
    cos, sin = rope_angles(args, tokens.shape[1])
    h = params["tok_embeddings.weight"][tokens]
    for i in range(args.n_layers):
        pre = f"layers.{i}"
        h = h + attention(
            params,
            f"{pre}.attention",
            rms_norm(h, params[f"{pre}.attention_norm.weight"], args.norm_eps),
            cos,
            sin,
            args,
            **attention_kw,
        )
        h = h + feed_forward(
            params, f"{pre}.feed_forward", rms_norm(h, params[f"{pre}.ffn_norm.weight"], args.norm_eps)
        )
    h = rms_norm(h, params["norm.weight"], args.norm_eps)
    out = params.get("output.weight", params["tok_embeddings.weight"])  # tied: the embedding
    return linear(h, out).astype(jnp.float32)


def token_ce_sum(
    params: dict, tokens: jax.Array, labels: jax.Array, args, ignore_index: int = -100, fwd=None
) -> tuple[jax.Array, jax.Array]:
    """Sum of token cross-entropies over labels != ignore_index, and how many tokens that is
    (the torch trainer divides the sum by the global batch's token count). `fwd`: another
    family's forward (default: this one)."""
    logp = jax.nn.log_softmax((fwd or forward)(params, tokens, args), axis=-1)
    mask = labels != ignore_index
    picked = jnp.take_along_axis(logp, jnp.where(mask, labels, 0)[..., None], axis=-1)[..., 0]
    return -jnp.sum(jnp.where(mask, picked, 0.0)), mask.sum()


def loss_fn(params: dict, tokens: jax.Array, labels: jax.Array, args, ignore_index: int = -100) -> jax.Array:
    """Mean token cross-entropy over labels != ignore_index."""
    total, n = token_ce_sum(params, tokens, labels, args, ignore_index)
    return total / jnp.maximum(n, 1)
