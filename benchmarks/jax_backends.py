"""Can the torch module itself serve `backend = "jax"`? The same recipe's steps three ways on
one mesh: torch (gloo processes), JAX with the hand-written twin (models/common/jax_decoder.py), and
JAX with torchax running the torch `Transformer` under `jax.jit` (the JAX trainer with its
forward swapped): steady step time, and each one's largest loss and grad-norm difference from
torch's, step by step, from the same init and data.

    python benchmarks/jax_backends.py [--steps 30] [--out benchmarks/results]

torchax 0.0.13 (the newest release) does not import on torch 2.13: its tables name the
named-tensor overloads torch 2.13 removed (aten.prod.dim_Dimname, aten.norm.names_ScalarOpt_dim,
...). `import_torchax` lets those names resolve to a placeholder while it imports; nothing here
calls them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MESH = {"dp_shard": 2, "tp": 2}
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={MESH['dp_shard'] * MESH['tp']}"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from recorded import provenance, save  # noqa: E402  (benchmarks/recorded.py)

from meshforge.jax.trainer import JaxTrainer  # noqa: E402
from meshforge.models import args_from_config, get_model_spec  # noqa: E402
from meshforge.models.common import jax_decoder  # noqa: E402
from meshforge.recipe import load_recipe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WARMUP = 3  # steps left out of the steady step time (compilation, the first all-gathers)


@contextlib.contextmanager
def removed_overloads_resolve():
    """torch 2.13's removed named-tensor overloads resolve to a placeholder (module doc)."""
    original = torch._ops.OpOverloadPacket.__getattr__

    def lookup(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if "imname" in key.lower() or "names" in key:
                return ("removed in torch 2.13", self._qualified_op_name, key)
            raise

    torch._ops.OpOverloadPacket.__getattr__ = lookup
    try:
        yield
    finally:
        torch._ops.OpOverloadPacket.__getattr__ = original


def import_torchax():
    with removed_overloads_resolve():
        import torchax

        torchax.default_env()  # loads its op tables, which name the removed overloads too
    return torchax


def overrides(steps: int, out: Path, name: str) -> list[str]:
    mesh = [f"mesh.{k}={v}" for k, v in MESH.items()]
    return [
        *["mesh.pp=1", *mesh, f"train.steps={steps}", "logging.progress=false", "logging.wandb=false"],
        *[f"output_dir={out}", f"run_name={name}", "logging.log_every=1"],
    ]


def run_cli(steps: int, out: Path, name: str, *extra: str) -> None:
    exe = Path(sys.executable).parent / "run_recipe"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # run_recipe sets the device count
    args = [str(exe), str(REPO / "recipes" / "debug_cpu.toml"), *overrides(steps, out, name), *extra]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")


def run_torchax(steps: int, out: Path) -> None:
    """The JAX trainer with torchax's forward of the torch module in place of the twin's."""
    torchax = import_torchax()
    recipe = load_recipe(
        str(REPO / "recipes" / "debug_cpu.toml"), [*overrides(steps, out, "torchax"), "backend=jax"]
    )
    trainer = JaxTrainer(recipe)
    model = get_model_spec(recipe.model.name).build(args_from_config(recipe.model))
    model.init_buffers()
    weights, module_forward = torchax.extract_jax(model)
    buffers = {k: v for k, v in weights.items() if k not in trainer.params}  # freqs_cis

    def forward(params, tokens, args):
        return module_forward({**params, **buffers}, (tokens,)).astype(jnp.float32)

    def token_ce_sum(params, tokens, labels, args, ignore_index):
        return jax_decoder.token_ce_sum(params, tokens, labels, args, ignore_index, fwd=forward)

    trainer._token_ce_sum = token_ce_sum  # read when the step is first traced
    trainer.run()


def summarize(out: Path) -> dict:
    rows = {
        n: [json.loads(line) for line in (out / n / "metrics.jsonl").open()]
        for n in ("torch", "twin", "torchax")
    }
    result = {}
    for name, r in rows.items():
        steady = [x["step_time"] for x in r[WARMUP:]]
        result[name] = {
            "step_s": statistics.median(steady),
            "tokens_per_sec": statistics.median(x["tokens_per_sec"] for x in r[WARMUP:]),
            "max_loss_delta_vs_torch": max(abs(a["loss"] - b["loss"]) for a, b in zip(r, rows["torch"])),
            "max_grad_norm_delta_vs_torch": max(
                abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(r, rows["torch"])
            ),
            "final_loss": r[-1]["loss"],
        }
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp)
        run_cli(a.steps, runs, "torch")
        run_cli(a.steps, runs, "twin", "backend=jax")
        run_torchax(a.steps, runs)
        result = summarize(runs)
    torchax_version = importlib.metadata.version("torchax")
    record = {
        **provenance(jax=jax.__version__, torchax=torchax_version),
        "recipe": "debug_cpu",
        "mesh": MESH,
        "steps": a.steps,
        "steady_from_step": WARMUP + 1,
        "backends": result,
    }
    mesh = " x ".join(f"{k} {v}" for k, v in MESH.items())
    md = [
        f"# torch, the JAX twin and torchax on one mesh (debug_cpu, {mesh}, {a.steps} fp32 steps, "
        f"{record['date']})",
        "",
        f"jax {jax.__version__}, torchax {torchax_version}, torch {torch.__version__}; step time: median "
        f"from step {WARMUP + 1}; deltas: the largest over every step against the torch run",
        "",
        "| backend | step s | tokens/s | max loss delta | max grad-norm delta | final loss |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in result.items():
        md.append(
            f"| {name} | {r['step_s']:.4f} | {r['tokens_per_sec']:,.0f} | {r['max_loss_delta_vs_torch']:.1e} "
            f"| {r['max_grad_norm_delta_vs_torch']:.1e} | {r['final_loss']:.4f} |"
        )
    save(Path(a.out), "jax_backends", record, md)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
