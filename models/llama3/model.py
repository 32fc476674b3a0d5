"""Llama 3's args: the shared decoder (models/common/decoder.py) is Llama 3's own shape, so
the family's module is that decoder built from these args."""

from __future__ import annotations

from dataclasses import dataclass

from ..common.decoder import Transformer

__all__ = ["LlamaArgs", "Transformer"]


@dataclass
class LlamaArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None = n_heads (no GQA)
    vocab_size: int = 128256
    multiple_of: int = 256  # FFN hidden size rounded up to this, for efficient matmuls
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3 RoPE frequency scaling (None disables): stretches low frequencies for long context
    rope_scaling_factor: float | None = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 8192
    tie_embeddings: bool = False
    ffn_dim: int | None = None  # explicit FFN width (an HF intermediate_size); None = the rule below

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """`ffn_dim` if given, else TorchTitan's (and Meta's) rule: 2/3 of 4*dim, times the
        multiplier, rounded up to `multiple_of`."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)
