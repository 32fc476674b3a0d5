"""Runner overhead: meshforge's training step vs a bare hand-written PyTorch loop.

Same model, weights, data, optimizer and LR schedule, one process. The two loops run in
alternating rounds within one process, so the machine's noise hits both alike; the
result is the ratio of median step times. Target: meshforge <= 1.03x the bare loop.

    python benchmarks/runner_overhead.py                 # full size, writes benchmarks/results/
    python benchmarks/runner_overhead.py --rounds 1 --steps 2 --out /tmp/bench   # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from recorded import provenance, save  # benchmarks/recorded.py

from meshforge.recipe import load_recipe
from meshforge.run.train.optim import build_optimizer, lr_multiplier
from meshforge.run.train.trainer import Trainer

TARGET = 1.03
SINGLE = [
    "mesh.dp_replicate=1",
    "mesh.dp_shard=1",
    "mesh.tp=1",
    "mesh.pp=1",
    "logging.wandb=false",
    "logging.tensorboard=false",
    "logging.progress=false",
]


def bare_loop(trainer: Trainer):
    """A hand-written step on a copy of the trainer's model: what a user would write."""
    r = trainer.recipe
    model = trainer.spec.build(trainer.model_args)
    model.load_state_dict(trainer.pmodel.parts[0].state_dict())
    opt = build_optimizer(model.parameters(), r.optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, r.train.steps, r.lr_scheduler))
    loader = trainer.loader

    def step() -> float:
        (batch,) = loader.next_step()
        logits = model(batch.inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r.train.max_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def meshforge_loop(trainer: Trainer):
    """meshforge's per-step work in `TrainingRun._steps`: the step plus its metrics (memory, FLOPs)
    and the loss read on the host, as a logging step does (and as the bare loop's loss.item()); the
    collector's pacing (`train.gc_every`) is left out, as the bare loop has none."""

    def step() -> float:
        t0, n = time.perf_counter(), trainer.state.step + 1
        result = trainer.train_step(n)
        trainer._unread_losses.append(result.loss)  # what TrainingRun._record hands _metrics
        return trainer._metrics(n, result, time.perf_counter() - t0)["loss"]

    return step


def measure(rounds: int, steps: int, overrides: list[str]) -> dict:
    trainer = Trainer(load_recipe("debug_cpu", [*SINGLE, "train.steps=100000", *overrides]))
    loops = {"bare": bare_loop(trainer), "meshforge": meshforge_loop(trainer)}
    times: dict[str, list[float]] = {k: [] for k in loops}
    for name in loops:  # warm-up, not timed
        loops[name]()
    for _ in range(rounds):
        for name, step in loops.items():
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
    medians = {k: statistics.median(v) for k, v in times.items()}
    ratio = medians["meshforge"] / medians["bare"]
    return {
        "benchmark": "runner_overhead",
        "target_ratio": TARGET,
        "ratio": ratio,
        "met": ratio <= TARGET,
        "median_step_s": medians,
        "rounds": rounds,
        "steps_per_round": steps,
        "overrides": overrides,
        **provenance(threads=torch.get_num_threads()),
    }


def write(result: dict, out: Path) -> None:
    m = result["median_step_s"]
    save(
        out,
        "runner_overhead",
        result,
        [
            "# Runner overhead",
            "",
            f"{result['date']}, {result['machine']['platform']}, {result['machine']['cpus']} CPUs, "
            f"torch {result['versions']['torch']}; {result['rounds']} alternating rounds x "
            f"{result['steps_per_round']} steps, debug model, one process.",
            "",
            "| loop | median step (ms) |",
            "|---|---|",
            f"| bare PyTorch | {m['bare'] * 1e3:.2f} |",
            f"| meshforge | {m['meshforge'] * 1e3:.2f} |",
            "",
            f"Ratio {result['ratio']:.3f} (target <= {result['target_ratio']}): "
            f"{'met' if result['met'] else 'NOT met'}.",
        ],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("overrides", nargs="*", help="recipe overrides, e.g. model.dim=256 train.seq_len=256")
    args = p.parse_args()
    result = measure(args.rounds, args.steps, args.overrides)
    write(result, Path(args.out))
    print(json.dumps({k: result[k] for k in ("ratio", "met", "median_step_s")}))


if __name__ == "__main__":
    main()
