"""`meshforge explain` and `run_recipe --help`: the schema's own field docs, as text."""

from __future__ import annotations

import dataclasses
import difflib

from rich.table import Table

from meshforge.core.errors import UsageError

from .schema import Recipe, field_doc, sections


def fields_help() -> str:
    """Every section.field with its doc, one per line (run_recipe --help's epilog)."""
    lines = ["recipe fields (override any with section.key=value, or key=value at the top level):"]
    secs = sections()
    for f in dataclasses.fields(Recipe):
        if f.name not in secs:
            lines.append(f"  {f.name}: {f.metadata.get('doc', '')}")
    for sec, cls in secs.items():
        lines += [f"  {name}: {doc}" for name, _, doc in _field_rows(sec, cls, "")]
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
            for row in _field_rows(sec, secs[sec], key):
                table.add_row(*row)
        else:
            try:
                table.add_row(sec, "", field_doc(None, sec))
            except KeyError:
                top = [f.name for f in dataclasses.fields(Recipe)]
                raise UsageError(f"no recipe field or section {name!r}; {_suggest(sec, top)}") from None
    return table


def _field_rows(prefix: str, cls, key: str) -> list[tuple[str, str, str]]:
    """(field, default, doc) of `cls`'s fields named by `key` ("" = all; "muon.ns_steps" descends
    into a sub-section), a sub-section's fields each on its own row."""
    head, _, rest = key.partition(".")
    fields = [f for f in dataclasses.fields(cls) if not head or f.name == head]
    if not fields:
        names = [f.name for f in dataclasses.fields(cls)]
        raise UsageError(f"{prefix} has no field {head!r}; {_suggest(head, names, prefix + '.')}")
    rows = []
    for f in fields:
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            rows += _field_rows(f"{prefix}.{f.name}", type(default), rest)
        else:
            rows.append((f"{prefix}.{f.name}", repr(default), f.metadata.get("doc", "")))
    return rows


def _suggest(name: str, choices: list[str], prefix: str = "") -> str:
    """'did you mean train.steps? (fields: ...)' or just the list."""
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    listed = f"fields: {', '.join(choices)}"
    return f"did you mean {prefix}{close[0]}? ({listed})" if close else listed
