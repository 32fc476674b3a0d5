"""Commands as a user meets them after a mistake or a surprise: a command that produced nothing
exits non-zero with the reason on one line, a misspelt override is explained, and files land
where the user was told."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import RECIPES, run_cli

ONE_PROCESS = ["mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1", "logging.progress=false"]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_an_estimate_of_a_refused_recipe_exits_2_with_the_refusal_on_one_line(tmp_path):
    recipe = str(RECIPES / "debug_cpu.toml")
    proc = run_cli(["estimate", recipe, "--world", "8", "mesh.dp_shard=3"], cwd=tmp_path, program="meshforge")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = error_lines(proc.stderr)
    assert "nothing estimated" in line and "12 but the world size is 8" in line
    assert "analytic total" not in proc.stdout  # no empty table


def test_every_layout_refused_exits_2_for_estimate_sweep_and_tune_plans(tmp_path):
    cases = {
        "estimate": (
            ["estimate", "debug_cpu", "--world", "5", "--all-meshes", "--analytic"],
            "all 5 layouts",
        ),
        "sweep": (["sweep", "debug_cpu", "--world", "2", "--plan"], "all 5 points were refused"),
        "tune": (
            ["tune", "debug_cpu", "--world", "2", "--plan", "--profile", "h100"],
            "none of the 5 points",
        ),
    }
    for command, (args, said) in cases.items():
        if command != "estimate":  # every point refused: an activation checkpointing mode that does not exist
            args = [*args, "--axis", "activation_checkpoint.mode=bogus"]
        proc = run_cli(args, cwd=tmp_path, program="meshforge")
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        (line,) = error_lines(proc.stderr)
        assert said in line, (command, line)
        assert "refused:" in proc.stdout  # each refusal listed above the one line
        assert "┏" not in proc.stdout, (command, proc.stdout)  # no empty table
    assert not (tmp_path / "outputs").exists()  # a plan writes nothing


@pytest.fixture(scope="module")
def one_run(tmp_path_factory) -> Path:
    """A two-step one-process run, in <tmp>/outputs/quick."""
    where = tmp_path_factory.mktemp("runs")
    args = ["debug_cpu", *ONE_PROCESS, "train.steps=2", "run_name=quick", "logging.tensorboard=false"]
    proc = run_cli(args, cwd=where)
    assert proc.returncode == 0, proc.stderr
    return where / "outputs" / "quick"


def test_compare_writes_its_plots_beside_the_runs_and_refuses_a_metric_no_run_logged(one_run, tmp_path):
    proc = run_cli(["compare", str(one_run)], cwd=tmp_path, program="meshforge")
    assert proc.returncode == 0, proc.stderr
    assert (one_run.parent / "compare" / "loss_vs_step.png").is_file()
    assert not (tmp_path / "compare").exists()  # nothing in the folder the command was typed in
    proc = run_cli(
        ["compare", str(one_run), "--out", str(tmp_path / "plots")], cwd=tmp_path, program="meshforge"
    )
    assert proc.returncode == 0 and (tmp_path / "plots" / "loss_vs_step.png").is_file()
    proc = run_cli(
        ["compare", str(one_run), "--metrics", "loss,nonsense", "--out", str(tmp_path / "no")],
        cwd=tmp_path,
        program="meshforge",
    )
    assert proc.returncode == 2
    (line,) = error_lines(proc.stderr)
    assert "no run logged nonsense" in line and "grad_norm" in line
    assert not (tmp_path / "no").exists()


def test_an_override_typed_as_a_flag_is_explained(tmp_path):
    proc = run_cli(["debug_cpu", "--train.steps=5"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "overrides are key=value without dashes: train.steps=5" in proc.stderr
    proc = run_cli(["estimate", "debug_cpu", "--train.steps", "5"], cwd=tmp_path, program="meshforge")
    assert proc.returncode == 2 and "without dashes: train.steps=VALUE" in proc.stderr
    proc = run_cli(["debug_cpu", "--bogus"], cwd=tmp_path)  # a flag that is no override: argparse's own words
    assert proc.returncode == 2 and "without dashes" not in proc.stderr
