"""The command line's parsers: `run_recipe` and every `meshforge` subcommand (the commands
themselves are in meshforge/cli/__init__.py)."""

from __future__ import annotations

import argparse

from meshforge.configs.explain import fields_help


class Parser(argparse.ArgumentParser):
    """argparse, with a hint where a recipe override was typed as a flag (`--train.steps=5`)."""

    def error(self, message: str):
        flags = [a for a in message.partition("unrecognized arguments: ")[2].split() if a.startswith("--")]
        dotted = [a.lstrip("-") for a in flags if "." in a.partition("=")[0]]
        if dotted:
            example = dotted[0] if "=" in dotted[0] else f"{dotted[0]}=VALUE"
            message += f" (overrides are key=value without dashes: {example})"
        super().error(message)


def parse_axes(items: list[str]) -> dict[str, list[str]]:
    """--axis KEY=V1,V2 (repeatable) -> {KEY: [V1, V2]}."""
    from meshforge.configs import Problem, RecipeError

    axes = {}
    for a in items:
        key, sep, values = a.partition("=")
        if not sep or not values:
            raise RecipeError(
                [Problem("--axis", a, "expected KEY=V1,V2, e.g. pp.schedule=1F1B,GPipe")], "sweep"
            )
        axes[key] = values.split(",")
    return axes


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sweep", action="store_true", help="try every valid mesh of --world ranks (see meshforge sweep)"
    )
    p.add_argument("--world", type=int, default=None, help="world size to sweep (default: the recipe's mesh)")
    p.add_argument(
        "--axis",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a policy axis crossed with every mesh, e.g. pp.schedule=1F1B,GPipe (repeatable)",
    )
    p.add_argument(
        "--sweep-dir", default=None, help="sweep folder (default: <output_dir>/sweep-<recipe>-w<world>)"
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print every layout's traced memory estimate and whether it fits; launch nothing",
    )


def run_parser(prog: str = "run_recipe") -> argparse.ArgumentParser:
    p = Parser(
        prog=prog,
        description="Validate a recipe, launch its processes, train, and log to JSONL, TensorBoard and W&B.",
        epilog=fields_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "items",
        nargs="*",
        metavar="RECIPE|key=value",
        help="a recipe file or embedded recipe name (default: debug_cpu), then dotted overrides",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved recipe and exit")
    p.add_argument("--dry-run", action="store_true", help="print the plan (parameters, mesh, batch) and exit")
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="repeat the run K times, model and data seeds +0..K-1, as <run_name>-seed<i> in one W&B group "
        "(compare: mean, std and Welch's interval over them)",
    )
    p.add_argument("--nproc", type=int, default=None, help="world size when the mesh has a -1 degree")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no banner, progress or summary (errors and meshforge's warnings still show)",
    )
    p.add_argument(
        "--log-level",
        default=None,
        choices=["debug", "info", "warning", "error"],
        help="meshforge's messages (default: MESHFORGE_LOG_LEVEL, else info)",
    )
    add_sweep_args(p)
    return p


