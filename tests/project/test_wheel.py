"""Packaging: a built wheel installs meshforge.* only (no top-level `models`/`configs`) and
runs the embedded default recipe from outside the repository."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support import REPO, cli_env

pytestmark = pytest.mark.slow


def test_wheel_installs_one_namespace_and_runs(tmp_path):
    wheels, target, work = tmp_path / "wheels", tmp_path / "site", tmp_path / "work"
    work.mkdir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(REPO),
            "-w",
            str(wheels),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("meshforge-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    top_level = sorted(
        p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin"
    )
    assert top_level == ["meshforge"], top_level
    env = cli_env(PYTHONPATH=str(target))
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import meshforge, meshforge.models, meshforge.configs, "
            "meshforge.parallelisms; print(meshforge.__file__, meshforge.models.__file__)",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert all(p.startswith(str(target)) for p in probe.stdout.split())  # from the wheel, not the repo

    def cli(*args: str) -> subprocess.CompletedProcess:  # the wheel's meshforge, from outside the repo
        cmd = [sys.executable, "-m", "meshforge.cli", *args]
        return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)

    quiet = ["logging.wandb=false", "logging.tensorboard=false"]
    run = cli("debug_cpu", "mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1", "train.steps=3", *quiet)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (work / "outputs" / "debug_cpu" / "metrics.jsonl").read_text().count("\n") == 3
    # text_cpu's corpus and tokenizer travel in the wheel, found from the recipe's own folder
    corpus = target / "meshforge" / "recipes" / "corpora" / "pydocs"
    assert len(list((corpus / "train").glob("*.jsonl"))) == 8
    assert (corpus / "tokenizer" / "tokenizer.json").is_file()
    plan = cli("text_cpu", "--dry-run")
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "8 local json files" in plan.stdout and "2048 tokens" in plan.stdout
