"""Recipe loading: TOML -> `extends` base -> dotted overrides -> OmegaConf structured merge.

Every problem is collected before anything fails, so a user fixes a recipe in one pass:
unknown keys come with "did you mean", wrong types with the expected type; such a key is left
at its default so that every other rule (meshforge.recipe, one layer up) still runs.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import time
import typing
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import tomli_w
import tomllib
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from meshforge.core.errors import Problem, RecipeError

from .schema import Recipe, sections


def embedded_recipes() -> dict[str, Path]:
    """Recipes shipped inside the package (the repo's recipes/ folder), by stem."""
    folder = resources.files("meshforge.recipes")
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".toml")}


def resolve_recipe_path(arg: str | None) -> Path:
    """A file path, or the name of an embedded recipe; None = the embedded default."""
    if arg is None:
        arg = "debug_cpu"
    path = Path(arg)
    if path.is_file():
        return path
    shipped = embedded_recipes()
    if path.stem in shipped and (path.suffix in ("", ".toml")) and not path.exists():
        return shipped[path.stem]
    hint = difflib.get_close_matches(path.stem, shipped, n=1)
    fix = f"did you mean {hint[0]}? " if hint else ""
    raise RecipeError(
        [Problem("recipe", arg, f"no such file; {fix}embedded recipes: {', '.join(sorted(shipped))}")],
        "recipe",
    )


def read_toml(path: Path, _seen: tuple[Path, ...] = ()) -> dict:
    """Read a recipe, merging it over its `extends` base (recursively, cycles refused)."""
    path = path.resolve()
    if path in _seen:
        raise RecipeError([Problem("extends", str(path), "recipes extend each other in a cycle")], str(path))
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise RecipeError([Problem("toml", str(path), f"not valid TOML: {e}")], str(path)) from None
    except UnicodeDecodeError as e:
        raise RecipeError(
            [
                Problem(
                    "toml",
                    str(path),
                    f"not UTF-8 text ({e.reason} at byte {e.start}): a recipe is a TOML text file",
                )
            ],
            str(path),
        ) from None
    anchor_paths(data, path.parent)
    base_name = data.pop("extends", None)
    if base_name is None:
        return data
    base_path = (path.parent / base_name) if not Path(base_name).is_absolute() else Path(base_name)
    if not base_path.is_file():
        raise RecipeError([Problem("extends", base_name, f"base recipe not found at {base_path}")], str(path))
    return _deep_merge(read_toml(base_path, _seen + (path,)), data)


# data paths written in a recipe file are relative to that file, so a recipe and its corpus travel
# together (the shipped text_cpu, a recipe beside its data); on the command line, to the cwd
RECIPE_RELATIVE = (("data", "path"), ("data", "tokenizer"), ("eval", "path"))


def anchor_paths(data: dict, folder: Path) -> None:
    """Make a recipe file's relative data paths absolute against its folder. A tokenizer that
    is not there stays as written: a hub id (`org/name`)."""
    for section, key in RECIPE_RELATIVE:
        value = data.get(section, {}).get(key) if isinstance(data.get(section), dict) else None
        if not isinstance(value, str) or value == "byte" or Path(value).expanduser().is_absolute():
            continue
        if key == "tokenizer" and not (folder / value).exists():
            continue
        data[section][key] = str(folder / value)


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_overrides(overrides: Sequence[str]) -> tuple[dict, list[Problem]]:
    """`train.steps=20 mesh.tp=2` -> nested dict (values parsed as YAML scalars)."""
    problems, good = [], []
    for o in overrides:
        if "=" not in o or o.startswith("="):
            problems.append(Problem("override", o, "expected key=value, e.g. train.steps=20"))
        else:
            good.append(o)
    parsed = OmegaConf.to_container(OmegaConf.from_dotlist(good))
    for o in good:  # a text field takes the text as written: YAML reads run_name=off as False, 1e3 as 1000.0
        key, _, text = o.partition("=")
        *path, leaf = key.split(".")
        parent = functools.reduce(lambda d, k: d[k], path, parsed)
        if _is_text_field(path, leaf) and parent[leaf] is not None and not isinstance(parent[leaf], str):
            parent[leaf] = text  # quoted text ('off') and null are YAML's to read
    return parsed, problems


def _is_text_field(path: list[str], leaf: str) -> bool:
    """Is the field at `path.leaf` (any depth: sweep.slurm.partition) a str or Optional[str] one?"""
    cls: Any = Recipe
    for name in path:
        hint = typing.get_type_hints(cls).get(name) if dataclasses.is_dataclass(cls) else None
        if hint is None or not dataclasses.is_dataclass(hint):
            return False
        cls = hint
    return typing.get_type_hints(cls).get(leaf) in (str, str | None)


def check_keys_and_types(raw: dict) -> list[Problem]:
    """Unknown sections/keys (with a suggestion) and values of the wrong type."""
    problems: list[Problem] = []
    secs = sections()
    top_fields = {f.name: f for f in dataclasses.fields(Recipe)}
    for key, value in raw.items():
        if key not in top_fields:
            problems.append(_unknown(key, value, list(top_fields)))
        elif key in secs:
            if not isinstance(value, dict):
                problems.append(Problem(key, value, f"[{key}] is a section: write it as a TOML table"))
                continue
            cls = secs[key]
            names = [f.name for f in dataclasses.fields(cls)]
            for k, v in value.items():
                if k not in names:
                    problems.append(_unknown(f"{key}.{k}", v, names, prefix=f"{key}."))
                else:
                    problems += _check_type(cls, k, v, f"{key}.{k}")
        else:
            problems += _check_type(Recipe, key, value, key)
    return problems


