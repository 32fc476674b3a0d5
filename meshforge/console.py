"""The terminal: a rich progress bar (or plain lines when not on a TTY) and a summary table."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

GiB = 1024**3


class RunConsole:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.console = Console(soft_wrap=True)
        self._progress: Progress | None = None
        self._task = None
        self._last_print = 0.0

    def start(self, trainer, run_dir: Path) -> None:
        if not self.enabled:
            return
        r, d = trainer.recipe, trainer.dims
        mesh = ", ".join(f"{k}={v}" for k, v in d.degrees.items())
        self.console.print(f"[bold]meshforge[/] {r.run_name}: {r.model.name}/{r.model.flavor} "
                           f"({trainer.n_params:,} params) on {trainer.env.world_size} x {trainer.env.device.type} [{mesh}]")
        if d.pp_enabled:
            stages = "; ".join(f"stage {s}: layers {l}" for s, l in enumerate(trainer.pmodel.layout))
            self.console.print(f"pipeline {r.pp.schedule} x {r.pp.microbatches} microbatches: {stages}")
        floor = trainer.summary().get("loss_floor")
        if floor is not None:
            self.console.print(f"synthetic source: loss floor (entropy rate) = {floor:.4f} nats/token")
        self.console.print(f"records: {run_dir}")
        if self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold blue]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                TimeElapsedColumn(), console=self.console,
            )
            self._task = self._progress.add_task("train", total=r.train.steps, loss="-", tps="-")
            self._progress.start()
        self._total = r.train.steps

    def update(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        loss, tps = f"{metrics['loss']:.4f}", f"{metrics['tokens_per_sec']:,.0f}"
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=loss, tps=tps)
        elif time.monotonic() - self._last_print > 2.0 or step == self._total or step == 1:
            # not a terminal (CI, a launcher's pipe): a plain line every couple of seconds
            self._last_print = time.monotonic()
            self.console.print(f"step {step}/{self._total}  loss {loss}  grad_norm {metrics['grad_norm']:.3f}  "
                               f"lr {metrics['lr']:.2e}  {tps} tok/s")

    def note(self, text: str) -> None:
        if self.enabled:
            self.console.print(f"[yellow]{text}[/]", highlight=False)

    def finish(self, trainer, run_dir: Path, loggers, status: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        s = trainer.summary()
        table = Table(title=f"{trainer.recipe.run_name}: {status}", show_header=False)
        table.add_column(style="bold")
        table.add_column()
        rows = [("steps", str(s["steps"]))]
        if "final_loss" in s:
            rows += [("final loss", f"{s['final_loss']:.4f}"), ("best loss", f"{s['best_loss']:.4f}")]
        if "loss_floor" in s:
            rows.append(("loss floor", f"{s['loss_floor']:.4f} (entropy of the synthetic source)"))
        if "tokens_per_sec" in s:
            rows.append(("tokens/s", f"{s['tokens_per_sec']:,.0f} (all ranks, after step 1)"))
            peak = (f"MFU {s['mfu']:.1%} of {s['peak_tflops_per_device']:.3g} TFLOP/s "
                    + ("(measured CPU matmul)" if trainer.env.device.type == "cpu" else "(datasheet)")) if "mfu" in s else ""
            rows.append(("TFLOP/s per device", f"{s['tflops_per_device']:.4g} {peak}"))
        if "peak_memory_bytes" in s:
            which = "CUDA peak active" if trainer.env.device.type == "cuda" else "peak RSS"
            rows.append(("peak memory", f"{s['peak_memory_bytes'] / GiB:.2f} GiB ({which}, max over ranks)"))
        rows.append(("records", str(run_dir / "metrics.jsonl") + ", run.json"))
        if loggers is not None and loggers.tensorboard is not None:
            rows.append(("tensorboard", str(loggers.tensorboard.path)))
        if loggers is not None and loggers.wandb is not None:
            rows.append(("wandb", f"{loggers.wandb.mode}" + (f": {loggers.wandb.path}" if loggers.wandb.path else "")))
        for k, v in rows:
            table.add_row(k, v)
        per_rank = trainer.state.per_rank_memory
        self.console.print(table)
        if len(per_rank) > 1:
            self.console.print(memory_table(per_rank))
        if trainer.state.memory_breakdown:
            self.console.print(breakdown_table(trainer.state.memory_breakdown, trainer.state.memory_breakdown_step,
                                               run_dir / "memory_breakdown.png"))


def memory_table(per_rank: list[dict]) -> Table:
    """Per-rank memory at the last logged step (MiB)."""
    keys = [k for k in per_rank[0] if not k.endswith(("retries", "ooms"))]
    table = Table(title="memory per rank (MiB, last logged step)")
    table.add_column("rank")
    for k in keys:
        table.add_column(k, justify="right")
    for rank, row in enumerate(per_rank):
        table.add_row(str(rank), *(f"{row[k] / 2**20:,.1f}" for k in keys))
    return table


def breakdown_table(per_rank: list[dict], step: int, picture: Path) -> Table:
    """Per-rank memory by category at the tracked step's peak (MiB)."""
    from meshforge.memtrace import CATEGORIES

    table = Table(title=f"memory by category at the peak of step {step} (MiB, tracked tensors); {picture.name}")
    table.add_column("rank")
    for k in (*CATEGORIES, "total"):
        table.add_column(k, justify="right")
    for rank, row in enumerate(per_rank):
        table.add_row(str(rank), *(f"{row[k] / 2**20:,.2f}" for k in (*CATEGORIES, "total")))
    return table
