"""What W&B users get, without any network: the mode and its offline fallback, settings precedence,
W&B's own offline run files read back after a preempted, killed and resumed run, and the one
`wandb sync` command that uploads them, run against a stand-in server."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from rich.console import Console
from support import QUICK, RECIPES, cli_env, read_metrics, run_cli
from support.fake_wandb_server import FakeWandbServer

from meshforge.configs.schema import LoggingConfig
from meshforge.run.observe import wandb_files as wf
from meshforge.run.observe.loggers import WandbLogger, wandb_mode, wandb_settings

ONE_RANK = ["mesh.dp_replicate=1", "mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1"]
# sitecustomize: before step 4 the process is preempted (SIGTERM: it stops cleanly after the step, with
# a checkpoint); before step 7 it kills itself (SIGKILL: nothing is flushed or closed)
STOP_AT_STEP4_KILL_AT_STEP7 = """
import os, signal
import meshforge.run.train.trainer as t
original = t.Trainer.train_step
def step(self, n):
    if self.state.step == 3 and os.environ.get("MESHFORGE_TEST_STOP") == "1":
        os.kill(os.getpid(), signal.SIGTERM)
    if self.state.step == 6 and os.environ.get("MESHFORGE_TEST_KILL") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, n)
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
    logger.log({"step": 1, "loss": 2.0}, 1)
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
    logger.log({"step": 1, "loss": 1.0}, 1)
    logger.close()
    assert logger.mode == "disabled" and logger.path is None and not list(tmp_path.iterdir())


def offline_segment(run_dir: Path, first: int, last: int) -> tuple[int, str]:
    """One process's share of the offline W&B run `s-1`: steps first..last; (kept step, where)."""
    logger = WandbLogger(LoggingConfig(wandb_mode="offline"), run_dir, "s", "s-1", {}, Console())
    kept = logger.kept_step()
    for step in range(first, last + 1):
        logger.log({"step": step, "loss": 1 / step}, step)
    where = logger.where
    logger.close()
    # in this process W&B's service writes the file after finish() returns (a process that ends,
    # as a run's does, waits for it)
    deadline = time.monotonic() + 60
    while not any(h["step"] == last for h in wf.history(wf.run_files(run_dir))):
        assert time.monotonic() < deadline, f"W&B did not write step {last}"
        time.sleep(0.1)
    started = int(time.time())
    while int(time.time()) == started:  # W&B names a run's folder by the second it starts in
        time.sleep(0.05)
    return kept, where


def sync_to_stand_in(command: str, cwd: Path) -> tuple[FakeWandbServer, str]:
    """Run a printed `wandb sync` command (W&B's own client) against a local stand-in server;
    the server (what it holds) and the command's stderr."""
    with FakeWandbServer() as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
        env.update(
            WANDB_BASE_URL=server.url, WANDB_API_KEY="x" * 40, WANDB_CONFIG_DIR=str(cwd / "wandb-config")
        )
        sync = subprocess.run(
            ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
        )
        assert sync.returncode == 0, sync.stderr[-3000:]
    return server, sync.stderr


def test_the_sync_command_names_each_folder_that_holds_the_run_in_start_order(tmp_path):
    """Two processes of one offline run (the second a resume) and, between them, one killed before
    W&B wrote anything (an empty run file, and one with only W&B's header)."""

    def segment(first: int, last: int) -> tuple[int, str]:
        return offline_segment(tmp_path, first, last)

    first = segment(1, 3)
    empty = [tmp_path / "wandb" / f"offline-run-29990101_00000{i}-s-1" for i in range(2)]
    for folder, content in zip(empty, (b"", b":W&B" + bytes(3))):
        folder.mkdir()
        (folder / "run-s-1.wandb").write_bytes(content)
    second = segment(4, 6)

    folders = sorted(set(tmp_path.glob("wandb/offline-run-*-s-1")) - set(empty))  # the two that hold the run
    assert len(folders) == 2
    assert first == (0, f"offline: upload with `wandb sync {folders[0]}`")
    # the resumed process: W&B held step 3; the empty folders are left out (given one, `wandb sync`
    # uploads nothing at all)
    assert second == (3, f"offline: upload with `wandb sync {folders[0]} {folders[1]}`")
    assert wf.segments(tmp_path / "wandb", "s-1") == folders
    files = [f / "run-s-1.wandb" for f in folders]
    assert [h["step"] for h in wf.history(files)] == [1, 2, 3, 4, 5, 6]
    assert [h["_step"] for h in wf.history(files)] == [0, 1, 2, 0, 1, 2]  # W&B's own counter restarts
    assert [wf.run_record(f).resume for f in files] == [True, True]  # which `wandb sync` numbers on


