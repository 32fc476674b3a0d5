"""Held-out evaluation: the same eval loss on every mesh for the same weights (one process, TP 2
with SP and loss parallel, FSDP 2 x PP 2 through the schedule's eval()), in every logger (JSONL,
TensorBoard, W&B read back) and in `compare`; held out for real, refused where it is not."""

from __future__ import annotations

import json
import math

import pytest
from support import QUICK, RECIPES, cli_env, read_metrics, run_cli, run_recipe

from meshforge.configs import RecipeError
from meshforge.experiments.compare import comparison_table, find_runs
from meshforge.recipe import load_recipe
from meshforge.run.observe import wandb_files as wf

MESHES = {
    "one": ["mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1"],
    "dp2_pp2": ["mesh.dp_shard=2", "mesh.tp=1", "mesh.pp=2"],  # FSDP + the 1F1B schedule's eval()
    "tp2": [
        "mesh.dp_shard=1",
        "mesh.tp=2",
        "mesh.pp=1",
        "tp.sequence_parallel=true",
        "tp.loss_parallel=true",
    ],
    # context parallel: each rank scores its part of every held-out sequence, through eval()
    "cp2_pp2": ["mesh.dp_shard=1", "mesh.cp=2", "mesh.tp=1", "mesh.pp=2"],
}


@pytest.mark.parametrize(
    "overrides, field, says",
    [
        (["data.source=files", "data.path=x/*.jsonl"], "eval.path", "never on training data"),
        (["data.source=hf", "data.hf_dataset=org/name"], "eval.split", "never on training data"),
        (["eval.path=held/*.jsonl"], "eval.path", "is not read with data.source = 'synthetic'"),
        (
            ["mesh.pp=2", "mesh.dp_shard=4", "pp.schedule=ZBVZeroBubble", "pp.stages_per_rank=2"],
            "eval.every",
            "forward-only pass fails",
        ),
    ],
)
def test_evaluation_is_refused_where_it_would_not_be_held_out_or_is_not_implemented(overrides, field, says):
    with pytest.raises(RecipeError) as e:
        load_recipe(
            RECIPES / "debug_cpu.toml",
            ["mesh.pp=1", "mesh.tp=1", "mesh.dp_shard=-1", "eval.every=2", *overrides],
            8,
        )
    assert any(p.field == field and says in p.message for p in e.value.problems), e.value.problems


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    for name, mesh in MESHES.items():
        extra = ["logging.tensorboard=true", "logging.wandb=true"] if name == "one" else []
        args = [str(RECIPES / "debug_cpu.toml"), *QUICK, *mesh, *extra, "train.steps=4", "eval.every=2"]
        args += ["eval.batches=2", f"output_dir={out}", f"run_name={name}"]
        if name == "one":  # W&B's offline files, through the user's variable
            proc = run_cli(args, cwd=out, env=cli_env(WANDB_MODE="offline"))
        else:
            proc = run_recipe(args, cwd=out)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_eval_loss_is_the_same_on_every_mesh(runs):
    evals = {name: {r["step"]: r for r in read_metrics(runs / name) if "eval/loss" in r} for name in MESHES}
    assert all(sorted(e) == [2, 4] for e in evals.values())
    for name in ("dp2_pp2", "tp2", "cp2_pp2"):
        for step in (2, 4):
            assert abs(evals[name][step]["eval/loss"] - evals["one"][step]["eval/loss"]) < 1e-5, (name, step)
    one = evals["one"]
    assert one[4]["eval/loss"] < one[2]["eval/loss"]  # training on the source lowers its held-out loss
    assert math.isclose(one[4]["eval/perplexity"], math.exp(one[4]["eval/loss"]), rel_tol=1e-9)
    summary = json.loads((runs / "one" / "run.json").read_text())["summary"]
    assert (
        summary["eval_loss"] == one[4]["eval/loss"] and 4 in summary["throughput_steps"]["excluded"]["eval"]
    )


@pytest.mark.slow
def test_eval_metrics_reach_tensorboard_wandb_and_compare(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    jsonl = {r["step"]: r["eval/loss"] for r in read_metrics(runs / "one") if "eval/loss" in r}
    acc = EventAccumulator(str(runs / "one" / "tensorboard"))
    acc.Reload()
    tb = {e.step: e.value for e in acc.Scalars("eval/loss")}
    assert tb.keys() == jsonl.keys() and all(abs(tb[s] - jsonl[s]) < 1e-6 for s in jsonl)
    assert {e.step for e in acc.Scalars("eval/perplexity")} == {2, 4}
    history = [h for h in wf.history(wf.run_files(runs / "one")) if "eval/loss" in h]
    assert {h["step"]: h["eval/loss"] for h in history} == pytest.approx(jsonl, abs=1e-6)
    table = comparison_table(find_runs([runs / n for n in MESHES]))
    assert "eval loss (ppl)" in [c.header for c in table.columns]
    cells = table.columns[-1]._cells
    assert all(c.endswith("@ 4") and c.startswith(f"{jsonl[4]:.4f}"[:5]) for c in cells), cells
