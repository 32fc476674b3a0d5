"""Benchmarks run on a tiny size and write their result files (their numbers are not asserted
here: speed targets are measured by the benchmark commands, on a quiet machine)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, cli_env


def test_runner_overhead_benchmark_writes_its_results(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "runner_overhead.py"), "--rounds", "1",
                           "--steps", "2", "--out", str(tmp_path)], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "runner_overhead.json").read_text())
    assert result["median_step_s"]["bare"] > 0 and result["median_step_s"]["meshforge"] > 0
    assert result["ratio"] == result["median_step_s"]["meshforge"] / result["median_step_s"]["bare"]
    assert result["met"] == (result["ratio"] <= result["target_ratio"] == 1.03)
    assert "| meshforge |" in (tmp_path / "runner_overhead.md").read_text()


def test_recorded_results_are_in_the_repo():
    recorded = json.loads((REPO / "benchmarks" / "results" / "runner_overhead.json").read_text())
    assert recorded["rounds"] >= 5 and recorded["steps_per_round"] >= 20  # a real run, not the smoke size
    scaling = json.loads((REPO / "benchmarks" / "results" / "fsdp_memory_scaling.json").read_text())
    assert [r["dp_shard"] for r in scaling["rows"]] == [1, 2, 4, 8]


@pytest.mark.slow
def test_fsdp_memory_scaling_benchmark_writes_its_results(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fsdp_memory_scaling.py"), "--degrees", "1", "2",
                           "--out", str(tmp_path)], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "fsdp_memory_scaling.json").read_text())
    one, two = result["rows"]
    assert one["state_bytes_per_rank"] > 1e6 and two["ideal_bytes"] == one["state_bytes_per_rank"] / 2
    assert two["ratio_to_ideal"] == two["state_bytes_per_rank"] / two["ideal_bytes"]
    assert "| 2 |" in (tmp_path / "fsdp_memory_scaling.md").read_text()
