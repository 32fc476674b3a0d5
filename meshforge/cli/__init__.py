"""Command line: `run_recipe` (the main job) and the `meshforge` command group.

Every command is a function of its parsed arguments; `main` maps a MeshforgeError to its
message and exit code in one place (bad recipe 2, machine cannot run it 2, run failed 1,
interrupted 130), so a user never sees a traceback for something they can fix. Heavy
modules (torch, jax) are imported inside the commands that need them: `--help` is instant.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from rich.console import Console
from rich.markup import escape

from meshforge.cli.formats import cmd_export, cmd_import_config
from meshforge.cli.parsers import parse_axes, run_parser, subcommand_parsers
from meshforge.cli.run import run_loaded, seed_repeats
from meshforge.configs import Recipe, embedded_recipes, recipe_to_toml, resolve_recipe_path
from meshforge.configs.explain import explain_table
from meshforge.core.errors import (
    EXIT_INTERRUPTED,
    Interrupted,
    MeshforgeError,
    RecipeError,
    UsageError,
)
from meshforge.core.logs import setup_logging
from meshforge.core.tables import wide

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)
log = logging.getLogger("meshforge.cli")


def main(command: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """Run one command; the single place errors become messages and exit codes."""
    try:
        return command(args) or 0
    except RecipeError as e:
        err_console.print(
            f"[bold red]error:[/] {escape(e.source)}: {len(e.problems)} problem(s)"
            + (" in the recipe" if e.kind == "recipe" else "")
        )
        for p in e.problems:  # the values and messages are text, not markup ('[/path/file.cc:553]')
            err_console.print(
                f"  [bold]{escape(p.field)}[/] = {escape(repr(p.value))}: {escape(p.message)}",
                highlight=False,
            )
        return e.exit_code
    except Interrupted as e:  # asked for, not an error: one line, from one rank under torchrun
        if os.environ.get("RANK", "0") == "0":
            err_console.print(f"[yellow]{escape(str(e))}[/]", highlight=False)
        return e.exit_code
    except MeshforgeError as e:
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        return e.exit_code
    except OSError as e:  # the machine's, not ours: a full disk, a permission, a missing file
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False)
        return 1
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        return EXIT_INTERRUPTED


def _split_positionals(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """`[RECIPE] [key=value ...]`: the recipe is the one positional without '='."""
    recipe = next((x for x in items if "=" not in x), None)
    return recipe, [x for x in items if x is not recipe]


def _load(args: argparse.Namespace, world: int | None = None, extra: Sequence[str] = ()) -> Recipe:
    from meshforge.recipe import load_recipe

    recipe_arg, overrides = _split_positionals(args.items)
    return load_recipe(recipe_arg, [*overrides, *extra], world_size=world)


def forks_local_ranks(args: argparse.Namespace) -> bool:
    """Whether `run_recipe ARGS` will fork several local CPU ranks, read before the recipe is
    validated (False for a recipe that does not load: `_load` says what is wrong)."""
    from meshforge.configs import load_config
    from meshforge.run.launch.rank_server import forks_cpu_ranks

    try:
        recipe, _ = load_config(*_split_positionals(args.items))
    except RecipeError:
        return False
    return forks_cpu_ranks(recipe)


def _start_rank_server(args: argparse.Namespace) -> None:
    """A run of several local CPU ranks: their server starts importing now, on another core,
    while this process loads and checks the recipe (run/launch/rank_server.py)."""
    from meshforge.run.launch.rank_server import start_rank_server

    if forks_local_ranks(args):
        start_rank_server()


def _env_world(nproc: int | None) -> int | None:
    from meshforge.run.rank.distributed import env_world_size

    return env_world_size() or nproc


def _world_for(path, overrides: list[str], world: int | None) -> int:
    """The world size a sweep or estimate is about: the one given, else the recipe mesh's
    (loading raises a RecipeError asking for a world size when the mesh has a -1)."""
    from meshforge.configs.parallelism import mesh_world_size
    from meshforge.recipe import load_recipe

    return world or mesh_world_size(load_recipe(path, overrides, world_size=None).mesh)


# --- run_recipe ------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    if args.sweep or args.plan:  # --plan is a sweep that launches nothing
        return cmd_sweep(args)
    if not (args.dry_run or args.print_config):
        _start_rank_server(args)
    recipe = _load(args, _env_world(args.nproc))
    if args.quiet:  # no banner, progress or summary: errors and warnings still reach stderr
        recipe.logging.progress = False
    if args.print_config:
        print(recipe_to_toml(recipe), end="")  # plain: TOML that loads back to the same recipe
        return 0
    for repeat in seed_repeats(recipe, args.seeds):  # each seed a run of its own, one after another
        recipe = _load(args, _env_world(args.nproc), repeat) if repeat else recipe
        recipe.logging.progress = recipe.logging.progress and not args.quiet
        run_loaded(recipe, dry_run=args.dry_run)
    return 0


# --- meshforge subcommands -------------------------------------------------------------


def cmd_sweep(args: argparse.Namespace) -> int:
    from meshforge.experiments.sweep import run_sweep

    if getattr(args, "seeds", 1) != 1:
        raise UsageError(
            "--seeds with --sweep: a sweep runs each layout once; repeat one with run_recipe --seeds K"
        )
    recipe_arg, overrides = _split_positionals(args.items)
    path = resolve_recipe_path(recipe_arg)
    world = _world_for(path, overrides, args.world or args.nproc)
    axes = parse_axes(args.axis)
    sweep_dir = Path(args.sweep_dir) if args.sweep_dir else None
    run_sweep(str(path), overrides, world, axes, sweep_dir, console, plan_only=args.plan)
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    from meshforge.experiments.search.runner import OPTIONS, run_search
    from meshforge.experiments.search.space import parse_space

    recipe_arg, overrides = _split_positionals(args.items)
    path = str(resolve_recipe_path(recipe_arg))
    options = {k: getattr(args, k) for k in OPTIONS}
    run_search(path, overrides, parse_space(args.space, path, overrides), console=console, **options)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from meshforge.configs import load_config
    from meshforge.experiments.refine import refined_profile
    from meshforge.experiments.tune import tune
    from meshforge.run.rank.distributed import pick_device_type
    from meshforge.simulate.calibrate import local_profile

    recipe_arg, overrides = _split_positionals(args.items)
    path = resolve_recipe_path(recipe_arg)
    world = _world_for(path, overrides, args.world)
    device = pick_device_type(load_config(path, overrides)[0].train.device)  # what --calibrate measures
    profile = local_profile(args.profile, args.calibrate, args.profile_out, world, console, device)
    if args.calibrate_from:
        profile = refined_profile(profile, [Path(p) for p in args.calibrate_from], console)
    tune_dir = Path(args.tune_dir) if args.tune_dir else None
    tune(str(path), overrides, world, profile, parse_axes(args.axis), args.top, args.plan, tune_dir, console)
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    """A seed checkpoint: the recipe's own initial weights, or (`meshforge import`) weights
    read from an HF / TorchTitan / safetensors / JAX checkpoint into the recipe's model."""
    from meshforge.convert import write_seed

    recipe = _load(args, _env_world(getattr(args, "nproc", None)))
    source = getattr(args, "source", None)
    path = write_seed(recipe, Path(args.out), Path(source) if source else None, getattr(args, "fmt", None))
    console.print(
        f"seed checkpoint: {path}  (start any mesh from it with checkpoint.init_from={args.out})",
        highlight=False,
    )
    return 0


