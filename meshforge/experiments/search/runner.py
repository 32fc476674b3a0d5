"""`meshforge search`: open (or continue) the study, run trials on K worker threads until it
holds --trials of them, then print the trials and the best one. Each worker asks the study for
a trial, runs it (trial.py) and tells the study how it ended; the study (SQLite by default) is
the only state, so a rerun of the command continues it, and several commands may share one."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import optuna
from optuna.trial import TrialState
from rich.console import Console
from rich.table import Table

from meshforge.core.errors import Interrupted, UsageError
from meshforge.core.tables import wide
from meshforge.experiments.search.plots import write_study_plots
from meshforge.experiments.search.space import as_override
from meshforge.experiments.search.study import (
    counted,
    default_storage,
    fail_killed_trials,
    make_pruner,
    open_study,
    worker_id,
)
from meshforge.experiments.search.trial import Outcome, Search, run_trial
from meshforge.recipe import load_recipe

# run_search's options, as `meshforge search` names them (its flags, with _ for -)
OPTIONS = (
    "trials",
    "objective",
    "direction",
    "storage",
    "workers",
    "pruner",
    "startup_trials",
    "seeds",
    "search_dir",
    "study",
)


def run_search(
    recipe_path: str,
    overrides: list[str],
    space: dict[str, optuna.distributions.BaseDistribution],
    trials: int,
    objective: str | None = None,
    direction: str = "min",
    storage: str | None = None,
    workers: int = 1,
    pruner: str = "median",
    startup_trials: int = 5,
    seeds: int = 1,
    search_dir: str | Path | None = None,
    study: str | None = None,
    console: Console | None = None,
) -> optuna.Study:
    """Search `space` over `recipe_path` until the study holds `trials` trials; the study."""
    console = console or Console(soft_wrap=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # its per-trial lines: the search says its own
    if trials < 1 or workers < 1 or seeds < 1:
        raise UsageError(f"--trials {trials}, --workers {workers}, --seeds {seeds}: each must be at least 1")
    base = load_recipe(recipe_path, overrides, world_size=None)
    if base.sweep.launcher == "slurm":
        raise UsageError(
            "sweep.launcher=slurm: a search runs its trials on this machine; run `meshforge search` "
            "inside the allocation (several commands may share one --storage), or set sweep.launcher=local"
        )
    stem = Path(recipe_path).stem
    study = study or f"search-{stem}"
    search_dir = Path(search_dir or Path(base.output_dir) / study).resolve()  # a folder per study
    search_dir.mkdir(parents=True, exist_ok=True)
    url = storage or default_storage(search_dir)
    metric = objective_of(base.eval.every, objective)
    opened = open_study(url, study, stem, direction, make_pruner(pruner, startup_trials), None)
    killed = fail_killed_trials(opened)
    if killed:
        console.print(f"trials {', '.join(map(str, killed))}: their worker was killed; marked failed")
    search = Search(
        recipe_path=recipe_path,
        overrides=overrides,
        search_dir=search_dir,
        objective=metric,
        group=base.logging.wandb_group or f"{stem}/{search_dir.name}",
        timeout_s=base.sweep.timeout_s,
        seeds=[(base.seed + i, base.data.seed + i) for i in range(seeds)],
    )
    console.print(
        f"search {search_dir}: {trials} trials ({counted(opened)} in the study), objective {metric} "
        f"({direction}), pruner {pruner}, {workers} worker(s); study {url}",
        highlight=False,
    )
    errors: list[BaseException] = []
    lock = threading.Lock()
    threads = [
        threading.Thread(
            target=_worker, args=(opened, space, search, trials, lock, errors, console), daemon=True
        )
        for _ in range(workers)
    ]
    with _StopOnSignal(search.stop) as stopped:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.5)
    if errors:
        raise errors[0]
    print_trials(opened, console)
    if plots := write_study_plots(opened, search_dir):
        console.print("plots: " + ", ".join(str(p) for p in plots), highlight=False)
    if stopped.name:
        raise Interrupted(
            f"stopped by {stopped.name}: the running trials were stopped and marked failed (not counted: "
            "the same command continues the study)"
        )
    return opened


def objective_of(eval_every: int, objective: str | None) -> str:
    """The metric the search optimises: the one given, else eval/loss if the recipe evaluates,
    else the training loss."""
    if objective is None:
        return "eval/loss" if eval_every > 0 else "loss"
    if objective.startswith("eval/") and eval_every == 0:
        raise UsageError(
            f"--objective {objective}: the recipe never evaluates (eval.every = 0); set eval.every=N, "
            "or search on the training loss (--objective loss)"
        )
    return objective


def _worker(study, space, search: Search, trials: int, lock, errors: list, console: Console) -> None:
    """Ask, run and tell trials until the study holds `trials` (or the search stops)."""
    try:
        while not search.stop.is_set():
            with lock:  # counting and asking together: this process's workers never overshoot
                if counted(study) >= trials:
                    return
                trial = study.ask(space)
                trial.set_user_attr("worker", worker_id())
            outcome = _run_told(study, trial, search)
            console.print(f"trial {trial.number}: {_said(outcome)}", highlight=False)
    except BaseException as e:  # the search stops: its other workers stop their trials
        errors.append(e)
        search.stop.set()


def _run_told(study: optuna.Study, trial: optuna.Trial, search: Search) -> Outcome:
    """Run the trial and tell the study how it ended, whatever happens to its run."""
    outcome = Outcome(TrialState.FAIL, attrs={"error": "the search stopped while it ran"})
    try:
        outcome = run_trial(search, trial)
        return outcome
    except UsageError as e:
        outcome = Outcome(TrialState.FAIL, attrs={"error": str(e)})
        raise
    finally:
        for k, v in outcome.attrs.items():
            trial.set_user_attr(k, v)
        study.tell(trial, outcome.value, state=outcome.state)


def _said(o: Outcome) -> str:
    if o.state == TrialState.COMPLETE:
        return f"complete, {o.value:.5g}"
    if o.state == TrialState.PRUNED:
        return f"pruned at step {o.attrs['pruned_at_step']}"
    return f"failed: {o.attrs.get('error', '')[:200]}"


def print_trials(study: optuna.Study, console: Console) -> None:
    """Every trial (number, state, value, params) and the best one, with its overrides."""
    trials = study.get_trials(deepcopy=False)
    keys = list(dict.fromkeys(k for t in trials for k in t.params))
    table = Table(title=f"study {study.study_name}: {len(trials)} trials")
    for col in ("#", "state", "value", *keys, "note"):
        table.add_column(col)
    for t in trials:
        note = (
            f"at step {t.user_attrs['pruned_at_step']}"
            if "pruned_at_step" in t.user_attrs
            else str(t.user_attrs.get("killed") or t.user_attrs.get("error") or "")[:80]
        )
        value = f"{t.value:.5g}" if t.value is not None else ""
        table.add_row(
            str(t.number), t.state.name.lower(), value, *(str(t.params.get(k, "")) for k in keys), note
        )
    wide(console).print(table)
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    if done:
        best = study.best_trial
        console.print(
            f"best: trial {best.number}, {best.value:.5g}; reproduce with: "
            + " ".join(as_override(k, v) for k, v in best.params.items()),
            highlight=False,
        )


class _StopOnSignal:
    """A Ctrl-C or SIGTERM to the search sets `stop`: every worker stops its run at a step (as the
    run's own SIGTERM does); a second signal is left to its default."""

    def __init__(self, stop: threading.Event):
        self.stop, self.name = stop, None

    def __enter__(self) -> _StopOnSignal:
        on_main = threading.current_thread() is threading.main_thread()
        self._previous = {s: signal.signal(s, self._set) for s in (signal.SIGINT, signal.SIGTERM) if on_main}
        return self

    def _set(self, signum: int, frame) -> None:
        self.name = self.name or signal.Signals(signum).name
        self.stop.set()
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
