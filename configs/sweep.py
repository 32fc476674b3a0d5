"""Experiments over many runs: [sweep] and its [sweep.slurm] jobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from .fields import F


@dataclass
class SlurmConfig:
    partition: Optional[str] = F(None, "sbatch --partition; None = the cluster's default")
    account: Optional[str] = F(None, "sbatch --account; None = your default account")
    time: Optional[str] = F(None, 'sbatch --time, Slurm syntax ("00:30:00"); None = sweep.timeout_s')
    gpus_per_node: int = F(
        8, "ranks per node (torchrun --nproc_per_node); on GPUs also sbatch --gpus-per-node"
    )
    max_concurrent: int = F(4, "points queued or running at once")
    poll_s: float = F(30.0, "seconds between squeue/sacct queries")
    sbatch_args: List[str] = F([], 'more sbatch options, one per entry, e.g. ["--qos=high", "--exclusive"]')
    setup: List[str] = F(
        [], 'shell lines run before srun, e.g. ["module load cuda", "source .venv/bin/activate"]'
    )


@dataclass
class SweepConfig:
    axes: Dict[str, List[str]] = F(
        {}, 'policy axes crossed with every mesh, e.g. "pp.schedule" = ["1F1B", "GPipe"]'
    )
    only: List[str] = F([], 'run only these layouts (labels as printed: "dp8-tp2"); [] = every mesh')
    steps: int = F(10, "steps per sweep point (a short budget: enough to time a layout)")
    timeout_s: int = F(600, "a point still running after this many seconds is stopped and recorded as hung")
    device_memory_gib: Optional[float] = F(None, "skip points whose estimated per-rank memory exceeds this")
    launcher: str = F(
        "auto",
        "local | slurm | auto: each point a local run_recipe, or a Slurm job (sbatch + srun torchrun); "
        "auto = slurm when the world needs more GPUs than this machine has",
    )
    slurm: SlurmConfig = F(SlurmConfig(), "Slurm jobs of a sweep (sweep.launcher = slurm)")
