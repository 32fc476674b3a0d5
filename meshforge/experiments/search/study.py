"""The Optuna study a search keeps: where it lives, that it belongs to this recipe, and its
trials left running by a worker that was killed (marked failed, so the next command continues)."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

from meshforge.core.errors import UsageError

PRUNERS = ("median", "halving", "hyperband", "none")
# what counts toward --trials: a failed trial counts too (a point that always fails is not retried
# forever); one whose worker was killed, or stopped by a Ctrl-C to its search, does not (the next
# command runs another in its place)
COUNTED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.RUNNING)
KILLED = "killed"  # user attr of a trial failed because its worker was killed
INTERRUPTED = "interrupted"  # user attr of a trial stopped with its search (Ctrl-C, SIGTERM)


def default_storage(search_dir: Path) -> str:
    return f"sqlite:///{search_dir / 'study.db'}"


def make_pruner(name: str, startup_trials: int) -> optuna.pruners.BasePruner:
    """--pruner: median (against the trials so far, once `startup_trials` are done), halving
    (successive halving), hyperband, or none."""
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials)
    if name == "halving":
        return optuna.pruners.SuccessiveHalvingPruner()
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner()
    if name == "none":
        return optuna.pruners.NopPruner()
    raise UsageError(f"--pruner {name!r}: not a pruner; use one of {', '.join(PRUNERS)}")


def open_study(
    url: str, name: str, recipe: str, direction: str, pruner: optuna.pruners.BasePruner, seed: int | None
) -> optuna.Study:
    """The study `name` at `url`, created or continued. One of another recipe, or searched in the
    other direction, is refused; a URL that cannot be opened is said on one line."""
    storage = _storage(url)
    sampler = optuna.samplers.TPESampler(seed=seed)
    study = optuna.create_study(
        storage=storage,
        study_name=name,
        direction="minimize" if direction == "min" else "maximize",
        sampler=sampler,
        pruner=pruner,
        load_if_exists=True,
    )
    owner = study.user_attrs.get("recipe")
    if owner is None:
        study.set_user_attr("recipe", recipe)
    elif owner != recipe:
        raise UsageError(
            f"--study {name}: the study at {url} is a search of {owner}, not {recipe}; name another "
            "--study (or --storage) for this recipe"
        )
    wanted = (
        optuna.study.StudyDirection.MINIMIZE if direction == "min" else optuna.study.StudyDirection.MAXIMIZE
    )
    if study.direction != wanted:
        raise UsageError(
            f"--direction {direction}: study {name!r} at {url} was created to "
            f"{study.direction.name.lower()}; keep its direction, or search in a new --storage"
        )
    return study


# what a worker reads when another is creating the same storage's tables at that moment
RACED = ("locked", "already exists")


def _storage(url: str, tries: int = 4) -> optuna.storages.RDBStorage:
    """Optuna's storage at `url`. Workers starting together race to create its tables (one gets
    an IntegrityError, finds the file locked, or finds a table the other just made): each try
    after the first finds them made."""
    for attempt in range(tries):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url))
        except Exception as e:  # SQLAlchemy's many kinds (no driver, refused, bad URL): said, not traced
            error = e
            raced = "IntegrityError" in type(e).__name__ or any(s in str(e) for s in RACED)
            if not raced:
                break
            time.sleep(0.5 * (attempt + 1))
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise UsageError(
        f"--storage {url}: cannot open it ({type(error).__name__}: {first[:200]}); give a reachable "
        "database URL, e.g. sqlite:///search.db or postgresql://user@host/db"
    )


def _engine_kwargs(url: str) -> dict:
    # several workers write one SQLite file: wait for its lock rather than fail at once
    return {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def fail_killed_trials(study: optuna.Study) -> list[int]:
    """Trials left RUNNING by a worker of this machine that is no longer alive: marked FAIL
    (user attr `killed`), their run, if still going, stopped. The numbers marked."""
    host = socket.gethostname()
    marked = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = t.user_attrs.get("worker", "")
        who, _, pid = worker.rpartition(":")
        if who != host or not pid.isdigit() or _alive(int(pid)):
            continue  # another machine's worker, or alive: its own
        run_pid = t.user_attrs.get("run_pid")
        if run_pid and _alive(run_pid):
            _stop(run_pid)  # its run, orphaned: stopped at a step as a SIGTERM stops it, its ranks freed
        # a Trial of another worker's trial: FrozenTrial names its id only privately
        optuna.trial.Trial(study, t._trial_id).set_user_attr(KILLED, f"its worker {worker} was killed")
        study.tell(t.number, state=TrialState.FAIL)
        marked.append(t.number)
    return marked


def counted(study: optuna.Study) -> int:
    """The trials that count toward --trials."""
    trials = study.get_trials(deepcopy=False, states=COUNTED)
    return sum(1 for t in trials if KILLED not in t.user_attrs and INTERRUPTED not in t.user_attrs)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop(pid: int) -> None:
    try:  # its launcher only: a SIGTERM to its group would kill the ranks' fork server
        os.kill(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
