"""meshforge.models: TorchTitan-style transformers, each family registered with everything
about itself (models/spec.py), and the registry of their shapes."""

from .llama import LlamaArgs, Transformer, count_params
from .registry import (
    MODELS,
    args_from_config,
    family_of_hf,
    get_model_spec,
    model_args,
    spec_of,
    unknown_overrides,
)
from .spec import ModelSpec

__all__ = [
    "LlamaArgs",
    "ModelSpec",
    "Transformer",
    "count_params",
    "MODELS",
    "get_model_spec",
    "model_args",
    "args_from_config",
    "family_of_hf",
    "spec_of",
    "unknown_overrides",
]
