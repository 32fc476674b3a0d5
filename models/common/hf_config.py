"""Reading and writing HF `config.json` for any family, refusing what we do not implement.

transformers 4 writes RoPE as `rope_theta` + `rope_scaling`; transformers 5 as
`rope_parameters` (with `rope_theta` inside, and nested by layer type for models that have
several). Both are read. Every key is either read (and checked against what the family
implements), or on an explicit list of keys that cannot change the forward and backward
math; any other key is refused with its name and value, never defaulted: a config we do
not fully understand would give silently wrong logits.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from pathlib import Path

from meshforge.core.errors import IncompatibleWeights, UnsupportedConfig

# keys that change nothing we compute, and why
IGNORED = {
    "architectures": "checked through model_type",
    "transformers_version": "provenance",
    "torch_dtype": "storage dtype: weights are read as stored, the recipe sets compute precision",
    "dtype": "storage dtype (transformers 5's name for torch_dtype)",
    "_name_or_path": "provenance",
    "use_cache": "inference KV cache",
    "bos_token_id": "tokenizer ids, read by the data pipeline",
    "eos_token_id": "tokenizer ids, read by the data pipeline",
    "pad_token_id": "tokenizer ids, read by the data pipeline",
    "initializer_range": "initialisation only: the weights come from the checkpoint",
    "pretraining_tp": "HF splits matmuls into slices when > 1: the same products",
    "output_attentions": "what HF returns, not what it computes",
    "output_hidden_states": "what HF returns, not what it computes",
    "return_dict": "what HF returns, not what it computes",
    "tie_word_embeddings": "read",
    "_attn_implementation": "which kernel HF runs attention with (eager, sdpa): the same math",
    "is_llama_config": "a marker some converters write (SmolLM2); transformers ignores it",
    "rope_interleaved": "a converter's note (SmolLM2): transformers ignores it and rotates halves",
    "transformers.js_config": "settings of the JavaScript port",
}
ROPE_KEYS = {"rope_theta", "rope_scaling", "rope_parameters"}


def refuse(key: str, value, why: str) -> UnsupportedConfig:
    return UnsupportedConfig(f"config.json: {key} = {value!r}: {why}")


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not an HF model folder (no config.json)")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IncompatibleWeights(f"{path} is not JSON ({e}); a truncated download? fetch it again") from e
    if not isinstance(cfg, dict):
        raise IncompatibleWeights(f"{path} is not a JSON object, so not an HF config; fetch it again")
    return cfg


def check_keys(cfg: dict, read: set[str], family: str) -> None:
    """Refuse every key that is neither read by the family nor known to be harmless."""
    unknown = sorted(k for k in cfg if k not in read and k not in IGNORED and k not in ROPE_KEYS)
    if unknown:
        k = unknown[0]
        others = f" (and {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
        raise refuse(
            k,
            cfg[k],
            f"meshforge's {family} does not implement this key{others}; it may change the "
            "computation, so the checkpoint is refused rather than read without it",
        )


def expect(cfg: dict, key: str, allowed: tuple, why: str) -> None:
    """A key the family reads only at these values (absent counts as the first one)."""
    value = cfg.get(key, allowed[0])
    if value not in allowed:
        raise refuse(key, value, why)


def rope_of(cfg: dict, default_theta: float) -> dict:
    """{rope_type, rope_theta, factor, ...} from either config format. `default_theta` is
    what the transformers class assumes when the file names no theta."""
    params = cfg.get("rope_parameters")
    if params is not None:
        if params and all(isinstance(v, dict) for v in params.values()):  # nested by layer type
            types = set(params)
            if types != {"full_attention"}:
                raise refuse(
                    "rope_parameters",
                    params,
                    "RoPE per layer type (sliding-window layers) is not implemented; only full attention is",
                )
            params = params["full_attention"]
        rope = dict(params)
    else:
        scaling = cfg.get("rope_scaling") or {}
        rope = {**scaling, "rope_theta": cfg.get("rope_theta", default_theta)}
        if "type" in rope and "rope_type" not in rope:  # transformers < 4.45 spelling
            rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_theta", cfg.get("rope_theta", default_theta))
    rope.setdefault("rope_type", "default")
    return rope


def rope_args(rope: dict) -> dict:
    """The args fields of a RoPE spec: plain (default) or Llama 3 scaling; others refused."""
    kind = rope["rope_type"]
    out = {"rope_theta": float(rope["rope_theta"]), "rope_scaling_factor": None}
    if kind == "default":
        extra = sorted(set(rope) - {"rope_type", "rope_theta"})
        if extra:
            raise refuse(
                "rope_parameters", rope, f"rope_type 'default' with {', '.join(extra)}: not understood"
            )
        return out
    if kind == "llama3":
        out.update(
            rope_scaling_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_seq_len=int(rope["original_max_position_embeddings"]),
        )
        return out
    raise refuse(
        "rope_type",
        kind,
        "only 'default' and 'llama3' RoPE are implemented (not linear, dynamic, yarn, longrope, ...)",
    )


# what every decoder family reads from config.json (a family adds its own keys)
DECODER_KEYS = {
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
}


def decoder_config(args, architecture: str, model_type: str, dtype: str, **extra) -> dict:
    """config.json of a SwiGLU RMSNorm decoder without biases, RoPE in the installed
    transformers' format; a family adds its own keys (`extra`)."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
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
        "torch_dtype": dtype,
        **extra,
        **rope_entries(args),
    }


