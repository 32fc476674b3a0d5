"""`meshforge parity`: the torch model vs its JAX twin on the same tokens."""

from __future__ import annotations

import copy
from pathlib import Path

from rich.console import Console
from rich.table import Table

from meshforge.configs import Recipe
from meshforge.jax.bridge import run_parity, sharpen
from meshforge.models import args_from_config, get_model_spec
from meshforge.run.checkpoint.dcp import load_full_model
from meshforge.run.data.loader import build_loader


def print_parity(
    recipe: Recipe,
    checkpoint: Path | None,
    dtype: str,
    sharpen_by: float | None,
    samples: int,
    seq_len: int,
    console: Console,
) -> bool:
    """Compare logits (max |dlogit|, mean KL, top-1) of a checkpoint's model, or of the
    recipe's freshly initialised one, with the JAX twin's; True when within targets."""
    if checkpoint is not None:
        model, margs, _ = load_full_model(checkpoint)
        what = f"checkpoint {checkpoint}"
    else:
        margs = args_from_config(recipe.model)
        model = get_model_spec(recipe.model.name).build(margs)
        model.init_weights(recipe.seed)
        what = f"{recipe.model.name}/{recipe.model.flavor} freshly initialised (seed {recipe.seed})"
    factor = sharpen_by if sharpen_by is not None else (1.0 if checkpoint is not None else 8.0)
    if factor != 1.0:
        sharpen(model, factor)
        what += f", attention/output weights x{factor:g}"
    sample = copy.deepcopy(recipe)
    sample.train.seq_len = min(seq_len, margs.max_seq_len)
    loader = build_loader(sample, margs.vocab_size, micro=samples)
    tokens = loader.next_step()[0].inputs
    loader.close()
    result = run_parity(model.eval(), margs, tokens, dtype)
    ok = result.within(dtype)
    table = Table(title=f"parity torch vs JAX ({dtype}): {what}; {tokens.numel()} tokens")
    for c in ("metric", "value", "target"):
        table.add_column(c)
    fp32 = dtype == "float32"
    table.add_row("max |dlogit|", f"{result.max_abs_logit_diff:.3g}", "<= 1e-4" if fp32 else "")
    table.add_row("mean KL", f"{result.mean_kl:.3g}", "<= 1e-6" if fp32 else "<= 2e-3")
    table.add_row("top-1 agreement", f"{result.top1_agreement:.4f}", "" if fp32 else ">= 0.95")
    console.print(table)
    console.print("[green]parity: within targets[/]" if ok else "[bold red]parity: outside targets[/]")
    return ok
