"""The terminal: a banner, a rich progress bar (or plain lines when not on a TTY) and a
summary table. It is told what to show (plain values and the run's summary), never the
trainer itself, so the torch and JAX trainers share it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from meshforge.run.observe.memory import PEAK_MEANING
from meshforge.run.observe.memtrace import CATEGORIES

log = logging.getLogger("meshforge.run")


@dataclass(frozen=True)
class Banner:
    """What the run is, for its first lines."""

    run_name: str
    model: str  # "llama3/debug"
    n_params: int
    world_size: int
    device_type: str
    mesh: str  # "pp=2, dp_replicate=1, ..."
    total_steps: int
    pipeline: str | None = None  # schedule and stage layout, when pipelined
    loss_floor: float | None = None
    precision: str | None = None  # float8: what runs in it
    backend: str = "torch"  # the recipe's backend: torch | jax
    resumed: str | None = None  # "resumed from step N (checkpoint ...; recipe changes: ...)"
    start_step: int = 0  # the step a resumed run starts after: the records up to it are not this run's


BACKEND_NAMES = {"torch": "PyTorch", "jax": "JAX"}


def counted_steps(throughput_steps: dict | None) -> str:
    """'over 25 steps (left out: warmup 1-2, checkpoint 10, 20)': which steps the rate covers."""
    if not throughput_steps:
        return ""
    left_out = [
        f"{why.replace('_', ' ')} {', '.join(map(str, steps))}"
        for why, steps in throughput_steps["excluded"].items()
    ]
    return f"over {throughput_steps['counted']} steps" + (
        f" (left out: {'; '.join(left_out)})" if left_out else ""
    )


class RunConsole:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.console = Console(soft_wrap=True)
        if not self.console.is_terminal:  # a pipe or a log file: wide enough that tables keep whole values
            self.console = Console(soft_wrap=True, width=160)
        self._progress: Progress | None = None
        self._task = None
        self._last_print = 0.0
        self._first: tuple[float, int] | None = None  # (time, step) of the first update shown
        self._total = 0
        self._start = 0  # a resumed run's checkpoint step: its records up to there are an earlier run's

    def start(self, b: Banner, run_dir: Path, wandb: str | None = None) -> None:
        if not self.enabled:
            return
        what = (
            f"{b.run_name}: {b.model} ({b.n_params:,} params) in {BACKEND_NAMES[b.backend]} "
            f"on {b.world_size} x {b.device_type} [{b.mesh}]"
        )
        self.console.print("[bold]meshforge[/] " + escape(what))  # escaped: [dp_shard=2, ...] is no markup
        if b.resumed:
            self.console.print(b.resumed, highlight=False, markup=False)
        if b.pipeline:
            self.console.print(escape(b.pipeline))
        if b.precision:
            self.console.print(escape(b.precision), highlight=False)
        if b.loss_floor is not None:
            self.console.print(f"synthetic source: loss floor (entropy rate) = {b.loss_floor:.4f} nats/token")
        self.console.print(f"records: {run_dir}", highlight=False, markup=False)
        if wandb:
            self.console.print(f"W&B: {wandb}", highlight=False, markup=False)
        self._total, self._start = b.total_steps, b.start_step
        if self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold blue]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task(
                "train", total=b.total_steps, completed=b.start_step, loss="-", tps="-"
            )
            self._progress.start()

    def update(self, step: int, metrics: dict) -> None:
        if not self.enabled or step <= self._start:  # never an earlier run's step, replayed
            return
        loss, tps = f"{metrics['loss']:.4f}", f"{metrics['tokens_per_sec']:,.0f}"
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=loss, tps=tps)
        elif time.monotonic() - self._last_print > 2.0 or step == self._total or step == self._start + 1:
            # not a terminal (CI, a pipe): a plain line every couple of seconds, with an ETA
            now = time.monotonic()
            self._first = self._first or (now, step)
            eta = ""
            if step > self._first[1]:
                left = (now - self._first[0]) / (step - self._first[1]) * (self._total - step)
                eta = f"  ETA {int(left // 60)}:{int(left % 60):02d}"
            self._last_print = now
            self.console.print(
                f"step {step}/{self._total}  loss {loss}  grad_norm {metrics['grad_norm']:.3f}  "
                f"lr {metrics['lr']:.2e}  {tps} tok/s{eta}",
                highlight=False,
            )
        if "eval/loss" in metrics:  # rare (every eval.every steps): always its own line
            self.console.print(
                f"step {step}/{self._total}  eval loss {metrics['eval/loss']:.4f}  "
                f"perplexity {metrics['eval/perplexity']:.2f}  (held out)",
                highlight=False,
            )

    def note(self, text: str) -> None:
        """Something the user should know mid-run: a warning through Python logging (so it
        reaches the terminal, or a launched rank's log and from there the launcher)."""
        log.warning(text)

    def finish(
        self,
        run_name: str,
        status: str,
        summary: dict,
        run_dir: Path,
        device_type: str,
        logger_paths: dict[str, str],
    ) -> None:
        """The summary table, then per-rank memory and memory by category when there are several ranks."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        s = summary
        table = Table(title=f"{run_name}: {status}", show_header=False)
        table.add_column(style="bold")
        table.add_column(overflow="fold")  # paths and URLs wrap whole, never cut to "..."
        rows = [("steps", str(s["steps"]))]
        if "final_loss" in s:
            rows += [("final loss", f"{s['final_loss']:.4f}"), ("best loss", f"{s['best_loss']:.4f}")]
        if "eval_loss" in s:
            rows.append(
                ("eval loss", f"{s['eval_loss']:.4f} (perplexity {s['eval_perplexity']:.2f}, held out)")
            )
        if "loss_floor" in s:
            rows.append(("loss floor", f"{s['loss_floor']:.4f} (entropy of the synthetic source)"))
        if "tokens_per_sec" in s:
            rows.append(
                (
                    "tokens/s",
                    f"{s['tokens_per_sec']:,.0f} (all ranks); "
                    f"{s['tokens_per_sec_per_device']:,.0f} per device; "
                    + counted_steps(s.get("throughput_steps")),
                )
            )
            if "checkpoint_step_overhead_s" in s:
                rows.append(
                    ("checkpoint step", f"+{s['checkpoint_step_overhead_s']:.2f} s over a steady step")
                )
            peak = ""
            if "mfu" in s:
                where = (
                    "(measured CPU matmul, one rank's share of the cores)"
                    if device_type == "cpu"
                    else "(datasheet)"
                )
                peak = f"MFU {s['mfu']:.1%} of {s['peak_tflops_per_device']:.3g} TFLOP/s {where}"
            rows.append(("TFLOP/s per device", f"{s['tflops_per_device']:.4g} {peak}"))
        if "peak_memory_gib" in s:
            rows.append(
                (
                    "peak memory",
                    f"{s['peak_memory_gib']:.2f} GiB ({PEAK_MEANING[device_type]}, max over ranks)",
                )
            )
        if "profile_compute_s" in s:
            parts = ", ".join(
                f"{k.removeprefix('profile_').removesuffix('_s').replace('_', ' ')} {s[k]:.3f}"
                for k in s
                if k.startswith("profile_")
            )
            rows.append(
                ("profiled step (s)", f"{parts} (slowest rank per part); traces: {run_dir / 'profile'}")
            )
        rows.append(("records", str(run_dir / "metrics.jsonl") + ", run.json"))
        rows += [(k, v) for k, v in logger_paths.items() if k != "wandb"]
        for k, v in rows:
            table.add_row(k, v)
        self.console.print(table)
        if "wandb" in logger_paths:  # a line of its own: a `wandb sync` folded in a cell won't paste
            self.console.print(f"W&B: {logger_paths['wandb']}", highlight=False, markup=False)
        per_rank = s.get("per_rank_memory", [])
        if len(per_rank) > 1:
            self.console.print(memory_table(per_rank))
        if "memory_breakdown" in s:
            b = s["memory_breakdown"]
            self.console.print(breakdown_table(b["per_rank"], b["step"], run_dir / "memory_breakdown.png"))


def memory_table(per_rank: list[dict]) -> Table:
    """Per-rank memory at the last logged step (GiB, %, counts as recorded)."""
    keys = list(per_rank[0])
    table = Table(title="memory per rank (last logged step)")
    table.add_column("rank")
    for k in keys:
        table.add_column(k, justify="right")
    for rank, row in enumerate(per_rank):
        table.add_row(
            str(rank), *(f"{row[k]:,.3f}" if k.endswith(("_gib", "_pct")) else f"{row[k]:g}" for k in keys)
        )
    return table


def breakdown_table(per_rank: list[dict], step: int, picture: Path) -> Table:
    """Per-rank memory by category at the tracked step's peak, in GiB as recorded."""
    table = Table(
        title=f"memory by category at the peak of step {step} (GiB, tracked tensors); {picture.name}"
    )
    table.add_column("rank")
    keys = [f"{k}_gib" for k in (*CATEGORIES, "total")]
    for k in keys:
        table.add_column(k, justify="right")
    for rank, row in enumerate(per_rank):
        table.add_row(str(rank), *(f"{row[k]:,.4f}" for k in keys))
    return table
