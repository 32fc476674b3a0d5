"""The toy decoder: the shared decoder with rotate-half RoPE and a head_dim of its own."""

from __future__ import annotations

from dataclasses import dataclass

from meshforge.models.common.decoder import Attention, Transformer, apply_rotary_emb_half


@dataclass
class ToyArgs:
    dim: int = 48
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = 2
    head_dim: int = 16
    vocab_size: int = 256
    ffn_dim: int = 80
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 256
    tie_embeddings: bool = False

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return self.ffn_dim


class ToyAttention(Attention):
    rope = staticmethod(apply_rotary_emb_half)


class ToyTransformer(Transformer):
    attention = ToyAttention
