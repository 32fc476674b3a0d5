"""Every parameter's placement on every rank, computed without devices or training.

Each rank is simulated in turn with torch's fake process group and a meta-device model,
so an 8-GPU (or 64-GPU) recipe's sharding can be dumped on a laptop and diffed against
a golden file: a changed plan shows up as a readable diff, not a surprise at scale.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshforge.configs import Recipe
from meshforge.models import args_from_config, get_model_spec
from meshforge.parallelisms import ParallelDims, ParallelModel, parallelize
from meshforge.parallelisms.mesh import Meshes


def describe(param: torch.Tensor) -> str:
    """'_S(0, 2),S(0) on (dp_shard,tp) local [16, 64] of [64, 64] at [32, 0]' or 'local [64]'."""
    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        dims = ",".join(param.device_mesh.mesh_dim_names or ())
        placements = ",".join(str(p) for p in param.placements)
        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return (f"{placements} on ({dims}) local {list(param.to_local().shape)} of {list(param.shape)} "
                f"at {list(offset)}")
    return f"local {list(param.shape)}"


@contextlib.contextmanager
def simulated_rank(recipe: Recipe, rank: int) -> Iterator[tuple[ParallelDims, Meshes, ParallelModel]]:
    """Rank `rank` of the recipe's mesh, parallelized on the meta device under torch's fake
    process group: shardings and schedules without devices, communication or memory."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dims = ParallelDims.from_config(recipe.mesh)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        meshes = dims.build_mesh("cpu")
        spec = get_model_spec(recipe.model.name)
        with torch.device("meta"):
            model = spec.build(args_from_config(recipe.model))
        compile_off = dataclasses.replace(recipe.compile, enabled=False)  # shapes and plans do not depend on it
        pmodel = parallelize(model, meshes, dims, spec, tp=recipe.tp, pp=recipe.pp,
                             ac=recipe.activation_checkpoint, compile=compile_off, fsdp=recipe.fsdp)
        yield dims, meshes, pmodel
    finally:
        dist.destroy_process_group()


def rank_placements(recipe: Recipe, rank: int) -> dict[str, str]:
    """Parameter FQN -> placement description, as rank `rank` of the recipe's mesh holds it."""
    with simulated_rank(recipe, rank) as (dims, _, pmodel):
        out = {}
        for stage_id, part in zip(pmodel.stage_ids, pmodel.parts):
            for fqn, p in part.named_parameters():
                out[fqn] = f"stage {stage_id}: {describe(p)}" if dims.pp_enabled else describe(p)
        return out


def all_placements(recipe: Recipe) -> dict[str, dict[str, str]]:
    """rank -> (FQN -> placement) for every rank of the recipe's mesh, each rank simulated
    in its own worker process (see rank_slices for why)."""
    from meshforge.estimate import trace_pool

    world = ParallelDims.from_config(recipe.mesh).world_size
    with trace_pool() as pool:
        futures = {str(rank): pool.submit(rank_placements, recipe, rank) for rank in range(world)}
        return {rank: f.result() for rank, f in futures.items()}


def rank_slices(recipe: Recipe, rank: int) -> dict[str, dict]:
    """Parameter FQN -> where rank `rank`'s local shard sits in the global tensor (offset,
    shape) and the placements behind it. Run one rank per process (estimate.trace_pool):
    torch caches sliced DeviceMeshes by layout, so a second simulated rank in the same
    process would see the first one's coordinates."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with simulated_rank(recipe, rank) as (_, meshes, pmodel):
        out = {}
        for part in pmodel.parts:
            for fqn, p in part.named_parameters():
                if not isinstance(p, DTensor):
                    out[fqn] = {"mesh_dims": (), "placements": (), "offset": (0,) * p.dim(), "shape": tuple(p.shape)}
                    continue
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                out[fqn] = {"mesh_dims": p.device_mesh.mesh_dim_names, "placements": tuple(p.placements),
                            "offset": tuple(offset), "shape": tuple(shape), "global_shape": tuple(p.shape),
                            "coordinate": tuple(meshes.root.get_coordinate())}
        return out
