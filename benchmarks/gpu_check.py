"""The CUDA path on one GPU, as a user runs it: the default recipe on `cuda` (with its memory
metrics checked), then a one-GPU llm_1b in bf16, eager and compiled, and once with
`fsdp.cpu_offload`, each beside `meshforge estimate` of the same recipe; float8 rowwise and
tensorwise against bf16 after 50 steps (speed and loss); activation checkpointing from none
through per-op and memory budgets 0.7/0.5/0.3 to full (tokens/s against peak memory, the
estimate's error on each); bf16 and float8 again at twice the batch; one profiled step's trace
kept in the results, with its GPU time by kernel kind. `--dry-run` validates every run's recipe
and prints its command, on any machine; `--merge` records checks made in parts (`--only`) as one;
`--repredict` prices a recorded check's runs again with today's step-time model (no GPU).

    bash benchmarks/gpu_check.sh                    # writes benchmarks/results/gpu_check.{json,md}
    python benchmarks/gpu_check.py --steps 30 --out /tmp/gpu

A failed check (an unexpected memory metric, a failed run) exits non-zero after the table.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from recorded import git_head, provenance, save  # benchmarks/recorded.py

from meshforge.configs import RecipeError
from meshforge.core.units import GiB
from meshforge.recipe import load_recipe
from meshforge.run.observe.memory import PEAK
from meshforge.simulate.estimate import estimate_rows, predict_recipe_step
from meshforge.simulate.profile_toml import SHIPPED, load_profile

REPO = Path(__file__).resolve().parents[1]
ONE_GPU = ["train.device=cuda", "mesh.dp_replicate=1", "mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1"]
QUIET = ["logging.wandb=false", "logging.progress=false"]
# the GPU machine has no network: llm_1b's FineWeb-Edu stream is swapped for the synthetic source
SYNTHETIC = [
    "data.source=synthetic",
    "data.hf_dataset=null",
    "data.hf_config=null",
    "data.tokenizer=byte",  # the synthetic source reads no tokenizer and shuffles no windows
    "data.shuffle_windows=0",
]
# llm_1b warms up over 100 steps: after 50 its loss had moved only 11.76 -> 11.72 on one H200,
# too little for float8's loss check to mean anything; 5 steps of warm-up leave 45 at full rate
LLM_1B_ONE_GPU = [
    *ONE_GPU,
    *SYNTHETIC,
    "activation_checkpoint.mode=none",
    "logging.log_every=5",
    "lr_scheduler.warmup_steps=5",
]
LLM_1B_COMPILED = [*LLM_1B_ONE_GPU, "compile.enabled=true", "logging.memory_history=false"]
PROFILED_STEP = 8  # after compilation and the first steps' allocations

# name: (recipe, overrides, steps scale): the runs this check makes, in order
RUNS: dict[str, tuple[str, list[str], float]] = {
    "default_recipe_cuda": ("debug_cpu", [*ONE_GPU, "checkpoint.enabled=true", "checkpoint.interval=10"], 1),
    "llm_1b_bf16_compile": (
        "llm_1b",
        [*LLM_1B_ONE_GPU, "compile.enabled=true", "logging.memory_history=false"],
        1,
    ),
    # float8 (#28): torchao's Float8Linear on the blocks' linears, compiled; against llm_1b_bf16_compile
    "llm_1b_float8_rowwise_compile": (
        "llm_1b",
        [*LLM_1B_ONE_GPU, "compile.enabled=true", "logging.memory_history=false", "float8.enabled=true"],
        1,
    ),
    "llm_1b_float8_tensorwise_compile": (
        "llm_1b",
        [*LLM_1B_ONE_GPU, "compile.enabled=true", "logging.memory_history=false", "float8.enabled=true"]
        + ["float8.recipe=tensorwise"],
        1,
    ),
    "llm_1b_bf16_cpu_offload": ("llm_1b", [*LLM_1B_ONE_GPU, "fsdp.cpu_offload=true"], 0.34),
    "llm_1b_bf16_eager": ("llm_1b", [*LLM_1B_ONE_GPU, "logging.memory_history=false"], 1),
    "llm_1b_bf16_eager_memory_history": ("llm_1b", LLM_1B_ONE_GPU, 1),
    "llm_1b_recipe_ac_full_compile": (
        "llm_1b",
        [*ONE_GPU, *SYNTHETIC, "compile.enabled=true", "logging.memory_history=false", "logging.log_every=5"],
        1,
    ),
    # activation checkpointing's Pareto (#28), beside no AC (llm_1b_bf16_compile) and full AC above
    "llm_1b_ac_op_compile": (
        "llm_1b",
        [*LLM_1B_COMPILED, "activation_checkpoint.mode=op"],
        0.5,
    ),
    **{
        f"llm_1b_memory_budget_{b}_compile": (
            "llm_1b",
            [
                *LLM_1B_COMPILED,
                "activation_checkpoint.mode=memory_budget",
                f"activation_checkpoint.memory_budget={b}",
            ],
            0.5,
        )
        for b in ("0.3", "0.5", "0.7")
    },
    # twice the tokens a step (micro batch 4): is the 1B's MFU, and float8's gain, held back by small matmuls?
    "llm_1b_bf16_compile_mb4": ("llm_1b", [*LLM_1B_COMPILED, "train.micro_batch_size=4"], 1),
    **{
        f"llm_1b_float8_{r}_compile_mb4": (
            "llm_1b",
            [*LLM_1B_COMPILED, "train.micro_batch_size=4", "float8.enabled=true", f"float8.recipe={r}"],
            1,
        )
        for r in ("rowwise", "tensorwise")
    },
    # one profiled step (torch.profiler's Chrome trace, gzipped into the results)
    "llm_1b_bf16_compile_profiled": (
        "llm_1b",
        [*LLM_1B_COMPILED, f"profile.start_step={PROFILED_STEP}", "profile.steps=1"],
        0.34,
    ),
}
# float8's loss is judged against bf16's after LOSS_STEPS steps (the runs' steps are raised to it)
LOSS_STEPS = 50
# each float8 run against the bf16 run of the same batch
FLOAT8_BASELINES = {
    "llm_1b_float8_rowwise_compile": "llm_1b_bf16_compile",
    "llm_1b_float8_tensorwise_compile": "llm_1b_bf16_compile",
    "llm_1b_float8_rowwise_compile_mb4": "llm_1b_bf16_compile_mb4",
    "llm_1b_float8_tensorwise_compile_mb4": "llm_1b_bf16_compile_mb4",
}
LOSS_RUNS = ("llm_1b_bf16_compile", "llm_1b_float8_rowwise_compile", "llm_1b_float8_tensorwise_compile")
PARETO = (
    "llm_1b_bf16_compile",
    "llm_1b_ac_op_compile",
    "llm_1b_memory_budget_0.7_compile",
    "llm_1b_memory_budget_0.5_compile",
    "llm_1b_memory_budget_0.3_compile",
    "llm_1b_recipe_ac_full_compile",
)


def run(name: str, recipe: str, overrides: list[str], steps: int, out: Path, timeout: float = 300) -> dict:
    """One `run_recipe` as a user starts it; its summary and memory records."""
    args = [
        sys.executable,
        "-m",
        "meshforge.cli",
        str(REPO / "recipes" / f"{recipe}.toml"),
        *overrides,
        *QUIET,
    ]
    args += [f"train.steps={steps}", f"output_dir={out}", f"run_name={name}"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        proc = subprocess.CompletedProcess(
            args, -1, "", f"{(e.stderr or b'')[-2000:]!r}\ntimed out after {timeout} s"
        )
    wall = time.perf_counter() - t0
    run_dir = out / name
    result: dict = {"recipe": recipe, "overrides": overrides, "steps": steps, "wall_s": round(wall, 1)}
    if proc.returncode != 0:
        result["error"] = (proc.stderr or proc.stdout)[-3000:]
        return result
    info = json.loads((run_dir / "run.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    result.update(summary={k: v for k, v in info["summary"].items() if k not in ("memory_breakdown",)})
    result["last_memory"] = {k: v for k, v in rows[-1].items() if k.startswith("memory")}
    try:
        result["estimate_gib"] = estimate_gib(recipe, overrides)
    except Exception as e:  # the run's figures still count; the table says what failed
        result["estimate_error"] = f"{type(e).__name__}: {e}"[:300]
    if profile := gpu_profile(torch.cuda.get_device_name(0)):
        result.update(priced(recipe, overrides, profile))
    return result


def priced(recipe: str, overrides: list[str], profile: str) -> dict:
    """A run's `predicted_step_s`, or its `prediction_error` where the prediction fails (as the
    estimate's: the run's figures still count)."""
    try:
        return {"predicted_step_s": predicted_step_s(recipe, estimate_overrides(overrides), profile)}
    except Exception as e:
        return {"prediction_error": f"{type(e).__name__}: {e}"[:300]}


@functools.cache
def _estimate(recipe: str, overrides: tuple[str, ...]) -> float:
    return (
        estimate_rows(str(REPO / "recipes" / f"{recipe}.toml"), list(overrides), 1, False)[0]["total"] / GiB
    )


def estimate_overrides(overrides: list[str]) -> tuple[str, ...]:
    """The overrides the trace (estimate, predicted step) needs: compile, logging and profiling do
    not change it (it runs eager), so runs that differ only there are traced once; a memory budget
    keeps compile (it is refused without it) and its estimate is an upper bound."""
    budget = "activation_checkpoint.mode=memory_budget" in overrides
    return tuple(
        o
        for o in overrides
        if not o.startswith(("logging.", "profile.")) and (budget or not o.startswith("compile."))
    )


def estimate_gib(recipe: str, overrides: list[str]) -> float:
    """`meshforge estimate` of the run."""
    return _estimate(recipe, estimate_overrides(overrides))


def memory_problems(result: dict) -> list[str]:
    """CUDA memory metrics that are missing, zero, or not ordered as the allocator's are."""
    mem, total = result.get("last_memory", {}), torch.cuda.get_device_properties(0).total_memory / GiB
    peak = mem.get(f"memory/{PEAK['cuda']}")
    problems = []
    if not peak or not 0 < peak <= total:
        problems.append(f"memory/{PEAK['cuda']} = {peak} (want 0 < peak <= {total:.0f} GiB)")
    for key, value in mem.items():
        if key.startswith("memory/") and key.endswith("_gib") and not 0 <= value <= total:
            problems.append(f"{key} = {value} outside [0, {total:.0f}] GiB")
    reserved, active = mem.get("memory/max_reserved_gib"), peak
    if reserved is not None and active is not None and reserved < active:
        problems.append(f"reserved {reserved} < active {active} GiB")
    return problems


