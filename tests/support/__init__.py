"""What the tests share: the repository's paths, running the real programs (`run_cli`,
`run_recipe`) and reading back their records. conftest.py keeps the pytest hooks and fixtures."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"


def cli_env(**extra: str) -> dict:
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", **extra}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("TORCHELASTIC_RUN_ID", None)
    return env


# What a test may set in a program's environment and still run it forked from the rank server:
# variables read while the program runs. Anything else (PYTHONPATH's sitecustomize hooks, torch's
# and OpenMP's settings, what a module reads when it is imported) needs a new interpreter.
READ_WHILE_RUNNING = ("WANDB_", "HF_", "HOME", "PATH", "FAKE_SLURM_", "MESHFORGE_TEST_")


def start_session_rank_server() -> None:
    """The session's rank server (multiprocessing's forkserver, one per process) with torch and the
    trainer imported: the ranks of run_recipe's launches and run_cli's programs fork from it. The
    consoles a program draws on are built after the fork (meshforge.cli is not preloaded), on the
    program's own output files."""
    multiprocessing.set_forkserver_preload(["meshforge.run.launch.local", "support.forked_program"])
    multiprocessing.forkserver.ensure_running()


def run_cli(
    args: list[str],
    cwd: Path,
    timeout: int = 600,
    env: dict | None = None,
    program: str = "run_recipe",
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """Run `run_recipe ARGS` (or `meshforge ARGS`, or `python SCRIPT.py ARGS` for a program that is
    a `.py` path) from `cwd`: the installed script's entry point (or the script) with these
    arguments, environment and output files, in a process forked from the session's rank server (a
    new interpreter spends 3 to 5 s importing torch and meshforge here). Its stdin is empty and its
    imports were made by the server. `fresh`, or an environment that changes a variable outside
    READ_WHILE_RUNNING, runs the script in a new interpreter, as a user starts it: the tests of the
    terminal, of the README's commands as written and of PYTHONPATH hooks. A forked script differs
    from `python SCRIPT` in what the server did first: torch and meshforge are imported (a variable
    read when they are imported is not read again), this session's sys.path entries stay, atexit
    handlers do not run, and an uncaught error prints a process header first."""
    default = cli_env()
    env = env or default
    changed = {k for k in {*env, *default} if env.get(k) != default.get(k)}
    script = program.endswith(".py")
    exe = Path(program) if script else Path(sys.executable).parent / program
    if fresh or not all(k.startswith(READ_WHILE_RUNNING) for k in changed):
        command = [sys.executable, str(exe)] if script else [str(exe)]
        return subprocess.run(
            [*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    from support.forked_program import run_program

    start_session_rank_server()
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        process = multiprocessing.get_context("forkserver").Process(
            target=run_program, args=(str(exe), args, str(cwd), env, str(out), str(err))
        )
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired([program, *args], timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(
            [program, *args], process.exitcode, out.read_text(), err.read_text()
        )


def run_recipe(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """`run_recipe ARGS` from `cwd`, for tests that read a run's records. A launch of several CPU
    ranks runs in this test process: the same code from the arguments to the ranks' exit, ranks
    forked from the session's rank server as always (never from this process), which starts once
    per session instead of once per launch (three quarters of a small launch here). Past `timeout`
    the launch is stopped as Ctrl-C stops it (a second one kills the ranks) and TimeoutExpired
    raised. The ranks see the environment the server started with, and stdout/stderr hold what
    the launcher printed (not its warnings, nor what C++ wrote): a test that sets variables, or
    checks the terminal, signals or exit, uses `run_cli`, as does a one-process run (it would
    train in the test process)."""
    from meshforge.cli import forks_local_ranks, run_recipe_main
    from meshforge.cli.parsers import run_parser

    with contextlib.chdir(cwd):
        several_ranks = forks_local_ranks(run_parser().parse_intermixed_args(args))
    if not several_ranks:
        return run_cli(args, cwd, timeout)
    start_session_rank_server()
    fired = []

    def interrupt() -> None:
        fired.append(True)
        os.kill(os.getpid(), signal.SIGINT)

    handlers = {
        s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    }
    stops = [threading.Timer(t, interrupt) for t in (timeout, timeout + 60)]
    out, err = io.StringIO(), io.StringIO()
    try:
        for stop in stops:
            stop.start()
        with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run_recipe_main(args)
    finally:
        for stop in stops:
            stop.cancel()
    if fired:
        raise subprocess.TimeoutExpired(args, timeout, out.getvalue(), err.getvalue())
    # the launcher leaves this process as it found it (a notebook launches again, a test goes on)
    assert {s: signal.getsignal(s) for s in handlers} == handlers, "a launch left its signal handlers"
    assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in os.environ, "a launch left torch's launcher settings"
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def slurm_env(tmp: Path, **extra: str) -> dict:
    """The environment of a command that finds fake_slurm.py's sbatch/squeue/... first on PATH."""
    from support import fake_slurm

    fake_slurm.install(tmp / "bin")
    env = cli_env(FAKE_SLURM_DIR=str(tmp / "slurm"), **extra)
    env["PATH"] = f"{tmp / 'bin'}:{env['PATH']}"
    return env


def running(pid: int | None = None, group: int | None = None) -> bool:
    """Whether a process (or any process of a group) still runs, from /proc: a zombie waiting to be
    reaped (an orphan's, by whichever process adopted it) does not."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError):  # it exited while listed
            continue
        if state != "Z" and (int(stat.parent.name) == pid or int(pgrp) == group):
            return True
    return False


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# Small, quick settings shared by the launch tests (one launch per configuration).
QUICK = [
    # the schedule these tests' tolerances were measured with (debug_cpu's is tuned for its 30-step demo)
    "optimizer.lr=3e-3",
    "lr_scheduler.warmup_steps=10",
    "train.seq_len=32",
    "train.global_batch_size=16",
    "train.micro_batch_size=-1",
    "train.grad_accum_steps=1",
    "train.max_norm=0.3",
    "logging.tensorboard=false",
    "logging.wandb=false",
    "logging.progress=false",
    # the step tracked by category costs 1 s (2 ranks) to 3 s (8) per launch: the tests that read
    # the breakdown ask for it (TRACKED)
    "logging.memory_breakdown_step=0",
]
TRACKED = "logging.memory_breakdown_step=2"  # the default: step 2 tracked by category


EXTRAS = (
    "jax",
    "optax",
    "orbax.checkpoint",
    "transformers",
    "torchtitan",
    "datasets",
    "deepspeed",
    "torchao",
)
