"""Shared helpers: run the real programs and read back their records."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
# W&B never touches the network in tests; tests that check W&B opt into offline mode.
os.environ["WANDB_MODE"] = "disabled"
os.environ.setdefault("WANDB_SILENT", "true")
os.environ["PYTHONUNBUFFERED"] = "1"  # as cli_env: the session's rank server inherits it


def cli_env(**extra: str) -> dict:
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", **extra}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("TORCHELASTIC_RUN_ID", None)
    return env


# what an interpreter (and torch) read when they start: a program whose environment changes one of
# these runs in a new interpreter, where it takes effect (a sitecustomize hook on PYTHONPATH)
READ_AT_START = ("PYTHON", "TORCH", "OMP_", "MKL_", "LD_")


_server_env: dict[str, str] = {}  # the environment the rank server started with


def start_rank_server() -> None:
    """The session's rank server (multiprocessing's forkserver, one per process), with what the
    ranks of run_recipe's launches and the programs of run_cli's need imported."""
    multiprocessing.set_forkserver_preload(["meshforge.run.launch.local", "meshforge.cli", "forked_program"])
    multiprocessing.forkserver.ensure_running()
    _server_env.update(_server_env or os.environ)


def run_cli(
    args: list[str],
    cwd: Path,
    timeout: int = 600,
    env: dict | None = None,
    program: str = "run_recipe",
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """Run `run_recipe ARGS` (or `meshforge ARGS`) as a user would, from `cwd`: the installed
    program's entry point, with these arguments, environment, working folder and output streams,
    in a process forked from the session's rank server (torch and meshforge imported once: a new
    interpreter spends 3 to 5 s importing them here). `fresh`, or an environment that changes
    what an interpreter reads when it starts (READ_AT_START), runs the program in a new
    interpreter: the tests of the terminal as a user sees it, of the README's commands as
    written, and of hooks installed through PYTHONPATH."""
    env = env or cli_env()
    exe = Path(sys.executable).parent / program
    start_rank_server()
    if fresh or any(
        k.startswith(READ_AT_START) and env.get(k) != _server_env.get(k) for k in {*env, *_server_env}
    ):
        return subprocess.run(
            [str(exe), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
        )
    from forked_program import run_program

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


def run_recipe(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`run_recipe ARGS` from `cwd`, for tests that read a run's records. A launch of several CPU
    ranks runs in this test process: the same code from the arguments to the ranks' exit, ranks
    forked from the rank server as always (never from this process), but the server (torch and
    the trainer imported) starts once per test session instead of once per launch, which was
    three quarters of a small launch here. Its ranks see the environment the server started with,
    so a test that sets variables, or reads the program's terminal, signals or exit, uses
    `run_cli`, as does a one-process run (it would train in the test process)."""
    from meshforge.cli import _split_positionals, run_recipe_main
    from meshforge.configs import load_config
    from meshforge.run.launch.rank_server import forks_cpu_ranks

    with contextlib.chdir(cwd):
        several_ranks = forks_cpu_ranks(load_config(*_split_positionals(args))[0])
    if not several_ranks:
        return run_cli(args, cwd)
    start_rank_server()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run_recipe_main(args)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


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
]


EXTRAS = ("jax", "optax", "orbax.checkpoint", "transformers", "torchtitan", "datasets", "deepspeed")


def pytest_sessionstart(session):
    """CI installs every extra (.[all]) and runs the whole suite with nothing skipped: a missing
    extra there is an error, not a skip. Locally, `.[test]` runs the quick subset without them."""
    if os.environ.get("CI"):
        import importlib.util

        missing = [m for m in EXTRAS if importlib.util.find_spec(m.split(".")[0]) is None]
        if missing:
            raise pytest.UsageError(
                f"CI must install every extra (pip install -e '.[all]'); missing: {missing}"
            )


@pytest.fixture
def repo() -> Path:
    return REPO


_seen_temp_dirs: set[Path] = set()


@pytest.fixture(autouse=True)
def multi_process_runs_are_marked_slow(request, tmp_path_factory):
    """A test not marked slow that launched ranks here (the local launcher writes one log folder
    per rank under <run>/logs/), itself or through a fixture it set up, fails: `-m "not slow"`
    must stay the quick loop."""
    yield
    base = tmp_path_factory.getbasetemp()
    new = set(base.iterdir()) - _seen_temp_dirs  # tmp_path and module fixtures' folders of this test
    _seen_temp_dirs.update(new)
    if request.node.get_closest_marker("slow"):
        return
    for folder in new:
        ranks = {p.name for p in folder.glob("**/logs/*/attempt_*/*") if p.is_dir()}
        if len(ranks) > 1:
            pytest.fail(f"this test launched {len(ranks)} ranks: mark it @pytest.mark.slow")
