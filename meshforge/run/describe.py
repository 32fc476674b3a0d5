"""What a run is, said once for the torch and JAX trainers: run.json's fields, the loggers'
config and the terminal's banner."""

from __future__ import annotations

from meshforge.configs import Recipe, recipe_to_dict
from meshforge.core.topology import ParallelDims
from meshforge.run.console import Banner
from meshforge.run.plan import model_source


def run_info(recipe: Recipe, dims: ParallelDims, device: str, n_params: int, **extra) -> dict:
    """run.json's description of the run (RunRecord adds id, status, times, versions)."""
    return {
        "recipe": recipe_to_dict(recipe),
        "mesh": dims.degrees,
        "world_size": dims.world_size,
        "device": device,
        "n_params": n_params,
        **extra,
    }


def logger_config(recipe: Recipe, dims: ParallelDims, **extra) -> dict:
    """The loggers' config: the recipe, and flat layout keys to group and plot runs by in W&B."""
    return {
        **recipe_to_dict(recipe),
        **dims.degrees,
        "world_size": dims.world_size,
        "layout": dims.label(),
        **extra,
    }


def banner(
    recipe: Recipe,
    dims: ParallelDims,
    n_params: int,
    device_type: str,
    layout: list[list[int]] | None = None,
    loss_floor: float | None = None,
) -> Banner:
    """The run's first lines: model, size, mesh, pipeline stages, the data's loss floor."""
    pipeline = None
    if layout is not None:
        stages = "; ".join(f"stage {s}: layers {ids}" for s, ids in enumerate(layout))
        pipeline = f"pipeline {recipe.pp.schedule} x {recipe.pp.microbatches} microbatches: {stages}"
    return Banner(
        recipe.run_name,
        model_source(recipe),
        n_params,
        dims.world_size,
        device_type,
        dims.spelled(),
        recipe.train.steps,
        pipeline,
        loss_floor,
    )
