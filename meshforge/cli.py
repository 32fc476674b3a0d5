"""Command line: `run_recipe` (the main job) and the `meshforge` command group.

Every command is a function of its parsed arguments; `main` maps a MeshforgeError to its
message and exit code in one place (bad recipe 2, machine cannot run it 2, run failed 1,
interrupted 130), so a user never sees a traceback for something they can fix. Heavy
modules (torch, jax) are imported inside the commands that need them: `--help` is instant.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from rich.console import Console
from rich.table import Table

from meshforge.configs import Recipe, embedded_recipes, recipe_to_dict, resolve_recipe_path
from meshforge.configs.explain import explain_table, fields_help
from meshforge.core.errors import EXIT_INTERRUPTED, MeshforgeError, Problem, RecipeError, UsageError

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


def main(command: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """Run one command; the single place errors become messages and exit codes."""
    try:
        return command(args) or 0
    except RecipeError as e:
        err_console.print(f"[bold red]error:[/] {e.source}: {len(e.problems)} problem(s) in the recipe")
        for p in e.problems:
            err_console.print(f"  [bold]{p.field}[/] = {p.value!r}: {p.message}", highlight=False)
        return e.exit_code
    except MeshforgeError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False)
        return e.exit_code
    except OSError as e:  # the machine's, not ours: a full disk, a permission, a missing file
        err_console.print(f"[bold red]error:[/] {e}", highlight=False)
        return 1
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        return EXIT_INTERRUPTED


def _split_positionals(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """`[RECIPE] [key=value ...]`: the recipe is the one positional without '='."""
    recipe = next((x for x in items if "=" not in x), None)
    return recipe, [x for x in items if x is not recipe]


def _load(args: argparse.Namespace, world: int | None = None) -> Recipe:
    from meshforge.recipe import load_recipe

    recipe_arg, overrides = _split_positionals(args.items)
    return load_recipe(recipe_arg, overrides, world_size=world)


def _env_world(nproc: int | None) -> int | None:
    from meshforge.run.distributed import env_world_size

    return env_world_size() or nproc


def _world_for(path, overrides: list[str], world: int | None) -> int:
    """The world size a sweep or estimate is about: the one given, else the recipe mesh's
    (loading raises a RecipeError asking for a world size when the mesh has a -1)."""
    from meshforge.configs.checks import mesh_world_size
    from meshforge.recipe import load_recipe

    return world or mesh_world_size(load_recipe(path, overrides, world_size=None))


# --- run_recipe ------------------------------------------------------------------------


def _add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sweep", action="store_true", help="try every valid mesh of --world ranks (see meshforge sweep)")
    p.add_argument("--world", type=int, default=None, help="world size to sweep (default: the recipe's mesh)")
    p.add_argument("--axis", action="append", default=[], metavar="KEY=V1,V2",
                   help="a policy axis crossed with every mesh, e.g. pp.schedule=1F1B,GPipe (repeatable)")
    p.add_argument("--sweep-dir", default=None, help="sweep folder (default: <output_dir>/sweep-<recipe>-w<world>)")


def run_parser(prog: str = "run_recipe") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Validate a recipe, launch its processes, train, and log to JSONL, TensorBoard and W&B.",
        epilog=fields_help(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("items", nargs="*", metavar="RECIPE|key=value",
                   help="a recipe file or embedded recipe name (default: debug_cpu), then dotted overrides")
    p.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    p.add_argument("--dry-run", action="store_true", help="print the plan (parameters, mesh, batch) and exit")
    p.add_argument("--nproc", type=int, default=None, help="world size when the mesh has a -1 degree")
    _add_sweep_args(p)
    return p


def cmd_run(args: argparse.Namespace) -> int:
    if args.sweep:
        return cmd_sweep(args)
    recipe = _load(args, _env_world(args.nproc))
    if args.print_config:
        from omegaconf import OmegaConf

        console.print(OmegaConf.to_yaml(recipe_to_dict(recipe)), highlight=False, markup=False)
        return 0
    return run_loaded(recipe, dry_run=args.dry_run)


def run_loaded(recipe: Recipe, dry_run: bool = False) -> int:
    """Plan, check the machine, set an earlier run's records aside, then train: here, through
    the local launcher, under torchrun, or in JAX."""
    from meshforge.core.errors import MachineError
    from meshforge.run.distributed import pick_device_type, under_torchrun
    from meshforge.run.plan import check_machine, make_plan

    plan = make_plan(recipe)
    if dry_run:
        table = Table(title=f"plan: {recipe.run_name}", show_header=False)
        for k, v in plan.rows(recipe):
            table.add_row(k, v)
        console.print(table)
        return 0
    world = plan.dims.world_size
    launching = world > 1 and not under_torchrun() and recipe.backend == "torch"
    missing = check_machine(plan, pick_device_type(recipe.train.device), launching)
    if missing:
        raise MachineError([*missing, "`run_recipe RECIPE --dry-run` shows the plan without running it."])
    resuming = recipe.checkpoint.load is not None  # a resumed run continues its own records
    if not resuming and (not under_torchrun() or os.environ.get("RANK") == "0"):
        _set_aside_previous_run(recipe)
    if recipe.backend == "jax":
        _train_jax(recipe, world, pick_device_type(recipe.train.device) == "cpu")
    elif launching:
        from meshforge.run.launch import launch_local

        launch_local(recipe, world)
    else:
        from meshforge.run.trainer import train

        train(recipe)
    return 0


def _train_jax(recipe: Recipe, world: int, on_cpu: bool) -> None:
    """One controller process; on CPU, JAX is told to expose `world` devices before it starts."""
    if "jax" not in sys.modules and on_cpu:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={world}".strip()
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
        console.print(f"note: an earlier run's records were moved to {target}", highlight=False)


# --- meshforge subcommands -------------------------------------------------------------


def cmd_sweep(args: argparse.Namespace) -> int:
    from meshforge.experiments.sweep import run_sweep

    recipe_arg, overrides = _split_positionals(args.items)
    path = resolve_recipe_path(recipe_arg)
    world = _world_for(path, overrides, args.world or args.nproc)
    axes = {}
    for a in args.axis:
        key, sep, values = a.partition("=")
        if not sep or not values:
            raise RecipeError([Problem("--axis", a, "expected KEY=V1,V2, e.g. pp.schedule=1F1B,GPipe")], "sweep")
        axes[key] = values.split(",")
    run_sweep(str(path), overrides, world, axes, Path(args.sweep_dir) if args.sweep_dir else None, console)
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    """A seed checkpoint: the recipe's own initial weights, or (`meshforge import`) weights
    read from an HF / TorchTitan / safetensors / JAX checkpoint into the recipe's model."""
    from meshforge.convert import write_seed

    recipe = _load(args, _env_world(getattr(args, "nproc", None)))
    source = getattr(args, "source", None)
    path = write_seed(recipe, Path(args.out), Path(source) if source else None, getattr(args, "fmt", None))
    console.print(f"seed checkpoint: {path}  (start any mesh from it with checkpoint.init_from={args.out})",
                  highlight=False)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from meshforge.convert import export_checkpoint
    from meshforge.run.checkpoint import resolve_load

    path = resolve_load(args.checkpoint, Path(args.checkpoint))
    out = export_checkpoint(path, Path(args.out), args.to)
    console.print(f"exported {path} -> {out}", highlight=False)
    return 0


