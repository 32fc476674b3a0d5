"""meshforge against TorchTitan 0.3.0 on the same work, on this machine.

(a) model: TorchTitan's Llama3 model class and ours, same weights, in the same loop
    (forward, cross-entropy, backward, fused AdamW), alternating rounds in one process:
    the ratio of median step times (> 1: ours is faster). Needs only the `titan` extra.
(b) end to end: `run_recipe` tokens/s per device for 1 process, FSDP 2, TP 2 (SP, loss
    parallel) and PP 2 (1F1B), fp32 and bf16, with the fraction of this CPU's measured matmul
    rate each reaches; beside it TorchTitan's own trainer on the same layout through the CPU
    shim (`--titan-shim`, default ../shared/titan_cpu), when it is there.
(c) what a checkpoint step costs beyond a steady step, synchronous and `async_save`.

Same dims on both sides (TorchTitan's llama3 debugmodel: dim 256, 6 layers, 16 heads, FFN
768, vocab 2048, untied), seq 256, 4 samples per rank, no activation checkpointing, no compile,
one thread per rank, W&B and TensorBoard off on our side (TorchTitan logs neither by default).
Both sides' tokens/s are tokens over time across steps after the first `--warmup`.

    python benchmarks/vs_torchtitan.py                       # writes benchmarks/results/vs_torchtitan.*
    python benchmarks/vs_torchtitan.py --steps 8 --layouts 1proc --dtypes float32 --no-titan --out /tmp/b
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from recorded import provenance, save  # benchmarks/recorded.py

from meshforge.models.llama3.model import LlamaArgs, Transformer
from meshforge.run.observe.flops import flops_per_token, measure_cpu_matmul_flops
from meshforge.run.train.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]
DIMS = ["model.dim=256", "model.n_layers=6", "model.n_heads=16", "model.n_kv_heads=16"]
DIMS += ["model.vocab_size=2048", "model.multiple_of=256", "model.ffn_dim_multiplier=null"]
ARGS = LlamaArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, multiple_of=256, max_seq_len=1024)
SEQ, BATCH = 256, 4
# layout: (processes, our overrides, TorchTitan's flags)
LAYOUTS: dict[str, tuple[int, list[str], list[str]]] = {
    "1proc": (1, [], []),
    "fsdp2": (2, ["mesh.dp_shard=2"], ["--parallelism.data-parallel-shard-degree", "2"]),
    "tp2": (2, ["mesh.tp=2"], ["--parallelism.tensor-parallel-degree", "2"]),
    "pp2": (
        2,
        ["mesh.pp=2", "pp.schedule=1F1B", f"pp.microbatches={BATCH}"],
        ["--parallelism.pipeline-parallel-degree", "2", "--parallelism.pipeline-parallel-schedule", "1F1B"],
    ),
}


# --- (a) the model class, same loop -----------------------------------------------------


def titan_and_ours() -> tuple[torch.nn.Module, torch.nn.Module]:
    """TorchTitan's debugmodel (SDPA attention, as its CPU configs use) and ours, same weights."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs

    torch.manual_seed(0)
    cfg = llama3_configs["debugmodel"](attn_backend="flex")
    for layer in cfg.layers:  # flex attention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    titan = cfg.build()
    titan.init_states()
    ours = Transformer(ARGS)
    renamed = {  # TorchTitan 0.3.0 names: fused qkv module, lm_head for output
        k.replace("attention.qkv_linear.", "attention.").replace("lm_head.", "output."): v
        for k, v in titan.state_dict().items()
        if "rope.cache" not in k
    }
    ours.load_state_dict(renamed, strict=False)
    ours.init_buffers(torch.device("cpu"))
    return titan, ours


def model_level(rounds: int, steps: int) -> dict:
    torch.set_num_threads(1)
    titan, ours = titan_and_ours()
    data = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = data[:, :-1], data[:, 1:]
    times: dict[str, list[float]] = {"torchtitan": [], "meshforge": []}
    optims = {
        name: build_optimizer(m.parameters(), _adamw())
        for name, m in (("torchtitan", titan), ("meshforge", ours))
    }
    models = {"torchtitan": titan, "meshforge": ours}
    for _ in range(rounds):
        for name, model in models.items():
            opt = optims[name]
            for i in range(steps + 1):
                t0 = time.perf_counter()
                logits = model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i:  # the first step of a round warms up
                    times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "median_step_s": med,
        "ratio": med["torchtitan"] / med["meshforge"],
        "steps_timed": {k: len(v) for k, v in times.items()},
    }


def _adamw():
    from meshforge.configs.schema import OptimizerConfig

    return OptimizerConfig(lr=1e-4, weight_decay=0.0)


# --- (b) end to end ---------------------------------------------------------------------


def steady_rate(tps: list[float], warmup: int) -> float:
    """Tokens over time across the steps after `warmup` (equal tokens per step: harmonic mean)."""
    steady = tps[warmup:] or tps
    return len(steady) / sum(1 / t for t in steady)


