"""Byte units: one definition of a GiB, and sizes as users write them ('80GiB')."""

from __future__ import annotations

from .errors import UsageError

MiB = 1024**2
GiB = 1024**3
_SUFFIXES = (
    ("tib", 1024**4),
    ("gib", GiB),
    ("mib", MiB),
    ("kib", 1024),
    ("tb", 1e12),
    ("gb", 1e9),
    ("mb", 1e6),
    ("kb", 1e3),
)


def parse_bytes(text: str) -> float:
    """'80GiB', '80GB', '512MiB', '40KB', '80' (GiB) -> bytes."""
    t = text.strip().lower().replace(" ", "")
    scale = GiB
    for suffix, factor in _SUFFIXES:
        if t.endswith(suffix):
            t, scale = t[: -len(suffix)], factor
            break
    try:
        return float(t) * scale
    except ValueError:
        raise UsageError(f"{text!r} is not a size: write e.g. 80GiB, 80GB or 512MiB") from None
