"""The Llama family's weight formats: HuggingFace `LlamaForCausalLM` and TorchTitan names.

Our parameter names are TorchTitan's classic Llama 3 names (TorchTitan 0.3.0 saves
`attention.qkv_linear.wq.weight` and `lm_head.weight`: models/hf_names.py). HuggingFace
rotates q and k by halves (rotate_half) where Meta/TorchTitan rotate interleaved pairs, so
the rows of wq and wk are permuted per head on the way to HF and back (as HF's own
convert_llama_weights_to_hf does). Registered as the family's `interop` (models/spec.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .hf_config import check_compatible, check_keys, expect, read_config, rope_args, rope_entries, rope_of
from .hf_names import (
    HFNames,
    from_torchtitan,
    load_hf_state,
    name_from_torchtitan,
    name_to_torchtitan,
    permute_from_hf,
    permute_to_hf,
    save_hf_state,
    to_torchtitan,
)
from .llama import LlamaArgs

# re-exported: the family's interop interface (models/spec.py)
__all__ = [
    "check_compatible",
    "from_torchtitan",
    "name_from_torchtitan",
    "name_to_torchtitan",
    "permute_from_hf",
    "permute_to_hf",
    "to_torchtitan",
]

HF_LAYER = {  # ours -> HF, within a block
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
HF_MODEL_TYPE = "llama"


def hf_permuted_heads(name: str, args: LlamaArgs) -> int | None:
    """How many heads `name`'s rows are permuted by in HF's layout (None: not permuted)."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


NAMES = HFNames(HF_LAYER, hf_permuted_heads, "Llama")
hf_name, to_hf, from_hf, source_name, tensor_to_hf = (
    NAMES.hf_name,
    NAMES.to_hf,
    NAMES.from_hf,
    NAMES.source_name,
    NAMES.tensor_to_hf,
)


def hf_config(args: LlamaArgs, dtype: str = "float32") -> dict:
    """config.json of the equivalent HF LlamaForCausalLM, RoPE in the installed transformers' format."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "num_hidden_layers": args.n_layers,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": args.head_dim,
        "torch_dtype": dtype,
        **rope_entries(args),
    }


# what LlamaForCausalLM computes that we read (the rest is hf_config.IGNORED or refused)
_READ = {
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "intermediate_size",
    "head_dim",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "attention_dropout",
}


def args_from_hf_config(cfg: dict) -> LlamaArgs:
    """LlamaArgs of an HF Llama config.json (transformers 4 or 5 format); every key that
    would change the math and that we do not implement is refused."""
    expect(cfg, "model_type", ("llama",), "not a Llama checkpoint: use the family of its model_type")
    check_keys(cfg, _READ, "llama3")
    expect(cfg, "hidden_act", ("silu",), "Llama's FFN is SwiGLU: only silu is implemented")
    expect(cfg, "attention_bias", (False,), "q/k/v/o projections with biases are not implemented")
    expect(cfg, "mlp_bias", (False,), "FFN projections with biases are not implemented")
    expect(cfg, "attention_dropout", (0.0, 0), "attention dropout is not implemented")
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    expect(
        cfg,
        "head_dim",
        (dim // heads,),
        f"Llama fixes head_dim = hidden_size / num_attention_heads = "
        f"{dim // heads}; another head_dim is not implemented",
    )
    rope = rope_args(rope_of(cfg, default_theta=10000.0))
    return LlamaArgs(
        dim=dim,
        n_layers=cfg["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads"),
        vocab_size=cfg["vocab_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        ffn_dim=cfg["intermediate_size"],
        **rope,
    )


def read_hf_args(folder: Path) -> LlamaArgs:
    """The args of the HF folder's config.json."""
    return args_from_hf_config(read_config(folder))


def save_hf(state: dict[str, torch.Tensor], args: LlamaArgs, out: Path, **kw) -> list:
    """An HF folder: config.json + safetensors (sharded with an index when large)."""
    return save_hf_state(NAMES, hf_config, state, args, out, **kw)


def load_hf(folder: Path) -> tuple[dict[str, torch.Tensor], LlamaArgs]:
    """Our state dict and args from an HF folder (one or several safetensors files)."""
    return load_hf_state(NAMES, read_hf_args, folder)
