"""Weights across formats: seed checkpoints (`meshforge init` / `import`) and exports
(`meshforge export --to safetensors|hf|torchtitan|jax|maxtext`). The family's weight adapter
(models/<family>/adapter.py) knows its names and row layouts; JAX formats need the `jax` extra."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshforge.configs import Recipe, recipe_to_dict
from meshforge.core.errors import IncompatibleWeights
from meshforge.core.files import save_safetensors
from meshforge.interop.weights import ArrayReader, WeightReader, hf_reader_for, load_into
from meshforge.models import args_from_config, get_model_spec, spec_of
from meshforge.models.common.hf_names import save_hf_shards
from meshforge.run.checkpoint.dcp import (
    SafeFileSystemReader,
    dcp_load,
    load_full_model,
    model_args_of,
    read_meta,
    save_seed_checkpoint,
)


def load_torchtitan_dcp(model: nn.Module, path: Path) -> None:
    """Fill `model` in place from a TorchTitan DCP checkpoint (its 0.3.0 or classic names,
    flat or under "model."): DCP reads straight into our parameters, no second copy."""
    adapter = spec_of(model.args).adapter
    ours = dict(model.named_parameters())
    metadata = SafeFileSystemReader(str(path)).read_metadata()
    state, found = {}, set()
    for key, meta in metadata.state_dict_metadata.items():
        name = adapter.name_from_torchtitan(key.removeprefix("model."))
        if name not in ours or not isinstance(meta, TensorStorageMetadata):
            continue  # optimizer, dataloader, RoPE cache, ...
        if tuple(meta.size) != tuple(ours[name].shape):
            raise IncompatibleWeights(
                f"{key}: the checkpoint holds {tuple(meta.size)}, the recipe's model "
                f"{tuple(ours[name].shape)}; set model.* to match"
            )
        state[key] = ours[name].data
        found.add(name)
    missing = set(ours) - found
    if missing:
        raise IncompatibleWeights(f"the TorchTitan checkpoint {path} lacks {sorted(missing)[:4]}")
    dcp_load(state, path)


def import_weights(model: nn.Module, source: Path, fmt: str) -> None:
    """Fill an unsharded model from `source` in format hf | torchtitan | safetensors | jax |
    maxtext (checking shapes, and for HF the config, against the model)."""
    args = model.args
    model.init_buffers()  # before the weights: a family's weight buffers are read with them
    if fmt == "hf":
        load_into(model, hf_reader_for(source, args))
    elif fmt == "torchtitan" and (source / ".metadata").is_file():
        load_torchtitan_dcp(model, source)
    elif fmt in ("torchtitan", "safetensors"):
        load_into(model, WeightReader(source, args, "torchtitan" if fmt == "torchtitan" else "ours"))
    elif fmt == "maxtext":
        from meshforge.jax.maxtext import from_maxtext, load_maxtext  # the jax extra

        state = from_maxtext(load_maxtext(source), args)
        load_into(model, ArrayReader(state, f"the MaxText checkpoint at {source}"))
    else:
        from meshforge.jax.bridge import load_pytree  # the jax extra

        folder = source / "params" if (source / "params").is_dir() else source
        load_into(model, ArrayReader(load_pytree(folder), f"the JAX pytree at {folder}"))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def export_checkpoint(
    checkpoint: Path, out: Path, to: str = "safetensors", max_shard_bytes: int | None = None
) -> Path:
    """A checkpoint's model, unsharded, as `to`: safetensors (our names + config.json),
    hf (an HF folder for the family's ForCausalLM, read one tensor at a time and written as
    shards of at most `max_shard_bytes` with the HF index, the run's tokenizer beside it),
    torchtitan (its 0.3.0 names), jax (an Orbax checkpoint of the flat pytree the
    family's JAX twin takes) or maxtext (the parameter checkpoint MaxText's decoder loads:
    jax/maxtext.py)."""
    out.mkdir(parents=True, exist_ok=True)
    if to == "hf":
        return export_hf(checkpoint, out, max_shard_bytes)
    model, args, meta = load_full_model(checkpoint)
    adapter = spec_of(args).adapter
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    del model  # `tensors` holds the only references: a consuming conversion frees as it goes
    if args.tie_embeddings:
        tensors.pop("output.weight")  # shared with tok_embeddings.weight; stored once
    if to == "maxtext":
        from meshforge.jax.maxtext import maxtext_config, save_maxtext, to_maxtext  # the jax extra

        arrays = {k: v.float().numpy() for k, v in tensors.items()}
        return save_maxtext(to_maxtext(arrays, args), out, maxtext_config(args))
    if to == "jax":
        from meshforge.jax.bridge import save_pytree, state_to_pytree  # the jax extra

        save_pytree(state_to_pytree(tensors, consume=True), out / "params")
    else:
        if to == "torchtitan":
            tensors = adapter.to_torchtitan(tensors)
        save_safetensors(
            tensors, out / "model.safetensors", metadata={"format": "pt", "step": str(meta["step"])}
        )
    (out / "config.json").write_text(
        json.dumps({"model": meta["recipe"]["model"], "args": vars(args)}, indent=1)
    )
    return out / ("params" if to == "jax" else "model.safetensors")


def export_hf(checkpoint: Path, out: Path, max_shard_bytes: int | None = None) -> Path:
    """An HF folder from a DCP checkpoint with no whole model in host memory: each tensor is
    read alone, renamed (and for Llama its q/k rows permuted), and written into the current
    shard; at most one shard is held. The run's tokenizer files are copied beside it."""
    meta = read_meta(checkpoint)
    args = model_args_of(meta)
    adapter = spec_of(args).adapter
    metadata = SafeFileSystemReader(str(checkpoint)).read_metadata()
    keys = [
        k
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    ]

    def pairs():
        for key in keys:
            m = metadata.state_dict_metadata[key]
            t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            dcp_load({key: t}, checkpoint)
            converted = adapter.tensor_to_hf(key.removeprefix("model."), t, args)
            if converted is not None:
                yield converted

    dtype = str(metadata.state_dict_metadata[keys[0]].properties.dtype).removeprefix("torch.")
    kw = {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}
    save_hf_shards(pairs(), adapter.hf_config(args, dtype), out, **kw)
    tokenizer = meta["recipe"]["data"].get("tokenizer")
    if tokenizer and tokenizer != "byte" and Path(tokenizer).exists():  # a tokenizer.json or its folder
        folder = Path(tokenizer) if Path(tokenizer).is_dir() else Path(tokenizer).parent
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                shutil.copyfile(folder / name, out / name)
    return out


def write_seed(recipe: Recipe, out: Path, source: Path | None = None, fmt: str | None = None) -> Path:
    """A seed checkpoint of the recipe's model: its own initial weights, or (source) weights
    imported from another format. Any mesh starts from it with checkpoint.init_from=OUT."""
    with torch.device("cpu"):
        model = get_model_spec(recipe.model.name).build(args_from_config(recipe.model))
    meta = {
        "recipe": recipe_to_dict(recipe),
        "seed": recipe.seed,
        "model_args": dataclasses.asdict(model.args),
    }
    if source is None:
        model.init_weights(seed=recipe.seed)
    else:
        import_weights(model, source, fmt)
        meta.update(imported_from=str(source), format=fmt)
    return save_seed_checkpoint(model, out, meta)
