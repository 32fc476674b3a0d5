"""The optimizer and the learning-rate schedule, from their own recipe sections."""

from __future__ import annotations

import math

import torch

from meshforge.configs.schema import LRSchedulerConfig, OptimizerConfig


def build_optimizer(params, cfg: OptimizerConfig, foreach: bool | None = None) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=foreach
    )


def lr_multiplier(step: int, total: int, cfg: LRSchedulerConfig) -> float:
    """Linear warmup to 1, then cosine/linear decay to min_lr_ratio (step counts from 0)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    floor = cfg.min_lr_ratio
    if cfg.decay == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.decay == "linear":
        return 1 - (1 - floor) * progress
    return 1.0


def build_lr_scheduler(
    opt: torch.optim.Optimizer, total_steps: int, cfg: LRSchedulerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, total_steps, cfg))
