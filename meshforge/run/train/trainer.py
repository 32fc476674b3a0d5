"""The training loop, for one process or one rank of many.

Flow: process group -> DeviceMesh -> model on meta -> parallelize (PP, TP, AC, compile,
FSDP) -> materialize weights (mesh-independent) -> optimizer + schedule -> sharded data
-> steps. The loss is the sum of token cross-entropies divided by the number of target
tokens in the whole global batch, so losses and gradients match across mesh shapes.
Each component owns its policy: the checkpointer when to save, the record run.json, the
console what the terminal shows; the run around the steps (records, timing, logging, the
summary, the closes) is `TrainingRun`'s (lifecycle.py), shared with the JAX trainer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

from meshforge.configs import Recipe, ac_policy, recipe_to_dict
from meshforge.core.logs import setup_logging
from meshforge.core.seeding import seed_process
from meshforge.core.topology import ParallelDims
from meshforge.models import args_from_config, count_params, get_model_spec
from meshforge.parallelisms import build_meshes, check_parameter_count, materialize, parallelize
from meshforge.parallelisms.cp import sequence_shard
from meshforge.parallelisms.fsdp import quiet_embedding_view_warning
from meshforge.parallelisms.pp import ZERO_BUBBLE_SCHEDULES, build_schedule
from meshforge.parallelisms.tied import tie_across_stages
from meshforge.run.checkpoint.dcp import Checkpointer, checkpoint_folder
from meshforge.run.checkpoint.state import ModelState, OptimizerState
from meshforge.run.observe.describe import draw_breakdown, draw_pipeline, run_info
from meshforge.run.observe.flops import device_peak_flops, flops_per_token
from meshforge.run.observe.loggers import LoggerContainer
from meshforge.run.observe.memory import (
    dump_oom,
    memory_metrics,
    model_state_bytes,
    rank_memory,
    start_memory_history,
)
from meshforge.run.observe.memtrace import in_gib, peak_categories, tracked_step
from meshforge.run.observe.profile import DATA, OPTIMIZER, PARTS, StepProfiler
from meshforge.run.observe.record import RunRecord, RunState, Throughput
from meshforge.run.rank import distributed as mfdist
from meshforge.run.rank.plan import make_plan
from meshforge.run.train.evaluate import data_streams
from meshforge.run.train.forward_backward import ForwardBackward, Phase, PipelineLoss
from meshforge.run.train.guards import BadStepBudget
from meshforge.run.train.lifecycle import StepResult, TrainingRun
from meshforge.run.train.loss_scale import LossScaler, overflow_note
from meshforge.run.train.moe_stats import MoEStats
from meshforge.run.train.optim import build_lr_scheduler, build_optimizer, group_summary
from meshforge.run.train.step import IGNORE_INDEX, StepPolicy, clip_grad_norm


class Trainer(TrainingRun):
    def __init__(self, recipe: Recipe):
        super().__init__()
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
            cp=r.cp,
            seq_len=r.train.seq_len,
            device_type=self.env.device.type,
            ac=r.activation_checkpoint,
            compile=r.compile,
            fsdp=r.fsdp,
            float8=r.float8,
        )
        for part in self.pmodel.parts:
            materialize(part, self.env.device, r.seed, params_on_cpu=r.fsdp.cpu_offload)
            part.train()
        self.params = [p for part in self.pmodel.parts for p in part.parameters()]
        self.pp_group = self.meshes.pp.get_group() if self.dims.pp_enabled else None
        root = self.meshes.root if self.meshes else None
        self.tied = tie_across_stages(self.pmodel.parts, self.pmodel.stage_ids, root, r.pp, self.env.device)
        check_parameter_count(self.pmodel.parts, self.n_params, self.env.device, self.pp_group, self.tied)

        # one optimizer per model part, so checkpoints key optimizer state by FQN per stage
        self.optimizers = [
            build_optimizer(part.named_parameters(), r.optimizer) for part in self.pmodel.parts
        ]
        self.schedulers = [build_lr_scheduler(opt, r.train.steps, r.lr_scheduler) for opt in self.optimizers]
        self.scaler = LossScaler(r.loss_scale, enabled=r.fsdp.param_dtype == "float16")
        self.budget = BadStepBudget(r.train.max_bad_steps)

        vocab = self.model_args.vocab_size
        self.loader, self.evaluator = data_streams(r, vocab, self.meshes, self.dims, self.env.device)
        self.forward_backward, self.schedule = self._build_forward_backward()
        self.moe = MoEStats(self.pmodel.parts, self.model_args, r.train.seq_len, r.train.global_batch_size)
        self.run_dir = Path(r.output_dir) / r.run_name
        c = r.checkpoint
        folder = checkpoint_folder(c, self.run_dir)
        self.checkpointer = Checkpointer(
            c,
            folder,
            model=ModelState(self.pmodel.parts),
            optim=OptimizerState(self.pmodel.parts, self.optimizers),
            is_main=self.env.is_main,
            need_bytes=12 * self.n_params,
        )
        self.resumed = self.checkpointer.restore(
            self.pmodel.parts, self.model_args, self.loader, self.schedulers, self.scaler, r.optimizer
        )
        self.start_step = self.resumed["step"] if self.resumed else 0
        if self.resumed and self.resumed["path"]:
            self.moe.check_restored(self.resumed["path"])
        self.throughput = Throughput(
            flops_per_token(self.model_args, r.train.seq_len, self.n_params),
            self.env.world_size,
            device_peak_flops(self.env, r.fsdp.param_dtype),
            self.env.device.type,
        )
        self.state = RunState(step=self.start_step)
        self.profiler = StepProfiler(r.profile, self.run_dir, self.env.rank, self.env.device)
        self.profile_breakdown: dict = {}
        self._breakdown_blocked = None
        if self.dims.pp_enabled and r.pp.schedule in ZERO_BUBBLE_SCHEDULES:
            self._breakdown_blocked = (
                f"no memory-by-category step under {r.pp.schedule}: its split backward runs "
                "torch.autograd.grad, which torch's MemTracker hooks cannot follow (meshforge estimate "
                "still traces it)"
            )

    def _build_forward_backward(self):
        """The step's forwards and backwards, whole: under pipeline parallelism the schedule
        (which calls the loss) and the ForwardBackward (which reads it) share one PipelineLoss."""
        r, ids = self.recipe, self.pmodel.stage_ids
        policy = StepPolicy.of(self.dims, r.tp, r.fsdp)
        shard = sequence_shard(self.meshes.cp if self.meshes else None)
        if not self.dims.pp_enabled:
            parts = self.pmodel.parts
            return ForwardBackward(parts=parts, policy=policy, device=self.env.device, shard=shard), None
        loss = PipelineLoss()
        schedule = build_schedule(self.pmodel.parts, ids, self.meshes.pp, r.pp, self.env.device, loss)
        n_stages = self.dims.pp * r.pp.stages_per_rank
        forward_backward = ForwardBackward(
            parts=self.pmodel.parts,
            policy=policy,
            device=self.env.device,
            schedule=schedule,
            loss=loss,
            has_first=0 in ids,
            has_last=n_stages - 1 in ids,
            microbatches=r.pp.microbatches,
            shard=shard,
        )
        return forward_backward, schedule

    # --- checkpoints ------------------------------------------------------------------

    def _checkpoint_meta(self, step: int) -> dict:
        return {
            "step": step,
            **self.loader.checkpoint_state(),  # a corpus gathers every dp rank's position (a collective)
            "lr_scheduler": self.schedulers[0].state_dict(),
            "loss_scale": self.scaler.state_dict() if self.scaler.enabled else None,
            "run_id": self.run_id,
            "mesh": self.dims.degrees,
            "recipe": recipe_to_dict(self.recipe),
            "model_args": dataclasses.asdict(self.model_args),  # the resolved shape (model.hf may move)
        }

    def latest_checkpoint(self) -> Path | None:
        return self.checkpointer.latest()

    def finish(self) -> None:
        self.checkpointer.wait()

    # --- one step -------------------------------------------------------------------

    def train_step(self, step: int) -> StepResult:
        """One training step (tracked by category on logging.memory_breakdown_step, and drawn),
        finished on the device."""
        on_breakdown_step = step == self.recipe.logging.memory_breakdown_step
        if on_breakdown_step and self._breakdown_blocked:
            self.console.note(self._breakdown_blocked)
        if on_breakdown_step and ac_policy(self.recipe.activation_checkpoint).by_compiler:
            self.console.note(
                "memory by category runs its step eager (a dispatch mode cannot watch a compiled graph): "
                "the memory budget's recomputation is not in its activations"
            )
        with self.profiler.step(step):
            if on_breakdown_step and self._breakdown_blocked is None:
                result = self._tracked_step(step)
            else:
                result = self._step()
            if self.env.device.type == "cuda":
                torch.cuda.synchronize()
        result.profiled = self.profiler.active(step)
        parts = self.profiler.finish(step)
        if parts is not None:
            result.profile = self._profile_metrics(parts)
        return result

    def _profile_metrics(self, parts: dict) -> dict:
        """The profiled steps' seconds by part, the slowest rank's of each (every rank reduces)."""
        values = torch.tensor([parts[k] for k in PARTS], dtype=torch.float64, device=self.env.device)
        if dist.is_initialized():
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        self.profile_breakdown = {f"profile_{k}": v for k, v in zip(PARTS, values.tolist())}
        return {f"profile/{k}": v for k, v in zip(PARTS, values.tolist())}

    def _step(self) -> StepResult:
        r, env = self.recipe, self.env
        with record_function(DATA):
            batches = self.loader.next_step()
        # the global number of target tokens, summed over accumulation and dp ranks (counted before
        # cp takes its part: every cp rank of a dp rank reads the same samples)
        n_tokens = torch.tensor(
            float(sum((b.labels != IGNORE_INDEX).sum() for b in batches)), device=env.device
        )
        if self.dims.dp > 1:
            dist.all_reduce(n_tokens, group=self.meshes.dp.get_group())
        # FSDP sums gradients over dp ranks (parallelisms/fsdp.py): each rank's CE sum / N,
        # times the loss scale (fp16; 1 otherwise), divided out again in the clipping multiply
        scale = self.scaler.scale
        if self.moe.enabled:
            self.moe.begin(scale)
        ce_total = self.forward_backward(batches, scale / n_tokens)
        self.tied.sync_grads()  # a weight tied across pipeline stages: both copies get its gradient
        skip = self.tied.norm_skips()
        grad_norm = clip_grad_norm(self.params, r.train.max_norm, self.pp_group, 1.0 / scale, skip)
        # every last-stage rank holds its dp slice's sum (of its cp part's tokens); tp ranks hold
        # copies of it. A stop request (SIGTERM) rides along in the same all-reduce, so all ranks
        # stop together.
        # and so do the MoE layers' statistics (per-expert loads, aux loss, rows computed)
        packed = torch.stack([ce_total, torch.tensor(float(self.stop.requested), device=env.device)])
        moe_stats = self.moe.local(env.device).flatten() if self.moe.enabled else packed[:0]
        packed = torch.cat([packed, moe_stats])
        if dist.is_initialized():
            dist.all_reduce(packed)
            packed[0] /= self.dims.tp
            packed[2:] /= self.dims.tp
        loss = packed[0] / n_tokens
        moe_stats = packed[2:].view(self.model_args.n_layers, -1) if self.moe.enabled else None
        # The one host read a step must make (a sync on a GPU): whether to apply the update (a
        # finite loss and grad norm; the fp16 loss scale's schedule), a stop request and the token
        # count. Loss and grad norm themselves stay on the device until a logging step reads them.
        host = [loss.isfinite(), grad_norm.to(env.device).isfinite(), packed[1] > 0, n_tokens]
        loss_finite, grads_finite, stop, tokens = torch.stack([x.float() for x in host]).tolist()
        lr = self.schedulers[0].get_last_lr()[0]
        # loss and norm are reduced over all ranks, so every rank takes the same branch
        outcome = self.scaler.judge(loss_finite=bool(loss_finite), grads_finite=bool(grads_finite))
        self.forward_backward.phase = Phase.OPTIMIZER
        with record_function(OPTIMIZER):
            if outcome == "ok":
                for opt, sched in zip(self.optimizers, self.schedulers):
                    opt.step()
                    sched.step()
                if moe_stats is not None:
                    self.moe.update_bias(moe_stats)
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
        return StepResult(
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            tokens=int(tokens),
            finite=outcome == "ok",
            overflow=outcome == "overflow",
            stop=bool(stop),
            loss_scale=self.scaler.metrics(scale),
            extra=moe_stats,
        )

    def _tracked_step(self, step: int) -> StepResult:
        """A training step under torch's memory tracker: every rank's peak by category,
        logged (max/min over ranks), tabled at the end and drawn as a stacked bar per rank."""
        with tracked_step(self.pmodel.parts, self.optimizers, eager=self.recipe.compile.enabled) as tracker:
            result = self._step()
        reduced, per_rank = memory_metrics(
            in_gib(peak_categories(tracker)), self.env.device, prefix="mem_breakdown"
        )
        self.state.memory_breakdown, self.state.memory_breakdown_step = per_rank, step
        result.tracked, result.memory_breakdown = True, reduced
        if self.loggers is not None:
            draw_breakdown(per_rank, self.recipe, step, self.loggers)
        return result

    def after_step(self, step: int, result: StepResult) -> float | None:
        """Evaluation when due, a non-finite step's note (or the end of the run when over
        train.max_bad_steps, before anything is saved), the checkpoint policy."""
        if result.finite and self.evaluator.due(step):
            result.eval = self.evaluator(self.forward_backward)
        if result.overflow:
            self.console.note(overflow_note(step, result.loss_scale))
        elif not result.finite:
            self.console.note(self.budget.spend(step, float(result.loss), float(result.grad_norm)))
        return self.checkpointer.maybe_save(
            step, last=self.is_last(step), stopping=result.stop, meta=lambda: self._checkpoint_meta(step)
        )

    # --- what the lifecycle asks --------------------------------------------------------

    def run_info(self) -> dict:
        device, layout = self.env.device.type, self.layout()
        named = [np for part in self.pmodel.parts for np in part.named_parameters()]
        groups = group_summary(named, self.recipe.optimizer)
        return run_info(
            self.recipe, self.dims, device, self.n_params, pipeline_layout=layout, optimizer_groups=groups
        )

    def on_open(self, record: RunRecord, loggers: LoggerContainer) -> None:
        if self.schedule is not None:
            draw_pipeline(self.schedule, self.recipe, record, loggers, self.start_step)

    def oom_report(self, error: BaseException, step: int) -> str:
        """Which rank, what phase, the estimate, and (CUDA) the allocator's snapshot, written
        beside the run's records (`oom-rank<r>.json`, `.pickle` for pytorch.org/memory_viz)."""
        estimate = make_plan(self.recipe).bytes_per_rank
        phase = self.forward_backward.phase.value
        report = dump_oom(self.run_dir, self.env.rank, self.env.device, step, phase, estimate, error)
        return report["message"]

    def memory(self) -> tuple[dict, list]:
        state = model_state_bytes(self.pmodel.parts, self.optimizers)
        return memory_metrics(rank_memory(self.env.device, state), self.env.device)

    def close_sources(self) -> None:
        self.loader.close()
        self.evaluator.close()

    def layout(self) -> list[list[int]] | None:
        return self.pmodel.layout if self.dims.pp_enabled else None

    def extra_metrics(self, result: StepResult) -> dict:
        return self.moe.metrics(result.extra) if result.extra is not None else {}

    def summary_extra(self) -> dict:
        fp16 = self.scaler.metrics(self.scaler.scale)  # the final scale and overflow count (fp16)
        evaluated = {k.replace("/", "_"): v for k, v in self.evaluator.last.items()}  # eval_loss, ...
        return {**fp16, **evaluated, **self.profile_breakdown}


def train(recipe: Recipe) -> RunState:
    """Train `recipe` in this process (one rank of the job); used by the launcher."""
    setup_logging()  # a spawned rank: the level the launcher was given (MESHFORGE_LOG_LEVEL)
    try:
        with quiet_embedding_view_warning():
            return Trainer(recipe).run()
    finally:
        mfdist.teardown()
