"""What W&B users see, read back from W&B's own offline run files, and what the terminal of a
real 8-process default run shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import QUICK, RECIPES, cli_env, read_metrics, run_cli

from meshforge.configs.schema import LoggingConfig
from meshforge.run.observe import wandb_files as wf
from meshforge.run.observe.loggers import wandb_settings

ONE_RANK = ["mesh.dp_replicate=1", "mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1"]
# sitecustomize: the process kills itself (SIGKILL: nothing is flushed or closed) at step 7
KILL_AT_STEP7 = """
import os, signal
import meshforge.run.train.trainer as t
original = t.Trainer.train_step
def step(self):
    if self.state.step == 6 and os.environ.get("MESHFORGE_TEST_KILL") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self)
t.Trainer.train_step = step
"""


def test_settings_follow_wandb_precedence():
    env = {
        "WANDB_PROJECT": "p-env",
        "WANDB_ENTITY": "team",
        "WANDB_RUN_GROUP": "g-env",
        "WANDB_TAGS": "a, b",
        "WANDB_JOB_TYPE": "eval",
        "WANDB_MODE": "dryrun",
    }
    got = wandb_settings(LoggingConfig(), env)
    assert got == {
        "project": "p-env",
        "entity": "team",
        "group": "g-env",
        "tags": ["a", "b"],
        "job_type": "eval",
        "mode": "offline",
    }  # dryrun: W&B's old name for offline
    recipe = LoggingConfig(
        wandb_project="p", wandb_group="g", wandb_tags=[], wandb_job_type="sweep-point", wandb_mode="disabled"
    )
    got = wandb_settings(recipe, env)
    assert (got["project"], got["group"], got["tags"], got["job_type"], got["mode"]) == (
        "p",
        "g",
        [],
        "sweep-point",
        "disabled",
    )  # the recipe wins, an empty list too
    got = wandb_settings(LoggingConfig(), {})
    assert (got["project"], got["tags"], got["job_type"], got["mode"]) == (
        "meshforge",
        [],
        "train",
        "offline",
    )


@pytest.mark.slow
def test_wandb_files_hold_the_nested_config_and_each_step_once_after_kill_and_resume(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_AT_STEP7)
    env = {
        "PYTHONPATH": str(hook),
        "WANDB_MODE": "dryrun",
        "WANDB_TAGS": "env-a,env-b",
        "WANDB_PROJECT": "proj-env",
    }
    args = [
        str(RECIPES / "debug_cpu.toml"),
        *ONE_RANK,
        *QUICK,
        "logging.wandb=true",
        "logging.tensorboard=true",
        "train.steps=10",
        "checkpoint.enabled=true",
        "checkpoint.interval=5",
        f"output_dir={tmp_path}",
        "run_name=w",
        "pp.schedule=GPipe",
    ]
    killed = run_cli(args, cwd=tmp_path, env=cli_env(**env, MESHFORGE_TEST_KILL="1"))
    assert killed.returncode != 0
    assert [r["step"] for r in read_metrics(tmp_path / "w")] == [1, 2, 3, 4, 5, 6]
    resumed = run_cli([*args, "checkpoint.load=latest"], cwd=tmp_path, env=cli_env(**env))
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    files = wf.run_files(tmp_path / "w")
    assert len(files) == 2  # the killed run's and the resumed run's
    # a SIGKILLed process keeps only what W&B had flushed (here: nothing): the resumed run gives
    # W&B the recorded steps it lacks, so together the files hold every step once
    runs = [wf.run_record(f) for f in files if wf.records(f)]
    assert len({r.run_id for r in runs}) == 1  # one W&B run, continued
    assert all(
        r.project == "proj-env" and list(r.tags) == ["env-a", "env-b"] and r.job_type == "train" for r in runs
    )
    rows = [h for h in wf.history(files) if "loss" in h]
    assert sorted(h["step"] for h in rows) == list(range(1, 11))  # each step exactly once
    final = read_metrics(tmp_path / "w")
    assert [r["step"] for r in final] == list(range(1, 11))
    by_step = {h["step"]: h["loss"] for h in rows}
    assert all(abs(by_step[r["step"]] - r["loss"]) < 1e-6 for r in final)  # the same numbers as the record
    assert all("time" not in h for h in rows)  # wall-clock time stays in the JSONL, off the charts

    config = wf.config(files[-1])
    assert config["pp"]["schedule"] == "GPipe" and config["mesh"]["dp_shard"] == 1  # nested, intact
    assert config["layout"] == "single" and config["world_size"] == 1
    recipes = [a for a in wf.artifacts(files[-1]) if a.type == "recipe"]
    assert recipes and [m.path for m in recipes[0].manifest.contents] == ["recipe.toml"]
    info = json.loads((tmp_path / "w" / "run.json").read_text())
    assert info["wandb"].startswith("offline: upload with `wandb sync ") and info["status"] == "finished"
    sync_dir = info["wandb"].split("wandb sync ")[1].rstrip("`")
    assert Path(sync_dir).is_dir() and Path(sync_dir).name.endswith(runs[0].run_id)
    assert (tmp_path / "w" / "recipe.toml").read_text().count('schedule = "GPipe"') == 1


@pytest.mark.slow
def test_the_default_run_s_terminal(tmp_path):
    """`run_recipe` as the README runs it (8 processes): the banner names the mesh, the
    progress lines have an ETA, no rank prefixes, each warning at most once, whole paths."""
    proc = run_cli(["train.steps=6"], cwd=tmp_path, env=cli_env(WANDB_MODE="offline"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "on 8 x cpu [pp=2, dp_replicate=1, dp_shard=2, tp=2]" in out
    assert re.search(r"step 6/6 .* ETA 0:00", out)
    assert "[rank" not in out + proc.stderr  # the ranks write to their log files
    warnings = [line for line in (out + proc.stderr).splitlines() if "warn" in line.lower()]
    assert len(warnings) == len(set(warnings))
    sync = re.search(r"wandb sync (\S+)`", out)
    assert sync and (tmp_path / sync.group(1)).is_dir()  # the whole path, not cut with "..."
    assert (
        tmp_path / "outputs" / "debug_cpu" / "tensorboard"
    ).is_dir() and "outputs/debug_cpu/tensorboard" in out
    assert "…" not in out and "..." not in out
    logs = list((tmp_path / "outputs" / "debug_cpu" / "logs").glob("**/stdout.log"))
    assert len(logs) == 8


def test_quiet_runs_show_nothing_but_meshforge_s_own_messages(tmp_path):
    args = [str(RECIPES / "debug_cpu.toml"), *ONE_RANK, *QUICK, "train.steps=2", "run_name=q", "--quiet"]
    first = run_cli(args, cwd=tmp_path)
    assert first.returncode == 0 and first.stdout == "", first.stdout + first.stderr[-2000:]
    second = run_cli([*args, "--log-level", "info"], cwd=tmp_path)  # the same run name again
    assert second.returncode == 0 and second.stdout == ""
    assert "INFO meshforge: an earlier run's records were moved to outputs/q." in second.stderr
    third = run_cli([*args, "--log-level", "warning"], cwd=tmp_path)
    assert "records were moved" not in third.stderr  # below the level
