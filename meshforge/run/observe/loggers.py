"""Where metrics go: the local JSONL record (the source of truth), TensorBoard and W&B.

Only one rank (rank 0, which receives the reduced loss) creates loggers. Nothing here
blocks on the network: W&B runs offline without a key and falls back to offline if an
online init fails or times out. W&B is used by its own conventions: the recipe's settings,
else W&B's environment variables, else defaults; the nested recipe as the config; a
job_type; the URL (or, offline, the `wandb sync` command) shown and kept in run.json.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from unittest import mock

from meshforge.configs.schema import LoggingConfig
from meshforge.run.observe.wandb_files import history, run_files

WALL_CLOCK = "time"  # kept in the JSONL record, never charted


class JSONLLogger:
    """`metrics.jsonl`: one JSON object per logged step, flushed line by line."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self._f = open(self.path, "a", buffering=1)

    def log(self, metrics: dict[str, Any]) -> None:
        self._f.write(json.dumps(metrics) + "\n")

    def close(self) -> None:
        self._f.close()


class TensorBoardLogger:
    """Scalars per step; on resume, events from the resumed step on are purged (no duplicates)."""

    def __init__(self, run_dir: Path, resume_step: int | None = None, flush_every: int = 10):
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / "tensorboard"
        # the writer's own thread also flushes every 30 s; a flush per step costs a file sync
        self._w = SummaryWriter(
            log_dir=str(self.path), purge_step=None if resume_step is None else resume_step + 1, flush_secs=30
        )
        self.flush_every, self._unflushed = flush_every, 0

    def describe(self, recipe_toml: str, hparams: dict[str, Any]) -> None:
        """The recipe as text, and the layout as HParams (with loss as its metric)."""
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        self._w.add_text("recipe", "```toml\n" + recipe_toml + "\n```", 0)
        for summary in hparams_summary(hparams, {"loss": 0.0}):
            self._w.file_writer.add_summary(summary)

    def log(self, metrics: dict[str, Any]) -> None:
        step = metrics["step"]
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


class WandbLogger:
    """One W&B run per meshforge run (a resumed run continues its id). `skip_through`: the
    last step W&B already holds from before a resume, which is not logged again."""

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
        return f"offline: upload with `wandb sync {self.path}`"

    def kept_step(self) -> int:
        """The last step W&B holds of this run from before a resume: online, the server's
        summary; offline, the earlier offline runs' files (a killed process keeps only what
        W&B had flushed)."""
        if self.mode == "online":
            return int(self.run.summary.get("step") or 0)
        here = Path(self.run.dir).parent
        files = [
            f for f in run_files(here.parent.parent) if f.parent != here and f.stem == f"run-{self.run_id}"
        ]
        return max((row.get("step", 0) for row in history(files)), default=0)

    def log(self, metrics: dict[str, Any]) -> None:
        if metrics["step"] > self.skip_through:
            self.run.log({k: v for k, v in metrics.items() if k != WALL_CLOCK})

    def log_image(self, name: str, fig) -> None:
        """A figure, in the history row of the step logged next (one row per step)."""
        from PIL import Image

        # rendered here as W&B renders a figure (savefig to PNG): its own path needs pyplot's state
        png = io.BytesIO()
        fig.savefig(png, format="png")
        self.run.log({name: self._wandb.Image(Image.open(png))}, commit=False)

    def log_table(self, name: str, columns: list[str], rows: list[list]) -> None:
        """A table in the run's summary (no history row of its own)."""
        self.run.summary[name] = self._wandb.Table(columns=columns, data=rows)

    def log_file(self, path: Path, name: str, kind: str) -> None:
        """A file as a W&B artifact (e.g. the resolved recipe)."""
        artifact = self._wandb.Artifact(name, type=kind)
        artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def log_reference(self, path: Path, name: str, kind: str) -> None:
        """A folder's location as an artifact (a reference: nothing is uploaded)."""
        artifact = self._wandb.Artifact(name, type=kind)
        artifact.add_reference(Path(path).resolve().as_uri(), checksum=False)
        self.run.log_artifact(artifact)

    def log_summary(self, summary: dict[str, Any]) -> None:
        for k, v in summary.items():
            self.run.summary[k] = v

    def close(self) -> None:
        self.run.finish()


class Loggers:
    """Fan-out to every configured logger; JSONL is always on. `resumed_step`: the checkpoint
    step a resumed run restarts after (TensorBoard purges later events; W&B is completed)."""

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: Path,
        run_name: str,
        run_id: str,
        config: dict,
        console,
        resumed_step: int | None = None,
    ):
        self.jsonl = JSONLLogger(run_dir)
        self.tensorboard = (
            TensorBoardLogger(run_dir, resumed_step, cfg.flush_every) if cfg.tensorboard else None
        )
        self.wandb = None
        if cfg.wandb:
            self.wandb = WandbLogger(cfg, run_dir, run_name, run_id, config, console)
            if self.wandb.mode == "disabled":
                self.wandb.close()
                self.wandb = None
            elif resumed_step is not None:
                self._continue_wandb()

    def _continue_wandb(self) -> None:
        """After a resume, W&B gets the recorded steps it lacks (replayed from metrics.jsonl,
        the source of truth) and none twice: each step appears once in its history."""
        kept = self.wandb.kept_step()
        for line in self.jsonl.path.read_text().splitlines():
            row = json.loads(line)
            if row["step"] > kept:
                self.wandb.log(row)
        self.wandb.skip_through = kept

    @property
    def all(self) -> list:
        return [x for x in (self.jsonl, self.tensorboard, self.wandb) if x is not None]

    def log(self, metrics: dict[str, Any]) -> None:
        metrics = {WALL_CLOCK: time.time(), **metrics}
        for logger in self.all:
            logger.log(metrics)

    def flush(self) -> None:
        """Make what was logged durable (at a checkpoint: a killed run resumes from there)."""
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def log_figure(self, name: str, fig, step: int) -> None:
        """A matplotlib figure to TensorBoard and W&B, at its step (the caller saves the PNG)."""
        if self.tensorboard is not None:
            self.tensorboard.log_figure(name, fig, step)
        if self.wandb is not None:
            self.wandb.log_image(name, fig)

    def describe(self, recipe_path: Path, recipe_toml: str, hparams: dict[str, Any], run_id: str) -> None:
        """The resolved recipe: TensorBoard text (and the layout as HParams), a W&B artifact."""
        if self.tensorboard is not None:
            self.tensorboard.describe(recipe_toml, hparams)
        if self.wandb is not None:
            self.wandb.log_file(recipe_path, f"recipe-{run_id}", "recipe")

    def log_table(self, name: str, columns: list[str], rows: list[list]) -> None:
        """A table (per-rank memory, ...) in W&B's summary; run.json keeps the numbers."""
        if self.wandb is not None:
            self.wandb.log_table(name, columns, rows)

    def paths(self) -> dict[str, str]:
        """Where each logger writes, for the run's summary (whole paths, the W&B URL)."""
        out = {}
        if self.tensorboard is not None:
            out["tensorboard"] = str(self.tensorboard.path)
        if self.wandb is not None:
            out["wandb"] = self.wandb.where
        return out

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self.wandb is not None and summary:
            self.wandb.log_summary(summary)
        for logger in self.all:
            logger.close()
