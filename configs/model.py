"""The [model] section: the family, its flavor or HF folder, and overrides of its fields."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import F


@dataclass
class ModelConfig:
    name: str = F(
        "llama3", "a model family registered in models/registry.py (a bad name is told the registered ones)"
    )
    flavor: str = F("debug", "named size of the family: debug, 1b, 8b, ... (not used with model.hf)")
    hf: str | None = F(
        None,
        "take the shape from this HF folder's config.json (dims, heads, FFN, vocab, eps, RoPE, tying); "
        "weights still come from checkpoint.init_from_hf",
    )
    # Size overrides: None keeps the flavor's (or HF config's) value. They let a GPU recipe run on a laptop.
    dim: int | None = F(None, "override: model width")
    n_layers: int | None = F(None, "override: number of transformer blocks")
    n_heads: int | None = F(None, "override: attention heads")
    n_kv_heads: int | None = F(None, "override: key/value heads (GQA); must divide n_heads")
    head_dim: int | None = F(None, "override: width of one head (qwen3; llama3 fixes it to dim / n_heads)")
    vocab_size: int | None = F(None, "override: vocabulary size (must cover the tokenizer)")
    ffn_dim: int | None = F(None, "override: FFN hidden width, exactly (an HF intermediate_size)")
    multiple_of: int | None = F(None, "override (llama3): FFN hidden size is rounded up to this")
    ffn_dim_multiplier: float | None = F(None, "override (llama3): FFN hidden size multiplier")
    max_seq_len: int | None = F(None, "override: longest sequence RoPE is precomputed for")
    tie_embeddings: bool | None = F(None, "override: share tok_embeddings and output weights")
    norm_eps: float | None = F(None, "override: RMSNorm epsilon")
    rope_theta: float | None = F(None, "override: RoPE base frequency")
    rope_scaling_factor: float | None = F(None, "override: Llama 3 RoPE scaling factor (e.g. 32.0)")
    rope_original_max_seq_len: int | None = F(
        None, "override: context length the Llama 3 RoPE scaling is from"
    )
    # Mixture of experts (qwen3_moe): transformers' Qwen3MoeConfig names where it has one
    num_experts: int | None = F(None, "override (MoE): experts per sparse layer")
    num_experts_per_tok: int | None = F(None, "override (MoE): top-k, the experts each token is sent to")
    moe_dim: int | None = F(None, "override (MoE): one expert's hidden width (HF moe_intermediate_size)")
    norm_topk_prob: bool | None = F(None, "override (MoE): renormalise the top-k router weights to sum to 1")
    decoder_sparse_step: int | None = F(None, "override (MoE): every n-th layer is sparse")
    mlp_only_layers: list[int] | None = F(None, "override (MoE): layer ids kept dense")
    router_aux_loss_coef: float | None = F(
        None, "override (MoE): weight of the load-balancing loss (per sequence and layer; DESIGN)"
    )
    load_balance: str | None = F(
        None, "override (MoE): aux_loss | aux_free (DeepSeek-V3's selection bias; no loss term)"
    )
    bias_update_rate: float | None = F(None, "override (MoE): aux_free's bias step per training step")
    grouped_mm: bool | None = F(
        None, "override (MoE): experts by F.grouped_mm where it runs (CPU; CUDA bf16), else a loop (false)"
    )
    capacity_factor: float | None = F(
        None, "refused: meshforge's MoE is dropless (every token reaches its top-k experts)"
    )