def cmd_parity(args: argparse.Namespace) -> int:
    """Torch model vs its JAX twin on the same tokens: max |dlogit|, mean KL, top-1 agreement."""
    from meshforge.jax.parity import print_parity
    from meshforge.recipe import load_recipe
    from meshforge.run.checkpoint.dcp import resolve_load

    source, overrides = _split_positionals(args.items)
    ckpt = None
    if source is not None and Path(source).is_dir():
        try:
            ckpt = resolve_load(source, Path(source))
        except FileNotFoundError as e:
            raise UsageError(f"{source} is a folder but not a checkpoint: {e}") from None
    recipe = load_recipe(source if ckpt is None else "debug_cpu", overrides, world_size=None)
    ok = print_parity(recipe, ckpt, args.dtype, args.sharpen, args.samples, args.seq_len, console)
    return 0 if ok else 1


def cmd_pp_schedule(args: argparse.Namespace) -> int:
    from meshforge.simulate.schedule import draw_schedule

    console.print(draw_schedule(_load(args), Path(args.out)), highlight=False)
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from meshforge.core.units import parse_bytes
    from meshforge.simulate.estimate import print_estimate

    recipe_arg, overrides = _split_positionals(args.items)
    path = str(resolve_recipe_path(recipe_arg))
    world = _world_for(path, overrides, args.world)
    device_memory = parse_bytes(args.device_memory) if args.device_memory else None
    print_estimate(path, overrides, world, args.all_meshes, args.analytic, device_memory, console)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from meshforge.experiments import compare

    runs = compare.find_runs([Path(p) for p in args.paths])
    metrics = compare.logged_metrics(runs, args.metrics.split(","))  # before anything is written
    out = wide(console)
    out.print(compare.comparison_table(runs))
    folder = Path(args.out) if args.out else compare.beside(runs)
    paths = compare.write_plots(runs, folder, metrics, args.align)
    console.print("plots: " + ", ".join(str(p) for p in paths), highlight=False)
    from meshforge.experiments.seeds import print_seeds  # a baseline point: its seeds, no parity

    if print_seeds(runs, args.metrics, args.baseline, out, paths[0].parent) or not args.baseline:
        return 0
    results = compare.parity(runs, args.baseline, args.tol)
    out.print(compare.parity_table(results, args.baseline, args.tol))
    return 0 if all(p["ok"] for p in results) else 1


