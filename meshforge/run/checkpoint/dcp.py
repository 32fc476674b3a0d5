"""Distributed checkpoints (torch.distributed.checkpoint), saved atomically, loadable on any mesh.

A checkpoint is a folder `step-00000050/` holding DCP shards of the model and optimizer
(keyed by parameter FQN with global shapes, so DCP reshards on load: save on FSDP 4,
resume on dp 2 x tp 2 or a single process) and `meta.json` (step, global data position,
LR schedule, W&B run id, the recipe). It is written as `step-00000050.tmp/` and renamed
only once every rank has finished: a folder without `meta.json` is never loaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from meshforge.configs.schema import CheckpointConfig, ModelConfig, OptimizerConfig
from meshforge.core.errors import CheckpointError, CheckpointNotFound, Problem, RecipeError
from meshforge.core.units import GiB
from meshforge.interop.weights import hf_reader_for, load_into
from meshforge.models import args_from_config, get_model_spec
from meshforge.run.checkpoint.state import (
    ModelState,
    OptimizerState,
    apply_optimizer_settings,
    built_settings,
    optimizer_changes,
    say_optimizer_changes,
)

STEP_DIR = re.compile(r"^step-(\d+)$")
META = "meta.json"


# DCP pickles its `.metadata`; only the classes a checkpoint's metadata consists of may be
# unpickled from it, so loading a checkpoint from elsewhere cannot run code. (Tensor data
# is read by DCP with torch.load(weights_only=True).)
_METADATA_MODULES = {"torch.distributed.checkpoint.metadata"}
_METADATA_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        torch_constant = module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        )
        if module in _METADATA_MODULES or (module, name) in _METADATA_NAMES or torch_constant:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which no checkpoint needs; "
            "refusing to load it (the file may be corrupt or malicious)"
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader, with its metadata unpickled by an allow-list instead of plain pickle."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def dcp_load(state: dict, path: Path) -> None:
    try:
        with _single_process():
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)))
    except CheckpointException as e:  # a BaseException carrying every rank's traceback
        reason = str(e).strip().splitlines()[-1]
        raise CheckpointError(f"could not load checkpoint {path}: {reason}") from None


def checkpoint_folder(cfg: CheckpointConfig, run_dir: Path) -> Path:
    """Where a run's checkpoints go: `checkpoint.folder`, relative to the run's folder."""
    folder = Path(cfg.folder)
    return folder if folder.is_absolute() else run_dir / folder


def committed(folder: Path) -> list[Path]:
    """Complete checkpoints in `folder`, oldest first; incomplete ones are warned about."""
    if not folder.is_dir():
        return []
    done = []
    for p in folder.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / META).is_file() and (p / ".metadata").is_file():
            done.append((int(m.group(1)), p))
        elif p.name.startswith("step-"):
            warnings.warn(
                f"ignoring incomplete checkpoint {p} (no {META}: it was never committed)", stacklevel=2
            )
    return [p for _, p in sorted(done)]


def resolve_load(spec: str, folder: Path, field: str = "checkpoint.load") -> Path | None:
    """`auto` -> newest complete checkpoint in `folder`, or None (a fresh start: what a requeued
    job needs); `latest` -> the newest, which must exist; a path -> that checkpoint, or the newest
    complete one inside it."""
    if spec in ("auto", "latest"):
        found = committed(folder)
        if not found and spec == "latest":
            raise CheckpointNotFound(
                f"checkpoint.load = 'latest': no complete checkpoint in {folder} yet; use "
                "checkpoint.load=auto to start afresh when there is none (e.g. a requeued job)"
            )
        return found[-1] if found else None
    path = Path(spec)
    if path.is_file():
        raise CheckpointNotFound(
            f"{field} = {spec!r} is a file, not a checkpoint: name its step-NNNNNNNN folder "
            "(with meta.json) or the folder holding them"
        )
    if (path / META).is_file():
        return path
    found = committed(path)
    if not found:
        raise CheckpointNotFound(
            f"{field} = {spec!r}: no complete checkpoint there; "
            "use 'auto', 'latest' or a step-NNNNNNNN folder with meta.json"
        )
    return found[-1]


def refuse_unresumed(cfg: CheckpointConfig, run_dir: Path) -> None:
    """A rerun without `checkpoint.load` of a run whose folder holds checkpoints is refused: it
    would start from step 0 beside them (or set them aside); resuming is `checkpoint.load=auto`."""
    found = committed(checkpoint_folder(cfg, run_dir)) if cfg.load is None and cfg.enabled else []
    if found:
        elsewhere = "another run_name" if not Path(cfg.folder).is_absolute() else "another checkpoint.folder"
        problem = (
            f"{found[-1]} exists: resume from it with checkpoint.load=auto (then the same command "
            f"resumes every time, as a requeued job needs), or start afresh under {elsewhere}"
        )
        raise RecipeError([Problem("checkpoint.load", None, problem)])


def read_meta(path: Path) -> dict:
    """A checkpoint's meta.json; a CheckpointError naming the file when it is not one."""
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{path / META} is not JSON ({e}): the checkpoint is corrupt; load an earlier one"
        ) from e
    missing = [k for k in ("step", "recipe") if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise CheckpointError(
            f"{path / META} has no {', '.join(missing)}: not a meshforge checkpoint's meta.json; "
            "load a step-NNNNNNNN folder meshforge wrote"
        )
    return meta


def check_writable(folder: Path, need_bytes: float) -> None:
    """Fail before training, not at the first save, if checkpoints cannot be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(
            f"checkpoint folder {folder} is not writable ({e.strerror}); "
            "set checkpoint.folder to a writable path"
        ) from None
    free = shutil.disk_usage(folder).free
    if free < need_bytes:
        raise CheckpointError(
            f"checkpoint folder {folder} has {free / GiB:.1f} GiB free but one checkpoint needs "
            f"about {need_bytes / GiB:.1f} GiB; free space or point checkpoint.folder elsewhere"
        )


class Checkpointer:
    """What a run starts from (`restore`), when it saves (`maybe_save`), and saving (sync or
    async) with an atomic commit. Every rank calls every method."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        folder: Path,
        model: ModelState,
        optim: OptimizerState,
        is_main: bool,
        need_bytes: float = 0,
    ):
        """`need_bytes`: about what one checkpoint takes; an enabled checkpointer checks the
        folder is writable and has that much room before training, not at the first save."""
        self.cfg, self.folder, self.is_main = cfg, folder, is_main
        if cfg.enabled and is_main:
            check_writable(folder, need_bytes)
        self.state = {"model": model, "optim": optim}
        self._pending = None  # (future, tmp folder, meta) of an async save
        # async saves run collectives from a thread: give them their own group, so they
        # never interleave with the training step's collectives on the default group
        self._pg = dist.new_group(backend="gloo") if (cfg.async_save and dist.is_initialized()) else None

    def restore(
        self, parts: list[nn.Module], model_args, loader, schedulers: list, scaler, optimizer: OptimizerConfig
    ) -> dict | None:
        """Resume from `checkpoint.load` (model, optimizer, data position, LR schedule, fp16 loss
        scale, on any mesh; `optimizer`'s settings over the saved ones, said when they differ) and
        return {path, step, run_id}; else load seed weights (`init_from`, or
        `init_from_hf` with each rank reading only its shards) and return None, or, for `auto`
        with no checkpoint yet, {path: None, step: 0}: this run's records go on from step 0."""
        c = self.cfg
        path = resolve_load(c.load, self.folder) if c.load else None
        if path is not None:
            meta = read_meta(path)
            changes = optimizer_changes(meta["recipe"].get("optimizer", {}), optimizer)  # before loading
            built = built_settings(schedulers)  # loading restores the saving run's: this run's hold
            dcp_load(self.state, path)
            loader.restore_from(meta)
            for sched in schedulers:
                sched.load_state_dict(meta["lr_scheduler"])
            apply_optimizer_settings(schedulers, built)
            if self.is_main:
                say_optimizer_changes(changes)
            if scaler.enabled and meta.get("loss_scale"):  # an fp32/bf16 checkpoint has none
                scaler.load_state_dict(meta["loss_scale"])
            return {"path": str(path), "step": meta["step"], "run_id": meta.get("run_id")}
        if c.init_from:
            self.load(resolve_load(c.init_from, Path(c.init_from)), model_only=True)
        elif c.init_from_hf:
            reader = hf_reader_for(Path(c.init_from_hf), model_args)
            for part in parts:
                load_into(part, reader)
        if c.load == "auto":  # a fresh start from the seed weights that still continues this run's records
            return {"path": None, "step": 0, "run_id": None}
        return None

    def latest(self) -> Path | None:
        """The newest committed checkpoint of this run (None if there is none)."""
        found = committed(self.folder)
        return found[-1] if found else None

    def maybe_save(self, step: int, last: bool, stopping: bool, meta: Callable[[], dict]) -> float | None:
        """The checkpoint policy: save every `interval` steps, after the last step
        (`save_at_end`), and when the run is stopping (a signal). Returns the seconds the save
        held training up (an async save: its staging), or None if it did not save."""
        c = self.cfg
        self._poll()
        if not c.enabled or not (step % c.interval == 0 or (last and c.save_at_end) or stopping):
            return None
        start = time.perf_counter()
        self.save(step, meta())
        return time.perf_counter() - start

    def save(self, step: int, meta: dict) -> None:
        self.wait()
        tmp = self.folder / f"step-{step:08d}.tmp"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        if self.cfg.async_save:
            future = dcp.async_save(self.state, checkpoint_id=str(tmp), process_group=self._pg)
            self._pending = (future, tmp, meta)
        else:
            with _single_process():
                dcp.save(self.state, checkpoint_id=str(tmp))
            self._commit(tmp, meta)

    def _poll(self) -> None:
        """Commit an async save as soon as its writes are done, without waiting for the next
        save: a run killed later keeps it. No collective: rank 0 is DCP's coordinator, and its
        future completes only after every rank's shards and the metadata are written."""
        if self._pending is not None and self._pending[0].done():
            self._finish_pending()

    def _finish_pending(self) -> None:
        future, tmp, meta = self._pending
        self._pending = None
        future.result()  # a failed write raises here, and the .tmp folder is never committed
        if self.is_main:
            self._publish(tmp, meta)

    def wait(self) -> None:
        """Finish and commit an async save in flight (every rank, at the same point)."""
        if self._pending is not None:
            self._finish_pending()
        if self.cfg.async_save:
            _barrier()  # on every rank: rank 0 may have committed already (`_poll`), others not

    def _commit(self, tmp: Path, meta: dict) -> None:
        _barrier()  # every rank has written its shards
        if self.is_main:
            self._publish(tmp, meta)
        _barrier()

    def _publish(self, tmp: Path, meta: dict) -> None:
        """meta.json, then one rename: a checkpoint folder without `.tmp` is complete."""
        (tmp / META).write_text(json.dumps({**meta, "saved_at": time.time()}, indent=1, default=str))
        final = tmp.with_suffix("")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if self.cfg.keep_latest > 0:
            for old in committed(self.folder)[: -self.cfg.keep_latest]:
                shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model_only: bool = False) -> dict:
        """Load `path` into this rank's parts (resharding as needed); returns its meta."""
        dcp_load({"model": self.state["model"]} if model_only else self.state, path)
        return read_meta(path)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _single_process():
    """DCP warns that it assumes one process when there is no process group: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_seed_checkpoint(model: nn.Module, out: Path, meta: dict) -> Path:
    """Write one process's full initial weights as a step-0 checkpoint any mesh can load."""
    target = out / "step-00000000"
    tmp = out / "step-00000000.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with _single_process():
        dcp.save({"model": ModelState([model])}, checkpoint_id=str(tmp))
    (tmp / META).write_text(json.dumps({**meta, "step": 0, "seed_checkpoint": True}, indent=1, default=str))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def model_args_of(meta: dict):
    """The model args a checkpoint was saved with: the shape the run resolved, or (older
    checkpoints, which did not record it) its recipe's [model] resolved again."""
    spec = get_model_spec(meta["recipe"]["model"]["name"])
    saved = meta.get("model_args")
    return spec.args_type(**saved) if saved else args_from_config(ModelConfig(**meta["recipe"]["model"]))


def load_full_model(checkpoint: Path) -> tuple[nn.Module, object, dict]:
    """One process's unsharded model from any checkpoint (any mesh it was saved on), its
    model args and the checkpoint's meta."""
    meta = read_meta(checkpoint)
    args = model_args_of(meta)
    model = get_model_spec(meta["recipe"]["model"]["name"]).build(args)
    model.init_buffers()
    dcp_load({"model": ModelState([model])}, checkpoint)
    return model, args, meta
