"""The run around the steps (run/train/lifecycle.py), shared by the torch and JAX trainers: driven
here by a trainer that supplies only a scripted step, so what the lifecycle itself does (when it
reads values on the host, what it records and logs, how it closes) is seen without a model."""

from __future__ import annotations

import contextlib
import gc
import json
import time
from pathlib import Path

import pytest
import torch
from support import QUICK, RECIPES

from meshforge.core.topology import ParallelDims
from meshforge.recipe import load_recipe
from meshforge.run.observe.describe import run_info
from meshforge.run.observe.record import RunState, Throughput
from meshforge.run.rank.distributed import DistEnv
from meshforge.run.train.lifecycle import StepResult, TrainingRun

ONE_RANK = ["mesh.dp_replicate=1", "mesh.dp_shard=1", "mesh.tp=1", "mesh.pp=1"]


class Counted:
    """A step's value as a device would hold it: counts the host reads (float())."""

    def __init__(self, value: float, reads: list[float]):
        self.value, self.reads = value, reads

    def __float__(self) -> float:
        self.reads.append(self.value)
        return self.value


class NoData:
    """A StepLoader with nothing to hand out (the scripted step makes its own numbers)."""

    closed = False

    def loss_floor(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True


class ScriptedTrainer(TrainingRun):
    """Step s has loss 10 - s and grad norm s / 10, on 100 tokens; `fail_at` raises there."""

    def __init__(self, recipe, fail_at: int | None = None):
        super().__init__()
        self.recipe, self.dims = recipe, ParallelDims.from_config(recipe.mesh)
        self.env = DistEnv(0, 0, 1, 1, torch.device("cpu"))
        self.n_params, self.loader, self.state = 1000, NoData(), RunState()
        self.throughput = Throughput(6000.0, 1, None, "cpu")
        self.run_dir = Path(recipe.output_dir) / recipe.run_name
        self.fail_at, self.loss_reads, self.norm_reads = fail_at, [], []

    def train_step(self, step: int) -> StepResult:
        if step == self.fail_at:
            raise RuntimeError(f"a deliberate failure at step {step}")
        loss, norm = Counted(10.0 - step, self.loss_reads), Counted(step / 10, self.norm_reads)
        return StepResult(loss=loss, grad_norm=norm, lr=1e-3, tokens=100)

    def memory(self) -> tuple[dict, list]:
        return {"memory/rss_gib": 1.0}, []

    def run_info(self) -> dict:
        return run_info(self.recipe, self.dims, "cpu", self.n_params)


def _recipe(tmp_path, name: str):
    overrides = [*ONE_RANK, *QUICK, "train.steps=7", "logging.log_every=3", "logging.warmup_steps=1"]
    return load_recipe(RECIPES / "debug_cpu.toml", [*overrides, f"output_dir={tmp_path}", f"run_name={name}"])


def test_values_are_read_on_logging_steps_and_the_run_is_recorded(tmp_path):
    trainer = ScriptedTrainer(_recipe(tmp_path, "scripted"))
    state = trainer.run()
    # grad norms are read only on the logging steps (3, 6, and the last, 7); every loss once
    assert trainer.norm_reads == [0.3, 0.6, 0.7]
    assert trainer.loss_reads == [10.0 - s for s in range(1, 8)] and state.losses == trainer.loss_reads
    run_dir = tmp_path / "scripted"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["grad_norm"], r["memory/rss_gib"]) for r in rows] == [
        (3, 7.0, 0.3, 1.0),
        (6, 4.0, 0.6, 1.0),
        (7, 3.0, 0.7, 1.0),
    ]
    info = json.loads((run_dir / "run.json").read_text())
    summary = info["summary"]
    assert info["status"] == "finished" and summary["steps"] == 7
    assert summary["final_loss"] == 3.0 and summary["best_loss"] == 3.0
    # the throughput rule: the first step (warmup_steps=1) left out, the other six counted
    assert summary["throughput_steps"] == {"counted": 6, "excluded": {"warmup": [1]}}
    assert trainer.loader.closed


