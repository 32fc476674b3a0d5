"""Sweep one recipe over every valid mesh shape (and policy axes) to find the fastest layout.

W&B's sweep controller needs a server and cannot express dp_replicate*dp_shard*tp*pp ==
world size, so the grid is built here. Each point is validated (refusals are recorded
with the reason), checked against the device memory (skips are recorded with the
estimate), then launched as its own `run_recipe` process with a timeout: a point that
fails, OOMs or hangs is recorded and the sweep goes on. `sweep.jsonl` is appended point
by point, so rerunning the same sweep skips the points already finished.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from meshforge.configs import Recipe, RecipeError
from meshforge.core.topology import ParallelDims
from meshforge.core.units import GiB
from meshforge.experiments.compare import find_runs
from meshforge.recipe import load_recipe
from meshforge.run.loggers import wandb_settings
from meshforge.run.plan import make_plan
from meshforge.simulate.estimate import trace_pool, traced_estimate


def mesh_shapes(world: int) -> list[dict[str, int]]:
    """Every mesh of `world` ranks, as {dim: degree} (ParallelDims.all_of_world)."""
    return [dims.degrees for dims in ParallelDims.all_of_world(world)]


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


def sweep_points(world: int, axes: dict[str, list[str]]) -> list[Point]:
    names = list(axes)
    points = []
    for mesh in mesh_shapes(world):
        for values in itertools.product(*(axes[n] for n in names)):
            policy = dict(zip(names, map(str, values)))
            points.append(Point(point_label(mesh, policy), mesh, policy))
    return points


def _read_rows(path: Path) -> dict[str, dict]:
    if not path.is_file():
        return {}
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["label"]] = row  # a later row for a point supersedes an earlier one
    return rows


def _run_point(cmd: list[str], timeout: int, log: Path) -> tuple[str, str]:
    """Run one point in its own process group; (status, error tail)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the point and every rank it started
            proc.wait()
            return "hung", f"no result after {timeout}s; stopped"
    if rc == 0:
        return "finished", ""
    lines = log.read_text(errors="replace").strip().splitlines()
    # run_recipe's own one-line verdict ("error: rank 1 failed ...: <message>") if there is one
    verdict = [line for line in lines if line.startswith("error:")] or lines[-1:]
    message = verdict[-1].removeprefix("error: ")[:500]
    oom = "out of memory" in message.lower() or "SIGKILL" in message
    return ("oom" if oom else "failed"), message


def _measure(run_dir: Path) -> dict:
    """A finished point's figures, read as `compare` reads them (its steady steps)."""
    (run,) = find_runs([run_dir])
    peak_max, peak_min = run.peak_memory()
    tp = run.throughput()
    return {
        "tokens_per_sec": tp["tokens_per_sec"],
        "tokens_per_sec_per_device": tp["tokens_per_sec_per_device"],
        "step_time": tp["step_time"],
        "peak_gib_max": peak_max,
        "peak_gib_min": peak_min,
        "final_loss": run.rows[-1]["loss"],
    }


def run_sweep(
    recipe_path: str,
    overrides: list[str],
    world: int,
    axes: dict[str, list[str]] | None = None,
    sweep_dir: Path | None = None,
    console: Console | None = None,
) -> Path:
    """Sweep `recipe_path` over every mesh of `world` ranks (x the recipe's and `axes`'
    policy values); returns the sweep folder."""
    console = console or Console(soft_wrap=True)
    base = load_recipe(recipe_path, [*overrides, *_mesh_for(world)], world_size=world)
    sw = base.sweep
    sw.axes = {**sw.axes, **(axes or {})}
    stem = Path(str(recipe_path)).stem
    sweep_dir = sweep_dir or Path(base.output_dir) / f"sweep-{stem}-w{world}"
    sweep_dir.mkdir(parents=True, exist_ok=True)
    record = sweep_dir / "sweep.jsonl"
    done = _read_rows(record)
    group = base.logging.wandb_group or f"{stem}/{sweep_dir.name}"
    points = sweep_points(world, sw.axes)
    console.print(
        f"sweep {sweep_dir}: {len(points)} points over {world} ranks "
        f"({len(mesh_shapes(world))} meshes x {max(1, len(points) // len(mesh_shapes(world)))} policies)"
    )
    pool = trace_pool()  # estimate workers for the whole sweep (exiting also stops them)
    for i, pt in enumerate(points, 1):
        if done.get(pt.label, {}).get("status") in ("finished", "refused", "skipped"):
            console.print(f"[{i}/{len(points)}] {pt.label}: {done[pt.label]['status']} earlier, kept")
            continue
        row = {"label": pt.label, "mesh": pt.mesh, "policy": pt.policy, "overrides": pt.overrides()}
        point_overrides = [
            *overrides,
            *pt.overrides(),
            f"train.steps={sw.steps}",
            f"output_dir={sweep_dir}",
            f"run_name={pt.label}",
            f"logging.wandb_group={group}",
            f"logging.wandb_tags=[sweep,{pt.label}]",
            "logging.wandb_job_type=sweep-point",
            "logging.progress=false",
        ]
        try:
            recipe = load_recipe(recipe_path, point_overrides, world_size=world)
        except RecipeError as e:
            row.update(status="refused", error="; ".join(str(p) for p in e.problems))
            _append(record, row, console, i, len(points))
            continue
        # the traced estimate (heaviest rank, fake tensors) decides; the analytic one is kept beside it
        estimate = traced_estimate(recipe, pool)["total"]
        row["estimate_gib"], row["estimate_bytes"] = round(estimate / GiB, 3), estimate
        row["analytic_gib"] = round(make_plan(recipe).bytes_per_rank / GiB, 3)
        if sw.device_memory_gib is not None and estimate > sw.device_memory_gib * GiB:
            row.update(
                status="skipped", error=f"estimate {row['estimate_gib']} GiB > {sw.device_memory_gib} GiB"
            )
            _append(record, row, console, i, len(points))
            continue
        cmd = [sys.executable, "-m", "meshforge.cli", str(recipe_path), *point_overrides]
        start = time.monotonic()
        status, error = _run_point(cmd, sw.timeout_s, sweep_dir / f"{pt.label}.log")
        row.update(status=status, error=error, wall_s=round(time.monotonic() - start, 1))
        if status == "finished":
            row.update(_measure(sweep_dir / pt.label))
        _append(record, row, console, i, len(points))
    pool.shutdown()
    rows = list(_read_rows(record).values())
    (console if console.is_terminal else Console(width=150)).print(summary_table(rows))
    for r in rows:
        if r["status"] != "finished":
            console.print(f"  {r['label']}: {r['status']}: {r.get('error', '')}", highlight=False)
    best = rank_rows(rows)
    if best:
        console.print(
            f"fastest layout that fits: [bold]{best[0]['label']}[/] "
            f"({best[0]['tokens_per_sec']:,.0f} tokens/s); reproduce with: " + " ".join(best[0]["overrides"]),
            highlight=False,
        )
    _log_wandb_table(base, group, rows, sweep_dir)
    return sweep_dir


