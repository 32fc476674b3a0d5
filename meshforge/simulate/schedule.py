"""`meshforge pp-schedule`: a recipe's pipeline schedule per rank, drawn without devices."""

from __future__ import annotations

from pathlib import Path

import torch

from meshforge.configs import Recipe
from meshforge.core.errors import UsageError
from meshforge.core.topology import ParallelDims
from meshforge.parallelisms.pp import bubble_fraction_gpipe, build_schedule
from meshforge.parallelisms.pp_actions import bubble_fraction, pipeline_order
from meshforge.run.observe.figures import timeline
from meshforge.simulate.fake_rank import simulated_rank


def recipe_schedule_order(recipe: Recipe) -> dict[int, list[str | None]]:
    """The recipe's pipeline order without devices (rank 0 of a simulated mesh builds it;
    every rank's schedule holds every rank's actions)."""
    with simulated_rank(recipe, rank=0) as (_, meshes, pm):
        schedule = build_schedule(
            pm.parts, pm.stage_ids, meshes.pp, recipe.pp, torch.device("cpu"), lambda x, y: x
        )
        return pipeline_order(schedule)


def draw_schedule(recipe: Recipe, out: Path) -> str:
    """Draw the recipe's schedule to `out`; the line that describes it."""
    if recipe.mesh.pp == 1:
        raise UsageError("mesh.pp = 1: the recipe has no pipeline; e.g. add mesh.pp=4")
    order = recipe_schedule_order(recipe)
    title = f"{recipe.pp.schedule}, pp={recipe.mesh.pp}, {recipe.pp.microbatches} microbatches"
    timeline(order, title).savefig(out, dpi=100, bbox_inches="tight")
    theory = bubble_fraction_gpipe(recipe.mesh.pp, recipe.pp.microbatches)
    world = ParallelDims.from_config(recipe.mesh).world_size
    return (
        f"{title}: bubble {bubble_fraction(order):.1%} of rank time (GPipe/1F1B theory (p-1)/(m+p-1) "
        f"= {theory:.1%}); world {world}; picture: {out}"
    )
