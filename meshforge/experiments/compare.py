"""Compare runs side by side from their local records, fully offline: a table and PNG plots,
and a loss-parity check (does a new layout train the same model as a baseline?)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from matplotlib.figure import Figure  # the object API: files only, no pyplot backend chosen
from rich.table import Table

from meshforge.configs import ACPolicy
from meshforge.core.errors import NothingProduced, UsageError
from meshforge.core.tables import add_name_column
from meshforge.core.topology import ParallelDims
from meshforge.run.observe.memory import PEAK
from meshforge.run.observe.record import steady_throughput, step_times_of_rows

THROUGHPUT_KEYS = ("tokens_per_sec", "step_time", "tokens_per_sec_per_device", "tflops_per_device")


@dataclass
class Run:
    name: str
    path: Path
    info: dict  # run.json
    rows: list[dict]  # metrics.jsonl

    @property
    def layout(self) -> str:
        return ParallelDims.from_degrees(self.info["mesh"]).label()

    @property
    def policy(self) -> str:
        r, dims = self.info["recipe"], ParallelDims.from_degrees(self.info["mesh"])
        parts = []
        if dims.pp_enabled:
            parts.append(f"{r['pp']['schedule']} x{r['pp']['microbatches']}")
        if dims.cp_enabled:  # records from before cp have no [cp]: they read as cp 1
            parts.append(f"cp {r['cp']['method']}")
        if ACPolicy(r["activation_checkpoint"]["mode"]).enabled:
            parts.append(f"AC {r['activation_checkpoint']['mode']}")
        if r["fsdp"]["param_dtype"] != "float32":
            parts.append(r["fsdp"]["param_dtype"])
        if not r["fsdp"]["reshard_after_forward"] and dims.fsdp_shard > 1:
            parts.append("no reshard")
        if r["compile"]["enabled"]:
            parts.append("compile")
        return ", ".join(parts) or "-"

    @property
    def tokens_per_step(self) -> int:
        t = self.info["recipe"]["train"]
        return t["global_batch_size"] * t["seq_len"]

    def throughput(self) -> dict[str, float | None]:
        """Steady tokens/s (all ranks, per device), TFLOP/s per device and step time: the
        run's summary (over every step), or for a run that ended without one, its logged
        steps under the same rule (`run.record.steady_throughput`)."""
        summary = self.info.get("summary") or {}
        if "tokens_per_sec" in summary:
            return {k: summary.get(k) for k in THROUGHPUT_KEYS}
        warmup = self.info["recipe"].get("logging", {}).get("warmup_steps", 2)
        times = step_times_of_rows(self.rows, warmup)
        if not times:
            return dict.fromkeys(THROUGHPUT_KEYS)
        steady, first = steady_throughput(times), next(r for r in self.rows if "step_time" in r)
        tps, world = steady["tokens_per_sec"], self.info["world_size"]
        return {
            "tokens_per_sec": tps,
            "tokens_per_sec_per_device": tps / world,
            "tflops_per_device": first["tflops_per_device"] * tps / first["tokens_per_sec"],
            "step_time": steady["step_time"],
        }

    def peak_memory(self) -> tuple[float | None, float | None]:
        """GiB at the last logged step: the largest rank's peak, and the smallest rank's."""
        kind = PEAK["cuda" if self.info.get("device") == "cuda" else "cpu"]
        last = self.rows[-1] if self.rows else {}
        return last.get(f"memory/{kind}"), last.get(f"memory_min/{kind}")

    def per_rank_peak(self) -> list[float]:
        kind = PEAK["cuda" if self.info.get("device") == "cuda" else "cpu"]
        return [r[kind] for r in self.info.get("summary", {}).get("per_rank_memory", [])]


def find_runs(paths: list[Path]) -> list[Run]:
    """Runs under `paths`: a run folder (run.json), a sweep folder (sweep.jsonl), or a folder of runs."""
    found: list[Path] = []
    for p in paths:
        if (p / "run.json").is_file():
            found.append(p)
        elif (p / "sweep.jsonl").is_file():
            labels = [
                json.loads(line)["label"]
                for line in (p / "sweep.jsonl").read_text().splitlines()
                if line.strip()
            ]
            found += [p / lab for lab in dict.fromkeys(labels) if (p / lab / "run.json").is_file()]
        else:
            found += sorted(q.parent for q in p.glob("*/run.json"))
    if not found:
        raise UsageError(
            f"no runs under {', '.join(map(str, paths))}: expected <run>/run.json or a sweep folder's "
            "sweep.jsonl; pass run folders, their parent, or sweep folders"
        )
    runs = []
    for d in found:
        metrics = d / "metrics.jsonl"
        rows = (
            [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
            if metrics.is_file()
            else []
        )
        runs.append(Run(d.name, d, json.loads((d / "run.json").read_text()), rows))
    return runs


def comparison_table(runs: list[Run]) -> Table:
    common = min((r.rows[-1]["step"] for r in runs if r.rows), default=None)
    table = Table(title="runs side by side")
    add_name_column(table, "run", (r.name for r in runs))
    add_name_column(table, "layout", (r.layout for r in runs))
    cols = [
        "policy",
        "world",
        "status",
        "tokens/s",
        "tokens/s/device",
        "TFLOP/s/device",
        "step s",
        "peak mem max/min GiB",
        "final loss",
        f"loss @ step {common}",
        "eval loss (ppl)",
    ]
    for c in cols:
        table.add_column(c)
    for r in runs:
        # the records' own figures: one FLOP formula (run/observe/flops.py) for the run, its records and here
        tp = r.throughput()
        tps, step_time, per_device, tflops = (tp[k] for k in THROUGHPUT_KEYS)
        mx, mn = r.peak_memory()
        at_common = next((x["loss"] for x in r.rows if x["step"] == common), None)
        evaluated = [x for x in r.rows if "eval/loss" in x]  # the last evaluation, at its step
        ev = evaluated[-1] if evaluated else None
        table.add_row(
            r.name,
            r.layout,
            r.policy,
            str(r.info["world_size"]),
            r.info["status"],
            f"{tps:,.0f}" if tps else "",
            f"{per_device:,.0f}" if per_device else "",
            f"{tflops:.4g}" if tflops else "",
            f"{step_time:.3f}" if step_time else "",
            f"{mx:.2f}/{mn:.2f}" if mx is not None else "",
            f"{r.rows[-1]['loss']:.4f}" if r.rows else "",
            f"{at_common:.4f}" if at_common is not None else "",
            f"{ev['eval/loss']:.4f} ({ev['eval/perplexity']:.1f}) @ {ev['step']}" if ev else "",
        )
    return table


def plot_metric(runs: list[Run], metric: str = "loss", align: str = "step"):
    """One line per run: `metric` against step or tokens seen."""
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for r in runs:
        rows = [x for x in r.rows if metric in x]
        xs = [x["step"] * (r.tokens_per_step if align == "tokens" else 1) for x in rows]
        ax.plot(xs, [x[metric] for x in rows], label=r.name)
    ax.set_xlabel("tokens" if align == "tokens" else "step")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs {ax.get_xlabel()}")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def plot_throughput(runs: list[Run]):
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    names = [r.name for r in runs]
    ax.bar(names, [r.throughput()["tokens_per_sec"] or 0 for r in runs])
    ax.set_ylabel("tokens/s (all ranks, steady steps)")
    ax.set_title("throughput")
    ax.tick_params(axis="x", rotation=45, labelsize="small")
    fig.tight_layout()
    return fig


def plot_memory(runs: list[Run]):
    """Peak memory per rank, grouped by run."""
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    width = 0.8 / max(1, max((len(r.per_rank_peak()) for r in runs), default=1))
    labelled: set[int] = set()
    for i, r in enumerate(runs):
        for rank, value in enumerate(r.per_rank_peak()):
            label = None if rank in labelled else f"rank {rank}"
            labelled.add(rank)
            ax.bar(i + rank * width, value, width, color=f"C{rank % 10}", label=label)
    ax.set_xticks(
        [i + 0.4 - width / 2 for i in range(len(runs))], [r.name for r in runs], rotation=45, fontsize="small"
    )
    ax.set_ylabel("peak memory (GiB)")
    ax.set_title("peak memory per rank")
    if any(r.per_rank_peak() for r in runs):
        ax.legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    return fig


def parity(runs: list[Run], baseline: str, tol: float) -> list[dict]:
    """Max per-step |Δloss| and |Δgrad_norm| of every run against `baseline`, on common steps."""
    base = next((r for r in runs if r.name == baseline), None)
    if base is None:
        names = ", ".join(r.name for r in runs)
        raise UsageError(f"--baseline {baseline!r} is not among the runs; use one of: {names}")
    ref = {x["step"]: x for x in base.rows}
    out = []
    for r in runs:
        if r is base:
            continue
        common = [x for x in r.rows if x["step"] in ref]
        dl = max((abs(x["loss"] - ref[x["step"]]["loss"]) for x in common), default=float("nan"))
        dg = max((abs(x["grad_norm"] - ref[x["step"]]["grad_norm"]) for x in common), default=float("nan"))
        out.append(
            {
                "run": r.name,
                "steps": len(common),
                "max_dloss": dl,
                "max_dgrad_norm": dg,
                "ok": bool(common) and dl <= tol and dg <= tol,
            }
        )
    return out


def parity_table(results: list[dict], baseline: str, tol: float) -> Table:
    table = Table(title=f"loss parity against {baseline} (tolerance {tol:g})")
    for c in ("run", "common steps", "max |Δloss|", "max |Δgrad_norm|", "verdict"):
        table.add_column(c)
    for p in results:
        table.add_row(
            p["run"],
            str(p["steps"]),
            f"{p['max_dloss']:.2e}",
            f"{p['max_dgrad_norm']:.2e}",
            "same" if p["ok"] else "[bold red]DIFFERENT[/]",
        )
    return table


def logged_metrics(runs: list[Run], metrics: list[str]) -> list[str]:
    """`metrics`, each logged by at least one run; a NothingProduced naming the ones no run logged."""
    logged = {k for r in runs for row in r.rows for k in row}
    if unknown := [m for m in metrics if m not in logged]:
        known = ", ".join(sorted(k for k in logged if k not in ("step", "time"))) or "none: no logged steps"
        raise NothingProduced(f"--metrics: no run logged {', '.join(unknown)}; the runs logged: {known}")
    return metrics


def beside(runs: list[Run]) -> Path:
    """compare/ beside the runs: in the folder holding them all (`<output_dir>`, a sweep's folder)."""
    return Path(os.path.commonpath([r.path.resolve().parent for r in runs])) / "compare"


def write_plots(runs: list[Run], out: Path, metrics: list[str], align: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    figures = {f"{m}_vs_{align}.png": plot_metric(runs, m, align) for m in metrics}
    figures["tokens_per_sec.png"] = plot_throughput(runs)
    figures["peak_memory_per_rank.png"] = plot_memory(runs)
    paths = []
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=100)
        paths.append(out / name)
    return paths
