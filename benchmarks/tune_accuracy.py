"""Step-time prediction vs measurement: `meshforge tune` on every valid layout of a recipe.

Each recipe is tuned with every point confirmed (`--top` all): its layouts crossed with the axes
given, predicted with a profile measured only by `--calibrate` (no layout's run is used to fit),
then each point runs `--steps` steps and its steady step time is read as `compare` reads it; with
`--passes N` every point is measured N times, a whole pass after another, and judged against the
mean (8 ranks on 2 cores read a launch up to tens of % apart from the same launch later: the
passes' spread is reported, the floor under any model's error). Per
recipe: median and worst |error|, Kendall's tau between predicted and measured order, and how far
the predicted best is from the measured best (order and best by tokens/s: llm_1b's layouts train
on different global batches, its micro batch fixed, so a shorter step is not a faster layout);
with two recipes or more, the same for each with the profile refined (`--calibrate-from`) on the
other recipes' runs only. Also the pipeline bubble predicted for each schedule of
benchmarks/pipeline_bubble.py (its model and batch, 1 thread per rank), against its recorded
measurement.

    python benchmarks/tune_accuracy.py --profile P.toml --passes 2  # writes benchmarks/results/
    python benchmarks/tune_accuracy.py --profile P.toml --recipes debug_cpu --only dp8,dp4-tp2 --out /tmp/t
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from datetime import datetime, timezone
from itertools import combinations
from pathlib import Path

from pipeline_bubble import COMMON, SCHEDULES  # benchmarks/pipeline_bubble.py
from recorded import at_least_one, provenance, save  # benchmarks/recorded.py
from rich.console import Console

from meshforge.configs import resolve_recipe_path
from meshforge.experiments.refine import measured_runs, refine
from meshforge.experiments.tune import tune
from meshforge.recipe import load_recipe
from meshforge.simulate.estimate import predict_recipe_step
from meshforge.simulate.profile_toml import load_profile

# llm_1b shrunk for 8 CPU processes, as its header says
LLM_1B_SHRUNK = [
    "train.device=cpu",
    "model.n_layers=2",
    "model.dim=256",
    "model.n_heads=8",
    "model.n_kv_heads=2",
    "model.vocab_size=4096",
    "model.multiple_of=64",
    "train.seq_len=128",
    "train.micro_batch_size=2",
    "activation_checkpoint.mode=none",
    "fsdp.param_dtype=float32",
    "data.source=synthetic",
    "data.hf_dataset=null",
    "data.hf_config=null",
    "data.tokenizer=byte",
    "data.shuffle_windows=0",
]
RECIPES = {"debug_cpu": [], "llm_1b": LLM_1B_SHRUNK}
QUIET = ["logging.wandb=false", "logging.tensorboard=false", "logging.progress=false"]


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a: concordant minus discordant pairs over all pairs."""
    pairs = list(combinations(range(len(a)), 2))
    score = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs) - sum(
        (a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs
    )
    return score / len(pairs) if pairs else float("nan")


def accuracy_of(labels: list[str], pred: list[float], real: list[float], tokens: list[int]) -> dict:
    """Errors of the step times; order and best by tokens/s (tokens per step over the step)."""
    errors = [p / m - 1 for p, m in zip(pred, real)]
    pred_rate, real_rate = ([n / s for n, s in zip(tokens, steps)] for steps in (pred, real))
    best = pred_rate.index(max(pred_rate)) if pred else None
    return {
        "points": len(labels),
        "median_abs_error": statistics.median(abs(e) for e in errors) if errors else None,
        "worst_abs_error": max((abs(e) for e in errors), default=None),
        "kendall_tau": kendall_tau(pred_rate, real_rate),
        "predicted_best": labels[best] if pred else None,
        "measured_best": labels[real_rate.index(max(real_rate))] if real else None,
        # the predicted best's measured tokens/s against the best measured (-10%: 10% fewer)
        "predicted_best_vs_measured_best": real_rate[best] / max(real_rate) - 1 if pred else None,
        "rows": [
            {"label": label, "predicted_s": p, "measured_s": m, "error": e, "tokens_per_step": n}
            for label, p, m, e, n in zip(labels, pred, real, errors, tokens)
        ],
    }


def cross_refined(
    profile, folders: dict[str, list[Path]], steps: dict[str, dict[str, float]], console: Console
) -> dict[str, dict]:
    """Each recipe's points predicted by the profile refined on the *other* recipes' measured runs
    (`meshforge tune --calibrate-from` their first pass, as a user refines from one sweep): none of
    its own runs is used to fit. Judged, as unrefined, against the mean of its passes (`steps`)."""
    out = {}
    for name, passes in folders.items():
        others = [f[0] for n, f in folders.items() if n != name]
        refined = refine(profile, others, console)
        runs = [r for r in measured_runs([passes[0]], console) if r.name.split("/")[-1] in steps[name]]
        out[name] = {
            "refined_from": [n for n in folders if n != name],
            "profile": refined.source.splitlines()[-1],
            **accuracy_of(
                [r.name.split("/")[-1] for r in runs],
                [r.predict(refined) for r in runs],
                [steps[name][r.name.split("/")[-1]] for r in runs],
                [r.tokens_per_step for r in runs],
            ),
        }
    return out


def bubbles(profile_path: str) -> list[dict]:
    """Predicted bubble per schedule as pipeline_bubble.py measures it: 1 - (T1 / pp) / T_pp."""
    recorded = json.loads((Path(__file__).parent / "results" / "pipeline_bubble.json").read_text())
    profile = load_profile(profile_path)
    base = [*COMMON, *recorded["model_overrides"]]

    def step(overrides: list[str]) -> float:
        recipe = load_recipe(str(resolve_recipe_path("debug_cpu")), [*base, *overrides])
        return predict_recipe_step(recipe, profile).step_s

    pp, m = recorded["pp"], recorded["microbatches"]
    t1 = step(["mesh.pp=1"])
    out = []
    for r in recorded["rows"]:
        name = r["schedule"]
        t_pp = step(
            [
                f"mesh.pp={pp}",
                f"pp.schedule={name}",
                f"pp.microbatches={m}",
                f"pp.stages_per_rank={SCHEDULES[name]}",
            ]
        )
        out.append({"schedule": name, "predicted": 1 - (t1 / pp) / t_pp, "measured": r["measured"]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", required=True, help="a profile from `meshforge tune --calibrate`")
    p.add_argument("--bubble-profile", default=None, help="a 2-rank profile for the bubble table")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--axis", action="append", default=[], metavar="KEY=V1,V2")
    p.add_argument("--only", default=None, help="layouts to run, comma-separated (default: all)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument(
        "--passes",
        type=at_least_one,
        default=1,
        help="measure every point this many times, one pass after another, and judge the model "
        "against their mean (the records in benchmarks/results/ take 2)",
    )
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument(
        "--keep", default=None, help="keep the tunes' run folders here (default: a temporary folder)"
    )
    args = p.parse_args()
    axes = {k: v.split(",") for k, _, v in (a.partition("=") for a in args.axis)}
    profile = load_profile(args.profile)
    console = Console(width=150)
    started = provenance()  # the commit the predictions import, whatever changes during the runs
    result = {"benchmark": "tune_accuracy", "profile": profile.source, "world": args.world, "axes": axes}
    result["profile_values"] = dataclasses.asdict(profile)  # what predicted, to price again later
    folders: dict[str, list[Path]] = {}  # recipe -> its passes' tune folders
    means: dict[str, dict[str, float]] = {}  # recipe -> point -> its mean step over the passes
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.keep or tmp
        for name in args.recipes.split(","):
            overrides = [*RECIPES[name], *QUIET, f"sweep.steps={args.steps}", "sweep.timeout_s=900"]
            if args.only:
                overrides.append(f"sweep.only=[{args.only}]")
            passes = folders[name] = [Path(tmp) / f"{name}{_pass_suffix(k)}" for k in range(args.passes)]
            reused = [(folder / "tune.jsonl").is_file() for folder in passes]
            for folder, old in zip(passes, reused):
                if old:  # a tune measured before: its points predicted again with this profile and code
                    console.print(f"{name}: reusing the measured tune in {folder}")
                else:
                    tune(
                        str(resolve_recipe_path(name)),
                        overrides,
                        args.world,
                        profile,
                        axes,
                        10**6,
                        False,
                        folder,
                        console,
                    )
            if reused[0]:
                runs = measured_runs([passes[0]], console)
                point = {r.name.split("/")[-1]: (r.predict(profile), r.tokens_per_step) for r in runs}
            else:
                rows = [json.loads(line) for line in (passes[0] / "tune.jsonl").read_text().splitlines()]
                point = {
                    r["label"]: (r["predicted"]["step_s"], r["predicted"]["tokens_per_step"])
                    for r in rows
                    if r.get("predicted")
                }
            readings = pass_readings(passes)
            steps = means[name] = {label: statistics.mean(t) for label, t in readings.items()}
            labels = [label for label in point if label in steps]
            # a point a pass did not measure (failed, timed out) is left out of every pass: named
            unmeasured = [label for label in point if label not in steps]
            result[name] = {
                **accuracy_of(
                    labels,
                    [point[label][0] for label in labels],
                    [steps[label] for label in labels],
                    [point[label][1] for label in labels],
                ),
                "reused": reused,
                "measured_at": [_measured_at(folder) for folder in passes],
                "unmeasured": unmeasured,
                **({"pass_spread": pass_spread(readings)} if len(passes) > 1 else {}),
            }
        if len(folders) > 1:
            for name, refined in cross_refined(profile, folders, means, console).items():
                result[name]["refined"] = refined
    if args.bubble_profile:
        result["bubbles"] = bubbles(args.bubble_profile)
    write({**result, **started}, Path(args.out))


def _pass_suffix(k: int) -> str:
    """The folder suffix of pass k (from 0): none for the first, so a one-pass tune is where it was."""
    return f".pass{k + 1}" if k else ""


def measured_steps(folder: Path) -> dict[str, float]:
    """A tune's measured steady step time per point (tune.jsonl)."""
    rows = [json.loads(line) for line in (folder / "tune.jsonl").read_text().splitlines()]
    return {r["label"]: r["measured"]["step_time"] for r in rows if r.get("measured", {}).get("step_time")}


def pass_readings(passes: list[Path]) -> dict[str, list[float]]:
    """Each point's step time in every pass, for the points all the passes measured: a launch on a
    shared host reads apart from the same launch minutes later, their mean less so."""
    each = [measured_steps(folder) for folder in passes]
    return {label: [e[label] for e in each] for label in each[0] if all(label in e for e in each)}


def pass_spread(readings: dict[str, list[float]]) -> dict[str, float]:
    """How far apart the passes read a point: (slowest - fastest) / their mean, median and worst
    over the points; the floor under any model's error against a single pass."""
    spreads = [(max(t) - min(t)) / statistics.mean(t) for t in readings.values()]
    return {"median": statistics.median(spreads), "worst": max(spreads)} if spreads else {}


def _measured_at(folder: Path) -> str:
    """When a tune's runs were measured: its tune.jsonl's last change, UTC."""
    stamp = datetime.fromtimestamp((folder / "tune.jsonl").stat().st_mtime, timezone.utc)
    return f"{stamp:%Y-%m-%d %H:%M} UTC"


def measured_when(a: dict) -> str:
    """When a recipe's points were measured, in how many passes and how far apart those read."""
    passes = len(a["measured_at"])
    text = f"Measured at {', '.join(a['measured_at'])}" + (
        f" ({passes} passes; measured s is their mean)" if passes > 1 else ""
    )
    if spread := a.get("pass_spread"):
        text += (
            f"; the passes read a point {spread['median']:.1%} apart at the median, {spread['worst']:.1%} "
            "at worst ((slowest - fastest) / mean)"
        )
    if any(reused := a.get("reused") or []):
        which = ", ".join(str(k + 1) for k, old in enumerate(reused) if old)
        text += f"; pass(es) {which} measured before, predicted again with the code and profile above"
    if a.get("unmeasured"):
        text += f"; left out, not measured by every pass: {', '.join(a['unmeasured'])}"
    return text + "."


def point_table(rows: list[dict]) -> list[str]:
    """The points in the order they are judged by: measured tokens/s, highest first."""

    def tokens_per_s(r: dict) -> float:
        return r["tokens_per_step"] / r["measured_s"]

    return [
        "| point | measured tokens/s | predicted s | measured s | error |",
        "|---|---|---|---|---|",
        *[
            f"| {r['label']} | {tokens_per_s(r):,.0f} | {r['predicted_s']:.4f} | {r['measured_s']:.4f} | "
            f"{r['error']:+.1%} |"
            for r in sorted(rows, key=tokens_per_s, reverse=True)
        ],
    ]


def write(result: dict, out: Path) -> None:
    lines = [
        "# Step-time prediction vs measurement (`meshforge tune`)",
        "",
        f"{result['date']}, {result['machine']['platform']}, torch {result['versions']['torch']}; "
        f"world {result['world']}, axes {result['axes'] or 'none'}; meshforge {result.get('commit') or '?'}; "
        f"profile: {result['profile']}.",
        *(["", result["note"]] if "note" in result else []),
    ]
    for name in RECIPES:
        if name not in result or not result[name]["points"]:
            continue
        a = result[name]
        lines += [
            "",
            f"## {name}: {a['points']} points; median |error| {a['median_abs_error']:.1%}, worst "
            f"{a['worst_abs_error']:.1%}, Kendall tau {a['kendall_tau']:.2f}; predicted best "
            f"{a['predicted_best']} measured {a['predicted_best_vs_measured_best']:+.1%} tokens/s from the "
            f"measured best {a['measured_best']}",
            "",
            measured_when(a),
            "",
            *point_table(a["rows"]),
        ]
        if "refined" in a:
            b = a["refined"]
            lines += [
                "",
                f"### {name} with the profile refined on {', '.join(b['refined_from'])}'s runs "
                f"(`--calibrate-from`): median |error| {b['median_abs_error']:.1%}, worst "
                f"{b['worst_abs_error']:.1%}, Kendall tau {b['kendall_tau']:.2f}; predicted best "
                f"{b['predicted_best']} measured {b['predicted_best_vs_measured_best']:+.1%} tokens/s "
                "from the best",
                "",
                f"{b['profile']}",
                "",
                *point_table(b["rows"]),
            ]
    if "bubbles" in result:
        lines += ["", "## Pipeline bubble (pipeline_bubble.py's model and batch)", ""]
        lines += ["| schedule | predicted | measured (recorded) | gap |", "|---|---|---|---|"]
        for b in result["bubbles"]:
            gap = b["predicted"] - b["measured"]
            lines.append(f"| {b['schedule']} | {b['predicted']:.1%} | {b['measured']:.1%} | {gap:+.1%} |")
    save(out, "tune_accuracy", result, lines)


if __name__ == "__main__":
    main()
