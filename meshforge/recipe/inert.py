"""Settings a choice makes inert, refused when they are set: a value that is accepted and
then not read would let a recipe say one thing and train another.

Refused here (set to anything but the default): what the chosen data source does not read,
loss-scale settings without fp16 compute, `selective_every` without selective checkpointing,
`op_save` without per-op checkpointing, `memory_budget` without its mode.
Left alone, with the reason in the field's doc (`meshforge explain`): settings of a switch
that is off (eval.every = 0, checkpoint.enabled = false, logging.wandb = false, compile off)
and policies of a mesh dimension of degree 1 (tp.*, pp.*, FSDP's with one data-parallel
rank): a recipe keeps them so one field (or a sweep's mesh) turns them on, and unread they
change no number.
"""

from __future__ import annotations

import dataclasses
from pathlib import PurePath

from meshforge.configs import Recipe
from meshforge.configs.activation_checkpoint import READ_BY, ac_policy
from meshforge.configs.training import OPTIMIZER_READS
from meshforge.core.errors import Problem

# a local file's suffix -> the HF datasets builder that reads it (one owner: the corpus reader uses it)
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".md": "text"}

# data.source -> (the DataConfig fields it does not read, why)
UNREAD_BY_SOURCE = {
    "synthetic": (
        ("path", "format", "text_sample_by", "hf_dataset", "hf_config", "split", "text_column", "tokenizer")
        + ("shuffle_windows",),
        "the synthetic source draws token ids itself: no files, dataset, split, column, tokenizer "
        "or window shuffle",
    ),
    "files": (
        ("hf_dataset", "hf_config", "split", "markov_branching"),
        "local files have no hub dataset, config or split, and no Markov source",
    ),
    "hf": (
        ("path", "format", "text_sample_by", "markov_branching"),
        "a hub dataset has no local files, format or plain-text sampling, and no Markov source",
    ),
}


# the policy sections a mesh dimension of degree 1 leaves unread, every field of them (each field's
# doc says so; tests/experiments/test_sweep_compare.py holds them to it): a sweep does not cross
# them with such a mesh, which would run the same point again under another name
UNREAD_AT_DEGREE_1 = {"pp": "pp.", "tp": "tp.", "cp": "cp."}


def unread_on_mesh(key: str, mesh: dict[str, int]) -> bool:
    """Whether the recipe field `key` ("pp.schedule") is a policy of a dimension `mesh` gives degree 1."""
    return any(
        key.startswith(section) and mesh.get(dim, 1) == 1 for dim, section in UNREAD_AT_DEGREE_1.items()
    )


def unread_problems(section: str, cfg, names, why: str, fix: str) -> list[Problem]:
    """A Problem for each of `names` in `cfg` set to other than its schema default."""
    defaults = type(cfg)()
    return [
        Problem(
            f"{section}.{name}",
            getattr(cfg, name),
            f"is not read: {why}; set {section}.{name}={as_override(getattr(defaults, name))} (its "
            f"default) or {fix}",
        )
        for name in names
        if getattr(cfg, name) != getattr(defaults, name)
    ]


def as_override(value) -> str:
    """A value as a command-line override spells it (null, true, 1.0, byte)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def file_format(path: str | None, fmt: str | None) -> str | None:
    """The builder local files are read with: data.format, else the glob's suffix (None if unknown)."""
    return fmt or (FILE_FORMATS.get(PurePath(path).suffix) if path else None)


def check_inert(r: Recipe) -> list[Problem]:
    """Every setting the recipe's own choices leave unread (see the module doc)."""
    d = r.data
    problems = []
    if d.source in UNREAD_BY_SOURCE:  # an unknown source is check_enums'
        names, why = UNREAD_BY_SOURCE[d.source]
        problems += unread_problems("data", d, names, why, f"change data.source (now {d.source!r})")
    if d.source == "files" and file_format(d.path, d.format) in ("json", "parquet"):
        problems += unread_problems(
            "data",
            d,
            ("text_sample_by",),
            "json and parquet records are documents already (it cuts plain-text files)",
            "point data.path at .txt/.md files",
        )
    if r.fsdp.param_dtype != "float16":
        names = [f.name for f in dataclasses.fields(r.loss_scale)]
        problems += unread_problems(
            "loss_scale",
            r.loss_scale,
            names,
            f"only float16 compute runs a loss scale (fsdp.param_dtype = {r.fsdp.param_dtype!r})",
            "set fsdp.param_dtype=float16",
        )
    problems += unread_optimizer_settings(r)
    ac = r.activation_checkpoint
    for name, (mode, reads_none) in READ_BY.items():
        if not ac_policy(ac).reads(name):
            why = f"activation_checkpoint.mode = {ac.mode!r} {reads_none}"
            problems += unread_problems(
                "activation_checkpoint", ac, (name,), why, f"set activation_checkpoint.mode={mode}"
            )
    return problems


def unread_optimizer_settings(r: Recipe) -> list[Problem]:
    """Settings of another optimizer than optimizer.name (AdamW's betas given to Lion, [optimizer.muon]
    given to SGD): refused field by field, a section's fields by their own names."""
    o = r.optimizer
    if o.name not in OPTIMIZER_READS:  # an unknown name is check_optimizer's
        return []
    reads = OPTIMIZER_READS[o.name]
    owners = {
        f: [n for n, fs in OPTIMIZER_READS.items() if f in fs] for fs in OPTIMIZER_READS.values() for f in fs
    }
    problems = []
    for field, readers in owners.items():
        if field in reads:
            continue
        why = f"optimizer.name = {o.name!r} does not read it (read by {', '.join(readers)})"
        fix = f"set optimizer.name={readers[0]}"
        section = getattr(o, field)
        if dataclasses.is_dataclass(section):
            names = [f.name for f in dataclasses.fields(section)]
            problems += unread_problems(f"optimizer.{field}", section, names, why, fix)
        else:
            problems += unread_problems("optimizer", o, (field,), why, fix)
    return problems
