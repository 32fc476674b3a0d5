"""What a run is, said once for the torch and JAX trainers: run.json's fields, the loggers'
config and hyperparameters, the terminal's banner, and opening the run's records."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from meshforge.configs import Recipe, recipe_to_dict, recipe_to_toml
from meshforge.core.topology import ParallelDims
from meshforge.run.checkpoint.dcp import checkpoint_folder, read_meta
from meshforge.run.observe.console import Banner, RunConsole
from meshforge.run.observe.figures import save_breakdown, save_pipeline
from meshforge.run.observe.loggers import LoggerContainer, build_loggers
from meshforge.run.observe.record import RunRecord
from meshforge.run.rank.plan import model_source


def run_info(recipe: Recipe, dims: ParallelDims, device: str, n_params: int, **extra) -> dict:
    """run.json's description of the run (RunRecord adds id, status, times, versions)."""
    return {
        "recipe": recipe_to_dict(recipe),
        "mesh": dims.degrees,
        "world_size": dims.world_size,
        "device": device,
        "n_params": n_params,
        "launch": launch_info(),
        **extra,
    }


def launch_info() -> dict:
    """How the ranks were started: torchrun's node count (its agents, GROUP_WORLD_SIZE) and
    ranks per node, and the Slurm job when there is one."""
    env = os.environ
    return {
        "nodes": int(env.get("GROUP_WORLD_SIZE", 1)),
        "ranks_per_node": int(env.get("LOCAL_WORLD_SIZE", 1)),
        "slurm_job_id": env.get("SLURM_JOB_ID"),
    }


def logger_config(recipe: Recipe, dims: ParallelDims) -> dict:
    """The loggers' config: the nested recipe exactly (group and filter by mesh.tp,
    pp.schedule, ...), plus keys that overwrite none of it: the layout's label and world size."""
    return {**recipe_to_dict(recipe), "layout": dims.label(), "world_size": dims.world_size}


def hparams(recipe: Recipe, dims: ParallelDims) -> dict:
    """The layout and policies TensorBoard's HParams view compares runs by."""
    r = recipe
    return {
        "layout": dims.label(),
        "world_size": dims.world_size,
        **{f"mesh.{k}": v for k, v in dims.degrees.items()},
        "model": model_source(r),
        "pp.schedule": r.pp.schedule,
        "fsdp.param_dtype": r.fsdp.param_dtype,
        "activation_checkpoint.mode": r.activation_checkpoint.mode,
        "compile.enabled": r.compile.enabled,
        "float8": r.float8.recipe if r.float8.enabled else "off",
        "backend": r.backend,
    }


def banner(
    recipe: Recipe,
    dims: ParallelDims,
    n_params: int,
    device_type: str,
    layout: list[list[int]] | None = None,
    loss_floor: float | None = None,
    resumed: dict | None = None,
) -> Banner:
    """The run's first lines: model, size, backend, mesh, where a resumed run starts, pipeline
    stages, the data's loss floor. `resumed`: the trainer's {path, step, run_id}."""
    pipeline = None
    if layout is not None:
        stages = "; ".join(f"stage {s}: layers {ids}" for s, ids in enumerate(layout))
        pipeline = f"pipeline {recipe.pp.schedule} x {recipe.pp.microbatches} microbatches: {stages}"
    r = recipe
    return Banner(
        r.run_name,
        model_source(r),
        n_params,
        dims.world_size,
        device_type,
        dims.spelled(),
        r.train.steps,
        pipeline,
        loss_floor,
        precision_line(r, device_type),
        r.backend,
        resumed_line(r, resumed),
        resumed["step"] if resumed else 0,
    )


def resumed_line(recipe: Recipe, resumed: dict | None) -> str | None:
    """'resumed from step N (checkpoint PATH; recipe changes: KEY OLD -> NEW, ...)', or what
    `checkpoint.load=auto` did when it found no checkpoint; None for a run that resumes nothing."""
    if not resumed:
        return None
    if resumed["path"] is None:
        folder = checkpoint_folder(recipe.checkpoint, Path(recipe.output_dir) / recipe.run_name)
        return f"no checkpoint in {folder} yet: starting from step 0 (checkpoint.load=auto)"
    saved = read_meta(Path(resumed["path"]))["recipe"]
    changes = [
        f"{key} {old!r} -> {new!r}"
        for key, (old, new) in recipe_changes(saved, recipe_to_dict(recipe)).items()
        if key != "checkpoint.load"  # how this run found the checkpoint, not a change to what it trains
    ]
    said = ", ".join(changes) or "none"
    return f"resumed from step {resumed['step']} (checkpoint {resumed['path']}; recipe changes: {said})"


