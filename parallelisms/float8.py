"""Float8 training of the linear layers with torchao: each chosen `nn.Linear` becomes torchao's
`Float8Linear`, whose matmuls (forward, input gradient, weight gradient) run in float8 with
scales computed from each tensor on the fly, while the weight, its gradient and the optimizer
stay in high precision. Applied first (parallelize.py): TP and FSDP then shard a Float8Linear as
any Linear, and its scales see the whole tensor (DTensor reduces the amax over the shards).

Kept in high precision: what `float8.exclude` names (the output head by default: the logits'
precision), MoE routers (a routing decision must not flip on a rounding) and experts (grouped
weights, not Linears), and any layer with a dim not divisible by 16 (float8 matmuls need it).

On a CPU the matmuls run in torchao's emulation: the same float8-rounded operands and scales,
multiplied in fp32. CPU float8 `_scaled_mm` is a reference kernel ~300x slower than fp32 with no
numerical gain (it too accumulates exactly in fp32); emulation differs from it only in rounding
order, and in not rounding a rowwise output to bf16 (a CUDA kernel's limitation torchao works around)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging

import torch
from torch import nn

from meshforge.configs import Problem
from meshforge.configs.parallelism import FLOAT8_RECIPES, Float8Config
from meshforge.models import get_model_spec

ALWAYS_KEPT = ("router",)  # a module under one of these names stays in high precision


def float8_layers(model: nn.Module, cfg: Float8Config) -> list[str]:
    """The FQNs of the linear layers `cfg` converts (before any conversion)."""
    return [fqn for fqn, module in model.named_modules() if _chosen(module, fqn, cfg)]


def _chosen(module: nn.Module, fqn: str, cfg: Float8Config) -> bool:
    if not isinstance(module, nn.Linear):
        return False
    names = fqn.split(".")
    if any(n in names for n in ALWAYS_KEPT):
        return False
    if any(fqn == e or fqn.endswith("." + e) for e in cfg.exclude):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: nn.Module, cfg: Float8Config, device_type: str = "cuda") -> list[str]:
    """Swap the chosen linear layers of `model` (meta or real) for torchao's Float8Linear with
    the recipe's scaling, emulated when the model runs on a CPU (module doc); returns their FQNs."""
    with _quiet_import():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = float8_layers(model, cfg)
    config = Float8LinearConfig.from_recipe_name(cfg.recipe)
    convert_to_float8_training(
        model,
        config=dataclasses.replace(config, emulate=device_type == "cpu"),
        module_filter_fn=lambda module, fqn: fqn in chosen,
    )
    return chosen


@contextlib.contextmanager
def _quiet_import():
    """torchao's import, without its two harmless lines on every rank: its CUDA kernels do not
    load on a CPU build (float8 training does not use them), and a deprecation inside torchao."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def check_float8(cfg: Float8Config, backend: str, param_dtype: str, family: str, args) -> list[Problem]:
    """float8's rules: a recipe torchao has, the torch backend, no fp16 (its loss scale and
    float8's scales are not composed here), torchao installed, every `exclude` entry naming a
    linear layer, and a layer left to convert (the `family` model built from `args` on the meta
    device; None args: the model is refused already)."""
    if not cfg.enabled:
        return []
    with torch.device("meta"):
        model = get_model_spec(family).build(args) if args is not None else None
    problems = []
    if cfg.recipe not in FLOAT8_RECIPES:
        problems.append(
            Problem("float8.recipe", cfg.recipe, f"torchao's recipes: {', '.join(FLOAT8_RECIPES)}")
        )
    if backend != "torch":
        problems.append(
            Problem("backend", backend, "float8 training is torchao's, torch-only: backend=torch")
        )
    if param_dtype == "float16":
        problems.append(
            Problem(
                "fsdp.param_dtype",
                "float16",
                "float8 with fp16's loss scale is not implemented (the scaled gradients would set float8's "
                "scales); use bfloat16 or float32",
            )
        )
    if importlib.util.find_spec("torchao") is None:
        problems.append(
            Problem("float8.enabled", True, "needs torchao: pip install torchao (or the [float8] extra)")
        )
    linears = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)] if model else []
    if unknown := [
        e for e in cfg.exclude if linears and not any(f == e or f.endswith("." + e) for f in linears)
    ]:
        problems.append(
            Problem(
                "float8.exclude",
                unknown,
                "names no linear layer (a name matches a layer's own name or its ending: output, wq, "
                "attention.wq, layers.0.feed_forward.w1; a parent such as attention matches none)",
            )
        )
    if model is not None and not float8_layers(model, cfg):
        problems.append(
            Problem(
                "float8.enabled",
                True,
                f"no linear layer qualifies (float8.exclude = {cfg.exclude}, and a layer needs both dims "
                "divisible by 16): nothing would train in float8; widen the model or set enabled=false",
            )
        )
    return problems
