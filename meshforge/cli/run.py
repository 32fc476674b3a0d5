"""What `run_recipe` does once the recipe is loaded: plan, check what the run reads and the
machine, set an earlier run's records aside, then train (here, through the local launcher, under
torchrun, or in JAX). Heavy modules are imported inside: `--help` stays instant."""

from __future__ import annotations

import logging
import os
import sys
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
    from meshforge.run.rank.distributed import pick_device_type, under_torchrun
    from meshforge.run.rank.plan import check_machine, make_plan

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
    from meshforge.run.observe.set_aside import set_aside_earlier_run

    refuse_unresumed(recipe.checkpoint, Path(recipe.output_dir) / recipe.run_name)  # never set aside
    resuming = recipe.checkpoint.load is not None  # a resumed run continues its own records
    if resuming and (not under_torchrun() or os.environ.get("RANK") == "0"):
        _warn_unsaved_continuation(recipe)
    if not resuming and (not under_torchrun() or os.environ.get("RANK") == "0"):
        set_aside_earlier_run(Path(recipe.output_dir) / recipe.run_name)
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


def _warn_unsaved_continuation(recipe: Recipe) -> None:
    """A run that continues an earlier one (`checkpoint.load`) but saves no checkpoint: the next
    resume starts again from the earlier checkpoint and sets this run's steps aside."""
    from meshforge.run.checkpoint.dcp import checkpoint_folder, resolve_load

    c, run_dir = recipe.checkpoint, Path(recipe.output_dir) / recipe.run_name
    if c.enabled:
        return
    start = resolve_load(c.load, checkpoint_folder(c, run_dir))  # checked already: it resolves
    if start is None and not (run_dir / "metrics.jsonl").is_file():
        return  # `auto` with nothing earlier to continue
    log.warning(
        f"checkpoint.load={c.load} continues {run_dir} from {start.name if start else 'step 0'}, but "
        "checkpoint.enabled=false: this run saves no checkpoint, so the next resume starts there again "
        "and sets this run's steps aside; set checkpoint.enabled=true to keep them"
    )
