"""`sweep.jsonl`: one row per point and event, appended as it happens, so a sweep that is
stopped loses nothing and its rerun knows every point's last state (the later row wins)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from meshforge.experiments.compare import find_runs


def read_rows(path: Path) -> dict[str, dict]:
    """Each point's latest row, by label."""
    if not path.is_file():
        return {}
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["label"]] = row  # a later row for a point supersedes an earlier one
    return rows


def append_row(record: Path, row: dict, console: Console, i: int, n: int) -> None:
    """Append the row and say it on one line."""
    with open(record, "a") as f:
        f.write(json.dumps(row) + "\n")
    if row["status"] == "finished":
        extra = f"{row['tokens_per_sec']:,.0f} tok/s"
    elif row["status"] in ("queued", "running"):
        extra = f"slurm job {row['job_id']}" + (f" on {row['nodelist']}" if row.get("nodelist") else "")
    else:
        extra = row.get("error", "")[:160]
    console.print(f"[{i}/{n}] {row['label']}: {row['status']} {extra}", highlight=False)


def log_verdict(log: Path) -> str:
    """A failed point's reason from its log: run_recipe's own one-line verdict
    ("error: rank 1 failed ...: <message>") if there is one, else the last line."""
    lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    verdict = [line for line in lines if line.startswith("error:")] or lines[-1:] or ["(its log is empty)"]
    return verdict[-1].removeprefix("error: ")[:500]


def run_finished(run_dir: Path) -> bool:
    """Whether the point's run recorded itself finished (run.json)."""
    path = run_dir / "run.json"
    return path.is_file() and json.loads(path.read_text()).get("status") == "finished"


# what `measure` reads of a finished point (a sweep's row holds them flat, a tune's under `measured`)
MEASURED = (
    "tokens_per_sec",
    "tokens_per_sec_per_device",
    "step_time",
    "peak_gib_max",
    "peak_gib_min",
    "final_loss",
)


def measure(run_dir: Path) -> dict:
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
