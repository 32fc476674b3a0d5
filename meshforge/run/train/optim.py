"""The optimizer and the learning-rate schedule, from their own recipe sections."""

from __future__ import annotations

import logging
import math

import torch
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from meshforge.configs.schema import LRSchedulerConfig, OptimizerConfig

log = logging.getLogger(__name__)


def fused_unavailable(params: list[torch.Tensor]) -> str | None:
    """Why torch's fused AdamW cannot take these parameters (None: it can). DTensors are
    fine (the kernel runs on their local shards), but not mixed with plain tensors in one call."""
    supported = _get_fused_kernels_supported_devices()
    if len({isinstance(p, DTensor) for p in params}) > 1:
        return "DTensor and plain parameters mixed (e.g. TP without sequence parallel leaves the norms plain)"
    for p in params:
        if p.device.type not in supported:
            return f"no fused AdamW kernel for {p.device.type} tensors (torch has one for {supported})"
        if not torch.is_floating_point(p):
            return f"a {p.dtype} parameter (fused AdamW takes floating-point tensors)"
    return None


def resolved_implementation(params: list[torch.Tensor], asked: str) -> tuple[str, str | None]:
    """The AdamW implementation a run steps these parameters with, and why it is not the one
    asked (None: it is): fused where torch's kernel takes them, else foreach, else for-loop."""
    if asked == "fused" and (why := fused_unavailable(params)):
        # foreach cannot mix DTensors and plain tensors in one list either
        return ("for-loop" if why.startswith("DTensor and plain") else "foreach"), why
    return asked, None


def build_optimizer(
    params, cfg: OptimizerConfig, implementation: str | None = None, quiet: bool = False
) -> torch.optim.Optimizer:
    """AdamW as the recipe asks: `fused` (TorchTitan's default: one kernel per step, on CPU
    as on CUDA), falling back, with the reason logged (unless `quiet`), where it cannot run."""
    params = list(params)
    impl, why = resolved_implementation(params, implementation or cfg.implementation)
    if why and not quiet:
        log.warning("optimizer.implementation = fused: %s; using %s", why, impl)
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=impl == "fused" or None,
        foreach=impl == "foreach" if impl != "fused" else None,
    )


def lr_multiplier(step: int, total: int, cfg: LRSchedulerConfig) -> float:
    """The lr of optimizer step `step` (from 0) as a fraction of the peak lr. TorchTitan's
    convention: warmup to (step+1)/W, then cosine/linear decay to min_lr_ratio from step W."""
    if cfg.convention == "deepspeed":
        return deepspeed_multiplier(step - 1, total, cfg)
    if step < cfg.warmup_steps:
        return cfg.warmup_start + (1 - cfg.warmup_start) * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    floor = cfg.min_lr_ratio
    if cfg.decay == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.decay == "linear":
        return 1 - (1 - floor) * progress
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
