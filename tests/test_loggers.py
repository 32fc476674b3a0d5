"""W&B mode resolution and its offline fallback, without any network."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from meshforge.configs.schema import LoggingConfig
from meshforge.run.observe.loggers import WandbLogger, wandb_mode


def test_mode_is_recipe_then_env_then_key(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode(LoggingConfig()) == "offline"  # no key: never online, never a prompt
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode(LoggingConfig()) == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode(LoggingConfig()) == "disabled"
    assert wandb_mode(LoggingConfig(wandb_mode="offline")) == "offline"  # the recipe wins
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.delenv("WANDB_MODE")
    (Path(tmp_path) / ".netrc").write_text(
        "machine api.wandb.ai\n  login user\n  password " + "y" * 40 + "\n"
    )
    assert wandb_mode(LoggingConfig()) == "online"


def test_a_failing_online_start_falls_back_to_offline(monkeypatch, tmp_path):
    import wandb

    real_init, modes = wandb.init, []

    def init(**kwargs):
        modes.append(kwargs["mode"])
        if kwargs["mode"] == "online":
            raise wandb.errors.CommError("network is unreachable")
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", init)
    console = Console(record=True, soft_wrap=True)
    logger = WandbLogger(LoggingConfig(wandb_mode="online"), tmp_path, "run", "run-1234", {"a": 1}, console)
    logger.log({"step": 1, "loss": 2.0})
    logger.close()
    assert modes == ["online", "offline"]
    assert logger.mode == "offline" and "logging offline instead" in console.export_text()
    assert list(tmp_path.glob("wandb/offline-run-*run-1234"))


def test_disabled_writes_nothing(tmp_path):
    logger = WandbLogger(LoggingConfig(wandb_mode="disabled"), tmp_path, "run", "r-1", {}, Console())
    logger.log({"step": 1, "loss": 1.0})
    logger.close()
    assert logger.mode == "disabled" and logger.path is None and not list(tmp_path.iterdir())
