"""Commands as a user meets them after a mistake or a surprise: a command that produced nothing
exits non-zero with the reason on one line, a misspelt override is explained, and files land
where the user was told."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import RECIPES, cli_env, read_metrics, run_cli

from meshforge.run.observe.wandb_files import config, history, run_files

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


@pytest.mark.slow
def test_a_torch_run_continued_in_jax_then_in_torch_sets_the_jax_steps_aside_and_says_so(tmp_path):
    """The README's cross-framework pair and the torch run after it: the JAX run saves nothing
    (warned at its start), so the torch run resumes from step 10 again; the JAX run's steps 11-20
    are set aside (one line: which, why, where), never silently overwritten, and W&B says so."""
    pytest.importorskip("jax", reason="the jax extra (installed by .[all], as CI does)")
    env = cli_env(WANDB_MODE="offline")
    quick = ["debug_cpu", "mesh.pp=1", "mesh.tp=1", "logging.wandb=true", "logging.tensorboard=false"]
    torch_run = run_cli(
        [*quick, "mesh.dp_shard=1", "checkpoint.enabled=true", "checkpoint.interval=5", "train.steps=10"],
        cwd=tmp_path,
        env=env,
    )
    assert torch_run.returncode == 0, torch_run.stderr[-3000:]
    jax_run = run_cli(
        [*quick, "mesh.dp_shard=1", "backend=jax", "checkpoint.load=auto", "train.steps=20"],
        cwd=tmp_path,
        env=env,
    )
    assert jax_run.returncode == 0, jax_run.stderr[-3000:]
    assert "this run saves no checkpoint, so the next resume starts there again" in jax_run.stderr
    lines = jax_run.stdout.splitlines()
    assert " in JAX on 1 x cpu [" in lines[0]
    assert lines[1].startswith(
        "resumed from step 10 (checkpoint outputs/debug_cpu/checkpoints/step-00000010;"
    )
    assert "recipe changes: train.steps 10 -> 20," in lines[1] and "backend 'torch' -> 'jax'" in lines[1]
    # continued in torch on 2 launched ranks: the launcher draws the terminal from the records
    again = run_cli(
        [*quick, "mesh.dp_shard=2", "checkpoint.enabled=true", "checkpoint.load=auto", "train.steps=14"],
        cwd=tmp_path,
        env=env,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    run_dir = tmp_path / "outputs" / "debug_cpu"
    (aside,) = tmp_path.glob("outputs/debug_cpu.*")
    said = [line for line in again.stderr.splitlines() if "set aside" in line]
    assert said == [
        "WARNING meshforge: steps 11-20 (10 logged) came after checkpoint step 10, which this run resumes "
        f"from and trains again: their records were set aside to outputs/{aside.name}"
    ]
    assert [row["step"] for row in read_metrics(aside)] == list(range(1, 21))
    assert [row["step"] for row in read_metrics(run_dir)] == list(range(1, 15))
    assert json.loads((run_dir / "run.json").read_text())["set_aside"]["steps"] == list(range(11, 21))
    steps = [line.split()[1] for line in again.stdout.splitlines() if line.startswith("step ")]
    assert steps[0] == "11/14", again.stdout  # no replay of the earlier run's step 1
    assert " in PyTorch on 2 x cpu [" in again.stdout and "resumed from step 10 (checkpoint" in again.stdout
    # W&B: the JAX run's folder went with its records; the run's history holds each step once
    files = run_files(run_dir)
    assert [row["step"] for row in history(files) if "loss" in row] == list(range(1, 15))
    assert config(files[-1])["set_aside"] == said[0].removeprefix("WARNING meshforge: ")
    assert len(list((aside / "wandb").glob("offline-run-*"))) == 1


def test_exported_weights_are_as_readable_as_the_user_s_umask_says(tmp_path):
    """Every file an export writes has the mode a plain open() gives under the umask (safetensors
    writes its files 0600: a colleague could not read the weights beside a readable config.json)."""
    seed = run_cli(["init", "debug_cpu", "--out", str(tmp_path / "seed")], cwd=tmp_path, program="meshforge")
    assert seed.returncode == 0, seed.stderr
    exe = Path(sys.executable).parent / "meshforge"
    for to, umask, extra in (
        ("hf", 0o022, []),
        ("hf", 0o027, ["--max-shard-size", "300KB"]),
        ("safetensors", 0o002, []),
    ):
        out = tmp_path / f"{to}-{umask:o}"
        proc = subprocess.run(
            [str(exe), "export", str(tmp_path / "seed"), "--to", to, str(out), *extra],
            cwd=tmp_path,
            env=cli_env(),
            capture_output=True,
            text=True,
            umask=umask,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
        assert len(modes) >= 2 and set(modes.values()) == {0o666 & ~umask}, (to, umask, modes)


def test_a_maxtext_export_names_its_load_path_and_a_refused_one_writes_nothing(tmp_path):
    pytest.importorskip("orbax.checkpoint", reason="the jax extra (installed by .[all], as CI does)")

    def meshforge(*args: str):
        return run_cli(list(args), cwd=tmp_path, program="meshforge")

    assert meshforge("init", "debug_cpu", "--out", "seed").returncode == 0
    done = meshforge("export", "seed", "--to", "maxtext", "mt")
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "mt" / "maxtext_config.json").read_text())
    assert config["load_parameters_path"] == str(tmp_path / "mt" / "0" / "items")
    assert (tmp_path / "mt" / "0" / "items" / "manifest.ocdbt").is_file()
    # a RoPE scaling MaxText's rotary does not apply: refused before anything is left on disk
    assert meshforge("init", "debug_cpu", "model.rope_scaling_factor=4.0", "--out", "scaled").returncode == 0
    refused = meshforge("export", "scaled", "--to", "maxtext", "new/deeper")
    assert refused.returncode == 2 and "RoPE scaling" in refused.stderr
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's")
    refused = meshforge("export", "scaled", "--to", "maxtext", "mine")
    assert refused.returncode == 2
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]  # the user's folder, as it was
