"""The decoder every family composes, in TorchTitan's style and module names (Llama 3's
shape: GQA attention with RoPE, SwiGLU feed-forward, RMSNorm; a family swaps its attention
or its blocks in).

Pipeline-friendly: blocks live in an `nn.ModuleDict` keyed "0".."n-1" (names survive a
pipeline split and checkpoints), top-level modules may be None on a pipeline stage, and
the top-level forward is a plain loop. Weights are not initialised in `__init__`, so
the model can be built on the meta device; `init_weights` fills a materialised model,
and `param_init` tells how any single parameter is drawn (for mesh-independent init).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.core.seeding import seeded_generator


def precompute_freqs_cis(args) -> torch.Tensor:
    """Complex RoPE rotations, (max_seq_len, head_dim // 2), with Llama 3 frequency scaling
    when `args.rope_scaling_factor` is set (any family's args with the rope_* fields)."""
    dim = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    if args.rope_scaling_factor is not None:
        factor, low, high = args.rope_scaling_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
        old_ctx = args.rope_original_max_seq_len
        low_freq_wavelen, high_freq_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / freqs
        # long wavelengths are divided by the factor, short ones kept, the band between blended
        scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * freqs / factor + smooth * freqs
        is_mid = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        freqs = torch.where(is_mid, blended, scaled)
    t = torch.arange(args.max_seq_len, dtype=torch.float32)
    angles = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(angles), angles)  # complex64


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    """Rotate interleaved (even, odd) pairs of q and k (Meta's layout). xq: (B, S, H, hd),
    freqs_cis: (S, hd/2)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis[None, :, None, :]  # (1, S, 1, hd/2)
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def apply_rotary_emb_half(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    """Rotate (i, i + hd/2) pairs of q and k (HF's rotate_half layout, Qwen3's native one)."""
    freqs = freqs_cis[None, :, None, :]  # (1, S, 1, hd/2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.view_as_real(torch.complex(x1, x2) * freqs)  # (..., hd/2, 2)
        return torch.cat([out[..., 0], out[..., 1]], dim=-1).type_as(x)

    return rotate(xq), rotate(xk)


class Attention(nn.Module):
    """Causal GQA attention. Subclasses change `norm_qk` (per-head norms) and `rope`; context
    parallelism sets `attend` (q, k, v -> out, all (B, H, S, hd)) to attend across its ranks."""

    rope = staticmethod(apply_rotary_emb)
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __init__(self, args):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them
        xq = self.wq(x).view(bsz, seqlen, -1, self.head_dim)  # (B, S, H, hd)
        xk = self.wk(x).view(bsz, seqlen, -1, self.head_dim)  # (B, S, KVH, hd)
        xv = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        xq, xk = self.rope(*self.norm_qk(xq, xk), freqs_cis[:seqlen])
        q, k, v = (t.transpose(1, 2) for t in (xq, xk, xv))  # (B, H, S, hd)
        if self.attend is not None:
            out = self.attend(q, k, v)
        else:  # GQA: query head h reads kv head h // (H / KVH), as repeat_interleave would
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)  # (B, S, H * hd)
        return self.wo(out)

    def norm_qk(self, xq: torch.Tensor, xk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return xq, xk


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args, attention: type[Attention] = Attention):
        super().__init__()
        self.attention = attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    attention: type[Attention] = Attention  # a family's subclass swaps its attention in
    rope_table = staticmethod(precompute_freqs_cis)  # args -> (max_seq_len, rotated dims / 2) complex
    # the sequence positions of the tokens this rank holds, when context parallelism shards them
    # (None: positions 0..S-1); RoPE rotates each token by its own position
    rope_positions: torch.Tensor | None = None

    def __init__(self, args):
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.make_block(args, i) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: recomputed by init_buffers, never checkpointed.
        self.register_buffer("freqs_cis", self.rope_table(args), persistent=False)

    def make_block(self, args, layer_id: int) -> nn.Module:
        """Block `layer_id` (a family with several kinds of block, e.g. MoE, overrides this)."""
        return TransformerBlock(args, self.attention)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, S) int -> logits (B, S, V); on a pipeline stage, hidden (B, S, D) in or out."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        freqs_cis = self.freqs_cis
        if self.rope_positions is not None:
            if self.rope_positions.device != freqs_cis.device:  # set on the meta model: moved once
                self.rope_positions = self.rope_positions.to(freqs_cis.device)
            freqs_cis = freqs_cis[self.rope_positions]
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the RoPE buffer, e.g. after `to_empty` from the meta device."""
        self.freqs_cis = self.rope_table(self.args).to(device or self.freqs_cis.device)

    def init_param(self, fqn: str, full: torch.Tensor, seed: int) -> None:
        """Fill `full` (the unsharded float32 value of parameter `fqn`) in place. A tied output
        is the embedding: on a pipeline's last stage, its copy draws the embedding's value."""
        if fqn == "output.weight" and self.args.tie_embeddings:
            fqn = "tok_embeddings.weight"
        param_init(self.args, fqn)(full, seeded_generator(seed, fqn))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise every parameter of an unsharded, materialised model in place."""
        for fqn, param in self.named_parameters():
            full = torch.empty(param.shape, dtype=torch.float32)
            self.init_param(fqn, full, seed)
            param.copy_(full)
        self.init_buffers()


def param_init(args, fqn: str) -> Callable[[torch.Tensor, torch.Generator], None]:
    """How the parameter named `fqn` is drawn (TorchTitan's Llama 3 scheme; every norm,
    q_norm and k_norm included, starts at one)."""
    if fqn.endswith("norm.weight"):
        return lambda t, g: t.fill_(1.0)
    if fqn == "output.weight" or (fqn == "tok_embeddings.weight" and args.tie_embeddings):
        std = args.dim**-0.5
        return lambda t, g: nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=g)
    if fqn == "tok_embeddings.weight":
        return lambda t, g: nn.init.normal_(t, std=1.0, generator=g)
    layer_id = int(fqn.split(".")[1])
    # depth-scaled init for the projections that write into the residual stream
    depth_std = 0.02 / (2 * (layer_id + 1)) ** 0.5
    std = depth_std if fqn.endswith(("wo.weight", "w2.weight", "w3.weight")) else 0.02
    return lambda t, g: nn.init.trunc_normal_(t, std=std, generator=g)


def count_params(model: nn.Module) -> int:
    """Parameters counted once even when tied (works on the meta device)."""
    return sum(p.numel() for p in model.parameters())