def _recipe_items(p: argparse.ArgumentParser, nproc: bool = True) -> argparse.ArgumentParser:
    p.add_argument("items", nargs="*", metavar="RECIPE|key=value")
    if nproc:
        p.add_argument("--nproc", type=int, default=None, help="world size when the mesh has a -1 degree")
    return p


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every `meshforge` subcommand's parser, by name."""
    out: dict[str, argparse.ArgumentParser] = {"run": run_parser("meshforge run")}

    def add(name: str, help_text: str) -> argparse.ArgumentParser:
        out[name] = Parser(prog=f"meshforge {name}", description=help_text)
        return out[name]

    add("explain", "document recipe sections and fields").add_argument(
        "field", nargs="?", help="a section (train) or field (train.steps)"
    )
    add("recipes", "list the recipes shipped with meshforge")
    ini = _recipe_items(
        add("init", "write a seed checkpoint: the recipe's initial weights, loadable on any mesh")
    )
    ini.add_argument("--out", required=True, help="folder for the seed checkpoint")
    imp = add(
        "import",
        "weights from an HF/TorchTitan/safetensors/JAX checkpoint -> a seed checkpoint of the "
        "recipe's model (then checkpoint.init_from=OUT)",
    )
    imp.add_argument(
        "source", help="an HF folder, a safetensors folder, an Orbax pytree folder, or a MaxText checkpoint"
    )
    imp.add_argument(
        "--from", dest="fmt", choices=["hf", "torchtitan", "safetensors", "jax", "maxtext"], required=True
    )
    imp.add_argument(
        "items", nargs="*", metavar="RECIPE|key=value", help="the recipe whose model receives them"
    )
    imp.add_argument("--out", required=True, help="folder for the seed checkpoint")
    ic = add(
        "import-config",
        "a DeepSpeed JSON or TorchTitan 0.2 TOML config -> a recipe (unmapped keys listed; exit 2 "
        "if one asks for what meshforge cannot do)",
    )
    ic.add_argument("source", help="ds_config.json or a TorchTitan job .toml")
    ic.add_argument("--out", required=True, help="the recipe to write, e.g. recipe.toml")
    ic.add_argument("--world", type=int, default=None, help="GPUs the config was for (DeepSpeed: required)")
    ic.add_argument("--model", default=None, help="family:flavor, e.g. llama3:8b (DeepSpeed names no model)")
    ic.add_argument("--base", default=None, help="a recipe to extend (model, data, seq_len, steps from it)")
    ic.add_argument(
        "--allow-unmapped",
        action="store_true",
        help="write the recipe even if keys meshforge cannot do are left out",
    )
    sw = _recipe_items(add("sweep", "try every valid mesh shape of a recipe; rank the layouts"))
    add_sweep_args(sw)
    tun = _recipe_items(
        add(
            "tune",
            "predict every layout's step time before launching, rank those that fit by tokens/s, "
            "confirm the top ones by short runs (--calibrate: measure this machine's profile first)",
        ),
        nproc=False,
    )
    tun.add_argument("--world", type=int, default=None, help="world size (default: the recipe's mesh)")
    tun.add_argument(
        "--profile", default=None, help="h100, h200 or a profile TOML (default: this machine's, calibrated)"
    )
    tun.add_argument(
        "--axis", action="append", default=[], metavar="KEY=V1,V2", help="a policy axis (repeatable)"
    )
    tun.add_argument("--top", type=int, default=3, help="how many of the best predicted points to run")
    tun.add_argument("--plan", action="store_true", help="predict and rank only; launch nothing")
    tun.add_argument("--tune-dir", default=None, help="folder (default: <output_dir>/tune-<recipe>-w<world>)")
    tun.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine (matmul and memory rates, collectives of 2..world ranks) and "
        "write its profile (--profile-out) before anything else",
    )
    tun.add_argument("--profile-out", default=None, help="where --calibrate writes the profile")
    tun.add_argument(
        "--calibrate-from",
        action="append",
        default=[],
        metavar="RUNS",
        help="refine the profile by measured runs (a sweep, tune or run folder: their steady step "
        "times; repeatable), write it to ./meshforge-profile-<name>+runs.toml, then predict with it",
    )
    sea = _recipe_items(
        add(
            "search",
            "search recipe fields (lr, warmup, layouts, ...) with Optuna: each trial an ordinary run, "
            "pruned early when it trails; the study kept in SQLite (or --storage), continued by a rerun",
        ),
        nproc=False,
    )
    sea.add_argument(
        "--space",
        action="append",
        default=[],
        metavar="KEY=SPEC",
        help="a recipe field and its range: log(1e-4,1e-2), float(a,b[,step]), int(0,200[,step]) or "
        "choice(a,b,...) (repeatable)",
    )
    sea.add_argument(
        "--trials", type=int, default=20, help="trials the study holds when done (a rerun continues)"
    )
    sea.add_argument(
        "--objective",
        default=None,
        help="a logged metric, its last value (default: eval/loss if the recipe evaluates, else loss)",
    )
    sea.add_argument("--direction", choices=["min", "max"], default="min", help="minimise or maximise it")
    sea.add_argument(
        "--storage", default=None, help="Optuna storage URL (default: sqlite:///<search-dir>/study.db)"
    )
    sea.add_argument("--workers", type=int, default=1, help="trials run at once, sharing the study")
    sea.add_argument(
        "--pruner",
        choices=["median", "halving", "hyperband", "none"],
        default="median",
        help="stops trials that trail at an intermediate step (each eval, else each logged loss)",
    )
    sea.add_argument(
        "--startup-trials", type=int, default=5, help="median pruner: trials run to the end before it prunes"
    )
    sea.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="runs per trial (model and data seed +0..K-1); objective: their mean",
    )
    sea.add_argument("--search-dir", default=None, help="folder (default: <output_dir>/<study>)")
    sea.add_argument(
        "--study", default=None, help="the study's name in the storage (default: search-<recipe>)"
    )
    cmp = add("compare", "compare runs or sweeps side by side from their local records (offline)")
    cmp.add_argument("paths", nargs="+", help="run folders, sweep folders, or folders of runs")
    cmp.add_argument(
        "--out",
        default=None,
        help="folder for the PNG plots (default: compare/ beside the runs: the folder that holds them)",
    )
    cmp.add_argument("--metrics", default="loss", help="comma-separated metrics to plot, e.g. loss,grad_norm")
    cmp.add_argument("--align", choices=["step", "tokens"], default="step", help="x axis of the metric plots")
    cmp.add_argument("--baseline", default=None, help="parity mode: compare every run's losses with this run")
    cmp.add_argument("--tol", type=float, default=1e-5, help="parity tolerance on loss and grad norm")
    est = _recipe_items(
        add(
            "estimate",
            "per-rank peak memory before launching (traced on fake tensors, and "
            "analytic), for one or every mesh",
        ),
        nproc=False,
    )
    est.add_argument("--world", type=int, default=None, help="world size (default: the recipe's mesh)")
    est.add_argument("--all-meshes", action="store_true", help="every valid mesh of --world ranks")
    est.add_argument("--device-memory", default=None, help="e.g. 80GiB: mark which layouts fit")
    est.add_argument(
        "--analytic", action="store_true", help="formulas only (instant; no trace, no categories)"
    )
    par = add("parity", "the torch model vs its JAX twin on the same tokens (needs the jax extra)")
    par.add_argument("items", nargs="*", metavar="RECIPE|CHECKPOINT|key=value")
    par.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    par.add_argument(
        "--sharpen",
        type=float,
        default=None,
        help="scale attention and output weights (default 8 "
        "for fresh weights, whose flat logits hide bugs; 1 for checkpoints)",
    )
    par.add_argument("--samples", type=int, default=4, help="sequences compared")
    par.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    pps = _recipe_items(
        add("pp-schedule", "draw a recipe's pipeline schedule per rank, with its bubble fraction"),
        nproc=False,
    )
    pps.add_argument("--out", default="pp_schedule.png", help="PNG to write")
    exp = add("export", "export a checkpoint's model")
    exp.add_argument("checkpoint", help="a step-NNNNNNNN checkpoint folder, or a checkpoints folder (newest)")
    exp.add_argument(
        "--to",
        choices=["safetensors", "hf", "torchtitan", "jax", "maxtext"],
        default="safetensors",
        help="safetensors (our names), hf (HF Llama folder), torchtitan (0.3.0 names), jax (Orbax pytree), "
        "maxtext (MaxText's scanned parameter checkpoint: load_parameters_path=OUT/0/items)",
    )
    exp.add_argument(
        "--max-shard-size", default=None, help="--to hf: largest safetensors shard, e.g. 5GB (HF's default)"
    )
    exp.add_argument("out", help="output folder")
    return out