def run_ours(layout: str, dtype: str, steps: int, warmup: int, out: Path, extra: tuple = ()) -> dict:
    nproc, mesh, _ = LAYOUTS[layout]
    name = "_".join([layout, dtype, *(e.replace(".", "-").replace("=", "-") for e in extra)])
    args = [
        str(REPO / "recipes" / "debug_cpu.toml"),
        "mesh.dp_replicate=1",
        "mesh.dp_shard=1",
        "mesh.tp=1",
        "mesh.pp=1",
        *mesh,
        *DIMS,
        f"train.seq_len={SEQ}",
        f"train.global_batch_size={BATCH * (2 if layout == 'fsdp2' else 1)}",
        f"train.micro_batch_size={BATCH}",
        "train.grad_accum_steps=1",
        "train.cpu_threads=1",
        f"train.steps={steps}",
        "activation_checkpoint.mode=none",
        f"fsdp.param_dtype={dtype}",
        "logging.wandb=false",
        "logging.tensorboard=false",
        "logging.progress=false",
        f"logging.warmup_steps={warmup}",
        "logging.memory_breakdown_step=0",  # TorchTitan tracks no step by category
        *extra,
        f"output_dir={out}",
        f"run_name={name}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    exe = Path(sys.executable).parent / "run_recipe"
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}

    summary = json.loads((out / name / "run.json").read_text())["summary"]
    return {
        "tokens_per_sec_per_device": summary["tokens_per_sec_per_device"],
        "matmul_fraction": summary.get("mfu"),
        "throughput_steps": summary["throughput_steps"],
        "checkpoint_step_overhead_s": summary.get("checkpoint_step_overhead_s"),
    }


def titan_workdir(shim: Path) -> Path:
    """The shim and its assets (tokenizer, dataset) in a cached folder, built once."""
    work = Path(tempfile.gettempdir()) / "meshforge_titan_bench"
    if not (work / "tests/assets/tokenizer/tokenizer.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        for f in shim.glob("*.py"):
            shutil.copy(f, work)
        (work / "tests/assets/c4_test").mkdir(parents=True, exist_ok=True)
        (work / "tests/assets/tokenizer").mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "make_assets.py"], cwd=work, check=True, capture_output=True)
    return work


def run_titan(
    layout: str, dtype: str, steps: int, warmup: int, work: Path, port: int, extra: tuple = ()
) -> dict:
    nproc, _, flags = LAYOUTS[layout]
    exe = Path(sys.executable).parent / "torchrun"
    cmd = [
        str(exe),
        "--nproc_per_node",
        str(nproc),
        "--master-port",
        str(port),
        "titan_cpu.py",
        "--module",
        "cpu_configs",
        "--config",
        "llama3_debugmodel_cpu_noac",
        "--parallelism.spmd-backend",
        "partial_dtensor",
        "--metrics.disable-color-printing",
        "--training.mixed-precision-param",
        dtype,
        "--training.steps",
        str(steps),
        "--training.seq-len",
        str(SEQ),
        "--training.local-batch-size",
        str(BATCH),
        "--dump-folder",
        f"out_{layout}_{dtype}",
        *flags,
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env)
    text = proc.stdout + proc.stderr
    per_step = {}
    for m in re.finditer(r"step:\s*(\d+).*?tps:\s*([\d,]+)", text):
        per_step[int(m.group(1))] = float(m.group(2).replace(",", ""))
    if proc.returncode != 0 or not per_step:
        return {"error": text[-1500:]}
    tps = [per_step[s] for s in sorted(per_step)]
    return {"tokens_per_sec_per_device": steady_rate(tps, warmup), "steps_logged": len(tps)}


