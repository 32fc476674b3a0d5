"""The run around the steps, written once for the torch and JAX trainers: open the records
(run.json, the loggers, the console), time every step, count it under the throughput rule,
log it, and, whatever happens, close the data, the records, the loggers and the console with
the run's status and summary. A trainer subclasses `TrainingRun` and supplies its step and
what is its own (evaluation, checkpoints, how it measures memory)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from meshforge.configs import Recipe
from meshforge.core.errors import Interrupted, OutOfMemory
from meshforge.core.topology import ParallelDims
from meshforge.run.data.loader import StepLoader
from meshforge.run.observe.console import RunConsole
from meshforge.run.observe.describe import banner, log_final, open_run
from meshforge.run.observe.loggers import LoggerContainer
from meshforge.run.observe.record import RunRecord, RunState, StepTime, Throughput, exclusion, summarize
from meshforge.run.rank import distributed as mfdist
from meshforge.run.rank.distributed import DistEnv
from meshforge.run.rank.env import LAUNCHED_ENV
from meshforge.run.train.guards import StopSignals
from meshforge.run.train.paced_gc import paced_gc

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """One training step's outcome. `loss` and `grad_norm` stay where the step computed them (a
    device tensor, a JAX array): the host reads them only on logging steps (and at the summary)."""

    loss: Any
    grad_norm: Any
    lr: float
    tokens: int  # target tokens in the global batch
    finite: bool = True  # the update was applied
    overflow: bool = False  # fp16: skipped on an overflow; the loss scale backed off
    stop: bool = False  # a stop signal reached every rank: stop after this step
    tracked: bool = False  # ran under the memory tracker (logging.memory_breakdown_step)
    profiled: bool = False  # ran under torch.profiler ([profile])
    loss_scale: dict = field(default_factory=dict)  # fp16: loss_scale, overflow_steps
    memory_breakdown: dict = field(default_factory=dict)  # mem_breakdown/<category>_gib and its _min/_rank
    eval: dict = field(default_factory=dict)  # eval/loss, eval/perplexity, when it evaluated
    extra: Any = None  # a trainer's further metrics, read on logging steps (`extra_metrics`)
    profile: dict = field(default_factory=dict)  # profile/<part>_s after the last profiled step


class TrainingRun:
    """A run's lifecycle; a trainer sets the attributes below in its __init__ and implements
    `train_step`, `memory` and `run_info` (the other hooks have defaults)."""

    recipe: Recipe
    dims: ParallelDims
    env: DistEnv
    n_params: int
    throughput: Throughput
    loader: StepLoader
    run_dir: Path
    state: RunState
    start_step: int = 0
    resumed: dict | None = None  # the checkpoint a resumed run continues ({path, step, run_id})

    def __init__(self):
        """The lifecycle's own state; a trainer calls this first."""
        self.stop = StopSignals()  # installed while the steps run
        self.console = RunConsole(enabled=False)  # rank 0's replaces it when the run opens
        self.record: RunRecord | None = None
        self.loggers: LoggerContainer | None = None
        self.run_id: str | None = None
        self._unread_losses: list = []

    # --- what a trainer supplies ------------------------------------------------------

    def train_step(self, step: int) -> StepResult:
        """One step, finished (the host may read its results)."""
        raise NotImplementedError

    def memory(self) -> tuple[dict, list]:
        """This rank's memory metrics for the loggers (max/min over ranks) and per rank."""
        raise NotImplementedError

    def run_info(self) -> dict:
        """run.json's description of the run (describe.run_info plus what is the trainer's)."""
        raise NotImplementedError

    def after_step(self, step: int, result: StepResult) -> float | None:
        """What follows a step before its time ends (evaluation, the bad-step budget, a
        checkpoint); returns the seconds a checkpoint save held training up, None if none."""
        return None

    def is_last(self, step: int) -> bool:
        """Whether `step` is the loop's last (train.steps): the one a checkpoint policy always saves."""
        return step == self.recipe.train.steps

    def layout(self) -> list[list[int]] | None:
        """The pipeline's layers per stage, for the banner (None: not pipelined)."""
        return None

    def on_open(self, record: RunRecord, loggers: LoggerContainer) -> None:
        """After the records open (rank 0), before the first step."""

    def finish(self) -> None:
        """After the last step, before the run counts as finished (an async save in flight)."""

    def close_sources(self) -> None:
        """Stop the data threads."""
        self.loader.close()

    def summary_extra(self) -> dict:
        """The trainer's own summary entries."""
        return {}

    def latest_checkpoint(self) -> Path | None:
        return None

    def oom_report(self, error: BaseException, step: int) -> str:
        """The message of an out-of-memory at `step` (and any report written beside the records)."""
        return f"out of memory at step {step}: {error}"

    # --- the lifecycle ------------------------------------------------------------------

    def run(self) -> RunState:
        r, env, st = self.recipe, self.env, self.state
        if self.start_step >= r.train.steps:  # a requeue of a finished run: its records stay as they are
            if env.is_main:
                log.warning(
                    f"{r.run_name} already trained {self.start_step} of {r.train.steps} steps: nothing to do"
                )
            self.close_sources()
            return st
        # launched here by meshforge: the launcher shows the run (run/launch/watch.py); else rank 0 does
        launched = os.environ.get(LAUNCHED_ENV) == "launcher"
        self.console = RunConsole(enabled=env.is_main and r.logging.progress and not launched)
        if env.is_main:
            layout, floor = self.layout(), self.loader.loss_floor()
            about = banner(r, self.dims, self.n_params, env.device.type, layout, floor, self.resumed)
            self.record, self.loggers = open_run(
                r, self.dims, self.run_info(), self.console, about, self.resumed
            )
            self.console.start(about, self.run_dir, self.loggers.paths().get("wandb"))
            self.on_open(self.record, self.loggers)
        self.run_id = mfdist.broadcast_object(self.record.run_id if self.record else None)
        status = "failed"
        try:
            with self.stop:
                self._steps()
            self.finish()
            status = "finished"
        except Interrupted as e:
            status = "preempted"
            self._fail(e)
            raise
        except torch.OutOfMemoryError as e:
            status = "oom"
            message = self.oom_report(e, st.step + 1)
            self._fail(message)
            raise OutOfMemory(message) from e
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            self.close_sources()
            if self.record:
                self._close(status)
        return st

    def _steps(self) -> None:
        with paced_gc(self.recipe.train.gc_every) as collect_garbage:
            step_end = time.perf_counter()
            for step in range(self.start_step + 1, self.recipe.train.steps + 1):
                result, saved_s = self.train_step(step), None
                collect_garbage(step)  # in the step's time: what the run pays
                try:
                    saved_s = self.after_step(step, result)
                finally:  # a step that ends the run (the bad-step budget) is logged first
                    now = time.perf_counter()  # the step's time runs from the last one's end to here
                    self._record(step, result, now - step_end, saved_s)
                    step_end = now
                if result.stop:
                    self.finish()  # an async save of this step is committed before the run ends
                    raise self.stop.interrupted(
                        step, self.latest_checkpoint() if saved_s is not None else None
                    )

    def _record(self, step: int, result: StepResult, seconds: float, checkpoint_s: float | None) -> None:
        """Count the step's time for the summary (steady or excluded, and why) and log it."""
        r, st, evaluated = self.recipe, self.state, bool(result.eval)
        why = exclusion(
            step - self.start_step,
            r.logging.warmup_steps,
            tracked=result.tracked,
            profiled=result.profiled,
            saved=checkpoint_s is not None,
            evaluated=evaluated,
        )
        st.step = step
        st.times.append(StepTime(step, result.tokens, seconds, why))
        self._unread_losses.append(result.loss)
        due = step % r.logging.log_every == 0 or step == r.train.steps
        if due or not result.finite or result.tracked or evaluated or result.profiled:
            metrics = self._metrics(step, result, seconds)  # every rank: memory is reduced over ranks
            if checkpoint_s is not None:
                metrics["checkpoint_seconds"] = checkpoint_s
            if self.loggers is not None:
                self.loggers.log(metrics, step)
            self.console.update(step, metrics)
        if checkpoint_s is not None and self.loggers is not None:
            self.loggers.flush()  # a run killed later resumes from this checkpoint: its records up to it stay

    def _read_losses(self) -> None:
        """The losses since the last logging step, read on the host now (for the summary)."""
        self.state.losses.extend(float(x) for x in self._unread_losses)
        self._unread_losses.clear()

    def _metrics(self, step: int, result: StepResult, seconds: float) -> dict:
        self._read_losses()
        mem, self.state.per_rank_memory = self.memory()
        self.state.last_memory = mem
        return {
            "step": step,
            "loss": self.state.losses[-1],
            "grad_norm": float(result.grad_norm),
            "lr": result.lr,
            **self.throughput.rates(result.tokens, seconds),
            **result.loss_scale,
            **mem,
            **result.memory_breakdown,
            **result.eval,
            **self.extra_metrics(result),
            **result.profile,
            **({"profile/active": 1.0} if result.profiled else {}),
        }

    def extra_metrics(self, result: StepResult) -> dict:
        """A trainer's further metrics of a logged step (e.g. MoE loads), from `result.extra`."""
        return {}

    def summary(self) -> dict:
        self._read_losses()
        return {**summarize(self.state, self.throughput, self.loader.loss_floor()), **self.summary_extra()}

    def _fail(self, error: BaseException | str) -> None:
        if self.record:
            self.record.fail(error)

    def _close(self, status: str) -> None:
        """run.json's status and summary, the final tables, the loggers and the terminal."""
        summary = self.summary()
        self.record.close(status, summary)
        log_final(self.loggers, self.recipe, self.state.per_rank_memory, self.latest_checkpoint())
        self.loggers.log_summary(summary)
        self.loggers.close()
        paths = self.loggers.paths()
        self.console.finish(self.recipe.run_name, status, summary, self.run_dir, self.env.device.type, paths)
