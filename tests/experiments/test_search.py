"""`meshforge search`: the study is read back with Optuna's own API (a real client), trials are
ordinary runs whose records say how they ended, a pruned trial stops early and says where, two
workers share one SQLite study, a killed worker's trial is marked failed and the next command
continues; bad input is one line naming the value and the fix."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState
from scipy import stats
from support import RECIPES, cli_env

from meshforge.cli import meshforge_main
from meshforge.experiments import compare, seeds

RECIPE = str(RECIPES / "debug_cpu.toml")
# one process, 10 steps of the tiny model: a trial is a few seconds
TINY = [
    "mesh.dp_shard=1",
    "mesh.tp=1",
    "mesh.pp=1",
    "train.steps=10",
    "train.seq_len=32",
    "train.global_batch_size=8",
    "logging.tensorboard=false",
    "logging.wandb=false",
    "logging.memory_breakdown_step=0",
]


def search(tmp: Path, *flags: str, recipe: str = RECIPE) -> list[str]:
    return ["search", recipe, *TINY, f"output_dir={tmp}", *flags]


def load(tmp: Path, name: str = "search-debug_cpu") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp / name / 'study.db'}")


def rows_of(tmp: Path, run: str) -> list[dict]:
    return [
        json.loads(x) for x in (tmp / "search-debug_cpu" / run / "metrics.jsonl").read_text().splitlines()
    ]


def run_json(tmp: Path, run: str) -> dict:
    return json.loads((tmp / "search-debug_cpu" / run / "run.json").read_text())


@pytest.mark.parametrize(
    "space, said",
    [
        (
            "optimizer.lrr=log(1e-4,1e-2)",
            "--space optimizer.lrr: optimizer.lrr = 0.0001: unknown key; did you mean optimizer.lr?",
        ),
        ("optimizer.lr=log(1e-2,1e-4)", "--space optimizer.lr=log(1e-2,1e-4): LOW (1e-2) must be below HIGH"),
        ("optimizer.lr=lg(1,2)", "--space optimizer.lr=lg(1,2): unknown SPEC; write log(1e-4,1e-2)"),
        ("optimizer.lr", "--space 'optimizer.lr': expected KEY=SPEC"),
        ("train.steps=int(1,x)", "--space train.steps=int(1,x): bounds must be ints"),
        ("train.steps=choice(10,ten)", "--space train.steps: train.steps = 'ten': wrong type: expected int"),
        ("optimizer.lr=log(0,1)", "log needs LOW > 0; use float(...)"),
        ("seed=int(0,9)", "--space seed: the search sets seed for every run itself (seeds: --seeds K"),
    ],
)
def test_a_bad_space_is_one_line_naming_it_and_the_fix(tmp_path, capsys, space, said):
    assert meshforge_main(search(tmp_path, "--space", space)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in " ".join(err.split()), err
    assert not (tmp_path / "search-debug_cpu").exists()  # refused before anything is made


def test_bad_storage_objective_and_study_are_refused_in_one_line(tmp_path, capsys):
    space = ["--space", "optimizer.lr=log(1e-4,1e-2)"]
    bad_url = f"sqlite:///{tmp_path}/no/such/folder/study.db"
    assert meshforge_main(search(tmp_path, *space, "--storage", bad_url)) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--storage {bad_url}: cannot open it (OperationalError" in err and "give a reachable" in err
    assert meshforge_main(search(tmp_path, *space, "--objective", "eval/loss")) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--objective eval/loss: the recipe never evaluates (eval.every = 0); set eval.every=N" in err
    # the study of one recipe is not continued by another
    optuna.create_study(study_name="mine", storage=f"sqlite:///{tmp_path}/s.db").set_user_attr("recipe", "x")
    flags = [*space, "--storage", f"sqlite:///{tmp_path}/s.db", "--study", "mine"]
    assert meshforge_main(search(tmp_path, *flags)) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--study mine: the study at" in err and "is a search of x, not debug_cpu" in err


def test_an_objective_no_run_logs_fails_its_trial_and_stops_the_search(tmp_path, capsys):
    args = search(
        tmp_path, "--space", "optimizer.lr=log(1e-4,1e-2)", "--objective", "grad_nrm", "--trials", "3"
    )
    assert meshforge_main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--objective grad_nrm: trial-0000 finished without logging it; did you mean grad_norm?" in err
    (trial,) = load(tmp_path).get_trials()  # one trial, not three: the search stopped
    assert trial.state == TrialState.FAIL and "grad_nrm" in trial.user_attrs["error"]


def test_a_search_prunes_a_trailing_trial_and_a_rerun_continues_the_study(tmp_path, capsys):
    # the study made first by Optuna itself, its first two trials queued: a good lr, then one that
    # barely moves the weights (the median pruner, judging after one trial, stops it)
    study = optuna.create_study(study_name="search-debug_cpu", storage=f"sqlite:///{tmp_path}/study.db")
    study.enqueue_trial({"optimizer.lr": 3e-3})
    study.enqueue_trial({"optimizer.lr": 1e-7})
    (tmp_path / "search-debug_cpu").mkdir()
    (tmp_path / "study.db").rename(tmp_path / "search-debug_cpu" / "study.db")
    # steps long enough (~0.5 s) for the search to see each one logged while the run goes on
    steps = ["train.steps=16", "train.seq_len=64", "train.global_batch_size=32"]
    flags = [*steps, "--space", "optimizer.lr=log(1e-7,1e-2)", "--startup-trials", "1", "--trials", "2"]
    assert meshforge_main(search(tmp_path, *flags)) == 0
    out = capsys.readouterr().out
    assert "trial 0: complete" in out and "trial 1: pruned at step " in out, out

    study = load(tmp_path)
    good, pruned = study.get_trials()
    assert good.state == TrialState.COMPLETE and pruned.state == TrialState.PRUNED
    assert study.user_attrs["recipe"] == "debug_cpu"
    assert study.best_trial.number == 0 and study.best_trial.params == {"optimizer.lr": 3e-3}
    rows = rows_of(tmp_path, "trial-0000")
    assert good.value == rows[-1]["loss"] and rows[-1]["step"] == 16  # the objective: the last loss
    assert good.intermediate_values == {r["step"]: r["loss"] for r in rows}
    # the pruned run: stopped after the step judged (or the one it was in), its records closed and saying so
    info = run_json(tmp_path, "trial-0001")
    at = pruned.user_attrs["pruned_at_step"]  # the first step its best loss trails the median's
    assert 2 <= at < 16 and f"trial 1: pruned at step {at}" in out
    assert info["status"] == "pruned" and info["pruned_at_step"] == at
    assert info["recipe"]["optimizer"]["lr"] == 1e-7 and info["recipe"]["train"]["steps"] == 16
    stopped = rows_of(tmp_path, "trial-0001")
    assert at <= len(stopped) < 16 and [r["step"] for r in stopped] == list(range(1, len(stopped) + 1))
    assert pruned.intermediate_values == {r["step"]: r["loss"] for r in stopped[:at]}
    assert run_json(tmp_path, "trial-0000")["status"] == "finished"
    assert "best: trial 0" in out and "reproduce with: optimizer.lr=0.003" in out
    assert f"plots: {tmp_path / 'search-debug_cpu' / 'history.png'}" in out  # Optuna's own analysis

    before = (tmp_path / "search-debug_cpu/trial-0000/metrics.jsonl").stat().st_mtime
    assert meshforge_main(search(tmp_path, *flags[:-1], "3")) == 0  # the same study, one more trial
    study = load(tmp_path)
    assert [t.number for t in study.get_trials()] == [0, 1, 2]
    assert study.get_trials()[2].state in (TrialState.COMPLETE, TrialState.PRUNED)
    assert (tmp_path / "search-debug_cpu/trial-0000/metrics.jsonl").stat().st_mtime == before


def _meshforge(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "meshforge"), *args],
        cwd=cwd,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_two_workers_write_one_sqlite_study_at_once(tmp_path):
    args = search(tmp_path, "--space", "optimizer.lr=log(1e-4,1e-2)", "--trials", "2", "--pruner", "none")
    first, second = _meshforge(args, tmp_path), _meshforge(args, tmp_path)
    for p in (first, second):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    trials = load(tmp_path).get_trials()
    # each command stops once the study holds 2: the other may have asked for one more meanwhile
    assert 2 <= len(trials) <= 3 and all(t.state == TrialState.COMPLETE for t in trials)
    assert {t.user_attrs["worker"].rpartition(":")[2] for t in trials} == {str(first.pid), str(second.pid)}
    for t in trials:
        info = run_json(tmp_path, f"trial-{t.number:04d}")
        assert info["status"] == "finished" and info["recipe"]["optimizer"]["lr"] == t.params["optimizer.lr"]


@pytest.mark.slow
def test_a_killed_worker_leaves_a_study_the_next_command_continues(tmp_path):
    # the orphaned trial is long, so it is still running when the next command stops it
    args = search(tmp_path, "--space", "optimizer.lr=log(1e-4,1e-2)", "--trials", "1", "train.steps=3000")
    worker = _meshforge(args, tmp_path)
    metrics = tmp_path / "search-debug_cpu/trial-0000/metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert time.monotonic() < deadline and worker.poll() is None, worker.communicate()
        time.sleep(0.5)
    os.kill(worker.pid, signal.SIGKILL)  # mid-trial: nothing of it gets to tell the study
    worker.wait()
    assert load(tmp_path).get_trials()[0].state == TrialState.RUNNING
    again = _meshforge(args[:-1] + ["train.steps=10"], tmp_path)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-2000:]
    assert "trials 0: their worker was killed; marked failed" in out
    killed, *rest = load(tmp_path).get_trials()
    assert killed.state == TrialState.FAIL and f":{worker.pid} was killed" in killed.user_attrs["killed"]
    # its run, orphaned in its own session, was stopped by the next command at a step, records closed
    deadline = time.monotonic() + 60
    while run_json(tmp_path, "trial-0000")["status"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    info = run_json(tmp_path, "trial-0000")
    assert info["status"] == "preempted" and "stopped by SIGTERM" in info["error"], info["status"]
    assert len(rows_of(tmp_path, "trial-0000")) < 3000
    assert [t.state for t in rest] == [TrialState.COMPLETE]  # the killed one is not counted


@pytest.mark.slow
def test_seeds_are_one_point_and_compare_gives_scipys_mean_std_and_welch_interval(tmp_path, capsys):
    flags = [
        "--space",
        "optimizer.lr=choice(0.003,0.0003)",
        "--seeds",
        "2",
        "--trials",
        "2",
        "--pruner",
        "none",
    ]
    study = optuna.create_study(study_name="search-debug_cpu", storage=f"sqlite:///{tmp_path}/study.db")
    study.enqueue_trial({"optimizer.lr": "0.003"})
    study.enqueue_trial({"optimizer.lr": "0.0003"})
    (tmp_path / "search-debug_cpu").mkdir()
    (tmp_path / "study.db").rename(tmp_path / "search-debug_cpu" / "study.db")
    assert meshforge_main(search(tmp_path, *flags)) == 0
    capsys.readouterr()
    folder = tmp_path / "search-debug_cpu"
    final = {
        (t, s): rows_of(tmp_path, f"trial-000{t}-seed{s}")[-1]["loss"] for t in range(2) for s in range(2)
    }
    for t in range(2):  # each seed its own model init and data order; the trial's value their mean
        infos = [run_json(tmp_path, f"trial-000{t}-seed{s}") for s in range(2)]
        assert [(i["recipe"]["seed"], i["recipe"]["data"]["seed"]) for i in infos] == [(0, 1234), (1, 1235)]
        assert final[t, 0] != final[t, 1]
        assert load(tmp_path).trials[t].value == pytest.approx((final[t, 0] + final[t, 1]) / 2, rel=1e-12)

    assert {p.name for p in folder.glob("*.png")} == {"history.png", "importances.png", "slice.png"}
    out_dir = tmp_path / "plots"
    assert meshforge_main(["compare", str(folder), "--out", str(out_dir), "--baseline", "trial-0000"]) == 0
    out = " ".join(re.sub("[│┃]", " ", capsys.readouterr().out).split())  # the table's cells, spaced
    # what scipy computes from the records themselves
    a, b = [final[1, 0], final[1, 1]], [final[0, 0], final[0, 1]]
    welch = stats.ttest_ind(a, b, equal_var=False)
    ci = welch.confidence_interval(0.95)
    for values in (a, b):
        assert f"{np.mean(values):.4f} {np.std(values, ddof=1):.4f}" in out
    diff = np.mean(a) - np.mean(b)
    assert (
        f"trial-0001 2 {np.mean(a):.4f} {np.std(a, ddof=1):.4f} {diff:+.4g} [{ci.low:+.4g}, {ci.high:+.4g}]"
        in out
    )
    assert ("significant" if welch.pvalue < 0.05 else "within noise") in out
    assert (out_dir / "loss_by_point.png").is_file()
    (d,) = seeds.differences(seeds.final_values(compare.find_runs([folder]), "loss"), "trial-0000")
    assert (d.low, d.high, d.pvalue) == (ci.low, ci.high, welch.pvalue) and d.diff == pytest.approx(
        diff, rel=1e-12
    )


@pytest.mark.slow
def test_run_recipe_seeds_repeat_one_point_in_one_group(tmp_path, capsys):
    from meshforge.cli import run_recipe_main

    args = [RECIPE, *TINY, "train.steps=4", f"output_dir={tmp_path}", "run_name=pt", "--seeds", "2"]
    assert run_recipe_main(args) == 0
    infos = [json.loads((tmp_path / f"pt-seed{i}" / "run.json").read_text()) for i in range(2)]
    assert [(i["status"], i["recipe"]["seed"], i["recipe"]["data"]["seed"]) for i in infos] == [
        ("finished", 0, 1234),
        ("finished", 1, 1235),
    ]
    assert {i["recipe"]["logging"]["wandb_group"] for i in infos} == {"pt"}
    assert run_recipe_main([*args, "--sweep"]) == 2
    assert "--seeds with --sweep: a sweep runs each layout once" in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_stops_every_running_trial_cleanly_and_they_are_not_counted(tmp_path):
    args = search(tmp_path, "--space", "optimizer.lr=log(1e-4,1e-2)", "--trials", "2", "--workers", "2")
    search_proc = _meshforge([*args, "train.steps=40"], tmp_path)
    folder, deadline = tmp_path / "search-debug_cpu", time.monotonic() + 120
    while not all((folder / f"trial-000{i}/metrics.jsonl").is_file() for i in range(2)):
        assert time.monotonic() < deadline and search_proc.poll() is None, search_proc.communicate()
        time.sleep(0.5)
    search_proc.send_signal(signal.SIGINT)
    out, err = search_proc.communicate(timeout=120)
    assert search_proc.returncode == 130, err[-2000:]
    assert "stopped by SIGINT: the running trials were stopped and marked failed (not counted" in err
    for t in load(tmp_path).get_trials():
        assert t.state == TrialState.FAIL and t.user_attrs["interrupted"] is True
        info = run_json(tmp_path, f"trial-{t.number:04d}")
        assert info["status"] == "preempted" and len(rows_of(tmp_path, f"trial-{t.number:04d}")) < 40


def test_a_seed_that_did_not_finish_is_left_out_of_its_points_statistics():
    """A pruned or failed seed's last value is an earlier step's: averaging it with finished seeds
    would be a wrong number, so it is left out (and compare names it)."""
    runs = [
        compare.Run(
            f"p-seed{i}", Path("."), {"status": status}, [{"step": 1, "loss": 9.0}, {"step": n, "loss": v}]
        )
        for i, (status, n, v) in enumerate([("finished", 20, 2.0), ("finished", 20, 2.2), ("pruned", 5, 6.0)])
    ]
    assert seeds.final_values(runs, "loss") == {"p": [2.0, 2.2]}
    assert seeds.unfinished(runs) == ["p-seed2"]


def test_a_worker_that_finds_the_tables_half_made_by_another_tries_again(monkeypatch, tmp_path):
    """Two workers opening a new SQLite study at once: the one that finds a table the other just
    made ("table studies already exists", seen in a two-worker run) opens it on its next try."""
    from meshforge.experiments.search import study

    real, calls = optuna.storages.RDBStorage, []

    def racing(url, **kw):
        calls.append(url)
        if len(calls) == 1:
            raise RuntimeError("(sqlite3.OperationalError) table studies already exists")
        return real(url, **kw)

    monkeypatch.setattr(optuna.storages, "RDBStorage", racing)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    assert isinstance(study._storage(url), real) and calls == [url, url]
