"""The Qwen3 family's weight formats: HuggingFace `Qwen3ForCausalLM` and TorchTitan names.

Qwen3 rotates (i, i + head_dim/2) pairs, as HF does, so no rows are permuted: names only.
Registered as the family's `interop` (models/spec.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .hf_config import (
    check_compatible,
    check_keys,
    expect,
    read_config,
    refuse,
    rope_args,
    rope_entries,
    rope_of,
)
from .hf_names import (
    HFNames,
    from_torchtitan,
    load_hf_state,
    name_from_torchtitan,
    name_to_torchtitan,
    permute_from_hf,
    save_hf_state,
    to_torchtitan,
)
from .llama_hf import HF_LAYER as LLAMA_LAYER
from .qwen3 import Qwen3Args

# re-exported: the family's interop interface (models/spec.py)
__all__ = [
    "check_compatible",
    "from_torchtitan",
    "name_from_torchtitan",
    "name_to_torchtitan",
    "permute_from_hf",
    "to_torchtitan",
]

HF_LAYER = {
    **LLAMA_LAYER,
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
HF_MODEL_TYPE = "qwen3"


def hf_permuted_heads(name: str, args: Qwen3Args) -> None:
    """Qwen3's HF rows are in our order: nothing is permuted."""
    return None


NAMES = HFNames(HF_LAYER, hf_permuted_heads, "Qwen3")
hf_name, to_hf, from_hf, source_name, tensor_to_hf = (
    NAMES.hf_name,
    NAMES.to_hf,
    NAMES.from_hf,
    NAMES.source_name,
    NAMES.tensor_to_hf,
)


def hf_config(args: Qwen3Args, dtype: str = "float32") -> dict:
    """config.json of the equivalent HF Qwen3ForCausalLM, RoPE in the installed transformers' format."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_attention_heads": args.n_heads,
        "head_dim": args.head_dim,
        "num_key_value_heads": args.kv_heads,
        "num_hidden_layers": args.n_layers,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
        "torch_dtype": dtype,
        **rope_entries(args),
    }


_READ = {
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "intermediate_size",
    "hidden_act",
    "attention_bias",
    "attention_dropout",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "layer_types",
}


def args_from_hf_config(cfg: dict) -> Qwen3Args:
    """Qwen3Args of an HF Qwen3 config.json (transformers 4 or 5 format); every key that
    would change the math and that we do not implement is refused."""
    expect(cfg, "model_type", ("qwen3",), "not a Qwen3 checkpoint: use the family of its model_type")
    check_keys(cfg, _READ, "qwen3")
    expect(cfg, "hidden_act", ("silu",), "Qwen3's FFN is SwiGLU: only silu is implemented")
    expect(cfg, "attention_bias", (False,), "q/k/v/o projections with biases are not implemented")
    expect(cfg, "attention_dropout", (0.0, 0), "attention dropout is not implemented")
    expect(cfg, "use_sliding_window", (False,), "sliding-window attention is not implemented")
    if set(cfg.get("layer_types") or ["full_attention"]) != {"full_attention"}:
        raise refuse("layer_types", cfg["layer_types"], "only full-attention layers are implemented")
    rope = rope_args(rope_of(cfg, default_theta=10000.0))
    heads = cfg["num_attention_heads"]
    return Qwen3Args(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads"),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        ffn_dim=cfg["intermediate_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_seq_len=cfg.get("max_position_embeddings", 32768),
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        **rope,
    )


def read_hf_args(folder: Path) -> Qwen3Args:
    """The args of the HF folder's config.json."""
    return args_from_hf_config(read_config(folder))


def save_hf(state: dict[str, torch.Tensor], args: Qwen3Args, out: Path, **kw) -> list:
    """An HF folder: config.json + safetensors (sharded with an index when large)."""
    return save_hf_state(NAMES, hf_config, state, args, out, **kw)


def load_hf(folder: Path) -> tuple[dict[str, torch.Tensor], Qwen3Args]:
    """Our state dict and args from an HF folder (one or several safetensors files)."""
    return load_hf_state(NAMES, read_hf_args, folder)
