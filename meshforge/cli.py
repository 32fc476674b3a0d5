"""Command line: `run_recipe` (the main job) and the `meshforge` command group.

A bad recipe prints every problem (field, value, fix) and exits 2, without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.table import Table

from meshforge.configs import Problem, RecipeError, field_doc, load_recipe, recipe_to_dict, sections
from meshforge.configs.schema import Recipe

EXIT_BAD_RECIPE = 2
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


def _split_positionals(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """`[RECIPE] [key=value ...]`: the recipe is the one positional without '='."""
    recipe = next((x for x in items if "=" not in x), None)
    return recipe, [x for x in items if x is not recipe]


def _field_help() -> str:
    lines = ["recipe fields (override any with section.key=value):"]
    for sec, cls in sections().items():
        for f in dataclasses.fields(cls):
            lines.append(f"  {sec}.{f.name}: {f.metadata.get('doc', '')}")
    return "\n".join(lines)


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run_recipe",
        description="Validate a recipe, launch its processes, train, and log to JSONL, TensorBoard and W&B.",
        epilog=_field_help(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("items", nargs="*", metavar="RECIPE|key=value",
                   help="a recipe file or embedded recipe name (default: debug_cpu), then dotted overrides")
    p.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    p.add_argument("--dry-run", action="store_true", help="print the plan (parameters, mesh, batch) and exit")
    p.add_argument("--nproc", type=int, default=None, help="world size when the mesh has a -1 degree")
    _add_sweep_args(p)
    return p


def _add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sweep", action="store_true", help="try every valid mesh of --world ranks (see meshforge sweep)")
    p.add_argument("--world", type=int, default=None, help="world size to sweep (default: the recipe's mesh)")
    p.add_argument("--axis", action="append", default=[], metavar="KEY=V1,V2",
                   help="a policy axis crossed with every mesh, e.g. pp.schedule=1F1B,GPipe (repeatable)")
    p.add_argument("--sweep-dir", default=None, help="sweep folder (default: <output_dir>/sweep-<recipe>-w<world>)")


def _sweep(recipe_arg: str | None, overrides: list[str], args) -> int:
    from meshforge.configs.loader import resolve_recipe_path
    from meshforge.sweep import run_sweep

    try:
        path = resolve_recipe_path(recipe_arg)
        world = _world_for(path, overrides, args.world or args.nproc)
        axes = {}
        for a in args.axis:
            key, sep, values = a.partition("=")
            if not sep or not values:
                raise RecipeError([Problem("--axis", a, "expected KEY=V1,V2, e.g. pp.schedule=1F1B,GPipe")], "sweep")
            axes[key] = values.split(",")
        run_sweep(str(path), overrides, world, axes, Path(args.sweep_dir) if args.sweep_dir else None, console)
    except RecipeError as e:
        _print_problems(e)
        return EXIT_BAD_RECIPE
    return 0


def _world_size(nproc: int | None) -> int | None:
    from meshforge.distributed import env_world_size

    return env_world_size() or nproc


def _world_for(path, overrides: list[str], world: int | None) -> int:
    """The world size a sweep or estimate is about: the one given, else the recipe mesh's
    (loading raises a RecipeError asking for a world size when the mesh has a -1)."""
    from meshforge.configs.validate import mesh_world_size

    return world or mesh_world_size(load_recipe(path, overrides, world_size=None))


def _print_problems(e: RecipeError) -> None:
    err_console.print(f"[bold red]error:[/] {e.source}: {len(e.problems)} problem(s) in the recipe")
    for p in e.problems:
        err_console.print(f"  [bold]{p.field}[/] = {p.value!r}: {p.message}", highlight=False)


def run_recipe_main(argv: Sequence[str] | None = None) -> int:
    args = _run_parser().parse_intermixed_args(argv)
    recipe_arg, overrides = _split_positionals(args.items)
    if args.sweep:
        return _sweep(recipe_arg, overrides, args)
    try:
        recipe = load_recipe(recipe_arg, overrides, world_size=_world_size(args.nproc))
    except RecipeError as e:
        _print_problems(e)
        return EXIT_BAD_RECIPE
    return run_loaded(recipe, print_config=args.print_config, dry_run=args.dry_run)


def run_loaded(recipe: Recipe, print_config: bool = False, dry_run: bool = False) -> int:
    from omegaconf import OmegaConf

    from meshforge.distributed import pick_device_type, under_torchrun
    from meshforge.plan import check_machine, make_plan

    if print_config:
        console.print(OmegaConf.to_yaml(recipe_to_dict(recipe)), highlight=False, markup=False)
        return 0
    plan = make_plan(recipe)
    if dry_run:
        table = Table(title=f"plan: {recipe.run_name}", show_header=False)
        for k, v in plan.rows(recipe):
            table.add_row(k, v)
        console.print(table)
        return 0
    world = plan.dims.world_size
    launching = world > 1 and not under_torchrun() and recipe.backend == "torch"
    missing = check_machine(recipe, plan, pick_device_type(recipe.train.device), launching)
    if missing:
        err_console.print("[bold red]error:[/] this machine cannot run the recipe as written:")
        for m in missing:
            err_console.print(f"  - {m}", highlight=False)
        err_console.print("  `run_recipe RECIPE --dry-run` shows the plan without running it.")
        return EXIT_BAD_RECIPE
    resuming = recipe.checkpoint.load is not None  # a resumed run continues its own records
    if not resuming and (not under_torchrun() or os.environ.get("RANK") == "0"):
        _set_aside_previous_run(recipe)
    try:
        if recipe.backend == "jax":
            _train_jax(recipe, world)
        elif launching:
            from meshforge.launch import launch_local

            launch_local(recipe, world)
        else:
            from meshforge.train import train

            train(recipe)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        return 130
    except Exception as e:  # the run's records are already closed by the trainer
        from meshforge.launch import LaunchFailed

        from meshforge.checkpoint import CheckpointError
        from meshforge.train import Preempted

        if not isinstance(e, (LaunchFailed, FloatingPointError, Preempted, OSError, CheckpointError)):
            raise
        err_console.print(f"[bold red]error:[/] {e}", highlight=False)
        return 1
    return 0


def _train_jax(recipe: Recipe, world: int) -> None:
    """One controller process; on CPU, JAX is told to expose `world` devices before it starts."""
    import sys

    if "jax" not in sys.modules and pick_jax_cpu(recipe):
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={world}".strip()
    from meshforge.train_jax import train_jax

    train_jax(recipe)


def pick_jax_cpu(recipe: Recipe) -> bool:
    from meshforge.distributed import pick_device_type

    return pick_device_type(recipe.train.device) == "cpu"


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


def _init(args) -> int:
    """A seed checkpoint: the recipe's own initial weights, or (`meshforge import`) weights
    read from an HF / TorchTitan / safetensors / JAX checkpoint into the recipe's model."""
    import torch

    from meshforge.checkpoint import import_weights, save_seed_checkpoint
    from meshforge.models import args_from_config, get_model_spec

    recipe_arg, overrides = _split_positionals(args.items)
    try:
        recipe = load_recipe(recipe_arg, overrides, world_size=_world_size(getattr(args, "nproc", None)))
    except RecipeError as e:
        _print_problems(e)
        return EXIT_BAD_RECIPE
    with torch.device("cpu"):
        model = get_model_spec(recipe.model.name).build(args_from_config(recipe.model))
    meta = {"recipe": recipe_to_dict(recipe), "seed": recipe.seed}
    source = getattr(args, "source", None)
    if source is None:
        model.init_weights(seed=recipe.seed)
    else:
        try:
            import_weights(model, Path(source), args.fmt)
        except (ValueError, FileNotFoundError, KeyError) as e:
            err_console.print(f"[bold red]error:[/] {e}", highlight=False)
            return EXIT_BAD_RECIPE
        meta.update(imported_from=str(source), format=args.fmt)
    path = save_seed_checkpoint(model, Path(args.out), meta)
    console.print(f"seed checkpoint: {path}  (start any mesh from it with checkpoint.init_from={args.out})",
                  highlight=False)
    return 0


