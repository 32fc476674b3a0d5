"""The loggers: one interface (BaseLogger) and a container that fans out to every logger the
`[logging]` switches turn on. (W&B's own behaviour is tested in test_wandb.py.)"""

from __future__ import annotations

from rich.console import Console

from meshforge.configs.schema import LoggingConfig
from meshforge.run.observe.loggers import WALL_CLOCK, BaseLogger, JSONLLogger, LoggerContainer, build_loggers


class ListLogger(BaseLogger):
    """A new logger is one class: it overrides what it can show, the rest are no-ops."""

    name = "list"

    def __init__(self):
        self.rows, self.summaries, self.figures, self.closed = [], [], [], False

    @property
    def where(self) -> str:
        return "memory"

    def log(self, metrics, step):
        self.rows.append((step, dict(metrics)))

    def log_figure(self, name, fig, step):
        self.figures.append((name, step))

    def log_summary(self, summary):
        self.summaries.append(summary)

    def close(self):
        self.closed = True


def test_a_new_logger_is_one_class_and_receives_every_metric(tmp_path):
    """Registered beside the JSONL record, a logger gets every row the record gets (same keys,
    same values, the same wall clock), every figure and the summary, and is closed."""
    fake = ListLogger()
    loggers = LoggerContainer([JSONLLogger(tmp_path), fake])
    sent = [{"step": s, "loss": 6.0 - s / 7, "grad_norm": 0.5 + s, "lr": 1e-3 * s} for s in (1, 2, 5)]
    for row in sent:
        loggers.log(row, row["step"])
    loggers.log_figure("pp_schedule", object(), 5)
    loggers.log_table("memory_per_rank", ["rank"], [[0]])  # a logger without tables ignores it
    loggers.log_summary({"steps": 5, "final_loss": sent[-1]["loss"]})
    paths = loggers.paths()
    loggers.close()
    recorded = JSONLLogger(tmp_path).rows()
    assert [step for step, _ in fake.rows] == [1, 2, 5]
    assert [row for _, row in fake.rows] == recorded  # what the source of truth holds, exactly
    assert [{k: v for k, v in row.items() if k != WALL_CLOCK} for row in recorded] == sent
    assert all(isinstance(row[WALL_CLOCK], float) for row in recorded)
    assert fake.figures == [("pp_schedule", 5)] and fake.summaries == [
        {"steps": 5, "final_loss": sent[-1]["loss"]}
    ]
    assert fake.closed and paths == {"list": "memory"}  # JSONL is pointed at by run.json, not here


def test_the_logging_switches_choose_the_loggers(tmp_path):
    (tmp_path / "b").mkdir()
    on = build_loggers(LoggingConfig(tensorboard=True, wandb=False), tmp_path, "r", "r-1", {}, Console())
    off = build_loggers(
        LoggingConfig(tensorboard=False, wandb=False), tmp_path / "b", "r", "r-2", {}, Console()
    )
    try:
        assert [x.name for x in on.loggers] == ["jsonl", "tensorboard"]
        assert [x.name for x in off.loggers] == ["jsonl"]
        assert on.paths() == {"tensorboard": str(tmp_path / "tensorboard")}
    finally:
        on.close()
        off.close()
