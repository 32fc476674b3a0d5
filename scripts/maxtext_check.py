"""Does MaxText compute what meshforge computes from a `meshforge export --to maxtext` checkpoint?

Two halves, in two environments (MaxText needs Python >= 3.12; meshforge runs on 3.11):

    # 1. meshforge's environment: a seed of the recipe's model (block weights x10 and norms off 1,
    #    so a wrong RoPE layout or a missing query scale moves the logits by far more than 1e-4),
    #    exported, with our logits on fixed tokens beside it
    python scripts/maxtext_check.py prepare debug_cpu /tmp/mt [key=value ...]
    # 2. MaxText's environment (scripts/maxtext_venv.sh makes one): its own decoder loads the
    #    checkpoint (load_parameters_path) and runs the same tokens
    /work/maxtext-venv/bin/python scripts/maxtext_check.py run /tmp/mt

`run` checks that every array MaxText loaded equals the exported one (its loader would reshape a
misfit silently) and that its logits are within 1e-4 of ours (fp32); exit 0 when both hold.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

TOLERANCE = 1e-4
TOKENS = 16  # positions compared (MaxText's max_target_length)


def prepare(recipe_name: str, out: Path, overrides: list[str]) -> None:
    import numpy as np
    import torch

    from meshforge.configs.loader import resolve_recipe_path
    from meshforge.convert import export_checkpoint, write_seed
    from meshforge.recipe import load_recipe
    from meshforge.run.checkpoint.dcp import load_full_model, save_seed_checkpoint

    one_process = ["mesh.pp=1", "mesh.dp_shard=1", "mesh.tp=1", "mesh.dp_replicate=1", "mesh.cp=1"]
    recipe = load_recipe(resolve_recipe_path(recipe_name), [*one_process, *overrides], world_size=1)
    seed = write_seed(recipe, out / "seed")
    model, args, _ = load_full_model(seed)
    with torch.no_grad():  # a sensitive check: attention far from uniform, norms that matter
        gen = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if name.startswith("layers."):
                p.mul_(10.0) if p.dim() > 1 else p.add_(torch.rand(p.shape, generator=gen) - 0.5)
    sensitive = save_seed_checkpoint(model, out / "sensitive", json.loads((seed / "meta.json").read_text()))
    items = export_checkpoint(sensitive, out / "maxtext", "maxtext")
    tokens = torch.randint(0, args.vocab_size, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).float().numpy()
    np.savez(out / "reference.npz", tokens=tokens.numpy(), logits=logits)
    print(f"prepared {items} and {out / 'reference.npz'} ({recipe.model.name}, {args.n_layers} layers)")


def run(out: Path) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from flax import nnx
    from maxtext.configs import pyconfig
    from maxtext.utils import model_creation_utils

    jax.config.update("jax_default_matmul_precision", "highest")
    reference = np.load(out / "reference.npz")
    tokens, ours = reference["tokens"], reference["logits"]
    config = json.loads((out / "maxtext" / "maxtext_config.json").read_text())
    items = (out / "maxtext" / "0" / "items").absolute()
    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    cfg = pyconfig.initialize(
        [sys.argv[0], base],
        **config,
        run_name="meshforge_check",
        base_output_directory=str(out / "maxtext_run"),
        hardware="cpu",
        skip_jax_distributed_system=True,
        enable_checkpointing=False,
        per_device_batch_size=tokens.shape[0],
        max_target_length=tokens.shape[1],
        max_prefill_predict_length=4,
        dtype="float32",
        weight_dtype="float32",
        matmul_precision="highest",
        attention="dot_product",
        enable_dropout=False,
        load_parameters_path=str(items),
    )
    model, _ = model_creation_utils.from_pretrained(cfg)
    held = {
        "/".join(map(str, p)): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    saved = ocp.PyTreeCheckpointer().restore(items)["params"]["params"]
    exported = {
        "/".join(k.key for k in p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(saved)
    }
    unequal = [k for k in exported if k not in held or not np.array_equal(held[k], exported[k])]
    batch, length = tokens.shape
    logits = model(
        decoder_input_tokens=jnp.asarray(tokens, jnp.int32),
        decoder_positions=jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length)),
        decoder_segment_ids=jnp.ones((batch, length), jnp.int32),
        enable_dropout=False,
    )
    diff = float(np.abs(np.asarray(logits) - ours).max())
    ok = not unequal and diff <= TOLERANCE
    print(
        json.dumps(
            {
                "arrays": len(exported),
                "arrays_loaded_unequal": unequal,
                "max_abs_logit_diff": diff,
                "max_abs_logit": float(np.abs(ours).max()),
                "tolerance": TOLERANCE,
                "ok": ok,
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or ["--help"]
    if command == "prepare" and len(rest) >= 2:
        prepare(rest[0], Path(rest[1]), rest[2:])
    elif command == "run" and len(rest) == 1:
        sys.exit(run(Path(rest[0])))
    else:
        sys.exit(__doc__)
