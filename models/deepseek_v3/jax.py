"""DeepSeek-V3 has no JAX twin yet: asking for one is refused by name (MLA and the grouped
sigmoid router are not written as JAX functions), never answered by another family's forward."""

from __future__ import annotations

from meshforge.core.errors import UnsupportedConfig


def forward(params, tokens, args):
    """Refused: see the module doc."""
    raise UnsupportedConfig(
        "model.name = 'deepseek_v3': the JAX twin of DeepSeek-V3 (MLA, grouped sigmoid routing) is not "
        "implemented; export to hf and run it in transformers, or train it in torch"
    )


loss = forward
