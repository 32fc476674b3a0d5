"""The process a local launch's ranks fork from (multiprocessing's forkserver).

A fresh interpreter per rank (spawn) spent most of a small run importing torch and the trainer,
once per rank on shared cores. The server imports them once and forks each rank from there. It is
never the launching process itself: that one has run torch ops (a forked OpenMP pool hangs) and
has threads (the terminal's watcher). Light on purpose: the CLI starts it before it has imported
torch, so the server's imports overlap its own recipe checks. CPU ranks only: CUDA ranks are
spawned fresh (nothing that may have touched CUDA is ever forked, and a GPU job does not notice
the seconds of import).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

from meshforge.configs import Recipe
from meshforge.configs.parallelism import mesh_world_size
from meshforge.run.rank.env import under_torchrun

RANK_ENTRY = "meshforge.run.launch.local"  # what a rank runs, with everything it imports


def start_rank_server() -> None:
    """Start the server (once per process) with the ranks' modules imported."""
    multiprocessing.set_forkserver_preload([RANK_ENTRY])
    multiprocessing.forkserver.ensure_running()


def forks_cpu_ranks(recipe: Recipe) -> bool:
    """Whether run_recipe will fork several local CPU ranks of this (unvalidated) recipe: a fixed
    mesh of more than one rank on `device = "cpu"`, not under torchrun (whose workers are started
    already)."""
    several = (mesh_world_size(recipe.mesh) or 1) > 1  # None: a -1 degree, sized by the world later
    return recipe.backend == "torch" and recipe.train.device == "cpu" and several and not under_torchrun()
