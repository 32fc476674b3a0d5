"""Start the ranks of a job on this machine through torch's own elastic launcher.

Under torchrun (one node or many, e.g. from Slurm) nothing is launched here: torchrun is
the distributed engine and each of its workers calls `train` directly.

SIGTERM (Slurm, Kubernetes) or Ctrl-C is not torch's to handle here (its agent would kill the
ranks after 30 s, mid-save, and raise a SignalException): this process passes the signal on, the
ranks stop together at the end of their step and save, and the run ends with one line, exit 130.
A launcher killed outright cannot pass anything on: its ranks see it gone and stop as if signalled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from unittest import mock

from torch.distributed import DistNetworkError
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from meshforge.configs import Recipe
from meshforge.core.errors import EXIT_INTERRUPTED, Interrupted, LaunchFailed
from meshforge.core.logs import LOG_LEVEL_ENV, log_level_name
from meshforge.run.launch.rank_server import start_rank_server
from meshforge.run.launch.watch import RunWatcher
from meshforge.run.observe.console import RunConsole
from meshforge.run.observe.record import mark_failed
from meshforge.run.rank.distributed import pick_device_type
from meshforge.run.rank.env import LAUNCHED_ENV
from meshforge.run.train import guards
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


@contextlib.contextmanager
def _torch_launcher_leaves_nothing():
    """torch's launcher sets TORCHELASTIC_SIGNALS_TO_HANDLE in this process's environment and its
    own handlers for the signals it names (SIGHUP, SIGQUIT), and leaves both: restored when the
    launch ends, for a caller that launches again or goes on with other work (ForwardStop owns
    SIGTERM and SIGINT)."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGQUIT)}
    try:
        with mock.patch.dict(os.environ):
            yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


# How long a rank whose peer vanished waits before it exits. torch's launcher reports only the
# first rank it sees exit, and a rank killed by a signal (the OOM killer, kill -9) takes its peers'
# collectives down within milliseconds: without the wait a survivor's "Connection reset by peer"
# could be named as the failure in place of the rank that was killed.
PEER_LOST_GRACE_S = 2.0


def _lost_a_peer(error: BaseException) -> bool:
    """A collective broken by another rank's death (gloo raises a plain RuntimeError naming the peer)."""
    return isinstance(error, DistNetworkError) or "by peer" in str(error)


@record
def _worker(recipe: Recipe, launcher_env: dict[str, str], launcher_pid: int) -> None:
    os.environ.update(launcher_env)
    trained = threading.Event()
    _stop_when_gone(launcher_pid, trained)
    try:
        train(recipe)
    except Interrupted:  # stopped and saved as asked: a clean exit, so torch waits for every rank
        pass
    except Exception as e:
        if _lost_a_peer(e):
            time.sleep(PEER_LOST_GRACE_S)
        raise
    finally:
        trained.set()


def _stop_when_gone(launcher_pid: int, trained: threading.Event) -> None:
    """A launcher killed outright (SIGKILL, the OOM killer) passes its ranks no stop: CPU ranks
    trained on alone, GPU ranks (torch's spawn asks for SIGINT at their parent's death) stopped but
    never exited. Each rank watches it (a pidfd: readable once it exits), then asks its run to stop
    as a signal would (at the end of a step, saving) and exits once `trained` is set: torch's wrapper
    would wait forever for the launcher to read its result. Linux only; elsewhere as before."""
    try:
        launcher = os.pidfd_open(launcher_pid)
    except ProcessLookupError:  # gone already
        launcher = None
    except (AttributeError, OSError):  # no pidfd_open (macOS, Linux < 5.3)
        return

    def watch() -> None:
        if launcher is not None:
            exited = select.poll()
            exited.register(launcher, select.POLLIN)
            exited.poll()
        guards.request_stop("the launcher's death")
        trained.wait()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(EXIT_INTERRUPTED)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


class ForwardStop:
    """SIGTERM/SIGINT to the launcher go to every rank (Kubernetes signals only the launcher);
    a second one kills them (what is committed stays: checkpoints are renamed once complete)."""

    def __init__(self, started: float):
        self.started, self.name = started, None

    def __enter__(self) -> ForwardStop:
        self._previous = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _forward(self, signum, frame) -> None:
        again, self.name = self.name is not None, self.name or signal.Signals(signum).name
        ranks = multiprocessing.active_children()  # the elastic agent's spawned ranks
        if not ranks:  # none started yet: start none
            raise Interrupted(f"stopped by {self.name} before training started: nothing saved")
        for rank in ranks:
            os.kill(rank.pid, signal.SIGKILL if again else signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def status_of(self, run_json: Path) -> str | None:
        """run.json's status when this launch wrote it (not an earlier attempt's record)."""
        info = json.loads(run_json.read_text()) if run_json.is_file() else {}
        return info.get("status") if info.get("start_time", 0) >= self.started else None

    def interrupted(self, run_json: Path) -> Interrupted:
        """The ranks' own line (run.json's error) when their loop stopped; else they were still
        starting, and the record says so."""
        info = json.loads(run_json.read_text()) if run_json.is_file() else {}
        if self.status_of(run_json) == "preempted" and info.get("error"):
            return Interrupted(info["error"].removeprefix(f"{Interrupted.__name__}: "))
        message = f"stopped by {self.name} before training started: nothing saved"
        mark_failed(run_json, message, status="preempted")
        return Interrupted(message)


def launch_local(recipe: Recipe, nproc: int) -> None:
    """Run `nproc` ranks of `recipe` here. Each rank writes its output to its log file under
    `<run>/logs/`; this process shows the run (run/launch/watch.py). A failing rank ends the whole
    job (max_restarts=0) and raises LaunchFailed naming it."""
    log_dir = Path(recipe.output_dir) / recipe.run_name / "logs"
    start_method = "forkserver" if pick_device_type(recipe.train.device) == "cpu" else "spawn"
    if start_method == "forkserver":
        start_rank_server()  # if the CLI has not yet (run/launch/rank_server.py)
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
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL),
        signals_to_handle="SIGHUP,SIGQUIT",  # SIGTERM and SIGINT are ForwardStop's
    )
    # this process owns the terminal, and the ranks log at its level (told explicitly: the rank
    # server may have started before this process knew them)
    launcher_env = {LAUNCHED_ENV: "launcher", LOG_LEVEL_ENV: log_level_name()}
    console = RunConsole(enabled=recipe.logging.progress)
    stop = ForwardStop(started=time.time())
    try:
        with (
            stop,
            RunWatcher(log_dir.parent, console, stop.started, config.run_id),
            _quiet_rank_failures(),
            _torch_launcher_leaves_nothing(),
        ):
            elastic_launch(config, _worker)(recipe, launcher_env, os.getpid())
    except ChildFailedError as e:
        if stop.name:  # a rank killed by a second signal, or one that was still starting
            raise stop.interrupted(log_dir.parent / "run.json") from None
        first_rank, failure = e.get_first_failure()  # the one rank torch saw exit first
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
        mark_failed(log_dir.parent / "run.json", f"rank {first_rank}: {message or failure.exitcode}")
        raise LaunchFailed(
            f"rank {first_rank} failed (exit code {failure.exitcode}): {message or 'see its log'}; "
            f"logs in {log_dir}"
        ) from None
    # the ranks' verdict, not only ours: ranks signalled directly stop too (exit 130), and a
    # signal that reached us after they finished changes nothing
    status = stop.status_of(log_dir.parent / "run.json")
    if status == "preempted" or (stop.name and status != "finished"):
        raise stop.interrupted(log_dir.parent / "run.json")
