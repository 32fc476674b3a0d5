"""Pipeline schedule pictures: per-rank actions from torch's schedules, and their bubble."""

from __future__ import annotations

import json

import pytest
from support import QUICK, RECIPES, read_metrics, run_cli, run_recipe

from meshforge.parallelisms.pp import bubble_fraction_gpipe
from meshforge.parallelisms.pp_actions import bubble_fraction, simulate, single_stage_actions
from meshforge.recipe import load_recipe
from meshforge.simulate.schedule import recipe_schedule_order

PP4 = ["mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=4"]
V8 = ["pp.stages_per_rank=2", "model.n_layers=8", "pp.microbatches=8"]


@pytest.mark.parametrize("pp, m", [(2, 2), (4, 4), (4, 8), (3, 9)])
@pytest.mark.parametrize("gpipe", [True, False])
def test_gpipe_and_1f1b_bubbles_match_theory(pp, m, gpipe):
    order = simulate({r: single_stage_actions(r, pp, m, gpipe) for r in range(pp)})
    assert bubble_fraction(order) == pytest.approx(bubble_fraction_gpipe(pp, m))  # (p-1)/(m+p-1)


def test_1f1b_alternates_after_warmup():
    assert single_stage_actions(3, 4, 3, gpipe=False) == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2"]
    assert single_stage_actions(0, 4, 5, gpipe=False)[:6] == ["0F0", "0F1", "0F2", "0F3", "0B0", "0F4"]


def test_schedules_from_torch_and_their_bubbles():
    bubbles = {}
    for schedule in ("1F1B", "ZBVZeroBubble", "DualPipeV"):
        recipe = load_recipe(
            RECIPES / "debug_cpu.toml",
            [*PP4, *V8, f"pp.schedule={schedule}"] if schedule != "1F1B" else [*PP4, "pp.microbatches=8"],
        )
        order = recipe_schedule_order(recipe)
        assert len(order) == 4
        acts = [a for a in order[3] if a]
        assert sum("F" in a for a in acts) >= 8  # every microbatch went forward on this rank
        bubbles[schedule] = bubble_fraction(order)
    assert bubbles["1F1B"] == pytest.approx(3 / 11)
    assert bubbles["ZBVZeroBubble"] < bubbles["1F1B"] / 2 and bubbles["DualPipeV"] < bubbles["1F1B"] / 2


def test_cli_draws_the_schedule(tmp_path):
    out = tmp_path / "zbv.png"
    proc = run_cli(
        [
            "pp-schedule",
            str(RECIPES / "debug_cpu.toml"),
            *PP4,
            *V8,
            "pp.schedule=ZBVZeroBubble",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        program="meshforge",
    )
    assert proc.returncode == 0, proc.stderr
    assert "ZBVZeroBubble, pp=4, 8 microbatches: bubble" in proc.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_pipelined_run_draws_its_schedule(tmp_path):
    proc = run_recipe(
        [
            str(RECIPES / "debug_cpu.toml"),
            *QUICK,
            "mesh.dp_shard=1",
            "mesh.tp=1",
            "mesh.pp=2",
            "train.steps=2",
            f"output_dir={tmp_path}",
            "run_name=pp",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "pp" / "pp_schedule.png").read_bytes()[:4] == b"\x89PNG"
    info = json.loads((tmp_path / "pp" / "run.json").read_text())
    assert info["pp_bubble_fraction"] == pytest.approx(1 / 5)  # 1F1B, p=2, m=4: (p-1)/(m+p-1)
    assert len(read_metrics(tmp_path / "pp")) == 2
