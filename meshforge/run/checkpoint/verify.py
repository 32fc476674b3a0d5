"""What a run starts from, read before launch as far as it can be without loading a tensor: a
checkpoint's meta.json, its DCP `.metadata` and every shard file that lists (present, long
enough), and an HF folder's safetensors headers. A corrupt or incomplete one stops the run
with exit 2 naming the file, instead of failing on every rank after launch."""

from __future__ import annotations

import pickle
from pathlib import Path

from meshforge.configs.schema import CheckpointConfig
from meshforge.core.errors import CheckpointError, CheckpointNotFound, Problem, RecipeError
from meshforge.interop.weights import open_safetensors
from meshforge.run.checkpoint.dcp import SafeFileSystemReader, checkpoint_folder, read_meta, resolve_load


def check_shards(path: Path) -> None:
    """A CheckpointError naming the file when `.metadata` is unreadable or a shard it lists is
    missing or shorter than it says."""
    try:
        metadata = SafeFileSystemReader(str(path)).read_metadata()
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} has no .metadata (DCP's index): not a complete checkpoint") from e
    except (pickle.UnpicklingError, EOFError) as e:
        raise CheckpointError(f"{path / '.metadata'} is unreadable ({e}): the checkpoint is corrupt") from e
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(
                f"{shard} is missing (.metadata lists it): copy the whole checkpoint folder, or load "
                "an earlier checkpoint"
            )
        if shard.stat().st_size < size:
            raise CheckpointError(
                f"{shard} holds {shard.stat().st_size} bytes where .metadata needs {size}: a truncated "
                "copy; copy it again or load an earlier checkpoint"
            )


def check_checkpoints(cfg: CheckpointConfig, run_dir: Path) -> list[str]:
    """The checkpoint a run resumes from (`load`; `latest` in the run's folder) or starts from
    (`init_from`, `init_from_hf`), checked as above; lines for the plan. Problems raise a
    RecipeError naming the field."""
    problems, lines, folder = [], [], checkpoint_folder(cfg, run_dir)
    for field, spec, where in (
        ("checkpoint.load", cfg.load, folder),
        ("checkpoint.init_from", cfg.init_from, Path(cfg.init_from or ".")),
    ):
        if not spec:
            continue
        try:
            path = resolve_load(spec, where, field)
            if path is None:
                lines.append(f"{field} = {spec}: no checkpoint in {folder} yet")
                continue
            meta = read_meta(path)
            check_shards(path)
            lines.append(f"{field}: {path} (step {meta['step']})")
        except (CheckpointError, CheckpointNotFound) as e:
            problems.append(Problem(field, spec, str(e).removeprefix(f"{field} = {spec!r}").lstrip(": ")))
    if cfg.init_from_hf and not cfg.init_from:
        try:
            files = open_safetensors(Path(cfg.init_from_hf))
            lines.append(f"checkpoint.init_from_hf: {len(files)} safetensors file(s) in {cfg.init_from_hf}")
        except (CheckpointError, CheckpointNotFound) as e:
            problems.append(Problem("checkpoint.init_from_hf", cfg.init_from_hf, str(e)))
    if problems:
        raise RecipeError(problems, "checkpoint")
    return lines
