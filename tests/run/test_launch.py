"""Launching: a failing rank ends the whole job promptly; torchrun across two "nodes" works; a
preempted job (SIGTERM, Ctrl-C) stops cleanly with one line and exit 130."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import QUICK, RECIPES, cli_env, read_metrics, run_cli, running

pytestmark = pytest.mark.slow

# Injected into every worker through sitecustomize: rank 1 raises at its 3rd step. (RANK
# is read at call time: spawned workers get their environment after start-up.)
FAULT = """
import os
import meshforge.run.train.trainer as t
original = t.Trainer.train_step
def failing(self, n):
    if os.environ.get("RANK") == "1" and self.state.step == 2:
        raise RuntimeError("injected failure on rank 1")
    return original(self, n)
t.Trainer.train_step = failing
"""


@pytest.mark.slow
def test_a_failing_rank_ends_the_job_with_its_error(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAULT)
    env = cli_env(PYTHONPATH=str(hook))
    start = time.monotonic()
    proc = run_cli(
        [
            str(RECIPES / "debug_cpu.toml"),
            *QUICK,
            "mesh.pp=1",
            "mesh.tp=2",
            "train.steps=50",
            f"output_dir={tmp_path}",
            "run_name=fail",
        ],
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 1
    assert "rank 1 failed" in proc.stderr and "injected failure on rank 1" in proc.stderr
    # ended by the failure, not by the other ranks' collectives timing out (300 s): a bound, not a
    # speed target (a loaded 2-core machine takes 80 s to start 4 ranks, train 2 steps and stop)
    assert elapsed < 200, f"took {elapsed:.0f}s to end the job"
    # nothing lost: the steps before the failure are on record, and the run is marked failed
    assert [r["step"] for r in read_metrics(tmp_path / "fail")] == [1, 2]
    info = json.loads((tmp_path / "fail" / "run.json").read_text())
    assert info["status"] == "failed" and "rank 1" in info["error"]
    assert (tmp_path / "fail" / "logs").is_dir()  # every rank's output is kept


def test_two_torchrun_agents_make_one_job(tmp_path):
    """Two 'nodes' (two torchrun agents, c10d rendezvous on 127.0.0.1), 2 processes each."""
    torchrun = Path(sys.executable).parent / "torchrun"
    port = 29500 + (hash(str(tmp_path)) % 1000)
    args = [
        str(RECIPES / "debug_cpu.toml"),
        *QUICK,
        "mesh.pp=1",
        "mesh.dp_shard=2",
        "mesh.tp=2",
        "train.steps=5",
        f"output_dir={tmp_path}",
        "run_name=two_nodes",
    ]
    cmd = [
        str(torchrun),
        "--nnodes",
        "2",
        "--nproc_per_node",
        "2",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"127.0.0.1:{port}",
        "--rdzv_id",
        "meshforge-test",
        "--local_addr",
        "127.0.0.1",
        "-m",
        "meshforge.cli",
        *args,
    ]
    nodes = [
        subprocess.Popen(
            cmd, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outputs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    info = json.loads((tmp_path / "two_nodes" / "run.json").read_text())
    assert info["world_size"] == 4 and info["status"] == "finished"
    assert [r["step"] for r in read_metrics(tmp_path / "two_nodes")] == [1, 2, 3, 4, 5]


def _wait_for_rows(run_dir: Path, rows: int, proc: subprocess.Popen, timeout: float = 900) -> None:
    """Wait (up to `timeout`) until `run_dir` has logged `rows` steps; fail if the run ended first."""
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout
    while not (metrics.is_file() and metrics.read_text().count("\n") >= rows):
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before logging {rows} steps"
        assert time.monotonic() < deadline, f"no {rows} steps logged in {timeout} s"
        time.sleep(0.2)


def _stop_and_check(proc: subprocess.Popen, run_dir: Path, name: str) -> int:
    """The stopped run: exit 130, one line (the signal, the step, the checkpoint, how to resume),
    no traceback or torch warning; run.json preempted; the checkpoint of the last step on disk."""
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    step = read_metrics(run_dir)[-1]["step"]
    checkpoint = run_dir / "checkpoints" / f"step-{step:08d}"
    assert err.strip().splitlines() == [
        f"stopped by {name} after step {step}; checkpoint saved in {checkpoint}; resume: the same "
        "command with checkpoint.load=auto"
    ]
    assert json.loads((checkpoint / "meta.json").read_text())["step"] == step  # committed
    assert json.loads((run_dir / "run.json").read_text())["status"] == "preempted"
    return step


def test_sigterm_ctrl_c_and_a_killed_launcher_stop_8_ranks_with_a_checkpoint(tmp_path):
    """SIGTERM to the launcher only (as Kubernetes sends it), then, on the resumed run, SIGINT to
    the whole process group (Ctrl-C), then SIGKILL to the launcher: every rank stops at the end of
    its step and saves (the first two with one line and exit 130)."""
    args = [
        str(RECIPES / "debug_cpu.toml"),
        *QUICK,
        "train.steps=100000",
        "checkpoint.enabled=true",
        "checkpoint.interval=100000",
        "checkpoint.save_at_end=false",
        "checkpoint.load=auto",
        f"output_dir={tmp_path}",
        "run_name=pre",
    ]
    run_dir, exe = tmp_path / "pre", Path(sys.executable).parent / "run_recipe"

    def start() -> subprocess.Popen:
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        return subprocess.Popen(
            [str(exe), *args], cwd=tmp_path, env=cli_env(), start_new_session=True, **pipes
        )

    proc = start()
    _wait_for_rows(run_dir, 2, proc)
    proc.send_signal(signal.SIGTERM)
    first = _stop_and_check(proc, run_dir, "SIGTERM")
    assert json.loads((run_dir / "run.json").read_text())["world_size"] == 8

    proc = start()  # the same command resumes from that checkpoint
    _wait_for_rows(run_dir, first + 2, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: every process of the job
    second = _stop_and_check(proc, run_dir, "SIGINT")
    info = json.loads((run_dir / "run.json").read_text())
    assert info["resumed_from"] == str(run_dir / "checkpoints" / f"step-{first:08d}")
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, second + 1))  # each step once

    # the launcher killed outright (the OOM killer's SIGKILL) passes nothing on: its ranks see it
    # gone, stop at a step, save, and exit; nothing of the job is left running (its process group)
    proc = start()
    try:
        _wait_for_rows(run_dir, second + 2, proc)
        proc.kill()
        proc.communicate(timeout=600)  # its pipes close once its ranks, which hold them, have exited
        deadline = time.monotonic() + 60
        while running(group=proc.pid):
            assert time.monotonic() < deadline, "ranks still running after their launcher was killed"
            time.sleep(0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a failed check leaves no ranks training on
    third = read_metrics(run_dir)[-1]["step"]
    checkpoint = run_dir / "checkpoints" / f"step-{third:08d}"
    info = json.loads((run_dir / "run.json").read_text())
    assert info["status"] == "preempted" and info["error"].startswith(
        f"Interrupted: stopped by the launcher's death after step {third}; checkpoint saved in {checkpoint}"
    ), info
    assert json.loads((checkpoint / "meta.json").read_text())["step"] == third > second + 1
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, third + 1))
