"""What the terminal shows: the real 8-process default run's, and a quiet run's (each program
started fresh, as a user starts it: whatever its imports print is on the terminal too)."""

from __future__ import annotations

import re

import pytest
from conftest import QUICK, RECIPES, cli_env, run_cli

ONE_RANK = ["mesh.dp_replicate=1", "mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1"]


@pytest.mark.slow
def test_the_default_run_s_terminal(tmp_path):
    """`run_recipe` as the README runs it (8 processes): the banner names the mesh, the
    progress lines have an ETA, no rank prefixes, each warning at most once, whole paths."""
    proc = run_cli(["train.steps=6"], cwd=tmp_path, env=cli_env(WANDB_MODE="offline"), fresh=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "on 8 x cpu [pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2]" in out
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
    first = run_cli(args, cwd=tmp_path, fresh=True)
    assert first.returncode == 0 and first.stdout == "", first.stdout + first.stderr[-2000:]
    second = run_cli([*args, "--log-level", "info"], cwd=tmp_path, fresh=True)  # the same run name again
    assert second.returncode == 0 and second.stdout == ""
    assert "INFO meshforge: an earlier run's records were moved to outputs/q." in second.stderr
    third = run_cli([*args, "--log-level", "warning"], cwd=tmp_path, fresh=True)
    assert "records were moved" not in third.stderr  # below the level
