"""AdamW (torch.optim.AdamW): fused where torch has the kernel, else foreach, else for-loop."""

from __future__ import annotations

import logging

import torch
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from meshforge.configs.schema import OptimizerConfig

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


def build(
    groups: list[dict],
    names: dict[int, str],
    cfg: OptimizerConfig,
    implementation: str | None = None,
    quiet: bool = False,
) -> torch.optim.Optimizer:
    """AdamW as the recipe asks: `fused` (TorchTitan's default: one kernel per step, on CPU
    as on CUDA), falling back, with the reason logged (unless `quiet`), where it cannot run."""
    params = [p for g in groups for p in g["params"]]
    impl, why = resolved_implementation(params, implementation or cfg.implementation)
    if why and not quiet:
        log.warning("optimizer.implementation = fused: %s; using %s", why, impl)
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=impl == "fused" or None,
        foreach=impl == "foreach" if impl != "fused" else None,
    )


def initial_state(p: torch.Tensor, fused: bool) -> dict:
    """AdamW's state for `p` as torch.optim.AdamW lays it out: the step counter (on the parameter's
    device for the fused kernel, on the host otherwise) and the two moments."""
    step = torch.zeros((), dtype=torch.float32, device=p.device) if fused else torch.tensor(0.0)
    return {
        "step": step,
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }


def steady_state(group: dict, p: torch.Tensor) -> dict:
    """AdamW's step counter and its two moments."""
    return initial_state(p, fused=False)
