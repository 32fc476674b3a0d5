"""`meshforge estimate`: per-rank memory of a recipe (or of every mesh of a world size)
before launching, from the analytic plan (no allocation, no devices): model states at
16 bytes/parameter divided by the sharding, plus a rough activation term (plan.py)."""

from __future__ import annotations

from rich.table import Table

from meshforge.configs import RecipeError, load_recipe
from meshforge.plan import GiB, make_plan
from meshforge.sweep import mesh_shapes, point_label


def parse_bytes(text: str) -> float:
    """'80GiB', '80GB', '80' (GiB) -> bytes."""
    t = text.strip().lower().replace(" ", "")
    for suffix, scale in (("gib", GiB), ("gb", 1e9), ("mib", 2**20), ("mb", 1e6), ("tib", 2**40)):
        if t.endswith(suffix):
            return float(t[: -len(suffix)]) * scale
    return float(t) * GiB


def estimate_rows(recipe_path: str, overrides: list[str], world: int, all_meshes: bool) -> list[dict]:
    meshes = mesh_shapes(world) if all_meshes else [None]
    rows = []
    for mesh in meshes:
        extra = [f"mesh.{k}={v}" for k, v in mesh.items()] if mesh else []
        try:
            recipe = load_recipe(recipe_path, [*overrides, *extra], world_size=world)
        except RecipeError as e:
            rows.append({"layout": point_label(mesh, {}) if mesh else "recipe", "refused": str(e.problems[0])})
            continue
        plan = make_plan(recipe)
        d = recipe.mesh
        rows.append({"layout": point_label({"dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "tp": d.tp,
                                            "pp": d.pp}, {}),
                     "states": plan.state_bytes_per_rank, "activations": plan.activation_bytes_per_rank,
                     "total": plan.bytes_per_rank})
    return sorted(rows, key=lambda r: r.get("total", float("inf")))


def estimate_table(rows: list[dict], device_memory: float | None) -> Table:
    title = "estimated peak memory per rank (analytic)"
    if device_memory:
        title += f", device {device_memory / GiB:.0f} GiB"
    table = Table(title=title)
    for c in ("layout", "model states GiB", "activations GiB", "total GiB", "fits"):
        table.add_column(c)
    for r in rows:
        if "refused" in r:
            table.add_row(r["layout"], "", "", "", f"refused: {r['refused']}")
            continue
        fits = "" if device_memory is None else ("yes" if r["total"] <= device_memory else "[red]no[/]")
        table.add_row(r["layout"], f"{r['states'] / GiB:.2f}", f"{r['activations'] / GiB:.2f}",
                      f"{r['total'] / GiB:.2f}", fits)
    return table
