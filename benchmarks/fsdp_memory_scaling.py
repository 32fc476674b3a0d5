"""FSDP memory scaling: model-state bytes per rank at dp_shard = 1, 2, 4, 8 against the ideal.

Model states are the parameters and AdamW moments (gradients are freed after each step),
measured on each rank as the bytes of the storages behind them, padding included
(`memory/state_gib` in metrics.jsonl: the largest rank).
The ideal at N ranks is the 1-rank figure / N. Target: <= 1.05x ideal (padding of
uneven shards and unsharded buffers are the overhead). Each degree is one real launch.

    python benchmarks/fsdp_memory_scaling.py                       # writes benchmarks/results/
    python benchmarks/fsdp_memory_scaling.py --degrees 1 2 --out /tmp/bench model.dim=64   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from recorded import provenance, save  # benchmarks/recorded.py

TARGET = 1.05
# a model big enough that shard padding is a fair share, small enough for 8 CPU processes
MODEL = [
    "model.dim=256",
    "model.n_layers=4",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.vocab_size=4096",
    "model.multiple_of=64",
]
QUICK = [
    "mesh.dp_replicate=1",
    "mesh.tp=1",
    "mesh.pp=1",
    "train.steps=2",
    "train.seq_len=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=-1",
    "logging.wandb=false",
    "logging.tensorboard=false",
    "logging.progress=false",
]


def state_bytes_at(dp: int, out: Path, overrides: list[str]) -> float:
    run = out / f"dp{dp}"
    cmd = [
        sys.executable,
        "-m",
        "meshforge.cli",
        "debug_cpu",
        *QUICK,
        *MODEL,
        f"mesh.dp_shard={dp}",
        f"output_dir={out}",
        f"run_name=dp{dp}",
        *overrides,
    ]
    subprocess.run(
        cmd, check=True, capture_output=True, timeout=600, env={**os.environ, "WANDB_MODE": "disabled"}
    )
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    return last["memory/state_gib"] * 2**30


def measure(degrees: list[int], overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        measured = {dp: state_bytes_at(dp, Path(tmp), overrides) for dp in degrees}
    base = measured[degrees[0]] * degrees[0]
    rows = [
        {
            "dp_shard": dp,
            "state_bytes_per_rank": b,
            "ideal_bytes": base / dp,
            "ratio_to_ideal": b / (base / dp),
        }
        for dp, b in measured.items()
    ]
    worst = max(r["ratio_to_ideal"] for r in rows)
    return {
        "benchmark": "fsdp_memory_scaling",
        "target_ratio": TARGET,
        "worst_ratio": worst,
        "met": worst <= TARGET,
        "rows": rows,
        "model_overrides": MODEL + overrides,
        **provenance(),
    }


def write(result: dict, out: Path) -> None:
    lines = [
        "# FSDP memory scaling",
        "",
        f"{result['date']}, {result['machine']['platform']}, torch {result['versions']['torch']}; "
        f"model {' '.join(result['model_overrides'])}; fp32 params + AdamW moments (grads are freed "
        "after the step), storage bytes incl. shard padding, largest rank.",
        "",
        "| dp_shard | state MiB/rank | ideal MiB | ratio |",
        "|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['dp_shard']} | {r['state_bytes_per_rank'] / 2**20:.3f} | {r['ideal_bytes'] / 2**20:.3f} "
            f"| {r['ratio_to_ideal']:.3f} |"
        )
    lines += [
        "",
        f"Worst ratio {result['worst_ratio']:.3f} (target <= {result['target_ratio']}): "
        f"{'met' if result['met'] else 'NOT met'}.",
    ]
    save(out, "fsdp_memory_scaling", result, lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("overrides", nargs="*", help="recipe overrides applied to every launch")
    args = p.parse_args()
    result = measure(args.degrees, args.overrides)
    write(result, Path(args.out))
    print(json.dumps({"worst_ratio": result["worst_ratio"], "met": result["met"]}))


if __name__ == "__main__":
    main()
