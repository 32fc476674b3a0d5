"""Mesh-independent weight initialisation of a (meta-device, possibly parallelized) model.

Each parameter's full value is drawn on the CPU from a generator seeded by (seed, name),
then this rank keeps its shard (`distribute_tensor` slices locally; no communication).
So the same recipe and seed give bit-identical weights on every mesh and device, and
only one full parameter is ever in host memory at a time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
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
    to_empty(model, param_device)
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


def to_empty(model: nn.Module, device: torch.device | str) -> None:
    """`model.to_empty(device)` that keeps tied parameters tied (see `retie`)."""
    shared = shared_parameters(model)
    model.to_empty(device=device)
    retie(model, shared)


def shared_parameters(model: nn.Module) -> list[list[str]]:
    """The names of every parameter registered under several (tied embeddings: the output
    projection's weight is the token embedding's), first name first."""
    names: dict[int, list[str]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(fqn)
    return [fqns for fqns in names.values() if len(fqns) > 1]


def retie(model: nn.Module, shared: list[list[str]]) -> None:
    """Register one parameter under all its names again. `to_empty` (like `Module._apply` for
    a move it cannot do in place, meta -> a device) gives each module its own new tensor, which
    would silently untie the weights: two parameters, each trained on half the gradient."""
    for first, *others in shared:
        param = model.get_parameter(first)
        for fqn in others:
            owner, _, name = fqn.rpartition(".")
            module = model.get_submodule(owner)
            if module._parameters[name] is not param:
                module._parameters[name] = param


def check_parameter_count(
    parts: list[nn.Module], expected: int, device: torch.device, pp_group=None, tied=None
) -> None:
    """Every parameter of the model is trained exactly once across this rank's pipeline (a
    DTensor counts at its global size; a weight tied across stages, `tied`, once): an
    untied weight or a lost one would be a silently different model, so the run stops here."""
    skip = tied.norm_skips() if tied is not None else set()
    unique = {id(p): p for part in parts for p in part.parameters() if id(p) not in skip}
    count = torch.tensor(float(sum(p.numel() for p in unique.values())), dtype=torch.float64, device=device)
    if pp_group is not None:
        dist.all_reduce(count, group=pp_group)
    if int(count) != expected:
        raise RuntimeError(
            f"the parallelized model trains {int(count):,} parameters, the model has {expected:,}: "
            "a tied or shared weight came apart (a meshforge bug: please report it with the recipe)"
        )