def _export(args) -> int:
    from meshforge.checkpoint import export_checkpoint, resolve_load

    try:
        path = resolve_load(args.checkpoint, Path(args.checkpoint))
    except FileNotFoundError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False)
        return EXIT_BAD_RECIPE
    out = export_checkpoint(path, Path(args.out), args.to)
    console.print(f"exported {path} -> {out}", highlight=False)
    return 0


def _parity(args) -> int:
    """Torch model vs its JAX twin on the same tokens: max |dlogit|, mean KL, top-1 agreement."""
    from rich.table import Table

    from meshforge.checkpoint import load_full_model, resolve_load
    from meshforge.data import ShardedLoader, build_source
    from meshforge.jax_bridge import run_parity, sharpen
    from meshforge.models import args_from_config, get_model_spec

    source, overrides = _split_positionals(args.items)
    try:
        ckpt = resolve_load(source, Path(source)) if Path(source).is_dir() else None
        recipe = load_recipe(source if ckpt is None else "debug_cpu", overrides, world_size=None)
    except RecipeError as e:
        _print_problems(e)
        return EXIT_BAD_RECIPE
    except FileNotFoundError as e:
        err_console.print(f"[bold red]error:[/] {source} is a folder but not a checkpoint: {e}", highlight=False)
        return EXIT_BAD_RECIPE
    if ckpt is not None:
        model, margs, _ = load_full_model(ckpt)
        what = f"checkpoint {ckpt}"
    else:
        margs = args_from_config(recipe.model)
        model = get_model_spec(recipe.model.name).build(margs)
        model.init_weights(recipe.seed)
        what = f"{recipe.model.name}/{recipe.model.flavor} freshly initialised (seed {recipe.seed})"
    factor = args.sharpen if args.sharpen is not None else (1.0 if ckpt is not None else 8.0)
    if factor != 1.0:
        sharpen(model, factor)
        what += f", attention/output weights x{factor:g}"
    data = build_source(recipe.data, margs.vocab_size, min(args.seq_len, margs.max_seq_len))
    tokens = ShardedLoader(data, args.samples, 1).next_step()[0].inputs
    result = run_parity(model.eval(), margs, tokens, args.dtype)
    ok = result.within(args.dtype)
    table = Table(title=f"parity torch vs JAX ({args.dtype}): {what}; {tokens.numel()} tokens")
    for c in ("metric", "value", "target"):
        table.add_column(c)
    fp32 = args.dtype == "float32"
    table.add_row("max |dlogit|", f"{result.max_abs_logit_diff:.3g}", "<= 1e-4" if fp32 else "")
    table.add_row("mean KL", f"{result.mean_kl:.3g}", "<= 1e-6" if fp32 else "<= 2e-3")
    table.add_row("top-1 agreement", f"{result.top1_agreement:.4f}", "" if fp32 else ">= 0.95")
    console.print(table)
    console.print("[green]parity: within targets[/]" if ok else "[bold red]parity: outside targets[/]")
    return 0 if ok else 1


