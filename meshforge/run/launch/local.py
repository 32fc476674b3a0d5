"""Start the ranks of a job on this machine through torch's own elastic launcher.

Under torchrun (one node or many, e.g. from Slurm) nothing is launched here: torchrun is
the distributed engine and each of its workers calls `train` directly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from unittest import mock

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from meshforge.configs import Recipe
from meshforge.core.errors import LaunchFailed
from meshforge.core.logs import LOG_LEVEL_ENV, log_level_name
from meshforge.run.launch.watch import LAUNCHED_ENV, RunWatcher
from meshforge.run.observe.console import RunConsole
from meshforge.run.observe.record import mark_failed
from meshforge.run.train.trainer import train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ReportedFailure(logging.Filter):
    """Drops torch's log of a rank's MeshforgeError (a traceback per failure; the launcher says it in
    one line and the rank's log file keeps the traceback) and of the other ranks being stopped
    after it. A rank's other errors (bugs) keep their traceback on the terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and "\nmeshforge.core.errors." in str(error):
            return False
        return not record.getMessage().startswith("Terminating process")


@contextlib.contextmanager
def _quiet_rank_failures():
    loggers = [
        logging.getLogger(n)
        for n in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")
    ]
    quiet = _ReportedFailure()
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


@record
def _worker(recipe: Recipe) -> None:
    train(recipe)


def launch_local(recipe: Recipe, nproc: int) -> None:
    """Run `nproc` ranks of `recipe` here. Each rank writes its output to its log file under
    `<run>/logs/`; this process shows the run (run/launch/watch.py). A failing rank ends the whole
    job (max_restarts=0) and raises LaunchFailed naming it."""
    log_dir = Path(recipe.output_dir) / recipe.run_name / "logs"
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"meshforge-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        local_addr="127.0.0.1",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL),
    )
    # the ranks inherit this process's environment (restored after): this process owns the
    # terminal, and the ranks log at its level
    rank_env = {LAUNCHED_ENV: "launcher", LOG_LEVEL_ENV: log_level_name()}
    console = RunConsole(enabled=recipe.logging.progress)
    try:
        with (
            mock.patch.dict(os.environ, rank_env),
            RunWatcher(log_dir.parent, console, started=time.time()),
            _quiet_rank_failures(),
        ):
            elastic_launch(config, _worker)(recipe)
    except ChildFailedError as e:
        first_rank, failure = e.get_first_failure()
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
        mark_failed(log_dir.parent / "run.json", f"rank {first_rank}: {message or failure.exitcode}")
        raise LaunchFailed(
            f"rank {first_rank} failed (exit code {failure.exitcode}): {message or 'see its log'}; "
            f"logs in {log_dir}"
        ) from None
