"""Tied embeddings across pipeline stages (Megatron's and DeepSpeed's TiedLayerSpec way).

The token embedding lives on the first stage and the output projection on the last, each
holding a copy of the one tied weight. Both copies start equal (the output draws its value
from the embedding's name, `init_param`) and stay equal: after backward their gradients are
summed over a group of the first- and last-stage ranks of each pipeline, so both take the
same update. A V schedule holds both stages on one rank: the sum is local. The copy on the
last stage is left out of the gradient norm, which counts the weight once, and checkpoints
store it once, under the embedding's name (run/checkpoint/dcp.py: `tied_alias`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshforge.configs.schema import PPConfig
from meshforge.core.tensors import local_tensor
from meshforge.core.topology import MESH_DIMS

from .pp import stage_ids_for_rank

EMBEDDING, OUTPUT = "tok_embeddings.weight", "output.weight"


class TiedAcrossStages:
    """This rank's copies of a weight tied across pipeline stages (the first stage's
    embedding, the last stage's output, or both under a V schedule) and their gradients' sum.
    Holding neither (a middle stage, an untied or unpipelined model), every method is a no-op."""

    def __init__(
        self,
        first: nn.Module | None = None,
        last: nn.Module | None = None,
        group=None,
        device: torch.device | None = None,
    ):
        self.first, self.last, self.group, self.device = first, last, group, device

    # read when used: FSDP and materializing register new parameter objects on the modules
    @property
    def embedding(self) -> nn.Parameter | None:
        return self.first.tok_embeddings.weight if self.first is not None else None

    @property
    def output(self) -> nn.Parameter | None:
        return self.last.output.weight if self.last is not None else None

    def norm_skips(self) -> set[int]:
        """ids of the parameters the gradient norm leaves out to count the weight once: the
        output copy (the embedding copy, on this rank or the first stage's, is counted)."""
        return {id(self.output)} if self.output is not None else set()

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum the copies' gradients: both then hold the weight's full gradient."""
        params = [p for p in (self.embedding, self.output) if p is not None and p.grad is not None]
        for p in params:  # the embedding's TP gradient comes back replicated: take the param's shard
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grads = [local_tensor(p.grad) for p in params]
        if not grads:
            return
        if len(grads) == 2:  # both stages on this rank (a V schedule)
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
            return
        (g,) = grads
        staged = g if g.device.type == self.device.type else g.to(self.device)  # CPU offload on CUDA
        dist.all_reduce(staged, group=self.group)
        if staged is not g:
            g.copy_(staged)


def tie_across_stages(
    parts: list[nn.Module], stage_ids: list[int], root_mesh, cfg: PPConfig, device: torch.device
) -> TiedAcrossStages:
    """The tie of a pipelined model whose embedding and output are tied, built on every rank
    (creating the groups is collective). `stage_ids` are this rank's stages."""
    if root_mesh is None or root_mesh["pp"].size() == 1 or not parts[0].args.tie_embeddings:
        return TiedAcrossStages()
    pp = root_mesh["pp"].size()
    last = pp * cfg.stages_per_rank - 1
    first = next((part for part, s in zip(parts, stage_ids) if s == 0), None)
    last_part = next((part for part, s in zip(parts, stage_ids) if s == last), None)
    # the pp rank holding the last stage: pp - 1 for looped schedules, 0 for V schedules
    last_pp = next(
        r for r in range(pp) if last in stage_ids_for_rank(r, pp, cfg.stages_per_rank, cfg.schedule)
    )
    if last_pp == 0:
        return TiedAcrossStages(first, last_part)
    pipelines = root_mesh.mesh.movedim(MESH_DIMS.index("pp"), -1).reshape(-1, pp).tolist()
    mine = None
    for pipeline in pipelines:  # every rank creates every group, in the same order
        ends = [pipeline[0], pipeline[last_pp]]
        group = dist.new_group(ends)
        if dist.get_rank() in ends:
            mine = group
    return TiedAcrossStages(first, last_part, mine, device)