def _pp_schedule(args) -> int:
    from meshforge.configs.validate import mesh_world_size
    from meshforge.parallelisms.pp import bubble_fraction_gpipe
    from meshforge.pp_schedule import bubble_fraction, recipe_schedule_order, timeline

    recipe_arg, overrides = _split_positionals(args.items)
    try:
        recipe = load_recipe(recipe_arg, overrides, world_size=None)
    except RecipeError as e:
        _print_problems(e)
        return EXIT_BAD_RECIPE
    if recipe.mesh.pp == 1:
        err_console.print("[bold red]error:[/] mesh.pp = 1: the recipe has no pipeline; e.g. add mesh.pp=4")
        return EXIT_BAD_RECIPE
    order = recipe_schedule_order(recipe)
    title = f"{recipe.pp.schedule}, pp={recipe.mesh.pp}, {recipe.pp.microbatches} microbatches"
    fig = timeline(order, title)
    fig.savefig(args.out, dpi=100, bbox_inches="tight")
    theory = bubble_fraction_gpipe(recipe.mesh.pp, recipe.pp.microbatches)
    console.print(f"{title}: bubble {bubble_fraction(order):.1%} of rank time (GPipe/1F1B theory (p-1)/(m+p-1) "
                  f"= {theory:.1%}); world {mesh_world_size(recipe)}; picture: {args.out}", highlight=False)
    return 0


