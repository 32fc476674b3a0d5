"""Mixture of experts on CPU: step time and all-to-all share vs ep degree on 4 CPU processes,
grouped vs looped experts, beside the estimator.

Each point is a real launch of debug_cpu with `model.name=qwen3_moe` (gloo, 4 CPU processes,
dp_shard 4, tp 1, pp 1) at ep 1, 2, 4, its experts computed by one `F.grouped_mm` per projection
(grouped) or one matmul per expert (looped). The debug flavor is widened so the experts are most
of the work (MODEL: dim 128, 16 experts of hidden 256, top-2, layers 1-3 sparse, 256 tokens a
sequence, 8 sequences a step, 2 per rank). On 2 shared cores the 4 ranks take turns and a launch's
steady step time moves by tens of percent from one launch to the next, so each point is launched
`--repeats` times, in rounds over the points, and its row takes the median. Per launch:

- step: the steady steps' mean (run.json `summary.step_time`, the 3 warmup steps excluded) and
  tokens/s;
- all-to-all share: a sitecustomize hook put on the ranks' PYTHONPATH (HOOK; meshforge's code is
  unchanged) times the ep dispatcher's collectives with time.perf_counter: the counts' exchange
  (`dist.all_to_all_single`) and the tokens' (`funcol.all_to_all_single_autograd`, replaced by an
  autograd function doing the same exchange there and, in backward, back), each waited for inside
  its timer. That serializes them (torch's version returns before the tokens arrive; the
  dispatcher reads them at once, so little could overlap), and a rank's time includes waiting for
  its slowest peer. Share = a rank's all-to-all seconds / its own step seconds (the hook times
  `Trainer.train_step` too), the mean over steady steps, the largest over ranks (and the least:
  the rank that waited least). ep 1 has no dispatcher: share 0;
- memory: the heaviest rank's tracked peak on step 2 (run.json `memory_breakdown`) beside
  `meshforge estimate`'s traced heaviest rank of the same recipe (traced after the launches). The
  trace has no routing values: it assumes balanced routing and, on fake tensors, runs the looped
  experts for both settings.

Compare points of one run with each other (ratios), not with another machine.

    python benchmarks/moe.py                                         # writes benchmarks/results/
    python benchmarks/moe.py --points ep1-grouped ep2-looped --steps 5 --repeats 1 --out /tmp/bench \\
        model.dim=64 model.moe_dim=48 model.num_experts=8 train.seq_len=64   # smoke run
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

from recorded import provenance, save  # benchmarks/recorded.py

from meshforge.recipe import load_recipe
from meshforge.simulate.estimate import heaviest, submit_roles, trace_pool

POINTS = {  # name -> (ep, grouped_mm)
    f"ep{ep}-{kind}": (ep, kind == "grouped") for ep in (1, 2, 4) for kind in ("grouped", "looped")
}
MODEL = [
    "model.name=qwen3_moe",
    "model.flavor=debug",
    "model.dim=128",
    "model.moe_dim=256",
    "model.num_experts=16",
    "train.seq_len=256",
]
RUN = [
    "mesh.dp_replicate=1",
    "mesh.dp_shard=4",
    "mesh.tp=1",
    "mesh.pp=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=-1",
    "logging.memory_breakdown_step=2",
    "logging.warmup_steps=3",
    "logging.wandb=false",
    "logging.tensorboard=false",
    "logging.progress=false",
]
HOOK_DIR = "MESHFORGE_BENCH_A2A_DIR"  # where the hook writes rank<R>.jsonl, one line a step (HOOK reads it)

# The ranks' sitecustomize: the launcher's rank server imports it, the ranks fork from there. Only
# ep.py's references to the collectives are replaced (its `dist` and `funcol` names); no tensor
# op runs at import (a forked OpenMP pool would hang).
HOOK = """
import json, os, time
import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
import meshforge.parallelisms.ep as ep
import meshforge.run.train.trainer as trainer

OUT = os.environ["MESHFORGE_BENCH_A2A_DIR"]
totals = {"counts_s": 0.0, "tokens_fwd_s": 0.0, "tokens_bwd_s": 0.0, "calls": 0}


class Proxy:
    def __init__(self, module, **over):
        self._module, self._over = module, over

    def __getattr__(self, name):
        return self._over[name] if name in self._over else getattr(self._module, name)


def exchange(x, output_split_sizes, input_split_sizes, group, key):
    start = time.perf_counter()
    y = funcol.all_to_all_single(x.contiguous(), output_split_sizes, input_split_sizes, group)
    y = y.wait() if isinstance(y, funcol.AsyncCollectiveTensor) else funcol.wait_tensor(y)
    totals[key] += time.perf_counter() - start
    totals["calls"] += 1
    return y


class TimedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):
        ctx.splits, ctx.group = (output_split_sizes, input_split_sizes), group
        return exchange(x, output_split_sizes, input_split_sizes, group, "tokens_fwd_s")

    @staticmethod
    def backward(ctx, grad):
        output_split_sizes, input_split_sizes = ctx.splits
        grad = exchange(grad, input_split_sizes, output_split_sizes, ctx.group, "tokens_bwd_s")
        return grad, None, None, None


def all_to_all_single_autograd(x, output_split_sizes, input_split_sizes, group, tag=""):
    return TimedAllToAll.apply(x, output_split_sizes, input_split_sizes, group)


def all_to_all_single(*args, **kwargs):
    start = time.perf_counter()
    work = dist.all_to_all_single(*args, **kwargs)
    if work is not None:
        work.wait()
    totals["counts_s"] += time.perf_counter() - start
    totals["calls"] += 1
    return work


ep.funcol = Proxy(funcol, all_to_all_single_autograd=all_to_all_single_autograd)
ep.dist = Proxy(dist, all_to_all_single=all_to_all_single)
original = trainer.Trainer.train_step


def train_step(self, step):
    totals.update(counts_s=0.0, tokens_fwd_s=0.0, tokens_bwd_s=0.0, calls=0)
    start = time.perf_counter()
    result = original(self, step)
    row = {"step": step, "step_s": time.perf_counter() - start, **totals}
    with open(os.path.join(OUT, f"rank{dist.get_rank()}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\\n")
    return result


trainer.Trainer.train_step = train_step
"""


def overrides_of(point: str, steps: int, extra: list[str]) -> list[str]:
    ep, grouped = POINTS[point]
    return [
        *MODEL,
        *RUN,
        f"train.steps={steps}",
        f"mesh.ep={ep}",
        f"model.grouped_mm={str(grouped).lower()}",
        *extra,
    ]


def all_to_all_of(a2a_dir: Path, steady: set[int]) -> dict:
    """Per rank, the steady steps' mean all-to-all seconds and share of its step; the largest rank's."""
    ranks = []
    for path in sorted(a2a_dir.glob("rank*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rows = [r for r in rows if r["step"] in steady]
        a2a = [r["counts_s"] + r["tokens_fwd_s"] + r["tokens_bwd_s"] for r in rows]
        ranks.append(
            {
                "rank": int(path.stem.removeprefix("rank")),
                "step_s": statistics.mean(r["step_s"] for r in rows),
                "a2a_s": statistics.mean(a2a),
                "tokens_fwd_s": statistics.mean(r["tokens_fwd_s"] for r in rows),
                "tokens_bwd_s": statistics.mean(r["tokens_bwd_s"] for r in rows),
                "counts_s": statistics.mean(r["counts_s"] for r in rows),
                "calls": rows[-1]["calls"],
                "share": statistics.mean(s / r["step_s"] for s, r in zip(a2a, rows)),
            }
        )
    top = max(ranks, key=lambda r: r["share"])
    least = min(r["share"] for r in ranks)  # the rank that waits least for its peers
    return {
        "a2a_share": top["share"],
        "a2a_share_min_rank": least,
        "a2a_s": top["a2a_s"],
        "a2a_per_rank": ranks,
    }


def measure_launch(point: str, steps: int, extra: list[str], out: Path) -> dict:
    """One launch of `point` (in `out`, a new folder), its records read back."""
    out.mkdir(parents=True)
    a2a_dir, hook = out / "a2a", out / "hook"
    a2a_dir.mkdir()
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": path, HOOK_DIR: str(a2a_dir)}
    cmd = [sys.executable, "-m", "meshforge.cli", "debug_cpu", *overrides_of(point, steps, extra)]
    cmd += [f"output_dir={out}", f"run_name={point}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if proc.returncode != 0:
        sys.exit(f"{point} failed:\n{proc.stderr[-4000:]}")
    summary = json.loads((out / point / "run.json").read_text())["summary"]
    excluded = {s for listed in summary["throughput_steps"]["excluded"].values() for s in listed}
    steady = {s for s in range(1, steps + 1) if s not in excluded}
    metrics = [json.loads(line) for line in (out / point / "metrics.jsonl").read_text().splitlines()]
    imbalance = [m["moe/imbalance"] for m in metrics if m.get("step") in steady and "moe/imbalance" in m]
    per_rank = summary["memory_breakdown"]["per_rank"]
    return {
        "steady_steps": sorted(steady),
        "step_s": summary["step_time"],
        "tokens_per_sec": summary["tokens_per_sec"],
        **all_to_all_of(a2a_dir, steady),
        "imbalance": statistics.mean(imbalance) if imbalance else None,
        "peak_bytes": max(r["total_gib"] for r in per_rank) * 2**30,
        "activation_bytes": max(r["activations_gib"] for r in per_rank) * 2**30,
    }


def summarize(point: str, launches: list[dict]) -> dict:
    """A point's row: the median over its launches of the timings, the largest peak."""
    ep, grouped = POINTS[point]

    def median(key: str) -> float:
        return statistics.median(launch[key] for launch in launches)

    return {
        "point": point,
        "ep": ep,
        "grouped_mm": grouped,
        "step_s": median("step_s"),
        "step_s_range": [min(x["step_s"] for x in launches), max(x["step_s"] for x in launches)],
        "tokens_per_sec": median("tokens_per_sec"),
        "a2a_s": median("a2a_s"),
        "a2a_share": median("a2a_share"),
        "a2a_share_min_rank": median("a2a_share_min_rank"),
        "imbalance": launches[0]["imbalance"],
        "peak_bytes": max(x["peak_bytes"] for x in launches),
        "activation_bytes": max(x["activation_bytes"] for x in launches),
        "launches": launches,
    }


def effective(overrides: list[str]) -> list[str]:
    """`overrides` with each key's last value only, in first-seen order."""
    last = {o.split("=", 1)[0]: o for o in overrides}
    return list(last.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", nargs="+", default=list(POINTS), choices=list(POINTS))
    p.add_argument("--steps", type=int, default=12, help="per launch; the first 3 are warmup")
    p.add_argument("--repeats", type=int, default=3, help="launches per point, in rounds over the points")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("overrides", nargs="*", help="recipe overrides applied to every launch (model size)")
    args = p.parse_args()
    launches: dict[str, list[dict]] = {point: [] for point in args.points}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.repeats):
            for point in args.points:
                launch = measure_launch(point, args.steps, args.overrides, Path(tmp) / f"{point}-{round_}")
                launches[point].append(launch)
                print(point, json.dumps({k: v for k, v in launch.items() if k != "a2a_per_rank"}), flush=True)
    with trace_pool() as pool:  # after the launches: the traces' workers would take their cores
        estimates = {
            point: submit_roles(
                load_recipe("debug_cpu", overrides_of(point, args.steps, args.overrides)), pool
            )
            for point in args.points
        }
        rows = []
        for point in args.points:
            row = summarize(point, launches[point])
            row["estimate_bytes"] = heaviest(estimates[point])["total"]
            row["estimate_error"] = row["estimate_bytes"] / row["peak_bytes"] - 1
            rows.append(row)
    by = {(r["ep"], r["grouped_mm"]): r for r in rows}
    ratios = {
        f"ep{ep}": by[ep, False]["step_s"] / by[ep, True]["step_s"]
        for ep in (1, 2, 4)
        if (ep, True) in by and (ep, False) in by
    }
    result = {
        "benchmark": "moe",
        "model_overrides": effective([*MODEL, *args.overrides]),
        "steps": args.steps,
        "repeats": args.repeats,
        "rows": rows,
        "looped_over_grouped_step": ratios,
        **provenance(),
    }
    lines = write(result, Path(args.out))
    print("\n".join(lines))


def write(result: dict, out: Path) -> list[str]:
    lines = [
        "# Mixture of experts on CPU: ep degree, grouped vs looped experts",
        "",
        f"{result['date']}, {result['machine']['platform']}, {result['machine']['cpus']} CPUs, torch "
        f"{result['versions']['torch']}; debug_cpu as qwen3_moe ({' '.join(result['model_overrides'])}; "
        "top-2, 4 layers, layer 0 dense), 4 CPU ranks (dp_shard 4), 8 sequences a step, fp32, "
        f"{result['steps']} steps (3 warmup), each point launched {result['repeats']} times: the median "
        "launch's step (range in brackets). step = steady mean; all-to-all = the ep dispatcher's "
        "collectives, timed on each rank by a PYTHONPATH hook (waited for, so serialized; a rank's "
        "time includes waiting for its peers), share of that rank's step, largest rank (least in brackets); "
        "peak = heaviest rank's tracked bytes on step 2; imbalance = max/mean expert load, steady mean.",
        "",
        "| point | ep | experts | step s (range) | tokens/s | all-to-all s | share (least rank) | imbalance "
        "| peak MiB/rank | estimate MiB | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        imbalance = "" if r["imbalance"] is None else f"{r['imbalance']:.2f}"
        lines.append(
            f"| {r['point']} | {r['ep']} | {'grouped' if r['grouped_mm'] else 'looped'} "
            f"| {r['step_s']:.3f} ({r['step_s_range'][0]:.3f}-{r['step_s_range'][1]:.3f}) "
            f"| {r['tokens_per_sec']:.0f} | {r['a2a_s']:.3f} "
            f"| {r['a2a_share']:.1%} ({r['a2a_share_min_rank']:.1%}) | {imbalance} "
            f"| {r['peak_bytes'] / 2**20:.2f} | {r['estimate_bytes'] / 2**20:.2f} "
            f"| {r['estimate_error']:+.1%} |"
        )
    if result["looped_over_grouped_step"]:
        lines += [
            "",
            "Looped / grouped step time (medians): "
            + ", ".join(f"{k} {v:.2f}x" for k, v in result["looped_over_grouped_step"].items()),
        ]
    save(out, "moe", result, lines)
    return lines


if __name__ == "__main__":
    main()
