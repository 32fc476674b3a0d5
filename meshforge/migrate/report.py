"""What an imported config became: recipe values, the approximations made, and every key that
did not carry over, split by whether it matters.

- not mapped: the key has no effect on the math here (a communication bucket size, a
  profiler, a print frequency of a console we do not have); listed, and the import goes on.
- unsupported: the key asks for something meshforge cannot do (ZeRO++ quantized weights,
  MoE, Ulysses sequence parallel, an lr warmup shape we do not implement, an unknown key):
  listed, and no recipe is written unless the user passes --allow-unmapped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import tomli_w


@dataclass
class Skipped:
    key: str  # dotted, as in the source file
    value: Any
    why: str

    def line(self) -> str:
        return f"{self.key} = {self.value!r}: {self.why}"


@dataclass
class Imported:
    system: str  # "DeepSpeed" | "TorchTitan 0.2"
    values: dict[str, Any] = field(default_factory=dict)  # dotted recipe field -> value
    notes: list[str] = field(default_factory=list)  # how something was approximated
    not_mapped: list[Skipped] = field(default_factory=list)
    unsupported: list[Skipped] = field(default_factory=list)

    def set(self, recipe_field: str, value: Any) -> None:
        self.values[recipe_field] = value

    def skip(self, key: str, value: Any, why: str) -> None:
        self.not_mapped.append(Skipped(key, value, why))

    def refuse(self, key: str, value: Any, why: str) -> None:
        self.unsupported.append(Skipped(key, value, why))

    def toml(self, header: str, extends: str | None) -> str:
        """The recipe: a comment saying where it came from, what was approximated and what
        did not carry over; then `extends` and the values, by section."""
        lines = [f"# {header}"]
        blocks = [
            ("Approximations", self.notes),
            ("Not mapped (no effect on the math here)", [s.line() for s in self.not_mapped]),
            (
                "UNSUPPORTED, left out (written only because of --allow-unmapped)",
                [s.line() for s in self.unsupported],
            ),
        ]
        for title, items in blocks:
            if items:
                lines += ["#", f"# {title}:"] + [f"#   - {item}" for item in items]
        body: dict[str, Any] = {"extends": extends} if extends else {}
        for dotted, value in self.values.items():
            *sections, name = dotted.split(".")
            node = body
            for s in sections:
                node = node.setdefault(s, {})
            node[name] = value
        return "\n".join(lines) + "\n\n" + tomli_w.dumps(body)


def leaves(d: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every (dotted key, value) of a nested mapping, in file order."""
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from leaves(v, key + ".")
        else:
            yield key, v
