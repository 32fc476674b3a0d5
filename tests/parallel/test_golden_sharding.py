"""Golden sharding: every parameter's placement on every rank of every shipped recipe.

A changed plan fails here with a readable diff. After an intended change, regenerate:
    MESHFORGE_UPDATE_GOLDEN=1 pytest tests/parallel/test_golden_sharding.py
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

import pytest
from support import RECIPES

from meshforge.recipe import load_recipe
from meshforge.simulate.sharding import all_placements

GOLDEN = Path(__file__).parent / "golden"
RECIPE_FILES = sorted(RECIPES.rglob("*.toml"))  # recursive: sub-folders count too
# golden name -> (recipe, overrides): every shipped recipe as it is, and llm_1b's tied embeddings
# under TP (one DTensor for both uses) and PP (a copy on the last stage)
CASES = {p.stem: (p, []) for p in RECIPE_FILES} | {
    "llm_1b_tp2": (RECIPES / "llm_1b.toml", ["mesh.dp_shard=4", "mesh.tp=2"]),
    "llm_1b_pp2": (RECIPES / "llm_1b.toml", ["mesh.dp_shard=4", "mesh.pp=2"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sharding_matches_golden(name):
    path, overrides = CASES[name]
    got = json.dumps(all_placements(load_recipe(path, overrides)), indent=1, sort_keys=True) + "\n"
    golden = GOLDEN / f"sharding_{name}.json"
    if os.environ.get("MESHFORGE_UPDATE_GOLDEN") == "1":
        golden.write_text(got)
    assert golden.is_file(), f"no golden file for {name}: run with MESHFORGE_UPDATE_GOLDEN=1"
    expected = golden.read_text()
    if got != expected:
        diff = "".join(
            difflib.unified_diff(expected.splitlines(True), got.splitlines(True), "golden", "now", n=1)
        )
        pytest.fail(f"sharding plan of {name} changed:\n{diff[:6000]}")


def test_golden_files_show_the_3d_layout():
    """Spot checks that the golden dumps say what the recipes ask for."""
    moe = json.loads((GOLDEN / "sharding_qwen3_30b_a3b.json").read_text())  # ep 8 borrowed from dp_shard 8
    assert moe["3"]["layers.0.moe.experts.w1"] == (
        "_S(0, 8),S(0) on (dp_shard_mod_ep,ep) local [16, 768, 2048] of [128, 768, 2048] at [48, 0, 0]"
    )  # rank 3 holds experts 48..63 whole; the router is FSDP's like any weight
    assert (
        moe["3"]["layers.0.moe.router.gate.weight"]
        == "S(0) on (dp_shard) local [16, 2048] of [128, 2048] at [48, 0]"
    )
    debug = json.loads((GOLDEN / "sharding_debug_cpu.json").read_text())
    assert len(debug) == 8  # dp_shard 2 x tp 2 x pp 2
    assert "layers.0.attention.wq.weight" in debug["0"] and "layers.0.attention.wq.weight" not in debug["7"]
    assert debug["0"]["layers.0.attention.wq.weight"].startswith("stage 0: _S(0, 2),S(0) on (dp_shard,tp)")
    assert debug["7"]["output.weight"].startswith("stage 1:")
    one_b = json.loads((GOLDEN / "sharding_llm_1b.json").read_text())
    assert (
        one_b["3"]["tok_embeddings.weight"]
        == "S(0) on (dp_shard) local [16032, 2048] of [128256, 2048] at [48096, 0]"
    )
    # llm_1b ties its embeddings: one parameter under FSDP and TP, a copy on PP's last stage
    assert (
        one_b["3"]["output.weight"]
        == "= tok_embeddings.weight (one parameter): " + one_b["3"]["tok_embeddings.weight"]
    )
    tp2 = json.loads((GOLDEN / "sharding_llm_1b_tp2.json").read_text())
    assert tp2["3"]["output.weight"].endswith(tp2["3"]["tok_embeddings.weight"])
    assert tp2["3"]["tok_embeddings.weight"].startswith("_S(0, 2),S(0) on (dp_shard,tp)")
    pp2 = json.loads((GOLDEN / "sharding_llm_1b_pp2.json").read_text())
    assert "output.weight" not in pp2["0"] and "tok_embeddings.weight" not in pp2["7"]
    assert pp2["7"]["output.weight"].startswith("stage 1: copy of tok_embeddings.weight (tied")
    # context parallel: FSDP shards over dp_shard x cp flattened; rank 5 of dp4-cp4 is (dp_shard 1, cp 1),
    # the sixth of 16 shards
    long = json.loads((GOLDEN / "sharding_llm_8b_long.json").read_text())
    assert len(long) == 16
    assert long["5"]["tok_embeddings.weight"] == (
        "S(0) on (dp_shard_cp) local [8016, 4096] of [128256, 4096] at [40080, 0]"
    )
    # FSDP inside TP: rank 3 is (dp_shard 1, tp 1): the second quarter-row block of the second TP half
    assert debug["3"]["layers.0.attention.wq.weight"].endswith("local [16, 64] of [64, 64] at [48, 0]")