def recipe_changes(saved: dict, now: dict, prefix: str = "") -> dict[str, tuple]:
    """Dotted key -> (saved, now) for every value that differs between two nested recipes."""
    out: dict[str, tuple] = {}
    for key in dict.fromkeys([*saved, *now]):
        old, new = saved.get(key), now.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            out.update(recipe_changes(old, new, f"{prefix}{key}."))
        elif old != new:
            out[f"{prefix}{key}"] = (old, new)
    return out


def precision_line(r: Recipe, device_type: str) -> str | None:
    """What trains in float8 and what does not, when it is on (and that a CPU emulates it)."""
    if not r.float8.enabled:
        return None
    kept = ", ".join([*r.float8.exclude, "MoE routers and experts", "layers with a dim not divisible by 16"])
    recipe, dtype = r.float8.recipe, r.fsdp.param_dtype
    emulated = "; emulated on CPU: float8 operands, fp32 matmuls" if device_type == "cpu" else ""
    return (
        f"float8 ({recipe} scaling, torchao{emulated}): the linear layers' matmuls; kept in {dtype}: {kept}"
    )


def open_run(
    recipe: Recipe,
    dims: ParallelDims,
    info: dict,
    console: RunConsole,
    about: Banner,
    resumed: dict | None = None,
) -> tuple[RunRecord, LoggerContainer]:
    """The run's records, opened by the process that logs: run.json, `<run>/recipe.toml` (the
    resolved recipe, also a W&B artifact and TensorBoard text), the loggers (continuing a
    resumed run without duplicate steps); run.json also keeps the banner and where each
    logger writes, so a launcher can show the run from its records."""
    run_dir = Path(recipe.output_dir) / recipe.run_name
    record = RunRecord(run_dir, recipe.run_name, {**info, "banner": dataclasses.asdict(about)}, resumed)
    set_aside = record.set_aside.line() if record.set_aside else None
    if set_aside:
        console.note(set_aside)
    toml = recipe_to_toml(recipe)
    (run_dir / "recipe.toml").write_text(toml)
    resumed_step = resumed["step"] if resumed else None
    config = logger_config(recipe, dims)
    if "optimizer_groups" in info:  # the parameter groups the optimizer was built with (torch runs)
        config["optimizer_groups"] = info["optimizer_groups"]
    loggers = build_loggers(
        recipe.logging,
        run_dir,
        recipe.run_name,
        record.run_id,
        config,
        console.console,
        resumed_step,
        set_aside,
    )
    loggers.describe(run_dir / "recipe.toml", toml, hparams(recipe, dims), record.run_id)
    record.info["loggers"] = loggers.paths()
    if "wandb" in record.info["loggers"]:
        record.info["wandb"] = record.info["loggers"]["wandb"]
    record.write()
    return record, loggers


def draw_pipeline(schedule, recipe: Recipe, record: RunRecord, loggers: LoggerContainer, step: int) -> None:
    """The schedule that runs, per rank, as a picture (run folder and W&B) and a bubble figure."""
    title = f"{recipe.pp.schedule}, {recipe.pp.microbatches} microbatches"
    fig, record.info["pp_bubble_fraction"] = save_pipeline(
        schedule, title, record.run_dir / "pp_schedule.png"
    )
    loggers.log_figure("pp_schedule", fig, step)
    fig.clf()


def draw_breakdown(per_rank: list[dict], recipe: Recipe, step: int, loggers: LoggerContainer) -> None:
    """Memory by category per rank at the tracked step, as a stacked bar (run folder and loggers)."""
    run_dir = Path(recipe.output_dir) / recipe.run_name
    title = f"{recipe.run_name}: memory by category at step {step}"
    fig = save_breakdown(per_rank, run_dir / "memory_breakdown.png", title)
    loggers.log_figure("memory_breakdown", fig, step)
    fig.clf()


def log_final(
    loggers: LoggerContainer, recipe: Recipe, per_rank_memory: list[dict], latest: Path | None
) -> None:
    """Per-rank memory as a table; with logging.wandb_log_checkpoint, the final checkpoint."""
    if per_rank_memory:
        keys = list(per_rank_memory[0])
        rows = [[i, *map(r.get, keys)] for i, r in enumerate(per_rank_memory)]
        loggers.log_table("memory_per_rank", ["rank", *keys], rows)
    if recipe.logging.wandb_log_checkpoint and latest is not None:
        loggers.log_checkpoint(latest, f"checkpoint-{recipe.run_name}")