def cmd_explain(args: argparse.Namespace) -> int:
    console.print(explain_table(args.field))
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    for name, path in sorted(embedded_recipes().items()):
        console.print(f"{name}: {path}", highlight=False)
    return 0


def run_recipe_main(argv: Sequence[str] | None = None) -> int:
    args = run_parser().parse_intermixed_args(argv)
    setup_logging(args.log_level)
    return main(cmd_run, args)


COMMANDS: dict[str, Callable[[argparse.Namespace], int | None]] = {
    "run": cmd_run,
    "explain": cmd_explain,
    "recipes": cmd_recipes,
    "init": cmd_init,
    "import": cmd_init,
    "sweep": cmd_sweep,
    "tune": cmd_tune,
    "search": cmd_search,
    "compare": cmd_compare,
    "estimate": cmd_estimate,
    "parity": cmd_parity,
    "pp-schedule": cmd_pp_schedule,
    "export": cmd_export,
    "import-config": cmd_import_config,
}


def meshforge_main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    table = {name: (parser, COMMANDS[name]) for name, parser in subcommand_parsers().items()}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in table:
        top = argparse.ArgumentParser(
            prog="meshforge",
            description="meshforge tools",
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog="commands:\n"
            + "\n".join(f"  {n:12} {p.description.split(':')[0]}" for n, (p, _) in table.items()),
        )
        top.add_argument("command", choices=list(table), help="see `meshforge COMMAND --help`")
        if not argv:
            top.print_help()
            return 0
        top.parse_args(argv[:1])  # prints help, or names the unknown command and exits 2
        return 2
    parser, fn = table[argv[0]]
    args = parser.parse_intermixed_args(argv[1:])
    setup_logging(getattr(args, "log_level", None))
    return main(fn, args)


def exit_now(code: int) -> NoReturn:
    """End the program with `code` once its output is flushed, skipping the interpreter's teardown:
    with torch imported it spends ~2 s walking every object torch made (on 2 cores), and it does
    nothing a command needs: records and loggers are closed and ranks joined before a command
    returns. Used by the installed programs only, never by `main` (tests call it in-process)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream
            stream.flush()
    os._exit(code)


def run_recipe_program() -> NoReturn:
    """The `run_recipe` program (and `python -m meshforge.cli`)."""
    exit_now(run_recipe_main())


def meshforge_program() -> NoReturn:
    """The `meshforge` program."""
    exit_now(meshforge_main())
