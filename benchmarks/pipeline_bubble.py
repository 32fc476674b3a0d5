"""Pipeline bubble: measured vs theory for GPipe, 1F1B, Interleaved1F1B and ZBVZeroBubble.

Theory: the idle share of the schedule's own per-rank action order (pp_schedule.py,
every action one time unit). Measured: one launch per schedule on pp ranks (one CPU
thread each, so 2 ranks use this machine's 2 cores without contention) against the same
model and batch on one rank: with no bubble and free communication, the pipelined step
would take T1 / pp, so the measured bubble is 1 - (T1 / pp) / T_pp. Steady steps only
(the first two pay for warm-up), the median of 22 (24 steps a run; the median of 6 of 8 steps
moved with the run by 3%); every launch in 3 passes, the mean of theirs
(one pass's bubble moved by 4 points between runs). Communication (gloo over loopback)
and unequal stage costs (embedding, output head) count as bubble here, as they do for a user.

    python benchmarks/pipeline_bubble.py                         # writes benchmarks/results/
    python benchmarks/pipeline_bubble.py --schedules 1F1B --steps 3 --out /tmp/b model.dim=64   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from recorded import at_least_one, provenance, save  # benchmarks/recorded.py

from meshforge.parallelisms.pp_actions import bubble_fraction
from meshforge.recipe import load_recipe
from meshforge.simulate.schedule import recipe_schedule_order

SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2}  # schedule -> stages per rank
MODEL = [
    "model.dim=256",
    "model.n_layers=8",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.vocab_size=2048",
    "model.multiple_of=64",
]
COMMON = [
    "mesh.dp_shard=1",
    "mesh.tp=1",
    "train.cpu_threads=1",
    "train.seq_len=128",
    "train.global_batch_size=16",
    "train.micro_batch_size=-1",
    "train.grad_accum_steps=1",
    "logging.wandb=false",
    "logging.tensorboard=false",
    "logging.progress=false",
    "logging.memory_breakdown_step=0",
    "pp.embedding_weight=1",
    "pp.output_weight=1",
]


def step_time(out: Path, name: str, overrides: list[str], steps: int) -> float:
    cmd = [
        sys.executable,
        "-m",
        "meshforge.cli",
        "debug_cpu",
        *COMMON,
        *MODEL,
        *overrides,
        f"train.steps={steps}",
        f"output_dir={out}",
        f"run_name={name}",
    ]
    subprocess.run(
        cmd, check=True, capture_output=True, timeout=900, env={**os.environ, "WANDB_MODE": "disabled"}
    )
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    steady = rows[2:] or rows[1:]
    return sorted(r["step_time"] for r in steady)[len(steady) // 2]  # median: robust to a noisy step


def measure(
    pp: int, microbatches: int, schedules: list[str], steps: int, overrides: list[str], passes: int = 1
) -> dict:
    """Every launch `passes` times, a whole pass (one rank, then each schedule) after another, each
    step the mean of its passes: the same launch read GPipe's bubble 27.7% and 32.0% hours apart,
    more than its gap to 1F1B, whose two readings crossed it."""
    times: dict[str, list[float]] = {}
    pipelined = {
        name: [
            f"mesh.pp={pp}",
            f"pp.schedule={name}",
            f"pp.microbatches={microbatches}",
            f"pp.stages_per_rank={SCHEDULES[name]}",
            *overrides,
        ]
        for name in schedules
    }
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(passes):
            launches = {"pp1": ["mesh.pp=1", *overrides], **pipelined}
            for name, launch_overrides in launches.items():
                times.setdefault(name, []).append(
                    step_time(Path(tmp), f"{name}.{k}", launch_overrides, steps)
                )
    t1 = statistics.mean(times["pp1"])
    rows = []
    for name, pp_over in pipelined.items():
        order = recipe_schedule_order(load_recipe("debug_cpu", [*COMMON, *MODEL, *pp_over]))
        t_pp = statistics.mean(times[name])
        measured = 1 - (t1 / pp) / t_pp
        rows.append(
            {
                "schedule": name,
                "stages_per_rank": SCHEDULES[name],
                "theory": bubble_fraction(order),
                "measured": measured,
                "step_time_s": t_pp,
                "gap": measured - bubble_fraction(order),
                "step_time_per_pass_s": times[name],
                # each pass's own bubble (its one-rank step and this schedule's)
                "measured_per_pass": [1 - (a / pp) / b for a, b in zip(times["pp1"], times[name])],
            }
        )
    return {
        "benchmark": "pipeline_bubble",
        "pp": pp,
        "microbatches": microbatches,
        "one_rank_step_time_s": t1,
        "one_rank_step_time_per_pass_s": times["pp1"],
        "steps": steps,
        "passes": passes,
        "rows": rows,
        "model_overrides": MODEL + overrides,
        **provenance(),
    }


def write(result: dict, out: Path) -> None:
    lines = [
        "# Pipeline bubble: measured vs theory",
        "",
        f"{result['date']}, {result['machine']['platform']}, torch {result['versions']['torch']}; "
        f"pp={result['pp']}, {result['microbatches']} microbatches, {result.get('steps', 8)} steps a run "
        f"(the median of the steady ones), {result.get('passes', 1)} pass(es) of every launch (the "
        "mean of theirs), one CPU thread per rank; model "
        f"{' '.join(result['model_overrides'])}. One-rank step {result['one_rank_step_time_s']:.3f} s. "
        "Measured bubble = 1 - (T1/pp) / T_pp (communication and unequal stages count as bubble).",
        "",
        "| schedule | stages/rank | theory | measured | gap | step s | measured per pass |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        per_pass = ", ".join(f"{b:.1%}" for b in r.get("measured_per_pass", []))
        lines.append(
            f"| {r['schedule']} | {r['stages_per_rank']} | {r['theory']:.1%} | {r['measured']:.1%} | "
            f"{r['gap']:+.1%} | {r['step_time_s']:.3f} | {per_pass} |"
        )
    save(out, "pipeline_bubble", result, lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument("--steps", type=int, default=24)
    p.add_argument(
        "--passes", type=at_least_one, default=3, help="measure every launch this many times (the mean)"
    )
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("overrides", nargs="*", help="recipe overrides applied to every launch")
    args = p.parse_args()
    result = measure(args.pp, args.microbatches, args.schedules, args.steps, args.overrides, args.passes)
    write(result, Path(args.out))
    print(
        json.dumps(
            {r["schedule"]: {"theory": r["theory"], "measured": r["measured"]} for r in result["rows"]}
        )
    )


if __name__ == "__main__":
    main()
