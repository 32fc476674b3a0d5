"""Mesh-independent weight initialisation of a (meta-device, possibly parallelized) model.

Each parameter's full value is drawn on the CPU from a generator seeded by (seed, name),
then this rank keeps its shard (`distribute_tensor` slices locally; no communication).
So the same recipe and seed give bit-identical weights on every mesh and device, and
only one full parameter is ever in host memory at a time.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, seed: int, params_on_cpu: bool = False) -> None:
    """Allocate `model` on `device` and fill every parameter as the unsharded model would be.
    With `params_on_cpu` (FSDP's CPU offload, which requires it) parameters live on the CPU
    and only the buffers on `device`.

    The model provides `init_param(fqn, full_tensor, seed)` and `init_buffers(device)`.
    """
    param_device = torch.device("cpu") if params_on_cpu else device
    model.to_empty(device=param_device)
    for fqn, param in model.named_parameters():
        full = torch.empty(param.shape, dtype=torch.float32)  # a DTensor reports its global shape
        model.init_param(fqn, full, seed)
        full = full.to(device=param_device, dtype=param.dtype)
        if isinstance(param, DTensor):
            local = distribute_tensor(
                full, param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)
    model.init_buffers(device)
