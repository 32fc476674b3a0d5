"""The corpus loader alone: tokens/s one rank reads, tokenizes and packs from local jsonl and
parquet (text_cpu's shipped corpus and BPE tokenizer), against what training consumes: the
text_cpu recipe measured here, and llm_1b on an 8 x H100 node from its FLOP count.

The loader must never be the bottleneck: its margin is loader tokens/s per rank over the
training step's tokens/s per rank. (It runs on its own thread beside the step, so the margin
is what matters, not the sum.) For llm_1b the tokenizer would be Llama 3's (128K vocabulary,
not shipped): a larger BPE vocabulary costs somewhat more per token, so its margin is an
upper bound of the order, stated with that caveat.

    python benchmarks/loader_throughput.py                      # writes benchmarks/results/
    python benchmarks/loader_throughput.py --tokens 20000 --no-train --out /tmp/l   # smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from recorded import provenance, save  # benchmarks/recorded.py

from meshforge.recipe import load_recipe
from meshforge.run.data.loader import build_loader
from meshforge.run.observe.flops import flops_per_token
from meshforge.run.rank.plan import make_plan

REPO = Path(__file__).resolve().parents[1]
TEXT_CPU = REPO / "recipes" / "text_cpu.toml"
H100_BF16 = 989.4e12  # dense bf16 FLOP/s (SXM)
MFU = 0.5  # a generous utilisation: the faster the step, the more the loader must keep up


def loader_rate(recipe, tokens: int) -> float:
    """Tokens/s one rank hands out (read + tokenize + pack + shuffle)."""
    loader = build_loader(recipe, recipe.model.vocab_size or 2048)
    per_step = recipe.train.micro_batch_size * recipe.train.grad_accum_steps * recipe.train.seq_len
    loader.next_step()  # opening the stream is a one-off
    start, done = time.perf_counter(), 0
    while done < tokens:  # nothing else runs: each call waits for the step its thread is building
        loader.next_step()
        done += per_step
    elapsed = time.perf_counter() - start
    loader.close()
    return done / elapsed


def as_parquet(src: Path, out: Path) -> Path:
    for f in sorted(src.glob("*.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        pq.write_table(pa.Table.from_pylist(rows), out / f"{f.stem}.parquet")
    return out


def train_rate(steps: int, out: Path) -> float:
    """text_cpu's steady tokens/s per rank (its 2 processes on this machine)."""
    cmd = [sys.executable, "-m", "meshforge.cli", str(TEXT_CPU), f"train.steps={steps}", "eval.every=0"]
    cmd += [f"output_dir={out}", "logging.wandb=false", "logging.tensorboard=false", "logging.progress=false"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=900)
    summary = json.loads((out / "text_cpu" / "run.json").read_text())["summary"]
    return summary["tokens_per_sec_per_device"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2_000_000, help="tokens to read per measurement")
    p.add_argument("--train-steps", type=int, default=40)
    p.add_argument("--no-train", action="store_true", help="skip the text_cpu training measurement")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args()
    corpus = REPO / "recipes" / "corpora" / "pydocs" / "train"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        parquet = as_parquet(corpus, Path(tmp))
        for fmt, path in (("jsonl", corpus / "*.jsonl"), ("parquet", parquet / "*.parquet")):
            for seq_len, shuffle in ((128, 0), (128, 64), (2048, 0)):
                over = [f"data.path={path}", f"train.seq_len={seq_len}", f"data.shuffle_windows={shuffle}"]
                over += [
                    "mesh.dp_shard=1",
                    "train.micro_batch_size=8",
                    "train.global_batch_size=8",
                    "eval.every=0",
                    "model.max_seq_len=4096",
                ]
                recipe = load_recipe(TEXT_CPU, over, world_size=1)
                rate = loader_rate(recipe, args.tokens)
                rows.append(
                    {"format": fmt, "seq_len": seq_len, "shuffle_windows": shuffle, "tokens_per_sec": rate}
                )
                print(
                    f"{fmt:8s} seq {seq_len:5d} shuffle {shuffle:3d}: {rate:,.0f} tokens/s per rank",
                    flush=True,
                )
        train = None if args.no_train else train_rate(args.train_steps, Path(tmp))
    slowest = min(r["tokens_per_sec"] for r in rows)
    llm = load_recipe(REPO / "recipes" / "llm_1b.toml", world_size=8)
    plan = make_plan(llm)
    need = H100_BF16 * MFU / flops_per_token(plan.args, llm.train.seq_len, plan.n_params)
    result = {
        **provenance(),
        "tokens_per_measurement": args.tokens,
        "rows": rows,
        "text_cpu_train_tokens_per_sec_per_rank": train,
        "text_cpu_margin": None if train is None else slowest / train,
        "llm_1b_h100_tokens_per_sec_per_gpu_at_mfu": {"mfu": MFU, "tokens_per_sec": need},
        "llm_1b_margin": slowest / need,
    }
    md = [
        "# Corpus loader throughput (one rank, its own thread)",
        "",
        "| format | seq_len | shuffle_windows | tokens/s per rank |",
        "|---|---|---|---|",
        *(
            f"| {r['format']} | {r['seq_len']} | {r['shuffle_windows']} | {r['tokens_per_sec']:,.0f} |"
            for r in rows
        ),
        "",
    ]
    if train is not None:
        md.append(
            f"text_cpu trains {train:,.0f} tokens/s per rank here: the slowest loader row has "
            f"{slowest / train:,.0f}x that."
        )
    md.append(
        f"llm_1b on H100 at MFU {MFU}: {need:,.0f} tokens/s per GPU from its FLOP count; the slowest "
        f"loader row is {slowest / need:.1f}x that (with text_cpu's 2K-vocabulary BPE; Llama 3's 128K "
        "one costs more per token)."
    )
    save(args.out, "loader_throughput", result, md)
    print("\n".join(md[-2:]))


if __name__ == "__main__":
    main()
