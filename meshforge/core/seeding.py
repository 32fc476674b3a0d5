"""One owner for every seeded random stream: each is drawn here, from the recipe's seed and a key.

- weights: a CPU generator per (seed, parameter name) (mesh-independent init);
- synthetic samples: a CPU generator per (data.seed, global sample index);
- the synthetic source's chain: one CPU generator from data.seed alone, drawn once at build;
- the process's global torch RNG: seeded from `seed`, for anything that draws without a
  generator of its own;
- corpus window shuffles: PER RANK, a stream per (data.seed, dp rank, block). A dp rank reads
  its own part of the files, so its shuffle is its own too; a resume on the same dp degree
  replays it exactly, and another dp degree reads different parts anyway.
Apart from the window shuffles, the values depend only on (seed, key), never on the mesh, the
rank or the order things are visited in.
"""

from __future__ import annotations

import random
import zlib

import torch


def seeded_generator(seed: int, key: int | str) -> torch.Generator:
    """A torch CPU generator for (seed, key); a str key is hashed with crc32."""
    k = zlib.crc32(key.encode()) if isinstance(key, str) else int(key)
    return torch.Generator().manual_seed(seed * 1_000_003 + k)


def source_generator(seed: int) -> torch.Generator:
    """A torch CPU generator from `seed` alone: a structure drawn once (the Markov chain's)."""
    return torch.Generator().manual_seed(seed)


def seed_process(seed: int) -> None:
    """Seed this process's global torch RNG (CPU and every device), for draws without a generator."""
    torch.manual_seed(seed)


def window_shuffle(seed: int, dp_rank: int, block: int) -> random.Random:
    """The per-rank stream that orders a block of corpus windows on one dp rank."""
    return random.Random(f"{seed}/{dp_rank}/{block}")
