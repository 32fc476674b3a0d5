"""The grid a sweep and tune walk: every mesh of a world size, crossed with the policy axes that
each mesh reads, as labelled points; `sweep.only` picks layouts of it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from meshforge.configs import Problem, RecipeError, RecipeLike, load_config
from meshforge.core.topology import ParallelDims
from meshforge.recipe.inert import unread_on_mesh


def mesh_shapes(world: int, experts: int = 0) -> list[dict[str, int]]:
    """Every mesh of `world` ranks, as {dim: degree} (ParallelDims.all_of_world); for a MoE model
    with `experts` per sparse layer, once per expert-parallel degree each can take."""
    return [dims.degrees for dims in ParallelDims.all_of_world(world, experts)]


def point_label(mesh: dict[str, int], policy: dict[str, str]) -> str:
    """dp2-tp2-pp2 (+ policy values), also the run name of the point."""
    parts = [ParallelDims(**mesh).label()] + [f"{k.split('.')[-1]}={v}" for k, v in policy.items()]
    return "-".join(parts).replace("/", "_")


@dataclass
class Point:
    label: str
    mesh: dict[str, int]
    policy: dict[str, str]

    def overrides(self) -> list[str]:
        return [f"mesh.{k}={v}" for k, v in self.mesh.items()] + [f"{k}={v}" for k, v in self.policy.items()]


def sweep_points(world: int, axes: dict[str, list[str]], experts: int = 0) -> list[Point]:
    """Every mesh of `world` ranks crossed with the axes' values, but for the policies a mesh leaves
    unread (pp.* where pp = 1: each value would run the same point again)."""
    points = []
    for mesh in mesh_shapes(world, experts):
        names = [n for n in axes if not unread_on_mesh(n, mesh)]
        for values in itertools.product(*(axes[n] for n in names)):
            policy = dict(zip(names, map(str, values)))
            points.append(Point(point_label(mesh, policy), mesh, policy))
    return points


def grid_points(
    source: RecipeLike, overrides: list[str], world: int, axes: dict, only: list, experts: int
) -> list:
    """The sweep's (and tune's) points, after checking the axes: every value parses as its field
    (key, type), and every axis is read by some point; one no layout reads would change nothing."""
    points = select_points(sweep_points(world, axes, experts), only, world, experts)
    problems = []
    for key, values in axes.items():
        for value in values:
            try:
                load_config(source, [*overrides, f"{key}={value}"])
            except RecipeError as e:
                problems += e.problems
        if not any(key in p.policy for p in points):
            problems.append(Problem(f"axis {key}", values, "no layout of this grid reads it (degree 1)"))
    if problems:
        raise RecipeError(problems, "sweep")
    return points


def select_points(points: list[Point], only: list[str], world: int, experts: int = 0) -> list[Point]:
    """The points whose layout is in `sweep.only` (all when empty); an unknown layout is refused."""
    if not only:
        return points
    layouts = [ParallelDims(**m).label() for m in mesh_shapes(world, experts)]
    unknown = [label for label in only if label not in layouts]
    if unknown:
        raise RecipeError(
            [Problem("sweep.only", unknown, f"not layouts of {world} ranks; valid: {', '.join(layouts)}")],
            "sweep",
        )
    return [p for p in points if ParallelDims(**p.mesh).label() in only]
