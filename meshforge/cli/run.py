"""What `run_recipe` does once the recipe is loaded: plan, check what the run reads and the
machine, set an earlier run's records aside, then train (here, through the local launcher, under
torchrun, or in JAX). Heavy modules are imported inside: `--help` stays instant."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from meshforge.configs import Recipe
from meshforge.core.errors import Problem, RecipeError
from meshforge.core.tables import wide

console = Console(soft_wrap=True)
log = logging.getLogger("meshforge.cli")


def run_loaded(recipe: Recipe, dry_run: bool = False) -> int:
    """Plan, check the machine, set an earlier run's records aside, then train: here, through
    the local launcher, under torchrun, or in JAX."""
    from meshforge.core.errors import MachineError
    from meshforge.run.checkpoint.verify import check_checkpoints
    from meshforge.run.data.loader import check_data
    from meshforge.run.launch.distributed import pick_device_type, under_torchrun
    from meshforge.run.launch.plan import check_machine, make_plan

    plan = make_plan(recipe)
    # what the run reads, checked here (nothing downloaded): bad data or checkpoints stop it, exit 2
    checked, problems = {}, []
    for name, check in (
        ("data", lambda: check_data(recipe, plan.args.vocab_size)),
        (
            "checkpoint",
            lambda: check_checkpoints(recipe.checkpoint, Path(recipe.output_dir) / recipe.run_name),
        ),
    ):
        try:
            checked[name] = check()
        except RecipeError as e:
            problems += e.problems
    if problems:
        raise RecipeError(problems, "what the run reads")
    if dry_run:
        table = Table(title=f"plan: {recipe.run_name}", show_header=False)
        for k, v in plan.rows(recipe):
            table.add_row(k, v)
        for name, lines in checked.items():
            for line in lines:
                table.add_row(name, line)
        wide(console).print(table)
        return 0
    world = plan.dims.world_size
    launching = world > 1 and not under_torchrun() and recipe.backend == "torch"
    missing = check_machine(plan, pick_device_type(recipe.train.device), launching)
    if missing:
        raise MachineError([*missing, "`run_recipe RECIPE --dry-run` shows the plan without running it."])
    from meshforge.run.checkpoint.dcp import refuse_unresumed

    refuse_unresumed(recipe.checkpoint, Path(recipe.output_dir) / recipe.run_name)  # never set aside
    resuming = recipe.checkpoint.load is not None  # a resumed run continues its own records
    if not resuming and (not under_torchrun() or os.environ.get("RANK") == "0"):
        _set_aside_previous_run(recipe)
    if recipe.backend == "jax":
        _train_jax(recipe, world, pick_device_type(recipe.train.device) == "cpu")
    elif launching:
        from meshforge.run.launch.local import launch_local

        launch_local(recipe, world)
    else:
        from meshforge.run.train.trainer import train

        train(recipe)
    return 0


def seed_repeats(recipe: Recipe, seeds: int) -> list[list[str]]:
    """`--seeds K`: the overrides of each of the K runs repeating the recipe's point (none for one
    run): model and data seeds +i, named <run_name>-seed<i>, all in one W&B group (the point)."""
    if seeds < 1:
        raise RecipeError([Problem("--seeds", seeds, "must be at least 1")], "command line")
    if seeds == 1:
        return [[]]
    group = recipe.logging.wandb_group or recipe.run_name
    return [
        [
            f"seed={recipe.seed + i}",
            f"data.seed={recipe.data.seed + i}",
            f"run_name={recipe.run_name}-seed{i}",
            f"logging.wandb_group={group}",
        ]
        for i in range(seeds)
    ]


def _train_jax(recipe: Recipe, world: int, on_cpu: bool) -> None:
    """One controller process; on CPU, JAX is told to expose `world` devices before it starts
    (XLA_FLAGS, read when JAX's backend starts, restored after the run)."""
    flags = os.environ.get("XLA_FLAGS", "")
    xla = {}
    if "jax" not in sys.modules and on_cpu and "xla_force_host_platform_device_count" not in flags:
        xla = {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={world}".strip()}
    from unittest import mock  # here, not at the top: `--help` stays quick

    with mock.patch.dict(os.environ, xla):
        from meshforge.jax.trainer import train_jax

        train_jax(recipe)


def _set_aside_previous_run(recipe: Recipe) -> None:
    """A new run never appends to, or overwrites, the records of an earlier run of the same name."""
    run_dir = Path(recipe.output_dir) / recipe.run_name
    if run_dir.exists() and any(run_dir.iterdir()):
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(run_dir.stat().st_mtime))
        target = run_dir.with_name(f"{run_dir.name}.{stamp}")
        n = 1
        while target.exists():
            n += 1
            target = run_dir.with_name(f"{run_dir.name}.{stamp}-{n}")
        run_dir.rename(target)
        log.info(f"an earlier run's records were moved to {target}")