@pytest.mark.slow
def test_a_folder_cut_short_mid_record_ends_its_sync_command(tmp_path):
    """A process killed while W&B wrote (its file ends inside a record): `wandb sync` uploads what
    comes before the cut, then skips the run's later folders in that command; so they get their
    own command, and W&B's client numbers them on."""
    offline_segment(tmp_path, 1, 3)
    (cut,) = wf.run_files(tmp_path)
    assert not wf.ends_mid_record(cut)
    cut.write_bytes(cut.read_bytes()[:-3])
    assert wf.ends_mid_record(cut)
    kept, where = offline_segment(tmp_path, 4, 6)
    assert kept == 3  # the whole records before the cut
    folders = wf.segments(tmp_path / "wandb", "s-1")
    command = f"wandb sync {folders[0]}; wandb sync {folders[1]}"
    assert len(folders) == 2 and where == f"offline: upload with `{command}`"
    server, stderr = sync_to_stand_in(command, tmp_path)
    assert "the file ends with an incomplete record" in stderr  # W&B's own complaint, and it goes on
    uploaded = server.history("s-1")
    assert [(h["_step"], h["step"]) for h in uploaded] == [(i, i + 1) for i in range(6)]


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
def test_a_preempted_killed_and_resumed_offline_run_uploads_as_one_run_with_each_step_once(tmp_path):
    """Preempted after step 4, resumed and killed before step 7, resumed to step 10: one W&B run id
    in a folder per process; the printed `wandb sync` names every folder that holds anything, in
    start order, and W&B's own `wandb sync`, against a stand-in server, uploads steps 1..10 once
    each, in order, numbered on across the folders."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STOP_AT_STEP4_KILL_AT_STEP7)
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
    stopped = run_cli(args, cwd=tmp_path, env=cli_env(**env, MESHFORGE_TEST_STOP="1"))
    assert stopped.returncode == 130 and "stopped by SIGTERM after step 4" in stopped.stderr
    resume = [*args, "checkpoint.load=latest"]
    killed = run_cli(resume, cwd=tmp_path, env=cli_env(**env, MESHFORGE_TEST_KILL="1"))
    assert killed.returncode != 0
    assert [r["step"] for r in read_metrics(tmp_path / "w")] == [1, 2, 3, 4, 5, 6]
    resumed = run_cli([*resume, "logging.progress=true"], cwd=tmp_path, env=cli_env(**env))  # the terminal
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    wandb_dir = tmp_path / "w" / "wandb"
    assert len(list(wandb_dir.glob("offline-run-*"))) == 3  # a folder per process
    runs = {f: wf.run_record(f) for f in wf.run_files(tmp_path / "w")}
    assert len({r.run_id for r in runs.values() if r}) == 1  # one W&B run, continued
    (run_id,) = {r.run_id for r in runs.values() if r}
    folders = wf.segments(wandb_dir, run_id)  # what holds anything, in start order
    # the preempted run closed W&B (its folder holds steps 1-4); a SIGKILLed process keeps only
    # what W&B had flushed: the resumed run gives W&B the recorded steps it lacks, so the folders
    # together hold every step once, in order
    files = [folder / f"run-{run_id}.wandb" for folder in folders]
    assert [h["step"] for h in wf.history(files[:1]) if "loss" in h] == [1, 2, 3, 4]
    rows = [h for h in wf.history(files) if "loss" in h]
    assert [h["step"] for h in rows] == list(range(1, 11))
    records = [runs[f] for f in files]
    assert all(r.resume for r in records)  # what makes `wandb sync` continue the run, not replace it
    assert all(
        r.project == "proj-env" and list(r.tags) == ["env-a", "env-b"] and r.job_type == "train"
        for r in records
    )
    final = read_metrics(tmp_path / "w")
    assert [r["step"] for r in final] == list(range(1, 11))
    by_step = {h["step"]: h["loss"] for h in rows}
    assert all(abs(by_step[r["step"]] - r["loss"]) < 1e-6 for r in final)  # the same numbers as the record
    assert all("time" not in h for h in rows)  # wall-clock time stays in the JSONL, off the charts

    # the one command, in run.json and the terminal (at the start and after the summary)
    info = json.loads((tmp_path / "w" / "run.json").read_text())
    command = "wandb sync " + " ".join(str(f) for f in folders)
    assert info["wandb"] == f"offline: upload with `{command}`" and info["status"] == "finished"
    assert resumed.stdout.count(f"W&B: offline: upload with `{command}`") == 2
    assert folders[-1].name == Path(info["wandb"].rstrip("`").split()[-1]).name  # this process's, last

    # W&B's own upload of that command, to a local stand-in of its server
    server, stderr = sync_to_stand_in(command, tmp_path)
    assert "ERROR" not in stderr, stderr[-3000:]
    uploaded = [h for h in server.history(run_id) if "loss" in h]
    assert [h["step"] for h in uploaded] == list(range(1, 11))  # each step once, in order, in one run
    assert [h["_step"] for h in uploaded] == list(range(10))  # W&B's own counter numbered on, no repeats
    assert all(abs(h["loss"] - by_step[h["step"]]) < 1e-6 for h in uploaded)
    assert server.operations.count("RunResumeStatus") == len(folders)  # each folder resumed the run

    config = wf.config(files[-1])
    assert config["pp"]["schedule"] == "GPipe" and config["mesh"]["dp_shard"] == 1  # nested, intact
    assert config["layout"] == "single" and config["world_size"] == 1
    recipes = [a for a in wf.artifacts(files[-1]) if a.type == "recipe"]
    assert recipes and [m.path for m in recipes[0].manifest.contents] == ["recipe.toml"]
    assert (tmp_path / "w" / "recipe.toml").read_text().count('schedule = "GPipe"') == 1
