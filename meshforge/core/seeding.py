"""One rule for seeded random streams: a CPU generator per (seed, key).

Keys are parameter names (mesh-independent init), sample indices (the synthetic data) or
epochs (window shuffles): the values depend only on (seed, key), never on the mesh, the
rank or the order things are visited in.
"""

from __future__ import annotations

import zlib

import torch


def seeded_generator(seed: int, key: int | str) -> torch.Generator:
    """A torch CPU generator for (seed, key); a str key is hashed with crc32."""
    k = zlib.crc32(key.encode()) if isinstance(key, str) else int(key)
    return torch.Generator().manual_seed(seed * 1_000_003 + k)
