"""The training loop, for one process or one rank of many.

Flow: process group -> DeviceMesh -> model on meta -> parallelize (PP, TP, AC, compile,
FSDP) -> materialize weights (mesh-independent) -> optimizer + schedule -> sharded data
-> steps. The loss is the sum of token cross-entropies divided by the number of target
tokens in the whole global batch, so losses and gradients match across mesh shapes.
Each component owns its policy: the checkpointer when to save, the record run.json, the
console what the terminal shows; the loop only steps, logs and asks them."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshforge.configs import Recipe, recipe_to_dict
from meshforge.core.errors import OutOfMemory
from meshforge.core.logs import setup_logging
from meshforge.core.seeding import seed_process
from meshforge.core.topology import ParallelDims
from meshforge.models import args_from_config, count_params, get_model_spec
from meshforge.parallelisms import build_meshes, check_parameter_count, materialize, parallelize
from meshforge.parallelisms.fsdp import quiet_embedding_view_warning
from meshforge.parallelisms.pp import ZERO_BUBBLE_SCHEDULES, build_schedule
from meshforge.parallelisms.tied import tie_across_stages
from meshforge.run.checkpoint.dcp import Checkpointer, checkpoint_folder
from meshforge.run.checkpoint.state import ModelState, OptimizerState
from meshforge.run.data.synthetic import loss_floor
from meshforge.run.launch import distributed as mfdist
from meshforge.run.launch.plan import make_plan
from meshforge.run.launch.watch import LAUNCHED_ENV
from meshforge.run.observe.console import RunConsole
from meshforge.run.observe.describe import (
    banner,
    draw_breakdown,
    draw_pipeline,
    log_final,
    open_run,
    run_info,
)
from meshforge.run.observe.flops import device_peak_flops, flops_per_token
from meshforge.run.observe.loggers import Loggers
from meshforge.run.observe.memory import (
    dump_oom,
    memory_metrics,
    model_state_tensors,
    rank_memory,
    reduce_across_ranks,
    start_memory_history,
    state_bytes,
)
from meshforge.run.observe.memtrace import peak_categories, tracked_step
from meshforge.run.observe.record import RunState, StepTime, Throughput, exclusion, summarize
from meshforge.run.train.evaluate import data_streams
from meshforge.run.train.forward_backward import ForwardBackward
from meshforge.run.train.guards import BadStepBudget, StopSignals
from meshforge.run.train.loss_scale import LossScaler, overflow_note
from meshforge.run.train.optim import build_lr_scheduler, build_optimizer
from meshforge.run.train.step import IGNORE_INDEX, StepPolicy, clip_grad_norm


class Trainer:
    def __init__(self, recipe: Recipe):
        self.recipe = r = recipe
        # one process needs a (1-rank) process group only when FSDP still applies: cpu_offload
        self.env = mfdist.setup(r.train.device, r.train.cpu_threads, group_of_one=r.fsdp.cpu_offload)
        if r.logging.memory_history:
            start_memory_history(self.env.device)
        self.dims = ParallelDims.from_config(r.mesh)
        self.dims.check_world(self.env.world_size)
        seed_process(r.seed)
        if r.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.meshes = build_meshes(self.dims, self.env.device.type) if dist.is_initialized() else None

        # model on meta -> parallelize -> materialize
        self.spec = get_model_spec(r.model.name)
        self.model_args = args_from_config(r.model)
        with torch.device("meta"):
            model = self.spec.build(self.model_args)
        self.n_params = count_params(model)
        self.pmodel = parallelize(
            model,
            self.meshes,
            self.dims,
            self.spec,
            tp=r.tp,
            pp=r.pp,
            ac=r.activation_checkpoint,
            compile=r.compile,
            fsdp=r.fsdp,
        )
        for part in self.pmodel.parts:
            materialize(part, self.env.device, r.seed, params_on_cpu=r.fsdp.cpu_offload)
            part.train()
        self.params = [p for part in self.pmodel.parts for p in part.parameters()]
        pp_group = self.meshes.pp.get_group() if self.dims.pp_enabled else None
        root = self.meshes.root if self.meshes else None
        self.tied = tie_across_stages(self.pmodel.parts, self.pmodel.stage_ids, root, r.pp, self.env.device)
        check_parameter_count(self.pmodel.parts, self.n_params, self.env.device, pp_group, self.tied)

        # one optimizer per model part, so checkpoints key optimizer state by FQN per stage
        self.optimizers = [build_optimizer(part.parameters(), r.optimizer) for part in self.pmodel.parts]
        self.schedulers = [build_lr_scheduler(opt, r.train.steps, r.lr_scheduler) for opt in self.optimizers]
        self.scaler = LossScaler(r.loss_scale, enabled=r.fsdp.param_dtype == "float16")

        vocab = self.model_args.vocab_size
        self.loader, self.evaluator = data_streams(r, vocab, self.meshes, self.dims, self.env.device)

        ids, n_stages = self.pmodel.stage_ids, self.dims.pp * r.pp.stages_per_rank
        self.forward_backward = ForwardBackward(
            self.pmodel.parts,
            None,
            0 in ids,
            n_stages - 1 in ids,
            r.pp.microbatches,
            StepPolicy.of(self.dims, r.tp, r.fsdp),
            self.env.device,
        )
        self.schedule = None
        if self.dims.pp_enabled:
            self.schedule = build_schedule(
                self.pmodel.parts,
                ids,
                self.meshes.pp,
                r.pp,
                self.env.device,
                self.forward_backward.pipeline_loss,
            )
            self.forward_backward.schedule = self.schedule
        self.run_dir = Path(r.output_dir) / r.run_name
        folder = checkpoint_folder(r.checkpoint, self.run_dir)
        state = ModelState(self.pmodel.parts), OptimizerState(self.pmodel.parts, self.optimizers)
        self.checkpointer = Checkpointer(r.checkpoint, folder, *state, self.env.is_main, 12 * self.n_params)
        self.resumed = self.checkpointer.restore(
            self.pmodel.parts, self.model_args, self.loader, self.schedulers, self.scaler
        )
        self.start_step = self.resumed["step"] if self.resumed else 0
        self.throughput = Throughput(
            flops_per_token(self.model_args, r.train.seq_len, self.n_params),
            self.env.world_size,
            device_peak_flops(self.env, r.fsdp.param_dtype),
            self.env.device.type,
        )
        self.state = RunState(step=self.start_step)
        self.stop = StopSignals()
        self._breakdown_blocked = None
        if self.dims.pp_enabled and r.pp.schedule in ZERO_BUBBLE_SCHEDULES:
            self._breakdown_blocked = (
                f"no memory-by-category step under {r.pp.schedule}: its split backward runs "
                "torch.autograd.grad, which torch's MemTracker hooks cannot follow (meshforge estimate "
                "still traces it)"
            )

    # --- checkpoints ------------------------------------------------------------------

    @property
    def phase(self) -> str:
        """What the step is doing (forward, backward, optimizer, ...), for an out-of-memory report."""
        return self.forward_backward.phase

    @phase.setter
    def phase(self, value: str) -> None:
        self.forward_backward.phase = value

    def _checkpoint_meta(self, step: int, run_id: str | None) -> dict:
        return {
            "step": step,
            **self.loader.checkpoint_state(),  # a corpus gathers every dp rank's position (a collective)
            "lr_scheduler": self.schedulers[0].state_dict(),
            "loss_scale": self.scaler.state_dict() if self.scaler.enabled else None,
            "run_id": run_id,
            "mesh": self.dims.degrees,
            "recipe": recipe_to_dict(self.recipe),
            "model_args": dataclasses.asdict(self.model_args),  # the resolved shape (model.hf may move)
        }

    # --- one step -------------------------------------------------------------------

    def train_step(self) -> dict:
        r, env = self.recipe, self.env
        batches = self.loader.next_step()
        # the global number of target tokens, summed over accumulation and dp ranks
        n_tokens = torch.tensor(
            float(sum((b.labels != IGNORE_INDEX).sum() for b in batches)), device=env.device
        )
        if self.dims.dp > 1:
            dist.all_reduce(n_tokens, group=self.meshes.dp.get_group())
        # FSDP sums gradients over dp ranks (parallelisms/fsdp.py): each rank's CE sum / N,
        # times the loss scale (fp16; 1 otherwise), divided out again in the clipping multiply
        scale = self.scaler.scale
        ce_total = self.forward_backward(batches, scale / n_tokens)
        self.tied.sync_grads()  # a weight tied across pipeline stages: both copies get its gradient
        pp_group = self.meshes.pp.get_group() if self.dims.pp_enabled else None
        skip = self.tied.norm_skips()
        grad_norm = float(clip_grad_norm(self.params, r.train.max_norm, pp_group, 1.0 / scale, skip))
        # every last-stage rank holds its dp slice's sum; tp ranks hold copies of it. A stop
        # request (SIGTERM) rides along in the same all-reduce, so all ranks stop together.
        packed = torch.stack([ce_total, torch.tensor(float(self.stop.requested), device=env.device)])
        if dist.is_initialized():
            dist.all_reduce(packed)
            packed[0] /= self.dims.tp
        loss, stop = float(packed[0] / n_tokens), bool(packed[1] > 0)
        lr = self.schedulers[0].get_last_lr()[0]
        # loss and norm are reduced over all ranks, so every rank takes the same branch
        outcome = self.scaler.judge(loss, grad_norm)
        self.phase = "optimizer"
        if outcome == "ok":
            for opt, sched in zip(self.optimizers, self.schedulers):
                opt.step()
                sched.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": int(n_tokens.item()),
            "finite": outcome == "ok",
            "overflow": outcome == "overflow",
            "stop": stop,
            **self.scaler.metrics(scale),
        }

    # --- the run --------------------------------------------------------------------

    def run(self) -> RunState:
        r, env, st = self.recipe, self.env, self.state
        # launched here by meshforge: the launcher shows the run (run/launch/watch.py); else rank 0 does
        console = RunConsole(
            enabled=env.is_main and r.logging.progress and os.environ.get(LAUNCHED_ENV) != "launcher"
        )
        record = loggers = None
        if env.is_main:
            info = run_info(r, self.dims, env.device.type, self.n_params, pipeline_layout=self._layout())
            about = banner(
                r, self.dims, self.n_params, env.device.type, self._layout(), loss_floor(self.loader)
            )
            record, loggers = open_run(r, self.dims, info, console, about, self.resumed)
            console.start(about, self.run_dir, loggers.paths().get("wandb"))
            if self.schedule is not None:
                draw_pipeline(self.schedule, r, record, loggers, self.start_step)
        run_id = mfdist.broadcast_object(record.run_id if record else None)
        status, budget = "failed", BadStepBudget(r.train.max_bad_steps)
        try:
            with self.stop:
                step_end = time.perf_counter()
                for step in range(self.start_step + 1, r.train.steps + 1):
                    out, tracked = self._step(step, loggers, console)
                    if out["finite"] and self.evaluator.due(step):
                        out["eval"] = self.evaluator(self.forward_backward)
                    if not out["finite"]:  # logged first: the budget may end the run here, unsaved
                        self._record(
                            step, out, time.perf_counter() - step_end, tracked, None, loggers, console
                        )
                        console.note(overflow_note(step, out) if out["overflow"] else budget.spend(step, out))
                    saved_s = self.checkpointer.maybe_save(
                        step, step == r.train.steps, out["stop"], lambda: self._checkpoint_meta(step, run_id)
                    )
                    now = time.perf_counter()  # the step's time runs from the last one's end to here
                    if out["finite"]:
                        self._record(step, out, now - step_end, tracked, saved_s, loggers, console)
                    step_end = now
                    if out["stop"]:
                        self.checkpointer.wait()  # an async save of this step is committed before we end
                        status = "preempted"
                        raise self.stop.interrupted(step, self.checkpointer.latest() if saved_s else None)
            self.checkpointer.wait()
            status = "finished"
        except torch.OutOfMemoryError as e:
            status = "oom"
            report = self._report_oom(e, st.step + 1)
            if record:
                record.fail(report["message"])
            raise OutOfMemory(report["message"]) from e
        except BaseException as e:
            if record:
                record.fail(e)
            raise
        finally:
            self.loader.close()
            self.evaluator.close()
            if record:
                summary = self.summary()
                record.close(status, summary)
                log_final(loggers, r, self.state.per_rank_memory, self.checkpointer.latest())
                loggers.close(summary)
                console.finish(r.run_name, status, summary, self.run_dir, env.device.type, loggers.paths())
        return st

    def _step(self, step: int, loggers: Loggers | None, console: RunConsole) -> tuple[dict, bool]:
        """One training step (tracked by category on logging.memory_breakdown_step, and drawn),
        finished on the device; returns its outputs and whether it was tracked."""
        on_breakdown_step = step == self.recipe.logging.memory_breakdown_step
        if on_breakdown_step and self._breakdown_blocked:
            console.note(self._breakdown_blocked)
        tracked = on_breakdown_step and self._breakdown_blocked is None
        out = self._tracked_step(step) if tracked else self.train_step()
        if tracked and loggers is not None:
            draw_breakdown(self.state.memory_breakdown, self.recipe, step, loggers)
        if self.env.device.type == "cuda":
            torch.cuda.synchronize()
        return out, tracked

    def _record(self, step, out, dt, tracked, checkpoint_s: float | None, loggers, console) -> None:
        """Count the step's time for the summary (steady or excluded, and why) and log it."""
        r, st, evaluated, saved = self.recipe, self.state, "eval" in out, checkpoint_s is not None
        why = exclusion(step - self.start_step, r.logging.warmup_steps, tracked, saved, evaluated)
        st.step = step
        st.losses.append(out["loss"])
        st.times.append(StepTime(step, out["tokens"], dt, why))
        due = step % r.logging.log_every == 0 or step == r.train.steps
        if due or not out["finite"] or tracked or evaluated:
            metrics = self._metrics(step, out, dt)
            if checkpoint_s is not None:
                metrics["checkpoint_seconds"] = checkpoint_s
            if loggers is not None:
                loggers.log(metrics)
            console.update(step, metrics)
        if saved and loggers is not None:
            loggers.flush()  # a run killed later resumes from this checkpoint: its records up to it are kept

    def _tracked_step(self, step: int) -> dict:
        """A training step under torch's memory tracker: every rank's peak by category,
        logged (max/min over ranks), tabled at the end and drawn as a stacked bar per rank."""
        with tracked_step(self.pmodel.parts, self.optimizers, eager=self.recipe.compile.enabled) as tracker:
            out = self.train_step()
        reduced, per_rank = reduce_across_ranks(
            peak_categories(tracker), self.env.device, prefix="mem_breakdown/"
        )
        self.state.memory_breakdown, self.state.memory_breakdown_step = per_rank, step
        out["memory_breakdown"] = reduced
        return out

    def _report_oom(self, error: BaseException, step: int) -> dict:
        """Which rank, what phase, the estimate, and (CUDA) the allocator's snapshot, written
        beside the run's records (`oom-rank<r>.json`, `.pickle` for pytorch.org/memory_viz)."""
        estimate = make_plan(self.recipe).bytes_per_rank
        return dump_oom(self.run_dir, self.env.rank, self.env.device, step, self.phase, estimate, error)

    def _metrics(self, step: int, out: dict, dt: float) -> dict:
        state = state_bytes(model_state_tensors(self.pmodel.parts, self.optimizers))
        mem, per_rank = memory_metrics(rank_memory(self.env.device, state), self.env.device)
        self.state.last_memory, self.state.per_rank_memory = mem, per_rank
        return {
            "step": step,
            "loss": out["loss"],
            "grad_norm": out["grad_norm"],
            "lr": out["lr"],
            **self.throughput.rates(out["tokens"], dt),
            **{k: out[k] for k in ("loss_scale", "overflow_steps") if k in out},
            **mem,
            **out.get("memory_breakdown", {}),
            **out.get("eval", {}),
        }

    def _layout(self) -> list[list[int]] | None:
        return self.pmodel.layout if self.dims.pp_enabled else None

    def summary(self) -> dict:
        fp16 = self.scaler.metrics(self.scaler.scale)  # the final scale and overflow count (fp16)
        evaluated = {
            k.replace("/", "_"): v for k, v in self.evaluator.last.items()
        }  # eval_loss, eval_perplexity
        return {**summarize(self.state, self.throughput, loss_floor(self.loader)), **fp16, **evaluated}


def train(recipe: Recipe) -> RunState:
    """Train `recipe` in this process (one rank of the job); used by the launcher."""
    setup_logging()  # a spawned rank: the level the launcher was given (MESHFORGE_LOG_LEVEL)
    try:
        with quiet_embedding_view_warning():
            return Trainer(recipe).run()
    finally:
        mfdist.teardown()
