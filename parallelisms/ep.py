"""Expert parallelism (the `ep` mesh dim): each ep rank holds num_experts / ep whole experts and
computes them for the tokens of every rank of its ep group.

ep borrows its ranks from dp_shard x cp (they hold different tokens): the experts' weights become
DTensors sharded over ep (Shard(0), so checkpoints keep global shapes and load on any ep), and
FSDP shards them again over the rest of those ranks (`dp_shard_mod_ep`, parallelisms/fsdp.py).
A step's MoE sorts its token copies by expert; the dispatcher exchanges the per-expert counts with
one all-to-all (counts first, so every rank knows what it will receive), sends each token to the
rank holding its expert with a second (autograd) all-to-all, regroups what arrived from (source
rank, expert) order into (expert, source rank) order for the grouped matmul, and sends the results
back the same way. Dropless: every row sent is computed and returned.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from meshforge.configs import ACPolicy
from meshforge.core.errors import Problem
from meshforge.core.topology import ParallelDims, divisors
from meshforge.models.common.moe import GroupedExperts, balanced, has_experts, moe_layers


class ExpertParallel:
    """The MoE's dispatcher under ep (see the module doc). `__call__(x, counts, experts)`: x (N, D)
    sorted by global expert, `counts` (E,) rows per expert -> the experts' outputs in x's order."""

    def __init__(self, group: dist.ProcessGroup, ep: int, num_experts: int):
        self.group, self.ep, self.local = group, ep, num_experts // ep

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [source rank][local expert]
        by_source = received.view(self.ep, self.local)
        if isinstance(counts, FakeTensor):  # the estimator's trace has no values: balanced routing
            send = recv = balanced(x.shape[0], self.ep)
            order = torch.arange(sum(recv), device=x.device)
        else:
            send, recv = torch.stack([counts, received]).view(2, self.ep, -1).sum(2).tolist()
            order = expert_major_order(by_source)
        tokens = funcol.all_to_all_single_autograd(x, recv, send, self.group)
        out = experts(tokens[order], by_source.sum(0))
        back = torch.empty_like(out).index_copy_(0, order, out)  # (source rank, expert) order again
        return funcol.all_to_all_single_autograd(back, send, recv, self.group)


def expert_major_order(by_source: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder rows laid out in blocks [source rank][expert] (`by_source`: the
    rows per block) into [expert][source rank] blocks."""
    sizes = by_source.flatten()
    starts = (torch.cumsum(sizes, 0) - sizes).view_as(by_source)
    sizes_t, starts_t = by_source.t().flatten(), starts.t().flatten()
    first_of_block = torch.repeat_interleave(starts_t, sizes_t)
    offset_in_block = torch.arange(first_of_block.numel(), device=sizes.device) - torch.repeat_interleave(
        torch.cumsum(sizes_t, 0) - sizes_t, sizes_t
    )
    return first_of_block + offset_in_block


def check_ep(dims: ParallelDims, args, ac: ACPolicy) -> list[Problem]:
    """What expert parallel needs: a model with sparse layers, an ep that divides both the dp_shard
    x cp ranks it borrows and the experts it splits whole, and no per-op AC (torch 2.13)."""
    if not dims.ep_enabled:
        return []
    if not has_experts(args):
        return [
            Problem(
                "mesh.ep", dims.ep, "the model has no sparse layer to split: set mesh.ep=1 (or a MoE model)"
            )
        ]
    valid = divisors(math.gcd(dims.fsdp_shard, args.num_experts))
    problems = []
    if dims.ep not in valid:
        problems.append(
            Problem(
                "mesh.ep",
                dims.ep,
                f"borrows its ranks from dp_shard x cp = {dims.fsdp_shard} and splits num_experts = "
                f"{args.num_experts} whole: it must divide both; valid ep: {', '.join(map(str, valid))}",
            )
        )
    if ac.per_op:
        problems.append(
            Problem(
                "activation_checkpoint.mode",
                "op",
                "per-op AC with expert parallel fails on torch 2.13 (the experts' own FSDP group gathers "
                "again in the recompute, so the recompute runs other ops than the forward): use "
                "mode=full or selective, or mesh.ep=1",
            )
        )
    return problems


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE's experts of `model` (a meta-device model or pipeline stage) over `ep_mesh`
    and route its tokens through an `ExpertParallel` dispatcher."""
    ep = ep_mesh.size()
    for moe in moe_layers(model).values():
        experts = moe.experts
        for name, param in list(experts.named_parameters()):
            local = torch.empty(
                (param.shape[0] // ep, *param.shape[1:]), dtype=param.dtype, device=param.device
            )
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(sharded))
        moe.dispatcher = ExpertParallel(ep_mesh.get_group(), ep, moe.num_experts)
