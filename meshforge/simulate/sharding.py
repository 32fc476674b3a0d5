"""Every parameter's placement on every rank, computed without devices or training.

Each rank is simulated in its own worker (fake_rank.py), so an 8-GPU (or 64-GPU) recipe's
sharding can be dumped on a laptop and diffed against a golden file: a changed plan shows
up as a readable diff, not a surprise at scale.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshforge.configs import Recipe
from meshforge.core.topology import ParallelDims
from meshforge.parallelisms.materialize import shared_parameters
from meshforge.simulate.fake_rank import simulated_rank, trace_pool


def describe(s: dict) -> str:
    """A rank_slices entry as '_S(0, 2),S(0) on (dp_shard,tp) local [16, 64] of [64, 64] at
    [32, 0]' (or 'local [64]' for a plain tensor), prefixed by 'stage N: ' under pipelining
    and by what a tied weight is tied to."""
    text = f"local {list(s['shape'])}"
    if s["placements"]:
        placements = ",".join(str(p) for p in s["placements"])
        text = (
            f"{placements} on ({','.join(s['mesh_dims'])}) {text} of {list(s['global_shape'])} "
            f"at {list(s['offset'])}"
        )
    if s.get("tied_to"):
        text = f"{s['tied_to']}: {text}"
    return text if s["stage"] is None else f"stage {s['stage']}: {text}"


def rank_placements(recipe: Recipe, rank: int) -> dict[str, str]:
    """Parameter FQN -> placement description, as rank `rank` of the recipe's mesh holds it."""
    return {fqn: describe(s) for fqn, s in rank_slices(recipe, rank, with_ties=True).items()}


def all_placements(recipe: Recipe) -> dict[str, dict[str, str]]:
    """rank -> (FQN -> placement) for every rank of the recipe's mesh, each rank simulated
    in its own worker process (see rank_slices for why)."""
    world = ParallelDims.from_config(recipe.mesh).world_size
    with trace_pool() as pool:
        futures = {str(rank): pool.submit(rank_placements, recipe, rank) for rank in range(world)}
        return {rank: f.result() for rank, f in futures.items()}


def rank_slices(recipe: Recipe, rank: int, with_ties: bool = False) -> dict[str, dict]:
    """Parameter FQN -> where rank `rank`'s local shard sits in the global tensor (offset,
    shape), the placements behind it, its pipeline stage (None without pipelining) and the
    rank's mesh coordinate. Run one rank per process (trace_pool): torch caches
    sliced DeviceMeshes by layout, so a second simulated rank in the same process would
    see the first one's coordinates. `with_ties` adds a tied weight's second name (the same
    parameter) and marks a pipeline's copy of it."""
    with simulated_rank(recipe, rank) as (dims, meshes, pmodel):
        coordinate = tuple(meshes.root.get_coordinate())
        out = {}
        for stage_id, part in zip(pmodel.stage_ids, pmodel.parts):
            for fqn, p in part.named_parameters():
                s = {
                    "stage": stage_id if dims.pp_enabled else None,
                    "coordinate": coordinate,
                    "mesh_dims": (),
                    "placements": (),
                    "offset": (0,) * p.dim(),
                    "shape": tuple(p.shape),
                    "global_shape": tuple(p.shape),
                }
                if isinstance(p, DTensor):
                    shape, offset = compute_local_shape_and_global_offset(
                        p.shape, p.device_mesh, p.placements
                    )
                    s.update(
                        mesh_dims=p.device_mesh.mesh_dim_names or (),
                        placements=tuple(p.placements),
                        offset=tuple(offset),
                        shape=tuple(shape),
                    )
                out[fqn] = s
                tied = part.args.tie_embeddings and fqn == "output.weight"
                if with_ties and tied:  # the last stage's copy of the first stage's embedding
                    s["tied_to"] = "copy of tok_embeddings.weight (tied; gradients summed with stage 0's)"
            for first, *others in shared_parameters(part) if with_ties else ():
                for fqn in others:
                    out[fqn] = {**out[first], "tied_to": f"= {first} (one parameter)"}
        return out
