"""Sweeps as Slurm jobs, against the stand-ins in support/fake_slurm.py (sbatch runs each job script
here, srun starts one torchrun agent per "node"): two agents really rendezvous; a failed and a
cancelled job are recorded with the scheduler's reason; a sweep stopped while its job runs is
resumed by asking the scheduler again, not by resubmitting; the README's llm_8b command
submits what it says; a missing or failing scheduler command is an error naming it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import QUICK, RECIPES, REPO, cli_env, run_cli, slurm_env

from meshforge.configs import RecipeError
from meshforge.configs.schema import SlurmConfig
from meshforge.experiments.grid import grid_points
from meshforge.experiments.slurm import job_script, nodes_for, slurm_time

SWEEP = [
    "debug_cpu",
    "--world",
    "4",
    *QUICK,
    "sweep.steps=3",
    "sweep.launcher=slurm",
    "sweep.slurm.gpus_per_node=2",
    "sweep.slurm.poll_s=0.5",
    "sweep.slurm.partition=debug",
    "sweep.slurm.account=proj",
    "sweep.slurm.time=00:05:00",
]


def rows_of(sweep_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (sweep_dir / "sweep.jsonl").read_text().splitlines()]


def statuses(sweep_dir: Path) -> list[str]:
    return [r["status"] for r in rows_of(sweep_dir)] if (sweep_dir / "sweep.jsonl").is_file() else []


def sweep_cmd(args: list[str]) -> list[str]:
    return [str(Path(sys.executable).parent / "meshforge"), "sweep", *args]


def submissions(tmp: Path) -> list[str]:
    """The job names sbatch accepted, in order (fake_slurm's log)."""
    return (tmp / "slurm" / "submissions.log").read_text().split()[1::2]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_job_script_asks_for_whole_nodes_and_one_agent_per_node():
    cfg = SlurmConfig(partition="gpu", account="proj", gpus_per_node=8, sbatch_args=["--qos=high"])
    cfg.setup = ["source /shared/venv/bin/activate"]
    command = [
        "/shared/venv/bin/python",
        "-m",
        "meshforge.cli",
        "/r/llm_8b.toml",
        "logging.wandb_tags=[sweep,dp16]",
    ]
    script = job_script("llm_8b-dp16", command, 16, Path("/s/dp16.log"), cfg, slurm_time(1800), gpus=True)
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --time=00:30:00",
        "#SBATCH --output=/s/dp16.log",
        "#SBATCH --qos=high",
        "source /shared/venv/bin/activate",
    ):
        assert line in script.splitlines(), line
    assert '--nnodes "$SLURM_NNODES" --nproc_per_node 8 --rdzv_id "$SLURM_JOB_ID"' in script
    assert "'logging.wandb_tags=[sweep,dp16]'" in script  # quoted for the shell
    bash = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert bash.returncode == 0, bash.stderr
    assert nodes_for(4, cfg) == (1, 4) and nodes_for(32, cfg) == (4, 8)
    with pytest.raises(RecipeError, match="sweep.slurm.gpus_per_node = 8: must divide the world size 12"):
        nodes_for(12, cfg)
    assert (
        slurm_time(600) == "00:10:00" and slurm_time(61) == "00:02:00" and slurm_time(90000) == "1-01:00:00"
    )


def test_a_missing_scheduler_command_stops_before_anything(tmp_path):
    env = cli_env()
    env["PATH"] = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    out = run_cli(["sweep", *SWEEP, f"output_dir={tmp_path}"], cwd=tmp_path, env=env, program="meshforge")
    assert out.returncode == 1
    assert (
        "`sbatch`, `squeue`, `sacct` not found on PATH" in out.stderr and "sweep.launcher=local" in out.stderr
    )
    assert not (tmp_path / "sweep-debug_cpu-w4" / "sweep.jsonl").exists()


@pytest.mark.slow
def test_a_failing_sbatch_is_named_with_its_stderr_and_nothing_is_lost(tmp_path):
    sweep_dir = tmp_path / "sweep-debug_cpu-w4"
    sweep_dir.mkdir()
    earlier = {"label": "dprep4", "status": "finished", "tokens_per_sec": 1.0, "mesh": {}, "overrides": []}
    (sweep_dir / "sweep.jsonl").write_text(json.dumps(earlier) + "\n")
    env = slurm_env(tmp_path, FAKE_SLURM_SBATCH_ERROR="sbatch: error: invalid partition specified: debug")
    args = [*SWEEP, f"output_dir={tmp_path}", "sweep.only=[pp4,dprep4]"]
    out = run_cli(["sweep", *args], cwd=tmp_path, env=env, program="meshforge")
    assert out.returncode == 1
    assert re.search(r"`sbatch --parsable \S+/jobs/pp4\.sbatch` failed \(exit 1\)", out.stderr), out.stderr
    assert "invalid partition specified: debug" in out.stderr
    rows = rows_of(sweep_dir)
    assert rows[0] == earlier and [r["label"] for r in rows] == ["dprep4"]  # kept; nothing half-written


