"""Planning speed: how long the traced commands a user runs before launching take on this machine.

Each case is a `meshforge` command run as a user runs it (a new interpreter, its terminal
captured), timed from start to exit, in alternating rounds so the machine's noise hits every
case alike; the result is each case's median and worst wall time against its target (issue #27:
every 8-rank layout of llm_1b estimated in under 60 s, llm_8b's 16-rank plan in under 120 s, on
2 cores). A case whose command fails, or prints no table, fails the benchmark.

    python benchmarks/plan_speed.py                     # both cases, 2 rounds, writes benchmarks/results/
    python benchmarks/plan_speed.py --cases smoke --rounds 1 --out /tmp/bench   # smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recorded import provenance, save  # benchmarks/recorded.py

REPO = Path(__file__).resolve().parents[1]

# name: (the command's arguments after `meshforge`, target seconds or None, a line its output must hold)
CASES: dict[str, tuple[list[str], float | None, str]] = {
    "estimate_llm_1b_world8": (
        ["estimate", "recipes/llm_1b.toml", "--world", "8", "--all-meshes"],
        60.0,
        "estimated peak memory per rank",
    ),
    "tune_llm_8b_world16_plan": (
        ["tune", "recipes/llm_8b.toml", "--world", "16", "--profile", "h100", "--plan"],
        120.0,
        "predicted",
    ),
    "smoke": (  # the benchmark's own test: every 2-rank layout of the debug model
        ["estimate", "recipes/debug_cpu.toml", "--world", "2", "--all-meshes"],
        None,
        "estimated peak memory per rank",
    ),
}
FULL = [name for name, (_, target, _) in CASES.items() if target is not None]


def run_once(args: list[str], expect: str, cwd: Path) -> float:
    """One command's wall time, from a new interpreter's start to its exit."""
    exe = shutil.which("meshforge", path=str(Path(sys.executable).parent)) or "meshforge"
    env = {**os.environ, "WANDB_MODE": "disabled"}
    t0 = time.perf_counter()
    proc = subprocess.run([exe, *args], cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0 or expect not in proc.stdout:
        raise SystemExit(f"meshforge {' '.join(args)} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return seconds


def measure(cases: list[str], rounds: int) -> dict:
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "recipes").symlink_to(REPO / "recipes")  # outputs land in tmp, recipes as in the repo
        for _ in range(rounds):
            for name in cases:
                args, _, expect = CASES[name]
                seconds[name].append(run_once(args, expect, work))
    rows = {}
    for name, times in seconds.items():
        args, target, _ = CASES[name]
        median = statistics.median(times)
        rows[name] = {
            "command": "meshforge " + " ".join(args),
            "seconds": times,
            "median_s": median,
            "worst_s": max(times),
            "target_s": target,
            "met": None if target is None else max(times) <= target,
        }
    return {
        "benchmark": "plan_speed",
        "rounds": rounds,
        "cases": rows,
        "met": all(r["met"] is not False for r in rows.values()),
        **provenance(),
    }


def write(result: dict, out: Path) -> None:
    lines = [
        "# Planning speed (`meshforge estimate` / `tune --plan`)",
        "",
        f"{result['date']}, {result['machine']['platform']}, {result['machine']['cpus']} CPUs, "
        f"torch {result['versions']['torch']}; {result['rounds']} alternating round(s), each command "
        "a new interpreter, wall time from start to exit.",
        "",
        "| command | median s | worst s | target s | met |",
        "|---|---|---|---|---|",
    ]
    for row in result["cases"].values():
        target = "-" if row["target_s"] is None else f"{row['target_s']:.0f}"
        met = "-" if row["met"] is None else ("yes" if row["met"] else "no")
        lines.append(
            f"| `{row['command']}` | {row['median_s']:.1f} | {row['worst_s']:.1f} | {target} | {met} |"
        )
    save(out, "plan_speed", result, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(FULL), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    a = parser.parse_args()
    cases = [c.strip() for c in a.cases.split(",")]
    if unknown := [c for c in cases if c not in CASES]:
        parser.error(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    result = measure(cases, a.rounds)
    write(result, a.out)
    for row in result["cases"].values():
        print(f"{row['command']}: median {row['median_s']:.1f} s, worst {row['worst_s']:.1f} s")


if __name__ == "__main__":
    main()
