"""meshforge.models: TorchTitan-style transformers, one folder per family (its module, TP plan,
JAX twin and weight adapter, registered as a ModelSpec: models/common/spec.py), the pieces they
share (models/common/) and the registry of their shapes."""

from .common.decoder import Transformer, count_params
from .common.spec import ModelSpec
from .registry import (
    MODELS,
    args_from_config,
    family_of_hf,
    get_model_spec,
    model_args,
    register,
    spec_of,
    unknown_overrides,
)

__all__ = [
    "ModelSpec",
    "Transformer",
    "count_params",
    "MODELS",
    "get_model_spec",
    "model_args",
    "register",
    "args_from_config",
    "family_of_hf",
    "spec_of",
    "unknown_overrides",
]
