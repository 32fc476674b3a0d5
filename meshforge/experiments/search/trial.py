"""One trial of a search: its point run as a sweep runs one (point_process.run_point), once per
seed, while its metrics.jsonl is read as it grows: each new value of the objective is reported
to the study, and a trial the pruner stops is stopped as a SIGTERM stops a run (at the end of a
step, its records closed), then recorded `pruned` at the step judged."""

from __future__ import annotations

import difflib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from optuna.trial import TrialState

from meshforge.core.errors import UsageError
from meshforge.experiments.point_process import run_point
from meshforge.experiments.search.space import as_override
from meshforge.experiments.search.study import INTERRUPTED
from meshforge.experiments.sweep import point_command
from meshforge.run.observe.record import write_json_atomic
from meshforge.run.observe.set_aside import set_aside_earlier_run


@dataclass
class Search:
    """What every trial of one search shares."""

    recipe_path: str
    overrides: list[str]
    search_dir: Path
    objective: str
    group: str
    timeout_s: int
    seeds: list[tuple[int, int]]  # (model seed, data seed) of each repeat
    stop: threading.Event = field(default_factory=threading.Event)


class ObjectiveNotLogged(UsageError):
    """The objective is not among the metrics a finished run logged."""


@dataclass
class Outcome:
    state: TrialState
    value: float | None = None
    attrs: dict = field(default_factory=dict)


def run_trial(search: Search, trial: optuna.Trial) -> Outcome:
    """Run the trial's point once per seed; its objective is the mean of the runs' last values."""
    label = f"trial-{trial.number:04d}"
    values = []
    for i, (seed, data_seed) in enumerate(search.seeds):
        name = label if len(search.seeds) == 1 else f"{label}-seed{i}"
        run_dir = search.search_dir / name
        overrides = [
            *search.overrides,
            *(as_override(k, v) for k, v in trial.params.items()),
            f"seed={seed}",
            f"data.seed={data_seed}",
            f"output_dir={search.search_dir}",
            f"run_name={name}",
            f"logging.wandb_group={search.group if len(search.seeds) == 1 else f'{search.group}/{label}'}",
            f"logging.wandb_tags=[search,{label}]",
            "logging.wandb_job_type=search-trial",
            "logging.progress=false",
        ]
        # a folder of this name from another study (or a deleted study.db) is set aside now, as a
        # rerun's would be, so the watch never reports that run's records as this trial's
        set_aside_earlier_run(run_dir)
        watch = Watch(trial if i == 0 else None, run_dir / "metrics.jsonl", search.objective, search.stop)
        command = point_command(search.recipe_path, {"run_overrides": overrides})
        log = search.search_dir / f"{name}.log"
        status, error = run_point(command, search.timeout_s, log, watch, _note_pid(trial))
        if status == "stopped" and watch.pruned_step is not None:
            _mark_pruned(run_dir, watch.pruned_step, error)
            return Outcome(TrialState.PRUNED, attrs={"pruned_at_step": watch.pruned_step, "run": name})
        if status == "stopped":  # with the search: not counted, the next command runs another
            return Outcome(TrialState.FAIL, attrs={"error": error, "run": name, INTERRUPTED: True})
        if status != "finished":
            return Outcome(TrialState.FAIL, attrs={"error": f"{status}: {error}", "run": name})
        watch.report_rest()  # the steps logged since it last looked: the study's curve is the whole run
        values.append(final_value(run_dir, search.objective))
    return Outcome(TrialState.COMPLETE, sum(values) / len(values), {"seed_values": values})


def _note_pid(trial: optuna.Trial):
    """The run's pid, kept with the trial: a worker killed mid-trial leaves the run going in its own
    session, and the next command stops it (study.fail_killed_trials)."""
    return lambda pid: trial.set_user_attr("run_pid", pid)


class Watch:
    """Asked by run_point while the run goes on: reports the objective's new values to the trial
    (None: reports nothing) and says to stop when the pruner prunes it or the search stops."""

    def __init__(self, trial: optuna.Trial | None, metrics: Path, objective: str, stop: threading.Event):
        self.trial, self.metrics, self.objective, self.stop = trial, metrics, objective, stop
        self.offset = 0
        self.pruned_step: int | None = None

    def __call__(self) -> str | None:
        if self.stop.is_set():
            return "the search was stopped"
        if self.trial is None:
            return None
        for row in self._new_rows():
            if self.objective not in row:
                continue
            self.trial.report(row[self.objective], row["step"])
            if self.trial.should_prune():
                self.pruned_step = row["step"]
                return f"pruned at step {row['step']} ({self.objective} {row[self.objective]:.4g})"
        return None

    def report_rest(self) -> None:
        """Report the values logged since the last look, judging none (the run has ended)."""
        if self.trial is not None:
            for row in self._new_rows():
                if self.objective in row:
                    self.trial.report(row[self.objective], row["step"])

    def _new_rows(self) -> list[dict]:
        """Complete lines written since the last call (a line being written waits for the next)."""
        if not self.metrics.is_file():
            return []
        with open(self.metrics) as f:
            f.seek(self.offset)
            text = f.read()
        done = text[: text.rfind("\n") + 1]
        self.offset += len(done.encode())
        return [json.loads(line) for line in done.splitlines() if line.strip()]


def final_value(run_dir: Path, objective: str) -> float:
    """The objective's last logged value; a run that never logs it raises ObjectiveNotLogged."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    logged = [r[objective] for r in rows if objective in r]
    if logged:
        return float(logged[-1])
    keys = sorted({k for r in rows for k in r if k not in ("time", "step")})
    close = difflib.get_close_matches(objective, keys, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ObjectiveNotLogged(
        f"--objective {objective}: {run_dir.name} finished without logging it; {hint}"
        f"its metrics: {', '.join(keys)}"
    )


def _mark_pruned(run_dir: Path, step: int, reason: str) -> None:
    """run.json says `pruned` and where (the run itself closed it `preempted`, stopped by SIGTERM)."""
    path = run_dir / "run.json"
    if not path.is_file():
        return
    info = json.loads(path.read_text())
    info.update(status="pruned", pruned_at_step=step, error=f"{reason}; stopped by meshforge search")
    write_json_atomic(path, info)
