"""A recipe loaded and validated: keys and types (configs/loader.py), then every rule in one
pass, in the order of `validate` (a rule that needs a resolved mesh, model or batch waits for it).

Every problem is reported at once (field, value, fix); -1 fields come back resolved.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshforge.configs import Problem, Recipe, RecipeError, RecipeLike, read_config
from meshforge.core.topology import ParallelDims
from meshforge.models import MODELS, get_model_spec
from meshforge.parallelisms.cp import ATTENTION
from meshforge.parallelisms.float8 import check_float8
from meshforge.parallelisms.fsdp import DTYPES
from meshforge.parallelisms.pp import SCHEDULES, check_pipeline

from . import own
from .combinations import check_combinations, check_op_names, check_profile
from .model import check_experts, check_hf_init, check_shapes, resolve_model


def load_recipe(
    path_or_name: RecipeLike,
    overrides: Sequence[str] = (),
    world_size: int | None = None,
) -> Recipe:
    """Load, merge and validate a recipe; -1 fields come back resolved for `world_size`.

    Raises RecipeError listing every problem.
    """
    recipe, path, key_problems = read_config(path_or_name, overrides)
    left_out = {p.field for p in key_problems}
    problems = [_left_out(p) if p.field != "override" else p for p in key_problems]
    problems += [p for p in validate(recipe, world_size) if not _names_any(p.field, left_out)]
    if problems:
        raise RecipeError(problems, str(path))
    return recipe


def _left_out(p: Problem) -> Problem:
    """A key problem, saying that the rules across fields ran without the key."""
    return Problem(p.field, p.value, f"{p.message} (the checks across fields left it out)")


def _names_any(field: str, keys: set[str]) -> bool:
    """Is `field` one of `keys` or inside one (`train.seq_len` inside `train`)?"""
    return any(field == k or field.startswith(f"{k}.") for k in keys)


def validate(r: Recipe, world_size: int | None) -> list[Problem]:
    """Every rule; resolves -1 degrees, batch sizes and microbatches in place."""
    mesh_problems = own.resolve_mesh(r, world_size)
    problems = check_choices(r) + mesh_problems
    dims = ParallelDims.from_config(r.mesh) if not mesh_problems else None
    model_problems, args = resolve_model(r)
    problems += model_problems
    family_problems = []
    if args is not None:
        family_problems = get_model_spec(r.model.name).check(args, dims or ParallelDims())
        mesh_fits = not any(
            p.field.startswith("mesh.") for p in family_problems
        )  # else cp and SP split by it
        problems += family_problems + check_shapes(r, args, dims if mesh_fits else None)
    buildable = None if model_problems or family_problems else args  # float8's check builds it
    if dims is not None:
        batch_problems = own.resolve_batch(r)
        problems += batch_problems
        if args is not None and not batch_problems:  # the schedule's rules need a resolved batch
            problems += check_pipeline(r.pp, dims.pp, args.n_layers, r.train.micro_batch_size)
        problems += check_combinations(r, dims)
        problems += check_experts(r, args, dims)
    problems += own.check(r)
    problems += check_op_names(r)
    problems += check_profile(r)
    if args is not None:
        problems += check_hf_init(r, args)
    problems += check_float8(r.float8, r.backend, r.fsdp.param_dtype, r.model.name, buildable)
    return problems


def check_choices(r: Recipe) -> list[Problem]:
    """Choices owned by the registry and the parallelisms: model, flavor, dtypes, schedule."""
    return own.choice_problems(
        {
            "fsdp.param_dtype": (r.fsdp.param_dtype, tuple(DTYPES)),
            "fsdp.reduce_dtype": (r.fsdp.reduce_dtype, tuple(DTYPES)),
            "pp.schedule": (r.pp.schedule, SCHEDULES),
            "cp.method": (r.cp.method, tuple(ATTENTION)),
            "model.name": (r.model.name, tuple(MODELS)),
        }
    )
