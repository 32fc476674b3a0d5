"""Where metrics go: the local JSONL record (the source of truth), TensorBoard and W&B.

Only one rank (rank 0, which receives the reduced loss) creates loggers. Nothing here
blocks on the network: W&B runs offline without a key and falls back to offline if an
online init fails or times out. W&B is used by its own conventions: the recipe's settings,
else W&B's environment variables, else defaults; the nested recipe as the config; a
job_type; the URL (or, offline, the `wandb sync` command) shown and kept in run.json.
A resumed offline run writes a folder per process under one run id; `wandb sync` given them all
uploads them as one run, in start order, numbering each folder's steps on from the last.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from unittest import mock

from meshforge.configs.schema import LoggingConfig
from meshforge.run.observe.wandb_files import ends_mid_record, history, segments

WALL_CLOCK = "time"  # kept in the JSONL record, never charted


class BaseLogger:
    """One place metrics go (TorchTitan's BaseLogger shape): a new logger subclasses this,
    overrides what it can show, and is switched on by a `[logging]` field in `build_loggers`.
    `name` and `where` (a path, a URL; None: nothing to point at) go to the run's summary."""

    name = ""

    @property
    def where(self) -> str | None:
        return None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """One logged step's metrics (`metrics["step"] == step`; WALL_CLOCK included)."""

    def log_figure(self, name: str, fig, step: int) -> None:
        """A matplotlib figure at its step (the caller saves the PNG)."""

    def log_table(self, name: str, columns: list[str], rows: list[list]) -> None:
        """A table (per-rank memory, ...); run.json keeps the numbers."""

    def describe(self, recipe_path: Path, recipe_toml: str, hparams: dict[str, Any], run_id: str) -> None:
        """The resolved recipe (as a file and as text) and the layout's hyperparameters."""

    def log_checkpoint(self, path: Path, name: str) -> None:
        """The run's final checkpoint folder (logging.wandb_log_checkpoint)."""

    def log_summary(self, summary: dict[str, Any]) -> None:
        """The run's summary, at its end."""

    def flush(self) -> None:
        """Make what was logged durable (at a checkpoint: a run killed later resumes from there)."""

    def close(self) -> None:
        """Flush and release what the logger holds."""


class JSONLLogger(BaseLogger):
    """`metrics.jsonl`: one JSON object per logged step, flushed line by line (the source of
    truth: the run's summary points at it through run.json's `records`, not here)."""

    name = "jsonl"

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self._f = open(self.path, "a", buffering=1)

    def rows(self) -> list[dict[str, Any]]:
        """Every step recorded so far (a resumed run's, cut back to its checkpoint)."""
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._f.write(json.dumps(metrics) + "\n")

    def close(self) -> None:
        self._f.close()


class TensorBoardLogger(BaseLogger):
    """Scalars per step; on resume, events from the resumed step on are purged (no duplicates)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, resume_step: int | None = None, flush_every: int = 10):
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / "tensorboard"
        # the writer's own thread also flushes every 30 s; a flush per step costs a file sync
        self._w = SummaryWriter(
            log_dir=str(self.path), purge_step=None if resume_step is None else resume_step + 1, flush_secs=30
        )
        self.flush_every, self._unflushed = flush_every, 0

    @property
    def where(self) -> str:
        return str(self.path)

    def describe(self, recipe_path: Path, recipe_toml: str, hparams: dict[str, Any], run_id: str) -> None:
        """The recipe as text, and the layout as HParams (with loss as its metric)."""
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        self._w.add_text("recipe", "```toml\n" + recipe_toml + "\n```", 0)
        for summary in hparams_summary(hparams, {"loss": 0.0}):
            self._w.file_writer.add_summary(summary)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for k, v in metrics.items():
            if k not in ("step", WALL_CLOCK) and isinstance(v, (int, float)):
                self._w.add_scalar(k, v, step)
        self._unflushed += 1
        if self._unflushed >= self.flush_every:
            self._w.flush()
            self._unflushed = 0

    def flush(self) -> None:
        self._w.flush()
        self._unflushed = 0

    def log_figure(self, name: str, fig, step: int) -> None:
        self._w.add_figure(name, fig, step, close=False)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


def _has_wandb_key(env: Mapping[str, str]) -> bool:
    if env.get("WANDB_API_KEY"):
        return True
    netrc = Path(env.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def wandb_mode(cfg: LoggingConfig, env: Mapping[str, str] = os.environ) -> str:
    """The recipe's mode, else WANDB_MODE (`dryrun` is W&B's old name for offline), else
    online with a key and offline without."""
    if cfg.wandb_mode:
        return cfg.wandb_mode
    if env.get("WANDB_MODE"):
        return "offline" if env["WANDB_MODE"] == "dryrun" else env["WANDB_MODE"]
    return "online" if _has_wandb_key(env) else "offline"


def wandb_settings(cfg: LoggingConfig, env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """wandb.init's project, entity, group, tags, job_type and mode, by W&B's precedence:
    the recipe, else the environment (WANDB_PROJECT, WANDB_ENTITY, WANDB_RUN_GROUP,
    WANDB_TAGS, WANDB_JOB_TYPE, WANDB_MODE), else defaults."""
    env_tags = [t.strip() for t in env.get("WANDB_TAGS", "").split(",") if t.strip()]
    return {
        "project": cfg.wandb_project or env.get("WANDB_PROJECT") or "meshforge",
        "entity": cfg.wandb_entity or env.get("WANDB_ENTITY"),
        "group": cfg.wandb_group or env.get("WANDB_RUN_GROUP"),
        "tags": list(cfg.wandb_tags) if cfg.wandb_tags is not None else env_tags,
        "job_type": cfg.wandb_job_type or env.get("WANDB_JOB_TYPE") or "train",
        "mode": wandb_mode(cfg, env),
    }


class WandbLogger(BaseLogger):
    """One W&B run per meshforge run (a resumed run continues its id). `skip_through`: the
    last step W&B already holds from before a resume, which is not logged again."""

    name = "wandb"

    def __init__(self, cfg: LoggingConfig, run_dir: Path, run_name: str, run_id: str, config: dict, console):
        import wandb

        self._wandb, self.skip_through, self.run_id = wandb, 0, run_id
        kwargs = {
            **wandb_settings(cfg),
            "name": run_name,
            "config": config,
            "dir": str(run_dir),
            "id": run_id,
            "resume": "allow",
        }
        settings = wandb.Settings(init_timeout=60, silent=True, console="off")
        # our own W&B service, not one a parent process advertises in WANDB_SERVICE (read at init):
        # a killed run's stream then dies with its service, and its resume is not refused as "in use"
        with mock.patch.dict(os.environ):
            os.environ.pop("WANDB_SERVICE", None)
            try:
                self.run = wandb.init(settings=settings, **kwargs)
            except (wandb.errors.Error, OSError) as e:  # no network, bad key, timeout: go offline
                if kwargs["mode"] != "online":
                    raise
                console.print(
                    f"[yellow]W&B online init failed ({type(e).__name__}: {e}); logging offline instead[/]"
                )
                self.run = wandb.init(settings=settings, **{**kwargs, "mode": "offline"})
        self.mode = "disabled" if self.run.disabled else self.run.settings.mode
        # a custom step axis, so a resumed run continues it instead of W&B's own counter
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    @property
    def path(self) -> str | None:
        return None if self.mode == "disabled" else str(Path(self.run.dir).parent)

    @property
    def where(self) -> str:
        """The run's URL, or (offline) the command that uploads it."""
        if self.mode == "disabled":
            return "disabled"
        if self.mode == "online":  # (asking an offline run for its URL makes W&B warn)
            return self.run.url
        return f"offline: upload with `{self.sync_command()}`"

    def _earlier_folders(self) -> list[Path]:
        """This run id's offline folders from before a resume that hold anything, in start order."""
        here = Path(self.path)
        return [folder for folder in segments(here.parent, self.run_id) if folder != here]

    def sync_command(self) -> str:
        """`wandb sync` with every folder of this run (this process's last): W&B uploads them as
        one run in start order and numbers each folder's steps on from the last (a folder left out
        would be lost, and one synced later would land after the rest). A folder that ends inside
        a record stops the command after it, so the folders after it go in a second command."""
        commands, folders = [], []
        for folder in self._earlier_folders():
            folders.append(str(folder))
            if ends_mid_record(folder / f"run-{self.run_id}.wandb"):
                commands.append(folders)
                folders = []
        commands.append([*folders, self.path])
        return "; ".join(shlex.join(["wandb", "sync", *group]) for group in commands)

    def kept_step(self) -> int:
        """The last step W&B holds of this run from before a resume: online, the server's
        summary; offline, the earlier offline folders (a killed process keeps only what W&B had
        flushed)."""
        if self.mode == "online":
            return int(self.run.summary.get("step") or 0)
        files = [folder / f"run-{self.run_id}.wandb" for folder in self._earlier_folders()]
        return max((row.get("step", 0) for row in history(files)), default=0)

    def catch_up(self, recorded: list[dict[str, Any]]) -> None:
        """After a resume, W&B gets the recorded steps it lacks (replayed from metrics.jsonl,
        the source of truth) and none twice: each step appears once in its history."""
        self.skip_through = self.kept_step()
        for row in recorded:
            self.log(row, row["step"])

    def note_set_aside(self, line: str) -> None:
        """Which logged steps a resume set aside, and where: in the config (with the run from its
        start) and the summary, so the W&B run says what its history no longer holds."""
        self.run.config.update({"set_aside": line}, allow_val_change=True)
        self.run.summary["set_aside"] = line

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if step > self.skip_through:
            self.run.log({k: v for k, v in metrics.items() if k != WALL_CLOCK})

    def log_figure(self, name: str, fig, step: int) -> None:
        """A figure, in the history row of the step logged next (one row per step)."""
        from PIL import Image

        # rendered here as W&B renders a figure (savefig to PNG): its own path needs pyplot's state
        png = io.BytesIO()
        fig.savefig(png, format="png")
        self.run.log({name: self._wandb.Image(Image.open(png))}, commit=False)

    def log_table(self, name: str, columns: list[str], rows: list[list]) -> None:
        """A table in the run's summary (no history row of its own)."""
        self.run.summary[name] = self._wandb.Table(columns=columns, data=rows)

    def describe(self, recipe_path: Path, recipe_toml: str, hparams: dict[str, Any], run_id: str) -> None:
        """The resolved recipe as a W&B artifact."""
        artifact = self._wandb.Artifact(f"recipe-{run_id}", type="recipe")
        artifact.add_file(str(recipe_path))
        self.run.log_artifact(artifact)

    def log_checkpoint(self, path: Path, name: str) -> None:
        """The folder's location as a model artifact (a reference: nothing is uploaded)."""
        artifact = self._wandb.Artifact(name, type="model")
        artifact.add_reference(Path(path).resolve().as_uri(), checksum=False)
        self.run.log_artifact(artifact)

    def log_summary(self, summary: dict[str, Any]) -> None:
        for k, v in summary.items():
            self.run.summary[k] = v

    def close(self) -> None:
        self.run.finish()