def test_a_failing_step_closes_the_records_with_the_error(tmp_path):
    trainer = ScriptedTrainer(_recipe(tmp_path, "failing"), fail_at=5)
    with pytest.raises(RuntimeError, match="deliberate failure at step 5"):
        trainer.run()
    info = json.loads((tmp_path / "failing" / "run.json").read_text())
    assert info["status"] == "failed" and "deliberate failure at step 5" in info["error"]
    assert info["summary"]["steps"] == 4 and info["summary"]["final_loss"] == 6.0  # steps 1-4 kept
    rows = (tmp_path / "failing" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [3]
    assert trainer.loader.closed


def test_a_requeue_of_a_finished_run_trains_nothing_and_keeps_its_records(tmp_path):
    """`checkpoint.load=auto` on a run whose last checkpoint is its last step: the summary, the
    status and the records of the run that finished stay exactly as they were."""
    finished = ScriptedTrainer(_recipe(tmp_path, "done"))
    finished.run()
    run_dir = tmp_path / "done"
    before = {f: (run_dir / f).read_text() for f in ("run.json", "metrics.jsonl")}
    requeued = ScriptedTrainer(_recipe(tmp_path, "done"))
    requeued.start_step = 7  # what restore() returns for the checkpoint of step 7 of 7
    requeued.train_step = lambda step: pytest.fail(f"step {step} of a finished run was trained")
    state = requeued.run()
    assert state.step == 0 and requeued.loader.closed
    assert {f: (run_dir / f).read_text() for f in before} == before
    assert json.loads(before["run.json"])["summary"]["final_loss"] == 3.0


class GcWatchingTrainer(ScriptedTrainer):
    """Records, per step, whether Python's collector was on, and which step's end ran a collection
    while it was off (the paced ones: an automatic one cannot run then); the collection at the end of
    step `slow_at` takes 0.2 s longer."""

    def __init__(self, recipe, fail_at: int | None = None, slow_at: int = 3):
        super().__init__(recipe, fail_at)
        self.enabled, self.collections, self.step, self.slow_at = {}, [], 0, slow_at

    def train_step(self, step: int) -> StepResult:
        self.step = step
        self.enabled[step] = gc.isenabled()
        return super().train_step(step)

    def watch(self, phase: str, info: dict) -> None:
        if phase == "start" and not gc.isenabled():
            self.collections.append((self.step, info["generation"]))
            if self.step == self.slow_at:
                time.sleep(0.2)


@pytest.mark.parametrize("gc_every,fail_at", [(3, None), (3, 7), (0, None)])
def test_the_garbage_collector_is_paced_by_the_steps_and_restored(tmp_path, gc_every, fail_at):
    """train.gc_every=3: the collector off while the steps run; everything collected once before step
    1, the young generations at the ends of steps 3 and 6 (every rank at the same steps, so none
    stalls its peers with its own), in those steps' time; on again when the run ends, finished or
    failed. 0: Python's automatic collection, untouched."""
    recipe = load_recipe(
        RECIPES / "debug_cpu.toml",
        [
            *ONE_RANK,
            *QUICK,
            "train.steps=7",
            f"train.gc_every={gc_every}",
            f"output_dir={tmp_path}",
            "run_name=gc",
        ],
    )
    trainer = GcWatchingTrainer(recipe, fail_at=fail_at)
    assert gc.isenabled()
    gc.callbacks.append(trainer.watch)
    try:
        with pytest.raises(RuntimeError, match="deliberate failure") if fail_at else contextlib.nullcontext():
            state = trainer.run()
    finally:
        gc.callbacks.remove(trainer.watch)
    assert gc.isenabled()  # restored
    steps = range(1, 8)  # a failing step 7 ran with the collector off too
    if gc_every:
        assert trainer.enabled == {s: False for s in steps}
        assert trainer.collections == [(0, 2), (3, 1), (6, 1)], trainer.collections
    else:
        assert trainer.enabled == {s: True for s in steps} and trainer.collections == []
    if not fail_at:
        seconds = {t.step: t.seconds for t in state.times}
        assert (seconds[3] >= 0.2) == bool(gc_every) and seconds[2] < 0.2  # the collection is in its step