def _unknown(name: str, value: Any, choices: list[str], prefix: str = "") -> Problem:
    leaf = name.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, choices, n=1, cutoff=0.6)
    hint = f"did you mean {prefix}{close[0]}?" if close else f"valid keys: {', '.join(choices)}"
    return Problem(name, value, f"unknown key; {hint}")


@functools.cache
def _schema(cls: type):
    """The section's structured config, built once (merge copies it: it is never changed)."""
    return OmegaConf.structured(cls)


def _check_type(cls: type, key: str, value: Any, name: str) -> list[Problem]:
    try:
        OmegaConf.merge(_schema(cls), {key: value})
        return []
    # OmegaConf's own errors about the value, and its TypeError for a table given where a list
    # goes (or a list for a table); anything else is a bug and keeps its traceback
    except (OmegaConfBaseException, TypeError):
        hint = typing.get_type_hints(cls)[key]
        plain = (
            getattr(hint, "__name__", None) if not typing.get_args(hint) else None
        )  # List[float], not List
        expected = plain or str(hint).replace("typing.", "")
        return [Problem(name, value, f"wrong type: expected {expected}")]


@dataclasses.dataclass(frozen=True)
class RecipeSource:
    """A recipe file read once (merged over its `extends` base): the variants a sweep, a tune or
    an estimate tries are this and their own overrides, not the file read again per variant."""

    path: Path
    raw: dict

    @classmethod
    def read(cls, path_or_name: str | Path | None) -> RecipeSource:
        """The file at a path, or the embedded recipe of that name (None: the default)."""
        path = resolve_recipe_path(None if path_or_name is None else str(path_or_name))
        return cls(path, read_toml(path))


RecipeLike = str | Path | RecipeSource | None  # a path, an embedded recipe's name, or one read already


def load_config(path_or_name: RecipeLike, overrides: Sequence[str] = ()) -> tuple[Recipe, Path]:
    """The recipe file merged over the schema's defaults, with `overrides` applied, and its
    path. Checks keys and types only; raises RecipeError listing every problem."""
    recipe, path, problems = read_config(path_or_name, overrides)
    if problems:
        raise RecipeError(problems, str(path))
    return recipe, path


def read_config(
    path_or_name: RecipeLike, overrides: Sequence[str] = ()
) -> tuple[Recipe, Path, list[Problem]]:
    """The recipe, its path and the problems of its keys and types: a key that is unknown or of
    the wrong type is left at its default, so the rules across fields still run on the rest and
    a user sees every problem in one pass."""
    source = path_or_name if isinstance(path_or_name, RecipeSource) else RecipeSource.read(path_or_name)
    path = source.path
    over, problems = parse_overrides(overrides)
    recipe, typing_problems = _typed(_deep_merge(source.raw, over))
    if recipe.run_name is None:
        recipe.run_name = f"{path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    return recipe, path, problems + typing_problems


# A launch loads its recipe twice (whether it forks local ranks, then the recipe itself), and the
# checks and OmegaConf merge cost ~65 ms here: the last 16 merged TOMLs (keyed by repr, so types
# count) are checked and typed once per process, each caller getting its own deep copy.
_TYPED: dict[str, tuple[Recipe, list[Problem]]] = {}
_TYPED_KEPT = 16


def _typed(raw: dict) -> tuple[Recipe, list[Problem]]:
    """A copy of the recipe `raw` (merged TOML) describes, with its unknown keys and values of
    the wrong type left out (at their defaults), and those keys' problems."""
    key = repr(raw)
    if key not in _TYPED:
        problems = check_keys_and_types(raw)
        if len(_TYPED) >= _TYPED_KEPT:
            del _TYPED[next(iter(_TYPED))]  # the oldest
        typed = OmegaConf.to_object(OmegaConf.merge(_schema(Recipe), _without(raw, problems)))
        _TYPED[key] = (typed, problems)
    recipe, problems = _TYPED[key]
    return copy.deepcopy(recipe), list(problems)


def _without(raw: dict, problems: list[Problem]) -> dict:
    """`raw` less every key a problem names (`train.seq_len`, `[train]`, an unknown key)."""
    out = copy.deepcopy(raw)
    for p in problems:
        *parents, leaf = p.field.split(".")
        table = functools.reduce(lambda d, k: d.get(k, {}) if isinstance(d, dict) else {}, parents, out)
        if isinstance(table, dict):
            table.pop(leaf, None)
    return out


def recipe_to_dict(recipe: Recipe) -> dict:
    """Plain nested dict (for run.json, W&B config)."""
    return dataclasses.asdict(recipe)


def recipe_to_toml(recipe: Recipe) -> str:
    """The recipe as TOML that loads back to the same recipe (`--print-config`, `<run>/recipe.toml`).
    TOML has no null: a None field is left out, which loads back as its default, None."""
    return tomli_w.dumps(_drop_none(recipe_to_dict(recipe)))


def _drop_none(d: dict) -> dict:
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}
