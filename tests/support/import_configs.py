"""The DeepSpeed and TorchTitan files the import-config tests read (as those projects ship them,
in tests/interop/configs/), and the two ways the tests import one."""

from __future__ import annotations

import re
from pathlib import Path

from meshforge.migrate import import_config
from meshforge.recipe import load_recipe
from support import REPO

CONFIGS = REPO / "tests" / "interop" / "configs"
DS = CONFIGS / "deepspeed"
TITAN = CONFIGS / "torchtitan_0.2"


def import_and_load(tmp_path, src: Path, world: int | None, **kw):
    """`import_config` SRC into TMP_PATH: what it imported, the recipe loaded back, its text."""
    out = tmp_path / (src.stem + ".toml")
    imported = import_config(src, out, world, **kw)
    return imported, load_recipe(out, world_size=world), out.read_text()


def titan_moe_job(tmp_path, flavor: str = "debugmodel_moe", training: str = "", **parallelism) -> Path:
    """TorchTitan's Qwen3 MoE debug job with its flavor line and the given [parallelism] lines
    changed (each replaces the file's own line of that key), and lines added to [training]."""
    text = (TITAN / "qwen3_moe_debug.toml").read_text()
    assert text.count('flavor = "debugmodel_moe"') == 1
    text = text.replace('flavor = "debugmodel_moe"', f'flavor = "{flavor}"')
    text = text.replace("[training]\n", f"[training]\n{training}")
    for key, value in parallelism.items():
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
        assert n == 1, key
    job = tmp_path / "titan" / f"{flavor}.toml"
    job.parent.mkdir(exist_ok=True)
    job.write_text(text)
    return job