class LoggerContainer(BaseLogger):
    """Fans every call out to its loggers (TorchTitan's LoggerContainer): the trainers hold one
    of these and never name a logger. Each metrics row gets the wall clock (WALL_CLOCK)."""

    def __init__(self, loggers: list[BaseLogger]):
        self.loggers = loggers

    def log(self, metrics: dict[str, Any], step: int) -> None:
        metrics = {WALL_CLOCK: time.time(), **metrics}
        for logger in self.loggers:
            logger.log(metrics, step)

    def flush(self) -> None:
        for logger in self.loggers:
            logger.flush()

    def log_figure(self, name: str, fig, step: int) -> None:
        for logger in self.loggers:
            logger.log_figure(name, fig, step)

    def log_table(self, name: str, columns: list[str], rows: list[list]) -> None:
        for logger in self.loggers:
            logger.log_table(name, columns, rows)

    def describe(self, recipe_path: Path, recipe_toml: str, hparams: dict[str, Any], run_id: str) -> None:
        for logger in self.loggers:
            logger.describe(recipe_path, recipe_toml, hparams, run_id)

    def log_checkpoint(self, path: Path, name: str) -> None:
        for logger in self.loggers:
            logger.log_checkpoint(path, name)

    def log_summary(self, summary: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log_summary(summary)

    def paths(self) -> dict[str, str]:
        """Where each logger writes, for the run's summary (whole paths, the W&B URL)."""
        return {x.name: x.where for x in self.loggers if x.where is not None}

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def build_loggers(
    cfg: LoggingConfig,
    run_dir: Path,
    run_name: str,
    run_id: str,
    config: dict,
    console,
    resumed_step: int | None = None,
    set_aside: str | None = None,
) -> LoggerContainer:
    """Every logger `[logging]` switches on; JSONL is always on. `resumed_step`: the checkpoint
    step a resumed run restarts after (TensorBoard purges later events; W&B is completed);
    `set_aside`: the line saying which steps logged past it were set aside (W&B notes it)."""
    jsonl = JSONLLogger(run_dir)
    loggers: list[BaseLogger] = [jsonl]
    if cfg.tensorboard:
        loggers.append(TensorBoardLogger(run_dir, resumed_step, cfg.flush_every))
    if cfg.wandb:
        wandb = WandbLogger(cfg, run_dir, run_name, run_id, config, console)
        if wandb.mode == "disabled":
            wandb.close()
        else:
            if resumed_step is not None:
                wandb.catch_up(jsonl.rows())
            if set_aside:
                wandb.note_set_aside(set_aside)
            loggers.append(wandb)
    return LoggerContainer(loggers)
