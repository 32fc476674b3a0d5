"""How the schema spells a field: a default with its one-line doc (`F`), and the note on a setting
another choice leaves unread (`unread_with`)."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def unread_with(condition: str, kind: str = "a mesh dimension of degree 1") -> str:
    """A field doc's note on a setting another choice leaves unread, and why that is harmless
    (recipe/inert.py refuses the ones that are not)."""
    why = "kept so the one field turns it on" if kind == "a switch" else "kept for the meshes that use it"
    return f"; unread with {condition} ({kind}: {why}; it changes nothing then)"


NO_FSDP = unread_with("one data-parallel rank, mesh.cp = 1 and no cpu_offload (no FSDP)")
NO_PP = unread_with("mesh.pp = 1")
NO_EVAL = unread_with("eval.every = 0", "a switch")
NO_SAVE = unread_with("checkpoint.enabled = false", "a switch")
NO_WANDB = unread_with("logging.wandb = false", "a switch")


def F(default: Any, doc: str) -> Any:
    """A dataclass field with a default and a one-line doc (read by `meshforge explain`)."""
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata={"doc": doc})
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})