def _mesh_for(world: int) -> list[str]:
    # the base recipe is validated on a 1-D mesh of `world`; each point sets its own
    return ParallelDims(dp_shard=world).overrides()


def _append(record: Path, row: dict, console: Console, i: int, n: int) -> None:
    with open(record, "a") as f:
        f.write(json.dumps(row) + "\n")
    extra = (
        f"{row['tokens_per_sec']:,.0f} tok/s" if row["status"] == "finished" else row.get("error", "")[:160]
    )
    console.print(f"[{i}/{n}] {row['label']}: {row['status']} {extra}", highlight=False)


def rank_rows(rows: list[dict]) -> list[dict]:
    """Finished points, fastest first."""
    return sorted((r for r in rows if r["status"] == "finished"), key=lambda r: -r["tokens_per_sec"])


def summary_table(rows: list[dict]) -> Table:
    table = Table(title="sweep: fastest first")
    for col in (
        "#",
        "layout",
        "status",
        "tokens/s",
        "step s",
        "peak mem max/min GiB",
        "estimate GiB",
        "final loss",
    ):
        table.add_column(col)
    ranked = rank_rows(rows)
    others = [r for r in rows if r["status"] != "finished"]
    for i, r in enumerate(ranked + others, 1):
        fin = r["status"] == "finished"
        mem = (
            f"{r['peak_gib_max']:.2f}/{r['peak_gib_min']:.2f}"
            if fin and r.get("peak_gib_max") is not None
            else ""
        )
        table.add_row(
            str(i) if fin else "-",
            r["label"],
            r["status"],
            f"{r['tokens_per_sec']:,.0f}" if fin else "",
            f"{r['step_time']:.3f}" if fin else "",
            mem,
            str(r.get("estimate_gib", "")),
            f"{r['final_loss']:.4f}" if fin else "",
        )
    return table


def _log_wandb_table(base: Recipe, group: str, rows: list[dict], sweep_dir: Path) -> None:
    """The sweep summary as a W&B Table in the sweep's group, job_type sweep-summary (offline
    without a key), in the sweep folder."""
    if not base.logging.wandb:
        return
    settings = {**wandb_settings(base.logging), "group": group, "job_type": "sweep-summary"}
    if settings["mode"] == "disabled":
        return
    import wandb  # slow to import: only when the sweep logs its table

    cols = [
        "label",
        "status",
        "dp_replicate",
        "dp_shard",
        "tp",
        "pp",
        "tokens_per_sec",
        "step_time",
        "final_loss",
    ]
    table = wandb.Table(columns=cols)
    for r in rows:
        mesh = [r["mesh"][k] for k in ("dp_replicate", "dp_shard", "tp", "pp")]
        table.add_data(
            r["label"], r["status"], *mesh, r.get("tokens_per_sec"), r.get("step_time"), r.get("final_loss")
        )
    run = wandb.init(
        name="sweep-summary",
        dir=str(sweep_dir),
        settings=wandb.Settings(init_timeout=60, silent=True),
        **settings,
    )
    run.log({"sweep_summary": table})
    run.finish()
