"""Model registry: (name, flavor) -> model args and constructor.

Flavors carry the exact published shapes; recipes may override single fields
(model.n_layers=2, ...) to run a GPU recipe on a laptop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from .llama import LlamaArgs, Transformer
from .llama_tp_plan import block_plan, top_level_plan


@dataclass(frozen=True)
class ModelSpec:
    name: str
    flavors: dict[str, Any]
    build: Callable[[Any], nn.Module]
    tp_top_level_plan: Callable[..., dict]
    tp_block_plan: Callable[..., dict]


LLAMA3_FLAVORS: dict[str, LlamaArgs] = {
    # tiny: trains on a CPU in seconds; 4 layers so pp=2 x 2 virtual stages still works
    "debug": LlamaArgs(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32,
        rope_theta=10000.0, rope_scaling_factor=None, max_seq_len=512,
    ),
    # Llama-3.2-1B: 1,235,814,400 parameters (tied embeddings)
    "1b": LlamaArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
        multiple_of=256, ffn_dim_multiplier=1.5, rope_theta=500000.0,
        rope_scaling_factor=32.0, max_seq_len=131072, tie_embeddings=True,
    ),
    # Llama-3.2-3B: 3,212,749,824 parameters (tied embeddings)
    "3b": LlamaArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256,
        multiple_of=256, ffn_dim_multiplier=1.0, rope_theta=500000.0,
        rope_scaling_factor=32.0, max_seq_len=131072, tie_embeddings=True,
    ),
    # Llama-3.1-8B: 8,030,261,248 parameters
    "8b": LlamaArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
        multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0,
        rope_scaling_factor=8.0, max_seq_len=131072,
    ),
    # Llama-3.1-70B: 70,553,706,496 parameters
    "70b": LlamaArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
        multiple_of=4096, ffn_dim_multiplier=1.3, rope_theta=500000.0,
        rope_scaling_factor=8.0, max_seq_len=131072,
    ),
}

MODELS: dict[str, ModelSpec] = {
    "llama3": ModelSpec("llama3", LLAMA3_FLAVORS, Transformer, top_level_plan, block_plan),
}


def get_model_spec(name: str) -> ModelSpec:
    return MODELS[name]


def model_args(name: str, flavor: str, overrides: dict[str, Any] | None = None) -> Any:
    """The flavor's args with the non-None overrides applied."""
    base = MODELS[name].flavors[flavor]
    return dataclasses.replace(base, **{k: v for k, v in (overrides or {}).items() if v is not None})


def args_from_config(cfg) -> Any:
    """Model args for a recipe's [model] section (flavor + size overrides)."""
    overrides = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("name", "flavor")}
    return model_args(cfg.name, cfg.flavor, overrides)