def gpu_profile(device_name: str) -> str | None:
    """The shipped tune profile of this GPU (`meshforge tune --profile`), None for another GPU."""
    return next((p for p in SHIPPED if p in device_name.lower()), None)


@functools.cache
def predicted_step_s(recipe: str, overrides: tuple[str, ...], profile: str) -> float:
    """`meshforge tune --plan --profile P` of the run: its eager step priced by the profile (a
    compiled run's step is not modelled: tune says so)."""
    r = load_recipe(str(REPO / "recipes" / f"{recipe}.toml"), list(overrides), world_size=1)
    return predict_recipe_step(r, load_profile(profile)).step_s


def step_error(r: dict) -> str:
    """The predicted step against the measured steady step, signed ('-' without both)."""
    measured, predicted = r.get("summary", {}).get("step_time"), r.get("predicted_step_s")
    return f"{predicted / measured - 1:+.1%}" if measured and predicted else "-"


def estimate_error(r: dict) -> str:
    """The estimate against the measured peak, as a signed percentage ('-' without both)."""
    peak, est = r.get("summary", {}).get("peak_memory_gib"), r.get("estimate_gib")
    return f"{est / peak - 1:+.1%}" if peak and est else "-"


def float8_table(results: dict[str, dict]) -> list[str]:
    """float8's speed and loss against the bf16 compiled run of the same batch and steps."""
    lines = []
    for name, base_name in FLOAT8_BASELINES.items():
        s, base = (results.get(n, {}).get("summary") for n in (name, base_name))
        if s and base and s["steps"] == base["steps"]:
            speed, loss = (
                s["tokens_per_sec"] / base["tokens_per_sec"] - 1,
                s["final_loss"] / base["final_loss"] - 1,
            )
            row = f"| {name} | {base_name} | {s['steps']} | {speed:+.1%} | {s['final_loss']:.4f} "
            lines.append(row + f"| {loss:+.2%} |")
    if not lines:
        return []
    head = f"(targets: >= +25% tokens/s, loss within 1% after {LOSS_STEPS} steps):"
    return ["", f"float8 against bf16 compiled, the same batch and steps {head}", ""] + [
        "| run | against | steps | tokens/s vs bf16 | final loss | vs bf16's |",
        "|---|---|---|---|---|---|",
        *lines,
    ]