def _median_row(repeats: list[dict]) -> dict:
    """Each side's median tokens/s per device over the repeats, and their ratio (the median of
    the per-repeat ratios, each taken from two runs made back to back)."""
    out: dict = {}
    for side in ("meshforge", "torchtitan"):
        runs = [r[side] for r in repeats if r[side] is not None]
        good = [r for r in runs if "error" not in r]
        if not runs:
            continue
        if not good:
            out[side] = runs[0]
            continue
        out[side] = {
            "tokens_per_sec_per_device": statistics.median(r["tokens_per_sec_per_device"] for r in good)
        }
    ratios = [
        r["meshforge"]["tokens_per_sec_per_device"] / r["torchtitan"]["tokens_per_sec_per_device"]
        for r in repeats
        if r["torchtitan"] and "error" not in r["torchtitan"] and "error" not in r["meshforge"]
    ]
    if ratios:
        out["ratio"], out["ratios"] = statistics.median(ratios), ratios
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out at the start, both sides")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--model-rounds", type=int, default=5, help="(a): alternating rounds of each model")
    p.add_argument("--repeats", type=int, default=2, help="(b): runs of each side per layout (median)")
    p.add_argument("--titan-shim", default=str(REPO.parent / "shared" / "titan_cpu"))
    p.add_argument("--no-titan", action="store_true", help="(b) without TorchTitan's trainer")
    p.add_argument("--no-checkpoints", action="store_true", help="skip (c), the checkpoint-step cost")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    a = p.parse_args()

    model = model_level(a.model_rounds, max(2, a.steps // 3))
    print(f"(a) model class, same loop: TorchTitan / meshforge step time = {model['ratio']:.3f}", flush=True)
    shim = Path(a.titan_shim)
    work = titan_workdir(shim) if not a.no_titan and (shim / "titan_cpu.py").is_file() else None
    flops = flops_per_token(ARGS, SEQ, sum(p.numel() for p in Transformer(ARGS).parameters()))
    rows, port = [], 29611
    with tempfile.TemporaryDirectory() as tmp:
        for layout in a.layouts.split(","):
            for dtype in a.dtypes.split(","):
                row = {"layout": layout, "dtype": dtype, "repeats": []}
                for _ in range(a.repeats):  # the two sides back to back, so the machine's drift hits both
                    ours = run_ours(layout, dtype, a.steps, a.warmup, Path(tmp))
                    port += 1
                    titan = run_titan(layout, dtype, a.steps, a.warmup, work, port) if work else None
                    row["repeats"].append({"meshforge": ours, "torchtitan": titan})
                row.update(_median_row(row["repeats"]))
                rows.append(row)
                print(_line(row), flush=True)
    peaks = add_matmul_fractions(rows, flops)

    checkpoints = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in () if a.no_checkpoints else ("false", "true"):
            extra = ("checkpoint.enabled=true", "checkpoint.interval=5", f"checkpoint.async_save={mode}")
            run = run_ours("fsdp2", "float32", a.steps, a.warmup, Path(tmp), extra)
            checkpoints["async" if mode == "true" else "sync"] = run.get("checkpoint_step_overhead_s")
    print(f"(c) checkpoint step overhead (s), fsdp2: {checkpoints}", flush=True)
    result = {
        **provenance(),
        "model_level": model,
        "end_to_end": rows,
        "matmul_peak_flops": peaks,
        "checkpoint_step_overhead_s": checkpoints,
        "settings": {"steps": a.steps, "warmup": a.warmup, "repeats": a.repeats},
    }
    md = render(result)
    save(Path(a.out), "vs_torchtitan", result, md)
    print("\n".join(md))
    return 0


def add_matmul_fractions(rows: list[dict], flops: float) -> dict[str, float]:
    """Each side's achieved FLOP/s as a fraction of this CPU's one-thread matmul rate in the
    row's compute dtype (measured here, after the runs; bf16 has its own rate)."""
    torch.set_num_threads(1)
    peaks = {d: measure_cpu_matmul_flops(dtype=getattr(torch, d)) for d in {r["dtype"] for r in rows}}
    for row in rows:
        for side in ("meshforge", "torchtitan"):
            if row.get(side) and "tokens_per_sec_per_device" in row[side]:
                row[side]["matmul_fraction"] = (
                    row[side]["tokens_per_sec_per_device"] * flops / peaks[row["dtype"]]
                )
    return peaks


def render(result: dict) -> list[str]:
    model, rows, s = result["model_level"], result["end_to_end"], result["settings"]
    peaks = ", ".join(f"{d} {v / 1e9:.1f} GFLOP/s" for d, v in result["matmul_peak_flops"].items())
    checkpoints = result["checkpoint_step_overhead_s"]
    md = [
        f"# meshforge vs TorchTitan 0.3.0 ({result['machine']['cpus']} CPUs, "
        f"torch {result['versions']['torch']}, {result['date']})",
        "",
        f"(a) model class in the same loop (median of {model['steps_timed']['meshforge']} steps each): "
        f"TorchTitan step / meshforge step = **{model['ratio']:.3f}**",
        "",
        f"(b) end to end, tokens/s per device over steps {s['warmup'] + 1}-{s['steps']} (tokens over time), "
        f"and the fraction of this CPU's one-thread matmul rate in the run's dtype ({peaks}); "
        f"median of {s['repeats']} runs a side; ratio: the median of the ratios of runs made back to back:",
        "",
        "| layout | dtype | meshforge tok/s/dev | matmul frac | TorchTitan tok/s/dev | matmul frac | ratio |",
        "|---|---|---|---|---|---|---|",
        *(_line(r) for r in rows),
    ]
    md += [
        "",
        "(c) what a checkpoint step costs beyond a steady step (fsdp2, fp32, every 5 steps): "
        + ", ".join(f"{k} {v:.3f} s" if v is not None else f"{k} -" for k, v in checkpoints.items()),
    ]
    return md


def _line(row: dict) -> str:
    def cell(side: dict | None) -> str:
        if not side:
            return "| - | - "
        if "error" in side:
            return f"| failed: {side['error'].strip().splitlines()[-1][:60]} | - "
        frac = side.get("matmul_fraction")
        return (
            f"| {side['tokens_per_sec_per_device']:,.0f} | {frac:.1%} "
            if frac
            else f"| {side['tokens_per_sec_per_device']:,.0f} | - "
        )

    ratio = f"{row['ratio']:.3f}x" if "ratio" in row else "-"
    return (
        f"| {row['layout']} | {row['dtype']} {cell(row['meshforge'])}{cell(row.get('torchtitan'))}| {ratio} |"
    )


if __name__ == "__main__":
    sys.exit(main())
