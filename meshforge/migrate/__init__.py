"""Other systems' configs in: a DeepSpeed JSON or a TorchTitan 0.2 TOML job file -> a recipe.

`import_config` maps what maps, writes down how it approximated what it approximated, lists
every key that did not carry over, validates the result as a recipe for the world size, and
writes it only when nothing the file asks for is beyond meshforge (or the user allows it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import tomllib
import torch

from meshforge.configs import RecipeError, load_config, resolve_recipe_path
from meshforge.configs.schema import ModelConfig
from meshforge.core.errors import UsageError
from meshforge.migrate.deepspeed import from_deepspeed
from meshforge.migrate.report import Imported
from meshforge.migrate.torchtitan import from_torchtitan, torchtitan_families
from meshforge.models import MODELS, args_from_config, get_model_spec
from meshforge.recipe import load_recipe

DEEPSPEED_KEYS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "zero_optimization",
    "fp16",
    "bf16",
    "optimizer",
)
TORCHTITAN_SECTIONS = ("job", "model", "training", "parallelism", "optimizer", "lr_scheduler")


class ImportRefused(UsageError):
    """The file asks for what meshforge cannot do; nothing was written (exit 2)."""

    def __init__(self, imported: Imported):
        self.imported = imported
        super().__init__(
            f"{len(imported.unsupported)} key(s) of the {imported.system} config ask for what meshforge "
            "cannot do (listed above); no recipe written. Remove them, or pass --allow-unmapped to write "
            "the recipe without them"
        )


def read_source(path: Path) -> tuple[str, dict]:
    """The file's system ("deepspeed" or "torchtitan") and its contents."""
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} is not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
        kind, known = "deepspeed", DEEPSPEED_KEYS
    elif path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise UsageError(f"{path} is not TOML ({e})") from None
        kind, known = "torchtitan", TORCHTITAN_SECTIONS
    else:
        raise UsageError(f"{path}: a DeepSpeed config ends in .json, a TorchTitan job file in .toml")
    if not isinstance(data, dict) or not any(key in data for key in known):
        what = "a DeepSpeed config" if kind == "deepspeed" else "a TorchTitan job file"
        raise UsageError(
            f"{path} does not look like {what}: it has none of {', '.join(known)} at the top level"
        )
    return kind, data


def import_config(
    source: Path,
    out: Path,
    world: int | None,
    model: str | None = None,
    base: str | None = None,
    allow_unmapped: bool = False,
) -> Imported:
    """Map `source` to a recipe at `out` (validated for `world` ranks); returns what was mapped.

    Raises ImportRefused (nothing written) when a key asks for what meshforge cannot do,
    unless `allow_unmapped`; RecipeError when the mapped recipe does not validate.
    """
    kind, data = read_source(source)
    base_path = resolve_recipe_path(base) if base else None
    model_cfg = _model_config(model, base_path)
    if kind == "deepspeed":
        if world is None:
            raise UsageError("a DeepSpeed config does not say how many GPUs: pass --world N")
        if model_cfg is None:
            raise UsageError("a DeepSpeed config names no model: pass --model llama3:8b or --base llm_8b")
        experts = getattr(args_from_config(model_cfg), "num_experts", None)
        imported = from_deepspeed(data, world, block_weights(model_cfg), experts)
    else:
        flavors = {spec.name: spec.flavors for spec in torchtitan_families().values()}
        imported = from_torchtitan(data, world, flavors)
    if model is not None:  # the user's model wins over a TorchTitan file's (DeepSpeed's has router keys)
        if kind == "torchtitan":
            for key in [k for k in imported.values if k.startswith("model.") and k != "model.max_seq_len"]:
                del imported.values[key]
        imported.values["model.name"], imported.values["model.flavor"] = model_cfg.name, model_cfg.flavor
    imported.values.setdefault("run_name", source.stem)
    if imported.unsupported and not allow_unmapped:
        raise ImportRefused(imported)
    out.parent.mkdir(parents=True, exist_ok=True)
    extends = None
    if base_path is not None:  # a file the user named: relative to the recipe; a shipped one: absolute
        given = Path(base).is_file()
        extends = (
            os.path.relpath(base_path.resolve(), out.parent.resolve()) if given else str(base_path.resolve())
        )
    text = imported.toml(
        f"Imported from {source.name} ({imported.system}) by `meshforge import-config`", extends
    )
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    try:
        load_recipe(tmp, world_size=world)
    except RecipeError as e:
        tmp.unlink()
        e.source = f"the recipe imported from {source}"
        raise
    tmp.replace(out)
    return imported


def _model_config(model: str | None, base: Path | None) -> ModelConfig | None:
    """`--model family:flavor`, else the base recipe's model, else None."""
    if model is not None:
        name, _, flavor = model.partition(":")
        if not flavor:
            raise UsageError(f"--model {model}: write family:flavor, e.g. llama3:8b")
        if name not in MODELS:
            raise UsageError(f"--model {model}: no model family {name!r}; families: {', '.join(MODELS)}")
        if flavor not in (flavors := MODELS[name].flavors):
            raise UsageError(
                f"--model {model}: {name} has no flavor {flavor!r}; flavors: {', '.join(flavors)}"
            )
        return ModelConfig(name=name, flavor=flavor)
    if base is not None:
        recipe, _ = load_config(base, ())
        return recipe.model
    return None


def block_weights(model_cfg: ModelConfig) -> tuple[float, float]:
    """The embedding's and the norm + output's parameters, in units of one block's."""
    spec = get_model_spec(model_cfg.name)
    with torch.device("meta"):
        m = spec.build(args_from_config(model_cfg))
    block = sum(p.numel() for p in m.layers["0"].parameters())
    head = sum(p.numel() for p in m.norm.parameters()) + (
        0 if m.args.tie_embeddings else m.output.weight.numel()
    )
    return m.tok_embeddings.weight.numel() / block, head / block