def decoder_args(
    cfg: dict, family: str, model_type: str, extra_keys: set[str], default_max_positions: int
) -> dict:
    """The args fields every decoder family reads, after refusing what none implements
    (another model_type, an unknown key, another activation, biases, attention dropout)."""
    expect(cfg, "model_type", (model_type,), f"not a {family} checkpoint: use the family of its model_type")
    check_keys(cfg, DECODER_KEYS | extra_keys, family)
    expect(cfg, "hidden_act", ("silu",), "the FFN is SwiGLU: only silu is implemented")
    expect(cfg, "attention_bias", (False,), "q/k/v/o projections with biases are not implemented")
    expect(cfg, "attention_dropout", (0.0, 0), "attention dropout is not implemented")
    return {
        "dim": cfg["hidden_size"],
        "n_layers": cfg["num_hidden_layers"],
        "n_heads": cfg["num_attention_heads"],
        "n_kv_heads": cfg.get("num_key_value_heads"),
        "vocab_size": cfg["vocab_size"],
        "ffn_dim": cfg["intermediate_size"],
        "norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "max_seq_len": cfg.get("max_position_embeddings", default_max_positions),
        "tie_embeddings": cfg.get("tie_word_embeddings", False),
        **rope_args(rope_of(cfg, default_theta=10000.0)),
    }


def rope_entries(args) -> dict:
    """The RoPE keys of a config.json for `args`, in the installed transformers' format
    (transformers 5: rope_parameters; 4, or none installed: rope_theta + rope_scaling,
    which transformers 5 also reads)."""
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling_factor is not None:
        rope = {
            "rope_type": "llama3",
            "rope_theta": args.rope_theta,
            "factor": args.rope_scaling_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
        }
    if transformers_major() >= 5:
        return {"rope_parameters": rope}
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_theta": args.rope_theta, "rope_scaling": scaling if args.rope_scaling_factor else None}


def transformers_major() -> int:
    """The installed transformers' major version (0 when it is not installed)."""
    try:
        return int(importlib.metadata.version("transformers").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return 0


_NOT_SHAPE = {
    "max_seq_len",
    "multiple_of",
    "ffn_dim_multiplier",
    "ffn_dim",
    "n_kv_heads",
}  # derived or RoPE-table length
_SCALING = ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len")


def check_compatible(checkpoint_args, recipe_args) -> list[str]:
    """What differs between a checkpoint's model and the recipe's (empty when they match):
    every shape and numeric field of the args, FFN width and kv heads as resolved."""
    keys = [f.name for f in dataclasses.fields(checkpoint_args) if f.name not in _NOT_SHAPE]
    keys += ["kv_heads", "ffn_hidden_dim"]
    if checkpoint_args.rope_scaling_factor is None and recipe_args.rope_scaling_factor is None:
        keys = [k for k in keys if k not in _SCALING]
    return [
        f"{k}: checkpoint {getattr(checkpoint_args, k)}, recipe {getattr(recipe_args, k)}"
        for k in keys
        if getattr(checkpoint_args, k) != getattr(recipe_args, k)
    ]
