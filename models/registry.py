"""Model registry: family name -> ModelSpec (one line per family, its folder holds the rest),
and a recipe's [model] section -> model args.

Flavors carry the exact published shapes; recipes may override single fields
(model.n_layers=2, ...) to run a GPU recipe on a laptop.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from omegaconf import ListConfig

from meshforge.configs.schema import ModelConfig
from meshforge.core.errors import UnsupportedConfig

from . import deepseek_v3, llama3, qwen3, qwen3_moe
from .common.hf_config import read_config
from .common.spec import ModelSpec

MODELS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Add a family (its folder's SPEC) under its name; a name taken by another spec is refused."""
    if MODELS.get(spec.name, spec) is not spec:
        raise ValueError(f"model family {spec.name!r} is registered already; pick another name")
    MODELS[spec.name] = spec
    return spec


register(llama3.SPEC)
register(qwen3.SPEC)
register(qwen3_moe.SPEC)
register(deepseek_v3.SPEC)


def get_model_spec(name: str) -> ModelSpec:
    return MODELS[name]


def spec_of(args: Any) -> ModelSpec:
    """The family whose args `args` are: the most derived args type that matches (Qwen3-MoE's args
    are Qwen3's and more)."""
    found = [spec for spec in MODELS.values() if isinstance(args, spec.args_type)]
    if found:
        return max(found, key=lambda spec: len(spec.args_type.__mro__))
    raise TypeError(
        f"{type(args).__name__} is not the args type of any registered family ({', '.join(MODELS)})"
    )


def model_args(name: str, flavor: str, overrides: dict[str, Any] | None = None) -> Any:
    """The flavor's args with the non-None overrides applied."""
    base = MODELS[name].flavors[flavor]
    return dataclasses.replace(base, **{k: v for k, v in (overrides or {}).items() if v is not None})


_NOT_ARGS = (
    "name",
    "flavor",
    "hf",
    "capacity_factor",
)  # capacity_factor: refused (dropless), meshforge/recipe/


def overrides_of(cfg: ModelConfig) -> dict[str, Any]:
    """The [model] fields the recipe sets (not None), besides name, flavor and hf."""
    return {
        f.name: tuple(value) if isinstance(value, (list, ListConfig)) else value
        for f in dataclasses.fields(cfg)
        if f.name not in _NOT_ARGS and (value := getattr(cfg, f.name)) is not None
    }


def unknown_overrides(cfg: ModelConfig) -> list[str]:
    """Overrides the family's args have no field for (e.g. head_dim for llama3)."""
    names = {f.name for f in dataclasses.fields(MODELS[cfg.name].args_type)}
    return [k for k in overrides_of(cfg) if k not in names]


def family_of_hf(folder: str | Path) -> str:
    """The registered family whose HF model_type the folder's config.json names."""
    model_type = read_config(Path(folder)).get("model_type")
    for spec in MODELS.values():
        if spec.adapter.hf_model_type == model_type:
            return spec.name
    known = ", ".join(f"{s.adapter.hf_model_type} ({s.name})" for s in MODELS.values())
    raise UnsupportedConfig(
        f"config.json: model_type = {model_type!r}: no registered family reads it; known: {known}"
    )


def args_from_config(cfg: ModelConfig) -> Any:
    """Model args for a recipe's [model] section: the flavor's (or, with model.hf, the HF
    folder's config.json's), with the size overrides applied."""
    spec = MODELS[cfg.name]
    base = spec.adapter.read_hf_args(Path(cfg.hf)) if cfg.hf else spec.flavors[cfg.flavor]
    return dataclasses.replace(base, **overrides_of(cfg))
