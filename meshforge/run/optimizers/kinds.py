"""A parameter's kind, by its name: what optimizer.no_decay and optimizer.lr_multipliers name, and
what Muon reads to leave a parameter to AdamW. One rule for both, so they cannot drift apart."""

from __future__ import annotations

# a parameter's kind, by the first word of its name found here (else a hidden "matrix")
KINDS = {"embed": "embedding", "output": "output", "router": "router", "norm": "norm", "bias": "bias"}


def param_kind(name: str) -> str:
    """embedding | output | router | norm | bias | matrix (configs.training.PARAM_KINDS)."""
    return next((kind for word, kind in KINDS.items() if word in name.lower()), "matrix")