def pareto_table(results: dict[str, dict]) -> list[str]:
    """Activation checkpointing from none to full: tokens/s against peak memory, and the estimate's error."""
    rows = [(n, results[n]) for n in PARETO if "summary" in results.get(n, {})]
    if not rows:
        return []
    lines = [
        "",
        "activation checkpointing (bf16 compiled; a memory budget's estimate is traced eager: an "
        "upper bound):",
        "",
    ]
    lines += ["| run | tokens/s | peak GiB | estimate GiB | estimate error |", "|---|---|---|---|---|"]
    for name, r in rows:
        s = r["summary"]
        lines.append(
            f"| {name} | {s['tokens_per_sec']:,.0f} | {s['peak_memory_gib']:.2f} "
            f"| {r.get('estimate_gib', 0):.2f} | {estimate_error(r)} |"
        )
    return lines


def keep_profile(run_dir: Path, out: Path) -> Path | None:
    """The profiled run's rank-0 trace, gzipped into the results folder; its path."""
    traces = sorted(run_dir.rglob("rank0.pt.trace.json"))
    if not traces:
        return None
    kept = out / "gpu_check_profile_rank0.pt.trace.json.gz"
    out.mkdir(parents=True, exist_ok=True)
    with traces[0].open("rb") as src, gzip.open(kept, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return kept


def steps_of(name: str, steps: int) -> int:
    """A run's steps: the check's, scaled per run, float8 and its baseline at least LOSS_STEPS."""
    n = max(6, int(steps * RUNS[name][2]))
    if f"profile.start_step={PROFILED_STEP}" in RUNS[name][1]:
        n = max(n, PROFILED_STEP + 2)  # the profiled step, and one after it
    return max(n, LOSS_STEPS) if name in LOSS_RUNS else n


def dry_run(names: list[str], steps: int, runs_dir: Path) -> int:
    """Every run's recipe validated here (no GPU needed) and its command printed."""
    failed = 0
    for name in names:
        recipe, overrides, _ = RUNS[name]
        final = [
            *overrides,
            *QUIET,
            f"train.steps={steps_of(name, steps)}",
            f"output_dir={runs_dir}",
            f"run_name={name}",
        ]
        try:
            load_recipe(str(REPO / "recipes" / f"{recipe}.toml"), final)
            load_recipe(str(REPO / "recipes" / f"{recipe}.toml"), list(estimate_overrides(overrides)))
            verdict = "valid"
        except RecipeError as e:
            verdict, failed = f"INVALID: {e}", failed + 1
        print(f"{name}: {verdict}\n  run_recipe recipes/{recipe}.toml {' '.join(final)}")
    return 1 if failed else 0


def table(results: dict[str, dict]) -> list[str]:
    lines = [
        "| run | tokens/s | MFU | TFLOP/s | peak GiB (measured) | estimate GiB | estimate error | step s "
        "| predicted step s | step error | wall s | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        s = r.get("summary", {})
        note = (
            r.get("error", "").strip().splitlines()[-1][:120]
            if "error" in r
            else "; ".join(r.get("problems", []))
        )
        mfu = f"{s['mfu']:.1%}" if "mfu" in s else "-"
        lines.append(
            f"| {name} | {s.get('tokens_per_sec', 0):,.0f} | {mfu} | {s.get('tflops_per_device', 0):.1f} "
            f"| {s.get('peak_memory_gib', 0):.2f} | {r.get('estimate_gib', 0):.2f} | {estimate_error(r)} "
            f"| {s.get('step_time', 0):.4f} | {r.get('predicted_step_s', 0):.4f} | {step_error(r)} "
            f"| {r['wall_s']} | {note} |"
        )
    return lines


# a CUDA kernel's share of the profiled step, by what its name says it is (first match wins)
KERNEL_KINDS = (
    ("attention (SDPA)", ("sdpa", "flash", "fmha", "cudnn")),  # cuDNN's attention and its helpers
    ("matmul", ("nvjet", "gemm", "cutlass")),
    ("loss softmax / nll (eager)", ("softmax", "nll")),
    ("optimizer (fused AdamW)", ("fusedadam",)),
    ("gradient norm and clip (foreach)", ("lpnorm", "multi_tensor")),
    ("compiled (triton)", ("triton",)),
    ("copies and casts", ("copy",)),
)


def kernel_breakdown(trace_gz: Path) -> dict:
    """The profiled step's GPU time by kernel kind, read from its Chrome trace: where the MFU goes."""
    with gzip.open(trace_gz, "rt") as f:
        kernels = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    if not kernels:  # a trace without CUDA kernels (CUPTI recorded none): nothing to break down
        return {}
    busy_us = sum(e["dur"] for e in kernels)
    span_us = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    kinds: dict[str, float] = {}
    for e in kernels:
        name = e["name"].lower()
        kind = next((k for k, marks in KERNEL_KINDS if any(m in name for m in marks)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + e["dur"] / 1e3
    ms = dict(sorted(kinds.items(), key=lambda kv: -kv[1]))
    return {"kernels": len(kernels), "busy_ms": busy_us / 1e3, "span_ms": span_us / 1e3, "by_kind_ms": ms}


def breakdown_table(b: dict) -> list[str]:
    lines = [
        "",
        f"the profiled step's GPU time ({b['kernels']} kernels, {b['busy_ms']:.1f} ms busy in a "
        f"{b['span_ms']:.1f} ms span from first kernel to last):",
        "",
        "| kernels | ms | share of busy |",
        "|---|---|---|",
    ]
    return lines + [f"| {k} | {ms:.1f} | {ms / b['busy_ms']:.1%} |" for k, ms in b["by_kind_ms"].items()]


def render(recorded: dict) -> list[str]:
    """The markdown of a recorded check (provenance and runs)."""
    machine, results = recorded["machine"], recorded["runs"]
    md = [f"# GPU check ({machine['gpu']}, torch {recorded['versions']['torch']}, {recorded['date']})", ""]
    md += [recorded["note"], ""] if "note" in recorded else []
    md += [f"Predicted steps priced again ({recorded['predicted']}).", ""] if "predicted" in recorded else []
    md += table(results) + float8_table(results) + pareto_table(results)
    profiled = results.get("llm_1b_bf16_compile_profiled", {})
    if profile := profiled.get("profile_trace"):
        md += ["", f"one profiled step (rank 0, Chrome trace for Perfetto / TensorBoard): `{profile}`"]
    if profiled.get("kernel_breakdown"):
        md += breakdown_table(profiled["kernel_breakdown"])
    return md + [
        "",
        "tokens/s, MFU and step s: steady steps (warm-up and checkpoint steps left out); MFU of bf16 "
        "dense peak. predicted step s: `meshforge tune --plan` with the GPU's shipped profile, which "
        "prices the eager step (compile's fusion is not modelled).",
    ]


def record(results: dict[str, dict], out: Path) -> list[str]:
    recorded = {
        **provenance(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda),
        "runs": results,
    }
    save(out, "gpu_check", recorded, md := render(recorded))
    return md


def merge(paths: list[str], out: Path) -> None:
    """Checks recorded in parts on one machine, as one record: the first's provenance, every
    part's runs (a later part's run of the same name wins)."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    merged = {**parts[0], "runs": {n: r for part in parts for n, r in part["runs"].items()}}
    save(out, "gpu_check", merged, render(merged))


def repredict(path: str, out: Path) -> None:
    """A recorded check's predicted steps, priced again here with today's code and its GPU's
    shipped profile (tune needs no GPU): the measured runs stay as they were."""
    recorded = json.loads(Path(path).read_text())
    if (profile := gpu_profile(recorded["machine"]["gpu"])) is None:
        gpu, shipped = recorded["machine"]["gpu"], ", ".join(SHIPPED)
        sys.exit(f"gpu_check --repredict: no shipped profile for {gpu} (shipped: {shipped})")
    for r in recorded["runs"].values():
        r.pop("prediction_error", None)
        r.pop("predicted_step_s", None)
        r.update(priced(r["recipe"], r["overrides"], profile))
    recorded["predicted"] = (
        f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__} on the CPU, meshforge at {git_head()}"
    )
    save(out, "gpu_check", recorded, render(recorded))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="steps of each run (the offload run takes a third)")
    p.add_argument(
        "--out", default=str(REPO / "benchmarks" / "results"), help="folder for gpu_check.{json,md}"
    )
    p.add_argument("--runs-dir", default="/tmp/meshforge_gpu_check", help="folder for the run records")
    p.add_argument("--only", default=None, help="comma-separated run names")
    p.add_argument(
        "--run-timeout", type=float, default=300, help="seconds one run may take before it is stopped"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="validate every run's recipe and print it; no GPU needed"
    )
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="write recorded parts (gpu_check.json files) as one; no GPU",
    )
    p.add_argument(
        "--repredict",
        metavar="JSON",
        help="price a recorded check's runs again with today's code and shipped profile; no GPU",
    )
    a = p.parse_args()
    if a.merge:
        merge(a.merge, Path(a.out))
        return 0
    if a.repredict:
        repredict(a.repredict, Path(a.out))
        return 0
    names = a.only.split(",") if a.only else list(RUNS)
    if a.dry_run:
        return dry_run(names, a.steps, Path(a.runs_dir))
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check", file=sys.stderr)
        return 2
    results = {}
    for name in names:
        recipe, overrides, _ = RUNS[name]
        results[name] = run(name, recipe, overrides, steps_of(name, a.steps), Path(a.runs_dir), a.run_timeout)
        results[name]["problems"] = memory_problems(results[name]) if "error" not in results[name] else []
        if "profile.steps=1" in overrides and "error" not in results[name]:
            kept = keep_profile(Path(a.runs_dir) / name, Path(a.out))
            results[name]["profile_trace"] = kept and str(
                kept.relative_to(REPO) if kept.is_relative_to(REPO) else kept
            )
            if kept:
                results[name]["kernel_breakdown"] = kernel_breakdown(kept)
        print(table({name: results[name]})[-1], flush=True)
        md = record(results, Path(a.out))  # after every run: a check cut short keeps what it measured
    print("\n".join(md))
    failed = [n for n, r in results.items() if "error" in r or r["problems"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
