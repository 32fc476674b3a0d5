"""The commands that carry weights and configs across the project's edge: `meshforge export`
(a checkpoint to HF, TorchTitan, safetensors or JAX) and `meshforge import-config` (another
system's config to a recipe). Heavy modules are imported inside: `--help` stays instant."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from meshforge.core.tables import wide

console = Console(soft_wrap=True)


def cmd_export(args: argparse.Namespace) -> int:
    from meshforge.convert import export_checkpoint
    from meshforge.core.files import output_folder
    from meshforge.core.units import parse_bytes
    from meshforge.run.checkpoint.dcp import resolve_load

    path = resolve_load(args.checkpoint, Path(args.checkpoint))
    shard = parse_bytes(args.max_shard_size) if args.max_shard_size else None
    with output_folder(Path(args.out)) as folder:  # a refused export leaves nothing behind
        out = export_checkpoint(path, folder, args.to, int(shard) if shard else None)
    console.print(f"exported {path} -> {out}", highlight=False)
    return 0


def cmd_import_config(args: argparse.Namespace) -> int:
    """Another system's config -> a recipe; what did not carry over is printed and commented."""
    from meshforge.migrate import ImportRefused, import_config

    try:
        imported = import_config(
            Path(args.source), Path(args.out), args.world, args.model, args.base, args.allow_unmapped
        )
    except ImportRefused as e:
        _print_import(e.imported)
        raise
    _print_import(imported)
    console.print(f"recipe: {args.out}  (run it: run_recipe {args.out})", highlight=False)
    return 0


def _print_import(imported) -> None:
    out = wide(console)
    out.print(f"[bold]{imported.system}[/]: {len(imported.values)} recipe fields set")
    for title, items in (
        ("approximated", imported.notes),
        ("not mapped (no effect on the math here)", [s.line() for s in imported.not_mapped]),
        ("[red]unsupported[/]", [s.line() for s in imported.unsupported]),
    ):
        if items:
            out.print(f"{title}:")
            for item in items:
                out.print(f"  - {item}", highlight=False, markup=False)
