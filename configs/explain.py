"""`meshforge explain` and `run_recipe --help`: the schema's own field docs, as text."""

from __future__ import annotations

import dataclasses

from rich.table import Table

from meshforge.core.errors import UsageError

from .schema import Recipe, field_doc, sections


def fields_help() -> str:
    """Every section.field with its doc, one per line (run_recipe --help's epilog)."""
    lines = ["recipe fields (override any with section.key=value):"]
    for sec, cls in sections().items():
        for f in dataclasses.fields(cls):
            lines.append(f"  {sec}.{f.name}: {f.metadata.get('doc', '')}")
    return "\n".join(lines)


def explain_table(target: str | None) -> Table:
    """Field, default and doc of a section, a field, or (None) every section and top-level field."""
    secs = sections()
    names = (
        [target]
        if target
        else list(secs) + [f.name for f in dataclasses.fields(Recipe) if f.name not in secs]
    )
    table = Table("field", "default", "doc")
    for name in names:
        sec, _, key = name.partition(".")
        if sec in secs:
            fields = [f for f in dataclasses.fields(secs[sec]) if not key or f.name == key]
            if not fields:
                raise UsageError(
                    f"{sec} has no field {key!r}; "
                    f"fields: {', '.join(f.name for f in dataclasses.fields(secs[sec]))}"
                )
            for f in fields:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                table.add_row(f"{sec}.{f.name}", repr(default), f.metadata.get("doc", ""))
        else:
            try:
                table.add_row(sec, "", field_doc(None, sec))
            except KeyError:
                raise UsageError(
                    f"no recipe field or section {name!r}; sections: {', '.join(secs)}"
                ) from None
    return table
