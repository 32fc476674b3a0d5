"""What the tune tests trace and price: the debug recipe on one process with its three layouts, and
a made-up CPU profile (1 GFLOP/s, 1 GB/s, free links)."""

from __future__ import annotations

from meshforge.recipe import load_recipe
from meshforge.simulate.hardware import Link, Profile
from support import RECIPES

ONE = ["mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1", "train.global_batch_size=4"]
# fsdp2 also as a recipe that leaves the device to the machine and logs every 5th step
FSDP2 = ["mesh.dp_shard=2", "train.global_batch_size=8", "train.device=auto", "logging.log_every=5"]
LAYOUTS = {"one": [], "tp2": ["mesh.tp=2"], "fsdp2": FSDP2}


def debug(*overrides: str):
    return load_recipe(str(RECIPES / "debug_cpu.toml"), [*ONE, *overrides], world_size=None)


CPU = Profile(
    name="test",
    source="made up for the test",
    matmul_flops={"float32": 1e9},
    memory_Bps=1e9,
    ranks_per_node=8,
    shared_cores=0,
    links={2: Link(0.0, 1e9)},
)
