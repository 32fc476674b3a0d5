"""The optimizer (meshforge/run/optimizers/, one file each) over the parameter groups [optimizer] asks for,
and the learning-rate schedule, from their own recipe sections."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from meshforge.configs.schema import LRSchedulerConfig, OptimizerConfig
from meshforge.run.optimizers import OPTIMIZERS
from meshforge.run.optimizers.adamw import fused_unavailable, resolved_implementation
from meshforge.run.optimizers.kinds import param_kind
from meshforge.run.optimizers.muon import adamw_reason

__all__ = ["build_optimizer", "fused_unavailable", "resolved_implementation", "parameter_groups"]


def parameter_groups(named: list[tuple[str, torch.Tensor]], cfg: OptimizerConfig) -> list[dict]:
    """The parameters grouped by (weight decay, lr) under optimizer.no_decay and
    optimizer.lr_multipliers, in first-seen order; each group keeps its parameters' names and kinds."""
    groups: dict[tuple[float, float], dict] = {}
    for name, p in named:
        kind = param_kind(name)
        wd = 0.0 if kind in cfg.no_decay else cfg.weight_decay
        lr = cfg.lr * cfg.lr_multipliers.get(kind, 1.0)
        g = groups.setdefault(
            (wd, lr), {"params": [], "weight_decay": wd, "lr": lr, "names": [], "kinds": []}
        )
        g["params"].append(p)
        g["names"].append(name)
        if kind not in g["kinds"]:
            g["kinds"].append(kind)
    return list(groups.values())


def group_summary(named: list[tuple[str, torch.Tensor]], cfg: OptimizerConfig) -> list[dict]:
    """The parameter groups as run.json and W&B record them: the kinds of parameter, weight decay,
    lr and tensor count of each (Muon: how many of them it orthogonalises; the rest take AdamW)."""
    out = []
    for g in parameter_groups(named, cfg):
        row = {
            "kinds": g["kinds"],
            "weight_decay": g["weight_decay"],
            "lr": g["lr"],
            "n_tensors": len(g["params"]),
        }
        if cfg.name == "muon":
            row["muon_tensors"] = sum(adamw_reason(n, p) is None for n, p in zip(g["names"], g["params"]))
        out.append(row)
    return out


def build_optimizer(
    params: Iterable, cfg: OptimizerConfig, implementation: str | None = None, quiet: bool = False
) -> torch.optim.Optimizer:
    """optimizer.name's optimizer over `params`: (name, parameter) pairs (a module's
    named_parameters(); Muon and the groups read the names), or bare parameters, named by position."""
    named = [p if isinstance(p, tuple) else (f"param{i}", p) for i, p in enumerate(params)]
    groups = parameter_groups(named, cfg)
    names = {id(p): n for g in groups for n, p in zip(g["names"], g["params"])}
    for g in groups:
        del g["names"], g["kinds"]
    opt = OPTIMIZERS[cfg.name](groups, names, cfg, implementation, quiet)
    opt.names = names  # id(parameter) -> name: the estimator rebuilds the run's optimizer from these
    return opt


def lr_multiplier(step: int, total: int, cfg: LRSchedulerConfig) -> float:
    """The lr of optimizer step `step` (from 0) as a fraction of the peak lr. TorchTitan's
    convention: warmup to (step+1)/W, then decay to min_lr_ratio from step W (with decay_ratio, from
    step steps - round(steps * decay_ratio), the lr at its peak between)."""
    if cfg.convention == "deepspeed":
        return deepspeed_multiplier(step - 1, total, cfg)
    if step < cfg.warmup_steps:
        return cfg.warmup_start + (1 - cfg.warmup_start) * (step + 1) / cfg.warmup_steps
    decay_steps = total - cfg.warmup_steps  # TorchTitan 0.3's linear_warmup_stable_decay, rearranged
    if cfg.decay_ratio is not None:
        decay_steps = min(round(total * cfg.decay_ratio), decay_steps)
    progress = min(1.0, max(0.0, (step - (total - decay_steps)) / max(1, decay_steps)))
    floor = cfg.min_lr_ratio
    if cfg.decay == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.decay == "linear":
        return 1 - (1 - floor) * progress
    if cfg.decay == "sqrt":
        return floor + (1 - floor) * (1 - math.sqrt(progress))
    return 1.0


def deepspeed_multiplier(iteration: int, total: int, cfg: LRSchedulerConfig) -> float:
    """DeepSpeed's WarmupLR (decay constant), WarmupDecayLR (linear) and WarmupCosineLR (cosine)
    at its `last_batch_iteration`, as deepspeed/runtime/lr_schedules.py (0.19) computes them.
    Its engine steps the schedule after each optimizer step, so step s runs at iteration s - 1."""
    start, warmup = cfg.warmup_start, max(2, cfg.warmup_steps)  # DeepSpeed warms up >= 2 steps
    if iteration < 0:  # the value set at construction: WarmupCosineLR's is 0, the others' their min lr
        return 0.0 if cfg.decay == "cosine" else start
    if iteration < warmup:
        if cfg.warmup_shape == "log":
            rise = 1.0 / math.log(warmup) * math.log(iteration + 1)
        else:
            rise = iteration / warmup
        return start + (1 - start) * rise
    floor = cfg.min_lr_ratio
    if cfg.decay == "cosine":  # counts decay steps from 1 (TorchTitan from 0)
        progress = min(1.0, (iteration - warmup + 1) / max(1, total - warmup))
        return max(0.0, floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)
    if cfg.decay == "linear":  # WarmupDecayLR decays to its warmup_min_lr (the importer's min_lr_ratio)
        return floor + (1 - floor) * max(0.0, (total - iteration) / max(1.0, total - warmup))
    return 1.0


def build_lr_scheduler(
    opt: torch.optim.Optimizer, total_steps: int, cfg: LRSchedulerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, total_steps, cfg))