def cmd_parity(args: argparse.Namespace) -> int:
    """Torch model vs its JAX twin on the same tokens: max |dlogit|, mean KL, top-1 agreement."""
    from meshforge.jax.parity import print_parity
    from meshforge.recipe import load_recipe
    from meshforge.run.checkpoint import resolve_load

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

    try:
        runs = compare.find_runs([Path(p) for p in args.paths])
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    wide = console if console.is_terminal else Console(width=160)
    wide.print(compare.comparison_table(runs))
    paths = compare.write_plots(runs, Path(args.out or "compare"), args.metrics.split(","), args.align)
    console.print("plots: " + ", ".join(str(p) for p in paths), highlight=False)
    if args.baseline is None:
        return 0
    try:
        results = compare.parity(runs, args.baseline, args.tol)
    except KeyError as e:
        raise UsageError(e.args[0]) from None
    wide.print(compare.parity_table(results, args.baseline, args.tol))
    return 0 if all(p["ok"] for p in results) else 1


def cmd_explain(args: argparse.Namespace) -> int:
    console.print(explain_table(args.field))
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    for name, path in sorted(embedded_recipes().items()):
        console.print(f"{name}: {path}", highlight=False)
    return 0


def _recipe_items(p: argparse.ArgumentParser, nproc: bool = True) -> argparse.ArgumentParser:
    p.add_argument("items", nargs="*", metavar="RECIPE|key=value")
    if nproc:
        p.add_argument("--nproc", type=int, default=None, help="world size when the mesh has a -1 degree")
    return p


