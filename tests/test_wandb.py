"""What W&B users get, without any network: the mode and its offline fallback, settings precedence,
and W&B's own offline run files read back after a killed and resumed run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import QUICK, RECIPES, cli_env, read_metrics, run_cli
from rich.console import Console

from meshforge.configs.schema import LoggingConfig
from meshforge.run.observe import wandb_files as wf
from meshforge.run.observe.loggers import WandbLogger, wandb_mode, wandb_settings

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


def test_mode_is_recipe_then_env_then_key(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode(LoggingConfig()) == "offline"  # no key: never online, never a prompt
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode(LoggingConfig()) == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode(LoggingConfig()) == "disabled"
    assert wandb_mode(LoggingConfig(wandb_mode="offline")) == "offline"  # the recipe wins
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.delenv("WANDB_MODE")
    (Path(tmp_path) / ".netrc").write_text(
        "machine api.wandb.ai\n  login user\n  password " + "y" * 40 + "\n"
    )
    assert wandb_mode(LoggingConfig()) == "online"


def test_a_failing_online_start_falls_back_to_offline(monkeypatch, tmp_path):
    import wandb

    real_init, modes = wandb.init, []

    def init(**kwargs):
        modes.append(kwargs["mode"])
        if kwargs["mode"] == "online":
            raise wandb.errors.CommError("network is unreachable")
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", init)
    console = Console(record=True, soft_wrap=True)
    logger = WandbLogger(LoggingConfig(wandb_mode="online"), tmp_path, "run", "run-1234", {"a": 1}, console)
    logger.log({"step": 1, "loss": 2.0})
    logger.close()
    assert modes == ["online", "offline"]
    assert logger.mode == "offline" and "logging offline instead" in console.export_text()
    assert list(tmp_path.glob("wandb/offline-run-*run-1234"))


def test_a_bug_in_wandb_init_is_not_taken_for_a_network_failure(monkeypatch, tmp_path):
    import wandb

    seen, modes = [], []
    monkeypatch.setenv("WANDB_SERVICE", "3-1-tcp-localhost-1")  # a parent process's service

    def init(**kwargs):
        modes.append(kwargs["mode"])
        seen.append(os.environ.get("WANDB_SERVICE"))
        raise TypeError("init() got an unexpected keyword argument 'resume_from'")

    monkeypatch.setattr(wandb, "init", init)
    with pytest.raises(TypeError, match="unexpected keyword"):
        WandbLogger(LoggingConfig(wandb_mode="online"), tmp_path, "run", "run-1", {}, Console())
    assert modes == ["online"]  # no offline retry: a bug keeps its traceback
    # W&B starts its own service (not the parent's), and the environment is given back after
    assert seen == [None] and os.environ["WANDB_SERVICE"] == "3-1-tcp-localhost-1"


def test_disabled_writes_nothing(tmp_path):
    logger = WandbLogger(LoggingConfig(wandb_mode="disabled"), tmp_path, "run", "r-1", {}, Console())
    logger.log({"step": 1, "loss": 1.0})
    logger.close()
    assert logger.mode == "disabled" and logger.path is None and not list(tmp_path.iterdir())


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
