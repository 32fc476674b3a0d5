"""A parsed config file that hands out its keys once: what the mapper did not take is what
did not map, so nothing is dropped without being listed."""

from __future__ import annotations

from typing import Any

from meshforge.migrate.report import Imported, leaves

MISSING = object()


class Keys:
    """A nested mapping whose keys are taken (popped) by dotted path."""

    def __init__(self, data: dict):
        self.data = data

    def take(self, dotted: str, default: Any = MISSING) -> Any:
        *path, name = dotted.split(".")
        node = self.data
        for p in path:
            node = node.get(p)
            if not isinstance(node, dict):
                return default
        return node.pop(name, default)

    def has(self, dotted: str) -> bool:
        value = self.take(dotted)
        if value is MISSING:
            return False
        self.put(dotted, value)
        return True

    def put(self, dotted: str, value: Any) -> None:
        *path, name = dotted.split(".")
        node = self.data
        for p in path:
            node = node.setdefault(p, {})
        node[name] = value

    def classify_rest(self, out: Imported, not_mapped: dict[str, str], unsupported: dict[str, str]) -> None:
        """Every key left: not mapped (no effect on the math), unsupported, or unknown
        (unsupported too: a typo or a newer version's key must not pass silently). The
        longest matching prefix decides."""
        for key, value in leaves(self.data):
            if isinstance(value, dict):  # an empty section
                continue
            why_skip = _longest(key, not_mapped)
            why_refuse = _longest(key, unsupported)
            if why_refuse is not None and (why_skip is None or len(why_refuse[0]) >= len(why_skip[0])):
                out.refuse(key, value, why_refuse[1])
            elif why_skip is not None:
                out.skip(key, value, why_skip[1])
            else:
                out.refuse(
                    key, value, f"not a {out.system} key meshforge knows; remove it or check its spelling"
                )


def _longest(key: str, table: dict[str, str]) -> tuple[str, str] | None:
    hits = [(p, why) for p, why in table.items() if key == p or key.startswith(p + ".")]
    return max(hits, key=lambda h: len(h[0])) if hits else None