def _estimate(args) -> int:
    from meshforge.configs.loader import resolve_recipe_path
    from meshforge.estimate import estimate_refusals, estimate_rows, estimate_table, parse_bytes

    recipe_arg, overrides = _split_positionals(args.items)
    try:
        path = str(resolve_recipe_path(recipe_arg))
        world = _world_for(path, overrides, args.world)
        rows = estimate_rows(path, overrides, world, args.all_meshes, traced=not args.analytic)
    except RecipeError as e:
        _print_problems(e)
        return EXIT_BAD_RECIPE
    device_memory = parse_bytes(args.device_memory) if args.device_memory else None
    out = console if console.is_terminal else Console(width=160)
    out.print(estimate_table(rows, device_memory))
    for line in estimate_refusals(rows):
        out.print(line, highlight=False, soft_wrap=True)
    return 0


def _compare(args) -> int:
    from meshforge import compare

    try:
        runs = compare.find_runs([Path(p) for p in args.paths])
    except FileNotFoundError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False)
        return EXIT_BAD_RECIPE
    wide = console if console.is_terminal else Console(width=160)
    wide.print(compare.comparison_table(runs))
    paths = compare.write_plots(runs, Path(args.out or "compare"), args.metrics.split(","), args.align)
    console.print("plots: " + ", ".join(str(p) for p in paths), highlight=False)
    if args.baseline is None:
        return 0
    try:
        results = compare.parity(runs, args.baseline, args.tol)
    except KeyError as e:
        err_console.print(f"[bold red]error:[/] {e.args[0]}", highlight=False)
        return EXIT_BAD_RECIPE
    wide.print(compare.parity_table(results, args.baseline, args.tol))
    return 0 if all(p["ok"] for p in results) else 1


def _explain(target: str | None) -> int:
    secs = sections()
    if target is None:
        names = list(secs) + [f.name for f in dataclasses.fields(Recipe) if f.name not in secs]
    else:
        names = [target]
    table = Table("field", "default", "doc")
    for name in names:
        sec, _, key = name.partition(".")
        if sec in secs:
            fields = [f for f in dataclasses.fields(secs[sec]) if not key or f.name == key]
            if not fields:
                err_console.print(f"[bold red]error:[/] {sec} has no field {key!r}; "
                                  f"fields: {', '.join(f.name for f in dataclasses.fields(secs[sec]))}")
                return EXIT_BAD_RECIPE
            for f in fields:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                table.add_row(f"{sec}.{f.name}", repr(default), f.metadata.get("doc", ""))
        else:
            try:
                table.add_row(sec, "", field_doc(None, sec))
            except KeyError:
                err_console.print(f"[bold red]error:[/] no recipe field or section {name!r}; "
                                  f"sections: {', '.join(secs)}")
                return EXIT_BAD_RECIPE
    console.print(table)
    return 0