def commands() -> dict[str, tuple[argparse.ArgumentParser, Callable]]:
    """Every `meshforge` subcommand: its parser and the function it runs."""
    out: dict[str, tuple[argparse.ArgumentParser, Callable]] = {}

    def add(name: str, help_text: str, fn: Callable) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=f"meshforge {name}", description=help_text)
        out[name] = (p, fn)
        return p

    out["run"] = (run_parser("meshforge run"), cmd_run)
    add("explain", "document recipe sections and fields", cmd_explain).add_argument(
        "field", nargs="?", help="a section (train) or field (train.steps)")
    add("recipes", "list the recipes shipped with meshforge", cmd_recipes)
    ini = _recipe_items(add("init", "write a seed checkpoint: the recipe's initial weights, loadable on any mesh",
                            cmd_init))
    ini.add_argument("--out", required=True, help="folder for the seed checkpoint")
    imp = add("import", "weights from an HF/TorchTitan/safetensors/JAX checkpoint -> a seed checkpoint of the "
                        "recipe's model (then checkpoint.init_from=OUT)", cmd_init)
    imp.add_argument("source", help="an HF folder, a safetensors folder, or an Orbax pytree folder")
    imp.add_argument("--from", dest="fmt", choices=["hf", "torchtitan", "safetensors", "jax"], required=True)
    imp.add_argument("items", nargs="*", metavar="RECIPE|key=value", help="the recipe whose model receives them")
    imp.add_argument("--out", required=True, help="folder for the seed checkpoint")
    sw = _recipe_items(add("sweep", "try every valid mesh shape of a recipe; rank the layouts", cmd_sweep))
    _add_sweep_args(sw)
    cmp = add("compare", "compare runs or sweeps side by side from their local records (offline)", cmd_compare)
    cmp.add_argument("paths", nargs="+", help="run folders, sweep folders, or folders of runs")
    cmp.add_argument("--out", default=None, help="folder for the PNG plots (default: ./compare)")
    cmp.add_argument("--metrics", default="loss", help="comma-separated metrics to plot, e.g. loss,grad_norm")
    cmp.add_argument("--align", choices=["step", "tokens"], default="step", help="x axis of the metric plots")
    cmp.add_argument("--baseline", default=None, help="parity mode: compare every run's losses with this run")
    cmp.add_argument("--tol", type=float, default=1e-5, help="parity tolerance on loss and grad norm")
    est = _recipe_items(add("estimate", "per-rank peak memory before launching (traced on fake tensors, and "
                                        "analytic), for one or every mesh", cmd_estimate), nproc=False)
    est.add_argument("--world", type=int, default=None, help="world size (default: the recipe's mesh)")
    est.add_argument("--all-meshes", action="store_true", help="every valid mesh of --world ranks")
    est.add_argument("--device-memory", default=None, help="e.g. 80GiB: mark which layouts fit")
    est.add_argument("--analytic", action="store_true", help="formulas only (instant; no trace, no categories)")
    par = add("parity", "the torch model vs its JAX twin on the same tokens (needs the jax extra)", cmd_parity)
    par.add_argument("items", nargs="*", metavar="RECIPE|CHECKPOINT|key=value")
    par.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    par.add_argument("--sharpen", type=float, default=None, help="scale attention and output weights (default 8 "
                     "for fresh weights, whose flat logits hide bugs; 1 for checkpoints)")
    par.add_argument("--samples", type=int, default=4, help="sequences compared")
    par.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    pps = _recipe_items(add("pp-schedule", "draw a recipe's pipeline schedule per rank, with its bubble fraction",
                            cmd_pp_schedule), nproc=False)
    pps.add_argument("--out", default="pp_schedule.png", help="PNG to write")
    exp = add("export", "export a checkpoint's model", cmd_export)
    exp.add_argument("checkpoint", help="a step-NNNNNNNN checkpoint folder, or a checkpoints folder (newest)")
    exp.add_argument("--to", choices=["safetensors", "hf", "torchtitan", "jax"], default="safetensors",
                     help="safetensors (our names), hf (HF Llama folder), torchtitan (0.3.0 names), jax (Orbax pytree)")
    exp.add_argument("out", help="output folder")
    return out


def run_recipe_main(argv: Sequence[str] | None = None) -> int:
    return main(cmd_run, run_parser().parse_intermixed_args(argv))


def meshforge_main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    table = commands()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in table:
        top = argparse.ArgumentParser(prog="meshforge", description="meshforge tools",
                                      formatter_class=argparse.RawDescriptionHelpFormatter,
                                      epilog="commands:\n" + "\n".join(
                                          f"  {n:12} {p.description.split(':')[0]}" for n, (p, _) in table.items()))
        top.add_argument("command", choices=list(table), help="see `meshforge COMMAND --help`")
        if not argv:
            top.print_help()
            return 0
        top.parse_args(argv[:1])  # prints help, or names the unknown command and exits 2
        return 2
    parser, fn = table[argv[0]]
    return main(fn, parser.parse_intermixed_args(argv[1:]))


if __name__ == "__main__":
    sys.exit(run_recipe_main())
