"""Qwen3 (dense) in TorchTitan's style and module names: Llama 3's decoder with an explicit
head_dim, RMSNorm on each query and key head before RoPE (QK-norm), and RoPE rotating
(i, i + head_dim/2) pairs, HF's and Qwen's own layout (so HF weights load unpermuted).

Tied embeddings for the small flavors. Pipeline-friendly and meta-device friendly exactly
as models/common/decoder.py, whose blocks it reuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..common.decoder import Attention, Transformer, apply_rotary_emb_half


@dataclass
class Qwen3Args:
    dim: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int | None = 8  # None = n_heads (no GQA)
    head_dim: int = 128  # explicit: n_heads x head_dim need not equal dim
    vocab_size: int = 151936
    ffn_dim: int = 3072
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # Llama 3 RoPE frequency scaling, which HF applies to any family (None: plain RoPE, Qwen3's own)
    rope_scaling_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 40960
    tie_embeddings: bool = True

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return self.ffn_dim


class Qwen3Attention(Attention):
    """Llama's attention with QK-norm: an RMSNorm over head_dim on every q and k head."""

    rope = staticmethod(apply_rotary_emb_half)

    def __init__(self, args: Qwen3Args):
        super().__init__(args)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)

    def norm_qk(self, xq: torch.Tensor, xk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(xq), self.k_norm(xk)  # (B, S, H, hd): per head, over hd


class Qwen3Transformer(Transformer):
    attention = Qwen3Attention