def meshforge_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="meshforge", description="meshforge tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("run", help="same as run_recipe", add_help=False)
    ex = sub.add_parser("explain", help="document recipe sections and fields")
    ex.add_argument("field", nargs="?", help="a section (train) or field (train.steps)")
    sub.add_parser("recipes", help="list the recipes shipped with meshforge")
    ini = sub.add_parser("init", help="write a seed checkpoint: the recipe's initial weights, loadable on any mesh")
    ini.add_argument("items", nargs="*", metavar="RECIPE|key=value")
    ini.add_argument("--out", required=True, help="folder for the seed checkpoint")
    ini.add_argument("--nproc", type=int, default=None, help="world size when the mesh has a -1 degree")
    imp = sub.add_parser("import", help="weights from an HF/TorchTitan/safetensors/JAX checkpoint -> a seed "
                                        "checkpoint of the recipe's model (then checkpoint.init_from=OUT)")
    imp.add_argument("source", help="an HF folder, a safetensors folder, or an Orbax pytree folder")
    imp.add_argument("--from", dest="fmt", choices=["hf", "torchtitan", "safetensors", "jax"], required=True)
    imp.add_argument("items", nargs="*", metavar="RECIPE|key=value", help="the recipe whose model receives them")
    imp.add_argument("--out", required=True, help="folder for the seed checkpoint")
    sw = sub.add_parser("sweep", help="try every valid mesh shape of a recipe; rank the layouts")
    sw.add_argument("items", nargs="*", metavar="RECIPE|key=value")
    sw.add_argument("--nproc", type=int, default=None, help=argparse.SUPPRESS)
    _add_sweep_args(sw)
    cmp = sub.add_parser("compare", help="compare runs or sweeps side by side from their local records (offline)")
    cmp.add_argument("paths", nargs="+", help="run folders, sweep folders, or folders of runs")
    cmp.add_argument("--out", default=None, help="folder for the PNG plots (default: ./compare)")
    cmp.add_argument("--metrics", default="loss", help="comma-separated metrics to plot, e.g. loss,grad_norm")
    cmp.add_argument("--align", choices=["step", "tokens"], default="step", help="x axis of the metric plots")
    cmp.add_argument("--baseline", default=None, help="parity mode: compare every run's losses with this run")
    cmp.add_argument("--tol", type=float, default=1e-5, help="parity tolerance on loss and grad norm")
    est = sub.add_parser("estimate", help="per-rank peak memory before launching (traced on fake tensors, and "
                                          "analytic), for one or every mesh")
    est.add_argument("items", nargs="*", metavar="RECIPE|key=value")
    est.add_argument("--world", type=int, default=None, help="world size (default: the recipe's mesh)")
    est.add_argument("--all-meshes", action="store_true", help="every valid mesh of --world ranks")
    est.add_argument("--device-memory", default=None, help="e.g. 80GiB: mark which layouts fit")
    est.add_argument("--analytic", action="store_true", help="formulas only (instant; no trace, no categories)")
    par = sub.add_parser("parity", help="the torch model vs its JAX twin on the same tokens (needs the jax extra)")
    par.add_argument("items", nargs="*", metavar="RECIPE|CHECKPOINT|key=value")
    par.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    par.add_argument("--sharpen", type=float, default=None,
                     help="scale attention and output weights (default 8 for fresh weights, whose flat logits hide bugs; 1 for checkpoints)")
    par.add_argument("--samples", type=int, default=4, help="sequences compared")
    par.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    pps = sub.add_parser("pp-schedule", help="draw a recipe's pipeline schedule per rank, with its bubble fraction")
    pps.add_argument("items", nargs="*", metavar="RECIPE|key=value")
    pps.add_argument("--out", default="pp_schedule.png", help="PNG to write")
    exp = sub.add_parser("export", help="export a checkpoint's model")
    exp.add_argument("checkpoint", help="a step-NNNNNNNN checkpoint folder, or a checkpoints folder (newest)")
    exp.add_argument("--to", choices=["safetensors", "hf", "torchtitan", "jax"], default="safetensors",
                     help="safetensors (our names), hf (HF Llama folder), torchtitan (0.3.0 names), jax (Orbax pytree)")
    exp.add_argument("out", help="output folder")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        return run_recipe_main(argv[1:])
    if argv[:1] == ["init"]:  # options may come between the recipe and its overrides
        return _init(ini.parse_intermixed_args(argv[1:]))
    if argv[:1] == ["import"]:
        return _init(imp.parse_intermixed_args(argv[1:]))
    if argv[:1] == ["pp-schedule"]:
        return _pp_schedule(pps.parse_intermixed_args(argv[1:]))
    if argv[:1] == ["estimate"]:
        return _estimate(est.parse_intermixed_args(argv[1:]))
    if argv[:1] == ["parity"]:
        return _parity(par.parse_intermixed_args(argv[1:]))
    if argv[:1] == ["sweep"]:
        args = sw.parse_intermixed_args(argv[1:])
        return _sweep(*_split_positionals(args.items), args)
    args = p.parse_args(argv)
    if args.cmd == "explain":
        return _explain(args.field)
    if args.cmd == "export":
        return _export(args)
    if args.cmd == "compare":
        return _compare(args)
    from meshforge.configs.loader import embedded_recipes

    for name, path in sorted(embedded_recipes().items()):
        console.print(f"{name}: {path}", highlight=False)
    return 0


def _exit(code: int) -> None:
    sys.exit(code)


if __name__ == "__main__":
    _exit(run_recipe_main())
