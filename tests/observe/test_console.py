"""What the terminal shows: the real 8-process default run's, and a quiet run's (each program
started fresh, as a user starts it: whatever its imports print is on the terminal too)."""

from __future__ import annotations

import re

import pytest
from support import QUICK, RECIPES, cli_env, run_cli

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


def test_the_launcher_says_the_ranks_meshforge_warnings_as_they_come_once_and_only_this_launch_s():
    """The watcher of a local launch (run/launch/watch.py) on logs written as torch's launcher lays
    them out: meshforge's warnings of this launch's ranks are logged once each, under the banner,
    a line still being written waits for its end; the end-of-run list holds the rest (torch's,
    Python's), and an earlier launch's logs in the same run folder are not this launch's."""
    import io
    import json
    import logging
    import shutil
    import tempfile
    import time
    from pathlib import Path

    from rich.console import Console

    from meshforge.run.launch.watch import RunWatcher
    from meshforge.run.observe.console import RunConsole

    started = time.time()
    # outside pytest's tmp folders, whose rank log folders mean a launch (conftest's slow-marker check)
    run_dir = Path(tempfile.mkdtemp()) / "run"
    logs = {r: run_dir / "logs" / "meshforge-new00000_ab12" / "attempt_0" / str(r) for r in (0, 1)}
    old = run_dir / "logs" / "meshforge-old00000_cd34" / "attempt_0" / "0"
    for folder in [*logs.values(), old]:
        folder.mkdir(parents=True)
    changed = "WARNING meshforge: resumed with the recipe's optimizer settings: optimizer.lr: 0.001 -> 0.01\n"
    torch_warning = "/x/torch/fsdp.py:12: UserWarning: a torch warning\n"
    (logs[0] / "stderr.log").write_text(changed + torch_warning)
    (logs[1] / "stderr.log").write_text(changed + torch_warning + "WARNING meshforge: a step was ski")
    (old / "stderr.log").write_text("WARNING meshforge: an earlier launch's\nUserWarning: an earlier one\n")

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("meshforge.run").addHandler(handler)
    console = RunConsole(enabled=True)
    console.console = Console(file=io.StringIO(), width=200)
    watcher = RunWatcher(run_dir, console, started, "meshforge-new00000")
    try:
        watcher._poll()
        assert said == []  # nothing before the banner: run.json is not written yet
        banner = {"run_name": "r", "model": "llama3/debug", "n_params": 1, "world_size": 2}
        banner |= {"device_type": "cpu", "mesh": "dp_shard=2", "total_steps": 3}
        info = {"start_time": started, "banner": banner, "loggers": {}}
        (run_dir / "run.json").write_text(json.dumps(info))
        watcher._poll()
        assert said == [changed.removeprefix("WARNING meshforge: ").strip()]  # two ranks, once
        with open(logs[1] / "stderr.log", "a") as f:
            f.write("pped\n")
        watcher._poll()
        watcher._poll()
        assert said[1:] == ["a step was skipped"]
        watcher.print_warnings()
    finally:
        logging.getLogger("meshforge.run").removeHandler(handler)
        shutil.rmtree(run_dir.parent)
    shown = console.console.file.getvalue()
    assert "meshforge r: llama3/debug" in shown
    assert shown.count("UserWarning: a torch warning") == 1 and "earlier" not in shown
    assert "meshforge:" not in shown.split("warnings from the ranks")[1]  # said as they came
