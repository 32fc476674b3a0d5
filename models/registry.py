"""Model registry: family name -> ModelSpec, and a recipe's [model] section -> model args.

Flavors carry the exact published shapes; recipes may override single fields
(model.n_layers=2, ...) to run a GPU recipe on a laptop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshforge.configs.schema import ModelConfig

from . import llama_family
from .spec import ModelSpec

MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (llama_family.SPEC,)}


def get_model_spec(name: str) -> ModelSpec:
    return MODELS[name]


def spec_of(args: Any) -> ModelSpec:
    """The family whose args `args` are."""
    for spec in MODELS.values():
        if isinstance(args, spec.args_type):
            return spec
    raise TypeError(
        f"{type(args).__name__} is not the args type of any registered family ({', '.join(MODELS)})"
    )


def model_args(name: str, flavor: str, overrides: dict[str, Any] | None = None) -> Any:
    """The flavor's args with the non-None overrides applied."""
    base = MODELS[name].flavors[flavor]
    return dataclasses.replace(base, **{k: v for k, v in (overrides or {}).items() if v is not None})


def args_from_config(cfg: ModelConfig) -> Any:
    """Model args for a recipe's [model] section (flavor + size overrides)."""
    overrides = {
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("name", "flavor")
    }
    return model_args(cfg.name, cfg.flavor, overrides)
