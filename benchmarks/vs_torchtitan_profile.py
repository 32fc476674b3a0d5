"""Where a step's time goes, meshforge beside TorchTitan 0.3.0, for the layouts where
benchmarks/vs_torchtitan.py measures us under 1.10x: the same runs as there (same dims, seq,
batch, one thread per rank, no AC, no compile), each with 5 steady steps under torch.profiler,
and rank 0's trace of each split the same way (one classifier, both frameworks' traces):

- matmul: aten::mm/addmm/bmm/linear/matmul and attention kernels (the model's FLOPs);
- collectives: gloo / c10d collective ops (FSDP's all-gather and reduce-scatter, TP's);
- optimizer: torch's own `Optimizer.step#...` region, which both frameworks' AdamW records;
- other: the rest of the step (elementwise ops, autograd, hooks, the loop's host work).

A part that costs both frameworks the same is the shared stack's (torch, gloo, this CPU); a part
where one is slower is that framework's to close.

    python benchmarks/vs_torchtitan_profile.py            # writes benchmarks/results/vs_torchtitan_profile.*
    python benchmarks/vs_torchtitan_profile.py --points fsdp2:float32 --no-titan --out /tmp/p
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
from pathlib import Path

from recorded import provenance, save  # benchmarks/recorded.py
from vs_torchtitan import REPO, run_ours, run_titan, titan_workdir  # benchmarks/vs_torchtitan.py

from meshforge.run.observe.profile import clip, is_collective, union_length

# the layouts and dtypes under 1.10x in benchmarks/results/vs_torchtitan.md
POINTS = ["1proc:float32", "fsdp2:float32", "fsdp2:bfloat16", "tp2:float32"]
STEPS, PROFILED = 12, 5  # steps 8-12 profiled on both sides
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "aten::_scaled_dot_product")
PARTS = ("matmul_s", "collectives_s", "optimizer_s", "other_s")


def split_steps(trace: dict, step_mark: str) -> dict:
    """Seconds per profiled step by part (module doc), from a chrome trace whose steps are the
    host spans named `step_mark`... (`meshforge/step`, TorchTitan's `ProfilerStep#`)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith(step_mark))

    def spans(test) -> list[tuple[float, float]]:
        return [(e["ts"], e["ts"] + e["dur"]) for e in events if test(e["name"])]

    matmul = spans(lambda n: n.startswith(MATMUL))
    comm = spans(is_collective)
    optim = spans(lambda n: n.startswith("Optimizer.step#"))
    out = dict.fromkeys(PARTS, 0.0)
    for lo, hi in steps:
        o = clip(optim, lo, hi)
        c = clip(comm, lo, hi)
        m = clip(matmul, lo, hi)
        out["optimizer_s"] += union_length(o)
        out["collectives_s"] += union_length(o + c) - union_length(o)
        out["matmul_s"] += union_length(o + c + m) - union_length(o + c)
        out["other_s"] += (hi - lo) - union_length(o + c + m)
    n = max(1, len(steps))
    return {
        "steps": len(steps),
        "step_s": sum(out.values()) / n / 1e6,
        **{k: v / n / 1e6 for k, v in out.items()},
    }


def profile_ours(layout: str, dtype: str, out: Path) -> dict:
    extra = (f"profile.start_step={STEPS - PROFILED + 1}", f"profile.steps={PROFILED}")
    run = run_ours(layout, dtype, STEPS, STEPS - PROFILED, out, extra)
    if "error" in run:
        return run
    (trace,) = out.glob(f"{layout}_{dtype}_*/profile/rank0.pt.trace.json")
    return {
        **split_steps(json.loads(trace.read_text()), "meshforge/step"),
        "tokens_per_sec_per_device": run["tokens_per_sec_per_device"],
    }


def profile_titan(layout: str, dtype: str, work: Path, port: int) -> dict:
    # TorchTitan's schedule: wait, `profiler_warmup` (3) steps, then the active ones, every profile_freq
    flags = ["--profiler.enable-profiling", "--profiler.profile-freq", str(STEPS)]
    flags += ["--profiler.profiler-active", str(PROFILED)]
    shutil.rmtree(work / f"out_{layout}_{dtype}" / "profiling", ignore_errors=True)  # an earlier run's
    run = run_titan(layout, dtype, STEPS, STEPS - PROFILED, work, port, tuple(flags))
    if "error" in run:
        return run
    (trace,) = (work / f"out_{layout}_{dtype}").glob("profiling/traces/iteration_*/rank0_trace.json.gz")
    with gzip.open(trace, "rt") as f:
        return {**split_steps(json.load(f), "ProfilerStep#"), **run}


def render(result: dict) -> list[str]:
    md = [
        f"# Where a step goes: meshforge beside TorchTitan 0.3.0 ({result['machine']['cpus']} CPUs, "
        f"torch {result['versions']['torch']}, {result['date']})",
        "",
        f"Rank 0, steps {STEPS - PROFILED + 1}-{STEPS} under torch.profiler, ms per step (the profiler's "
        "own cost included, on both sides); the parts as the module doc defines them.",
        "",
        "| layout | dtype | side | step | matmul | collectives | optimizer | other |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        for side in ("meshforge", "torchtitan"):
            r = row.get(side)
            if not r:
                continue
            if "error" in r:
                md.append(f"| {row['layout']} | {row['dtype']} | {side} | failed | | | | |")
                continue
            cells = " | ".join(f"{r[k] * 1e3:.1f}" for k in ("step_s", *PARTS))
            md.append(f"| {row['layout']} | {row['dtype']} | {side} | {cells} |")
    return md


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", nargs="+", default=POINTS, metavar="LAYOUT:DTYPE")
    p.add_argument("--titan-shim", default=str(REPO.parent / "shared" / "titan_cpu"))
    p.add_argument("--no-titan", action="store_true", help="meshforge's side only")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    a = p.parse_args()
    shim = Path(a.titan_shim)
    work = titan_workdir(shim) if not a.no_titan and (shim / "titan_cpu.py").is_file() else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, point in enumerate(a.points):
            layout, dtype = point.split(":")
            row = {"layout": layout, "dtype": dtype, "meshforge": profile_ours(layout, dtype, Path(tmp))}
            if work:
                row["torchtitan"] = profile_titan(layout, dtype, work, 29711 + i)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {**provenance(), "rows": rows, "settings": {"steps": STEPS, "profiled": PROFILED}}
    md = render(result)
    save(Path(a.out), "vs_torchtitan_profile", result, md)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
