"""What one training step is made of, for the trainer and the estimator alike: the loss (a
sum, normalised by the caller), the context forward and backward run under, and the
gradient norm across every mesh."""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from meshforge.configs.schema import FSDPConfig, TPConfig
from meshforge.core.topology import ParallelDims
from meshforge.parallelisms.fsdp import DTYPES, fsdp_applies

IGNORE_INDEX = -100


class _SequentialNormReduction(logging.Filter):
    """Drops DTensor's note that a grad norm over a 2-D mesh (FSDP x TP) takes two all-reduces.
    Why it is safe to drop: the reduced value is one fp32 scalar, all-reduce hands every rank the
    same result, and two collectives of 4 bytes cost nothing next to the step; the message
    otherwise repeats on every rank of every 2-D run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_reduce operations will be performed" not in record.getMessage()


@contextlib.contextmanager
def _quiet_sequential_norm_reduction():
    """The filter above on DTensor's redistribute logger, only while a grad norm is reduced."""
    logger, quiet = logging.getLogger("torch.distributed.tensor._redistribute"), _SequentialNormReduction()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of token cross-entropies: the caller divides by the global count."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )


@dataclass(frozen=True)
class StepPolicy:
    """How a step's forward and backward run: loss parallel (logits sharded over tp), and
    autocast when reduced precision has no FSDP MixedPrecisionPolicy to carry it."""

    loss_parallel: bool = False
    autocast_dtype: torch.dtype | None = None

    @classmethod
    def of(cls, dims: ParallelDims, tp: TPConfig, fsdp: FSDPConfig) -> StepPolicy:
        autocast = not fsdp_applies(dims, fsdp) and fsdp.param_dtype != "float32"
        return cls(dims.tp_enabled and tp.loss_parallel, DTYPES[fsdp.param_dtype] if autocast else None)

    def context(self, device_type: str) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.loss_parallel:
            stack.enter_context(loss_parallel())
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(device_type, dtype=self.autocast_dtype))
        return stack


@torch.no_grad()
def clip_grad_norm(
    params: list[torch.Tensor],
    max_norm: float,
    pp_group=None,
    unscale: float = 1.0,
    skip: set[int] = frozenset(),
) -> torch.Tensor:
    """Global L2 norm of all gradients (clipped to max_norm if > 0), correct on every mesh.

    Norms are taken per DeviceMesh, since torch refuses to combine DTensors of two
    meshes (FSDP x TP without sequence parallel has both), then summed in squares and,
    under pipeline parallel, across stages. Gradients of a loss scaled by S come with
    `unscale` = 1/S: the norm is reported unscaled and the division rides on the clipping
    multiply. An inf or nan gradient anywhere makes the norm non-finite on every rank.
    Parameters whose ids are in `skip` are clipped but not counted (a tied weight's second copy).
    """
    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict = defaultdict(list)
    for p in params:
        if p.grad is not None and id(p) not in skip:
            by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p.grad)
    device = grads[0].device if grads else torch.device("cpu")
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    with _quiet_sequential_norm_reduction():
        for group in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(group, 2.0)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            total_sq += norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt() * unscale
    coef = unscale
    if max_norm > 0:
        coef *= min(1.0, max_norm / (float(total) + 1e-6))
    if coef != 1.0:
        for g in grads:
            g.mul_(coef)
    return total
