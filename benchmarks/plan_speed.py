"""Planning speed: how long the traced commands a user runs before launching take on this machine.

Each case is a `meshforge` command run as a user runs it (a new interpreter, its output captured,
not a terminal), timed from start to exit (interpreter start included), in alternating rounds so
the machine's noise hits every case alike; the result is each case's median and worst wall time,
"met" when every round is within its target (issue #27: every 8-rank layout of llm_1b estimated
in under 60 s, llm_8b's 16-rank plan in under 120 s, on 2 cores), with how many layouts it
traced and refused. A case whose command fails, or traces no layout, fails the benchmark.

    python benchmarks/plan_speed.py                     # both cases, 2 rounds, writes benchmarks/results/
    python benchmarks/plan_speed.py --cases smoke --rounds 1 --out /tmp/bench   # smoke run
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recorded import provenance, save  # benchmarks/recorded.py

REPO = Path(__file__).resolve().parents[1]

# name: (the command's arguments after `meshforge`, target seconds or None)
CASES: dict[str, tuple[list[str], float | None]] = {
    "estimate_llm_1b_world8": (["estimate", "recipes/llm_1b.toml", "--world", "8", "--all-meshes"], 60.0),
    "tune_llm_8b_world16_plan": (
        ["tune", "recipes/llm_8b.toml", "--world", "16", "--profile", "h100", "--plan"],
        120.0,
    ),
    # the benchmark's own test: every 2-rank layout of the debug model
    "smoke": (["estimate", "recipes/debug_cpu.toml", "--world", "2", "--all-meshes"], None),
}
FULL = [name for name, (_, target) in CASES.items() if target is not None]


def layouts(command: str, stdout: str) -> dict[str, int]:
    """How many layouts the command traced and refused, read off what it printed: estimate's table
    rows, tune's 'predicted N of M points' line (traced, ranked; those that do not fit are not)."""
    refused = sum(": refused: " in line for line in stdout.splitlines())
    if command == "tune":
        found = re.search(r"^predicted (\d+) of \d+ points", stdout, re.MULTILINE)
        return {"traced": int(found.group(1)) if found else 0, "refused": refused}
    return {"traced": sum(line.startswith("│ ") for line in stdout.splitlines()), "refused": refused}


def run_once(args: list[str], cwd: Path) -> tuple[float, dict[str, int]]:
    """One command's wall time, from a new interpreter's start to its exit, and its layout counts."""
    exe = shutil.which("meshforge", path=str(Path(sys.executable).parent)) or "meshforge"
    env = {**os.environ, "WANDB_MODE": "disabled"}
    t0 = time.perf_counter()
    proc = subprocess.run([exe, *args], cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    counts = layouts(args[0], proc.stdout)
    if proc.returncode != 0 or counts["traced"] == 0:
        why = f"exit code {proc.returncode}" if proc.returncode else "no layout traced"
        raise SystemExit(f"meshforge {' '.join(args)}: {why}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return seconds, counts


def measure(cases: list[str], rounds: int) -> dict:
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    counts: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "recipes").symlink_to(REPO / "recipes")  # outputs land in tmp, recipes as in the repo
        for _ in range(rounds):
            for name in cases:
                took, counts[name] = run_once(CASES[name][0], work)
                seconds[name].append(took)
    rows = {}
    for name, times in seconds.items():
        args, target = CASES[name]
        median = statistics.median(times)
        rows[name] = {
            "command": "meshforge " + " ".join(args),
            "seconds": times,
            "median_s": median,
            "worst_s": max(times),
            "target_s": target,
            "met": None if target is None else max(times) <= target,  # every round within it
            **counts[name],
        }
    targeted = [r["met"] for r in rows.values() if r["met"] is not None]
    return {
        "benchmark": "plan_speed",
        "rounds": rounds,
        "cases": rows,
        "met": all(targeted) if targeted else None,  # None: no case has a target (the smoke run)
        **provenance(),
    }


def write(result: dict, out: Path) -> None:
    lines = [
        "# Planning speed (`meshforge estimate` / `tune --plan`)",
        "",
        f"{result['date']}, {result['machine']['platform']}, {result['machine']['cpus']} CPUs, "
        f"torch {result['versions']['torch']}; {result['rounds']} alternating round(s), each command "
        "a new interpreter, wall time from start to exit (interpreter start included); met: every "
        "round within the target.",
        "",
        "| command | layouts traced | refused | median s | worst s | target s | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["cases"].values():
        target = "-" if row["target_s"] is None else f"{row['target_s']:.0f}"
        met = "-" if row["met"] is None else ("yes" if row["met"] else "no")
        lines.append(
            f"| `{row['command']}` | {row['traced']} | {row['refused']} | {row['median_s']:.1f} | "
            f"{row['worst_s']:.1f} | {target} | {met} |"
        )
    save(out, "plan_speed", result, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(FULL), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--rounds", type=int, default=2, choices=range(1, 100), metavar="N (1-99)")
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
