"""What every rich table of layouts or runs shares."""

from __future__ import annotations

from collections.abc import Iterable

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table


def wide(console: Console) -> Console:
    """`console` on a terminal; else (a pipe, a log file, a Slurm job's output) one wide enough that
    no table cuts a number and no path or value is wrapped: rich gives a pipe 80 columns, where
    tune's step column read "0.041…" for 0.04178. It writes where `console` does."""
    return console if console.is_terminal else Console(file=console.file, width=1000, soft_wrap=True)


def add_name_column(table: Table, header: str, names: Iterable[str]) -> None:
    """Add the column that names each row (a layout, a run), never cut short: in 80 columns (a
    pipe's) rich shortened dprep2-dp2-pp2 and dprep2-dp4 both to "dprep2-d…"; the other columns
    wrap or give way instead."""
    widest = max(cell_len(name) for name in [header, *names])
    table.add_column(header, min_width=widest, no_wrap=True)