@pytest.fixture(scope="module")
def slurm_sweep(tmp_path_factory):
    """Run 1 submits dp4 alone and is stopped (Ctrl-C) while the job runs; run 2 asks again
    about dp4 and adds two points the fake scheduler fails (NODE_FAIL) and cancels."""
    tmp = tmp_path_factory.mktemp("slurm")
    env = slurm_env(tmp, FAKE_SLURM_FAIL="dp2-tp2", FAKE_SLURM_CANCEL="dp2-pp2")
    sweep_dir = tmp / "sweep-debug_cpu-w4"
    first = subprocess.Popen(
        sweep_cmd([*SWEEP, f"output_dir={tmp}", "sweep.only=[dp4]", "sweep.slurm.max_concurrent=1"]),
        cwd=tmp,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: "running" in statuses(sweep_dir), 300, "dp4's job to start")  # after the plan
    first.send_signal(signal.SIGINT)
    out1, err1 = first.communicate(timeout=60)
    rows1 = rows_of(sweep_dir)
    args = [*SWEEP, f"output_dir={tmp}", "sweep.only=[dp4,dp2-tp2,dp2-pp2]", "sweep.slurm.max_concurrent=2"]
    second = run_cli(["sweep", *args], cwd=tmp, env=env, program="meshforge", timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    return sweep_dir, (first.returncode, err1, rows1), second.stdout, submissions(tmp)


@pytest.mark.slow
def test_two_torchrun_agents_rendezvous_for_one_point(slurm_sweep):
    sweep_dir, _, out, _ = slurm_sweep
    final = {r["label"]: r for r in rows_of(sweep_dir)}
    dp4 = final["dp4"]
    assert dp4["status"] == "finished" and dp4["tokens_per_sec"] > 0 and dp4["final_loss"] > 0
    assert dp4["nodelist"] == "localhost,localhost" and dp4["log"] == str(sweep_dir / "dp4.log")
    launch = json.loads((sweep_dir / "dp4" / "run.json").read_text())["launch"]
    # two agents (torchrun's GROUP_WORLD_SIZE) of two ranks each made one 4-rank job
    assert launch == {"nodes": 2, "ranks_per_node": 2, "slurm_job_id": dp4["job_id"]}
    script = (sweep_dir / "jobs" / "dp4.sbatch").read_text()
    for line in ("--nodes=2", "--partition=debug", "--account=proj", "--time=00:05:00"):
        assert f"#SBATCH {line}" in script
    assert "--nproc_per_node 2" in script and "mesh.dp_shard=4" in script
    assert "fastest layout that fits: dp4" in out


@pytest.mark.slow
def test_failed_and_cancelled_jobs_are_recorded_with_the_schedulers_reason(slurm_sweep):
    sweep_dir, _, out, _ = slurm_sweep
    final = {r["label"]: r for r in rows_of(sweep_dir)}
    failed, cancelled = final["dp2-tp2"], final["dp2-pp2"]
    assert failed["status"] == "failed" and failed["slurm_state"] == "NODE_FAIL"
    assert f"slurm job {failed['job_id']} NODE_FAIL" in failed["error"] and "dp2-tp2.log" in failed["error"]
    assert cancelled["status"] == "cancelled" and cancelled["slurm_state"].startswith("CANCELLED by ")
    assert f"dp2-pp2: cancelled: slurm job {cancelled['job_id']} CANCELLED by" in out
    assert failed["nodelist"] == cancelled["nodelist"] == "localhost,localhost"


@pytest.mark.slow
def test_a_stopped_sweep_asks_the_scheduler_again_instead_of_resubmitting(slurm_sweep):
    sweep_dir, (rc1, err1, rows1), out, submitted = slurm_sweep
    job = rows1[-1]["job_id"]
    assert rc1 == 130 and f"rerun the same command to collect them, or `scancel {job}`" in err1
    assert [r["status"] for r in rows1] == ["queued", "running"]
    assert submitted.count("sweep-debug_cpu-w4-dp4") == 1  # dp4 was submitted once, by run 1
    assert {r["job_id"] for r in rows_of(sweep_dir) if r["label"] == "dp4"} == {job}
    assert [r["status"] for r in rows_of(sweep_dir) if r["label"] == "dp4"] == [
        "queued",
        "running",
        "finished",
    ]


def readme_slurm_command() -> list[str]:
    """The README's multi-node sweep command, as written."""
    readme = (REPO / "README.md").read_text()
    (line,) = [
        ln
        for ln in readme.splitlines()
        if ln.startswith("meshforge sweep recipes/llm_8b.toml --world 16") and "--plan" not in ln
    ]
    return line.split("#")[0].split()


@pytest.mark.slow
def test_the_readme_llm_8b_command_submits_two_node_jobs_as_their_points_are_judged(tmp_path):
    """Run as written (the jobs are held in the fake queue: no 8B model trains here) and
    stopped once max_concurrent jobs are queued. Jobs go out as their points are judged, while
    the rest are traced: with the queue full, no further point is judged, and Ctrl-C leaves the
    queued jobs to the scheduler without waiting for the traces still pending."""
    words = readme_slurm_command()
    assert words[:2] == ["meshforge", "sweep"]
    env = slurm_env(tmp_path, FAKE_SLURM_HOLD="1")
    proc = subprocess.Popen(
        sweep_cmd(words[2:]), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    sweep_dir = tmp_path / "outputs" / "sweep-llm_8b-w16"
    wait_for(lambda: statuses(sweep_dir).count("queued") >= 4, 400, "four llm_8b jobs in the queue")
    time.sleep(2)  # the sweep now only polls: no fifth job while four are queued
    assert len(submissions(tmp_path)) == 4
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "4 job(s) left to the scheduler" in err, err[-2000:]
    rows = rows_of(sweep_dir)
    status = [r["status"] for r in rows]
    # the points up to the fourth that fits, in order, each once: the others refused (every
    # pipeline: one sample a rank is too few microbatches), and no later point judged
    points = [p.label for p in grid_points(str(RECIPES / "llm_8b.toml"), [], 16, {}, [], 0)]
    assert [r["label"] for r in rows] == points[: len(rows)] and len(rows) < len(points)
    assert status.count("queued") == 4 and status[-1] == "queued"
    assert set(status) == {"queued", "refused"}
    refused = [r for r in rows if r["status"] == "refused"]
    assert all("pp.microbatches" in r["error"] for r in refused if "pp" in r["label"])
    assert all(r["error"] for r in refused)
    for r in (r for r in rows if r["status"] == "queued"):
        script = Path(r["script"]).read_text()
        for line in (
            "--nodes=2",
            "--gpus-per-node=8",
            "--partition=gpu",
            "--account=myproj",
            "--time=00:30:00",
        ):
            assert f"#SBATCH {line}" in script, (r["label"], line)
        assert "--nproc_per_node 8" in script and "recipes/llm_8b.toml" in script
        assert r["estimate_gib"] <= 79


@pytest.mark.slow
def test_llm_8b_layouts_that_do_not_fit_are_skipped(tmp_path):
    """The traced estimate judges llm_8b's layouts against its 79 GiB: replicated weights do not fit."""
    only = "sweep.only=[dp16,dprep8-dp2,dprep16]"
    out = run_cli(
        ["sweep", str(RECIPES / "llm_8b.toml"), "--world", "16", "--plan", only],
        cwd=tmp_path,
        program="meshforge",
    )
    assert out.returncode == 0, out.stderr
    table = [ln for ln in out.stdout.splitlines() if ln.startswith("│")]
    fits = {ln.split("│")[1].strip(): ln.split("│")[-2].strip() for ln in table}
    assert fits == {"dp16": "yes", "dprep8-dp2": "no", "dprep16": "no"}


@pytest.mark.slow
def test_plan_prints_every_layout_and_launches_nothing(tmp_path):
    args = ["sweep", "debug_cpu", "--world", "4", "--plan", *QUICK, f"output_dir={tmp_path}"]
    out = run_cli([*args, "sweep.device_memory_gib=0.0035"], cwd=tmp_path, program="meshforge")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "tp4: refused: mesh.tp = 4: n_kv_heads=2" in text
    table = [ln for ln in text.splitlines() if ln.startswith("│")]
    fits = {ln.split("│")[1].strip(): ln.split("│")[-2].strip() for ln in table}
    assert len(table) == 14  # 15 layouts of 5 dims, tp4 refused
    assert "dp2-cp2" in fits and "cp4" in fits  # context parallel is a dimension like the others
    assert set(fits.values()) == {"yes", "no"}  # the limit splits them
    assert "planned 15 points" in text and "nothing launched" in text
    assert not (tmp_path / "sweep-debug_cpu-w4").exists()


def test_auto_launcher_goes_to_slurm_only_when_the_world_needs_more_gpus(monkeypatch):
    import torch

    from meshforge.experiments.grid import select_points, sweep_points
    from meshforge.experiments.sweep import choose_launcher

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert choose_launcher("auto", 16, "cuda") == "slurm"
    assert choose_launcher("auto", 8, "cuda") == "local"
    assert choose_launcher("auto", 16, "cpu") == "local"  # gloo ranks always run here
    assert choose_launcher("local", 16, "cuda") == "local" and choose_launcher("slurm", 2, "cpu") == "slurm"
    points = sweep_points(4, {"pp.schedule": ["1F1B", "GPipe"]})
    assert [p.label for p in select_points(points, ["dp2-pp2", "dp4"], 4)] == [
        "dp2-pp2-schedule=1F1B",
        "dp2-pp2-schedule=GPipe",
        "dp4",  # no pipeline: one point
    ]
    with pytest.raises(RecipeError, match=r"sweep.only = \['dp3'\]: not layouts of 4 ranks; valid: pp4, "):
        select_points(points, ["dp3"], 4)
