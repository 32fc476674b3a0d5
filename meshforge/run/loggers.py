"""Where metrics go: the local JSONL record (the source of truth), TensorBoard and W&B.

Only one rank (rank 0, which receives the reduced loss) creates loggers. Nothing here
blocks on the network: W&B runs offline without a key and falls back to offline if an
online init fails or times out.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from meshforge.configs.schema import LoggingConfig


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
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / "tensorboard"
        self._w = SummaryWriter(log_dir=str(self.path))

    def log(self, metrics: dict[str, Any]) -> None:
        step = metrics["step"]
        for k, v in metrics.items():
            if k != "step" and isinstance(v, (int, float)):
                self._w.add_scalar(k, v, step)
        self._w.flush()

    def log_figure(self, name: str, fig, step: int) -> None:
        self._w.add_figure(name, fig, step, close=False)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


def _has_wandb_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def wandb_mode(cfg: LoggingConfig) -> str:
    """The recipe's mode, else WANDB_MODE, else online with a key and offline without."""
    if cfg.wandb_mode:
        return cfg.wandb_mode
    if os.environ.get("WANDB_MODE"):
        return "disabled" if os.environ["WANDB_MODE"] == "dryrun" else os.environ["WANDB_MODE"]
    return "online" if _has_wandb_key() else "offline"


class WandbLogger:
    def __init__(self, cfg: LoggingConfig, run_dir: Path, run_name: str, run_id: str, config: dict, console):
        import wandb

        self._wandb = wandb
        mode = wandb_mode(cfg)
        kwargs = dict(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity,
            group=cfg.wandb_group,
            name=run_name,
            tags=list(cfg.wandb_tags),
            config=config,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
        )
        settings = wandb.Settings(init_timeout=60, silent=True, console="off")
        try:
            self.run = wandb.init(mode=mode, settings=settings, **kwargs)
        except Exception as e:  # no network, bad key, timeout: keep the run, go offline
            if mode != "online":
                raise
            console.print(
                f"[yellow]W&B online init failed ({type(e).__name__}: {e}); logging offline instead[/]"
            )
            self.run = wandb.init(mode="offline", settings=settings, **kwargs)
        self.mode = "disabled" if self.run.disabled else self.run.settings.mode
        # a custom step axis, so a resumed run continues it instead of W&B's own counter
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    @property
    def path(self) -> str | None:
        return None if self.mode == "disabled" else self.run.dir

    def log(self, metrics: dict[str, Any]) -> None:
        self.run.log(metrics)

    def log_summary(self, summary: dict[str, Any]) -> None:
        for k, v in summary.items():
            self.run.summary[k] = v

    def close(self) -> None:
        self.run.finish()


class Loggers:
    """Fan-out to every configured logger; JSONL is always on."""

    def __init__(self, cfg: LoggingConfig, run_dir: Path, run_name: str, run_id: str, config: dict, console):
        self.jsonl = JSONLLogger(run_dir)
        self.tensorboard = TensorBoardLogger(run_dir) if cfg.tensorboard else None
        self.wandb = WandbLogger(cfg, run_dir, run_name, run_id, config, console) if cfg.wandb else None

    @property
    def all(self) -> list:
        return [x for x in (self.jsonl, self.tensorboard, self.wandb) if x is not None]

    def log(self, metrics: dict[str, Any]) -> None:
        metrics = {"time": time.time(), **metrics}
        for logger in self.all:
            logger.log(metrics)

    def paths(self) -> dict[str, str]:
        """Where each logger writes, for the run's summary."""
        out = {}
        if self.tensorboard is not None:
            out["tensorboard"] = str(self.tensorboard.path)
        if self.wandb is not None:
            out["wandb"] = self.wandb.mode + (f": {self.wandb.path}" if self.wandb.path else "")
        return out

    def log_figure(self, name: str, fig, step: int) -> None:
        """A matplotlib figure to TensorBoard and W&B (the caller saves the PNG in the run folder)."""
        if self.tensorboard is not None:
            self.tensorboard.log_figure(name, fig, step)
        if self.wandb is not None and self.wandb.mode != "disabled":
            import wandb

            self.wandb.run.log({name: wandb.Image(fig)})

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self.wandb is not None and summary:
            self.wandb.log_summary(summary)
        for logger in self.all:
            logger.close()
