"""The training loop, for one process or one rank of many.

Flow: process group -> DeviceMesh -> model on meta -> parallelize (PP, TP, AC, compile,
FSDP) -> materialize weights (mesh-independent) -> optimizer + schedule -> sharded data
-> steps. The loss is the sum of token cross-entropies divided by the number of target
tokens in the whole global batch, so losses and gradients match across mesh shapes.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import time
import uuid
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import meshforge
from meshforge import distributed as mfdist
from meshforge.configs import Recipe, recipe_to_dict
from meshforge.configs.validate import ZERO_BUBBLE_SCHEDULES
from meshforge.checkpoint import Checkpointer, ModelState, OptimizerState, check_writable, resolve_load
from meshforge.configs.schema import LRSchedulerConfig, OptimizerConfig
from meshforge.console import RunConsole
from meshforge.data import ShardedLoader, build_source, loss_floor
from meshforge.flops import flops_per_token, gpu_peak_flops, measure_cpu_matmul_flops
from meshforge.loggers import Loggers, write_json_atomic
from meshforge.memory import model_state_tensors, rank_memory, reduce_across_ranks, start_memory_history, state_bytes
from meshforge.models import args_from_config, count_params, get_model_spec
from meshforge.parallelisms import ParallelDims, materialize, parallelize
from meshforge.parallelisms.fsdp import DTYPES
from meshforge.parallelisms.pp import build_schedule

IGNORE_INDEX = -100
# Our blocks add to the embedding output out of place, the case this warning is about.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor")


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of token cross-entropies: the caller divides by the global count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX)


def step_context(recipe: Recipe, dims: ParallelDims, device_type: str) -> contextlib.ExitStack:
    """What a training step's forward and backward run under: loss parallel (TP), and
    autocast when reduced precision has no FSDP MixedPrecisionPolicy to carry it."""
    stack = contextlib.ExitStack()
    if dims.tp_enabled and recipe.tp.loss_parallel:
        stack.enter_context(loss_parallel())
    if not dims.fsdp_enabled and recipe.fsdp.param_dtype != "float32":
        stack.enter_context(torch.autocast(device_type, dtype=DTYPES[recipe.fsdp.param_dtype]))
    return stack


def build_optimizer(params, cfg: OptimizerConfig, foreach: bool | None = None) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                             foreach=foreach)


def lr_multiplier(step: int, total: int, cfg: LRSchedulerConfig) -> float:
    """Linear warmup to 1, then cosine/linear decay to min_lr_ratio (step counts from 0)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    floor = cfg.min_lr_ratio
    if cfg.decay == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.decay == "linear":
        return 1 - (1 - floor) * progress
    return 1.0


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float, pp_group=None) -> torch.Tensor:
    """Global L2 norm of all gradients (clipped to max_norm if > 0), correct on every mesh.

    Norms are taken per DeviceMesh, since torch refuses to combine DTensors of two
    meshes (FSDP x TP without sequence parallel has both), then summed in squares and,
    under pipeline parallel, across stages.
    """
    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict = defaultdict(list)
    for g in grads:
        by_mesh[g.device_mesh if isinstance(g, DTensor) else None].append(g)
    device = grads[0].device if grads else torch.device("cpu")
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        total_sq += norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0:
        coef = max_norm / (float(total) + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return total


@dataclass
class RunState:
    step: int = 0
    losses: list[float] = field(default_factory=list)
    tokens_per_sec: list[float] = field(default_factory=list)
    last_memory: dict = field(default_factory=dict)
    per_rank_memory: list = field(default_factory=list)
    memory_breakdown: list = field(default_factory=list)  # per rank: category -> bytes at the tracked step's peak
    memory_breakdown_step: int = 0


class Trainer:
    def __init__(self, recipe: Recipe):
        self.recipe = r = recipe
        self.env = mfdist.setup(r.train.device, r.train.cpu_threads)
        if r.logging.memory_history:
            start_memory_history(self.env.device)
        self.dims = ParallelDims.from_config(r.mesh)
        if self.dims.world_size != self.env.world_size:
            raise RuntimeError(f"mesh {self.dims.degrees} needs {self.dims.world_size} ranks, running {self.env.world_size}")
        torch.manual_seed(r.seed)
        if r.train.deterministic:
            torch.use_deterministic_algorithms(True)
        self.meshes = self.dims.build_mesh(self.env.device.type) if self.env.world_size > 1 else None

        # model on meta -> parallelize -> materialize
        self.spec = get_model_spec(r.model.name)
        self.model_args = args_from_config(r.model)
        with torch.device("meta"):
            model = self.spec.build(self.model_args)
        self.n_params = count_params(model)
        self.pmodel = parallelize(model, self.meshes, self.dims, self.spec, tp=r.tp, pp=r.pp,
                                  ac=r.activation_checkpoint, compile=r.compile, fsdp=r.fsdp)
        for part in self.pmodel.parts:
            materialize(part, self.env.device, r.seed)
            part.train()
        self.params = [p for part in self.pmodel.parts for p in part.parameters()]

        # one optimizer per model part, so checkpoints key optimizer state by FQN per stage
        self.optimizers = [build_optimizer(part.parameters(), r.optimizer) for part in self.pmodel.parts]
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, r.train.steps, r.lr_scheduler))
                           for opt in self.optimizers]

        # data: this rank's dp coordinate decides its slice of every global batch
        dp_rank = self.meshes.dp.get_local_rank() if self.meshes is not None else 0
        self.source = build_source(r.data, self.model_args.vocab_size, r.train.seq_len)
        self.loader = ShardedLoader(self.source, r.train.micro_batch_size, r.train.grad_accum_steps, dp_rank, self.dims.dp)

        self.n_stages = self.dims.pp * r.pp.stages_per_rank
        self.has_first = 0 in self.pmodel.stage_ids
        self.has_last = (self.n_stages - 1) in self.pmodel.stage_ids
        self.schedule = None
        self._ce_sums: list[torch.Tensor] = []
        if self.dims.pp_enabled:
            self.schedule = build_schedule(self.pmodel.parts, self.pmodel.stage_ids, self.meshes.pp, r.pp,
                                           self.env.device, self._pipeline_loss)
        self.run_dir = Path(r.output_dir) / r.run_name
        self._setup_checkpoints()
        self.flops_per_token = flops_per_token(self.model_args, r.train.seq_len, self.n_params)
        self.peak_flops = self._device_peak_flops()
        self.state = RunState(step=self.start_step)
        self._stop_requested = False
        self.phase = "setup"  # what the step is doing, for an out-of-memory report
        self._breakdown_blocked = None
        if self.dims.pp_enabled and r.pp.schedule in ZERO_BUBBLE_SCHEDULES:
            self._breakdown_blocked = (
                f"no memory-by-category step under {r.pp.schedule}: its split backward runs torch.autograd.grad, "
                "which torch's MemTracker hooks cannot follow (meshforge estimate still traces it)")

    def _device_peak_flops(self) -> float | None:
        """Per-device peak: the GPU's datasheet number, or this CPU's measured matmul rate
        (rank 0 measures once; every rank uses its figure)."""
        if self.env.device.type == "cuda":
            dtype = "bfloat16" if self.recipe.fsdp.param_dtype == "bfloat16" else "float32"
            return gpu_peak_flops(self.env.device, dtype)
        peak = torch.tensor(measure_cpu_matmul_flops() if self.env.is_main else 0.0, dtype=torch.float64)
        if dist.is_initialized():
            dist.broadcast(peak, src=0)
        return float(peak)

    # --- checkpoints ------------------------------------------------------------------

    def _setup_checkpoints(self) -> None:
        """Seed weights or resume state (any mesh), and a writable place for new checkpoints."""
        c = self.recipe.checkpoint
        folder = Path(c.folder) if Path(c.folder).is_absolute() else self.run_dir / c.folder
        self.checkpointer = Checkpointer(c, folder, ModelState(self.pmodel.parts),
                                         OptimizerState(self.pmodel.parts, self.optimizers), self.env.is_main)
        if c.enabled and self.env.is_main:
            check_writable(folder, need_bytes=12 * self.n_params)  # fp32 params + AdamW moments
        self.start_step, self.resumed = 0, None
        path = resolve_load(c.load, folder) if c.load else None
        if path is not None:
            meta = self.checkpointer.load(path)
            self.start_step = meta["step"]
            self.loader.load_state_dict({"position": meta["data_position"]})
            for sched in self.schedulers:
                sched.load_state_dict(meta["lr_scheduler"])
            self.resumed = {"path": str(path), "step": meta["step"], "run_id": meta.get("run_id")}
        elif c.init_from:
            self.checkpointer.load(resolve_load(c.init_from, Path(c.init_from)), model_only=True)
        elif c.init_from_hf:
            from meshforge.interop import hf_reader_for, load_into

            reader = hf_reader_for(Path(c.init_from_hf), self.model_args)
            for part in self.pmodel.parts:
                load_into(part, reader)

    def save_checkpoint(self, step: int, run_id: str | None) -> None:
        self.checkpointer.save(step, {
            "step": step, "data_position": self.loader.position, "lr_scheduler": self.schedulers[0].state_dict(),
            "run_id": run_id, "mesh": self.dims.degrees, "recipe": recipe_to_dict(self.recipe),
        })

    # --- one step -------------------------------------------------------------------

    def _pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ce = cross_entropy_sum(logits, labels)
        self._ce_sums.append(ce.detach())
        return ce * self._loss_scale

    def train_step(self) -> dict:
        r, env = self.recipe, self.env
        batches = self.loader.next_step()
        # the global number of target tokens, summed over accumulation and dp ranks
        n_tokens = torch.tensor(float(sum((b.labels != IGNORE_INDEX).sum() for b in batches)), device=env.device)
        if self.dims.dp > 1:
            dist.all_reduce(n_tokens, group=self.meshes.dp.get_group())
        # FSDP averages gradients over dp ranks; multiplying by dp turns that into a sum
        self._loss_scale = self.dims.dp / n_tokens
        self._ce_sums = []
        ce_total = torch.zeros((), device=env.device)
        for b in batches:
            inputs, labels = b.inputs.to(env.device), b.labels.to(env.device)
            with step_context(r, self.dims, env.device.type):
                if self.schedule is not None:
                    self.phase = "forward/backward (pipeline schedule)"
                    kwargs = {"target": labels, "losses": []} if self.has_last else {}
                    args = (inputs,) if self.has_first else ()
                    before = len(self._ce_sums)
                    self.schedule.step(*args, **kwargs)
                    # the first step's shape inference also calls the loss on dummy data: keep the real ones
                    real = self._ce_sums[before:][-self.recipe.pp.microbatches:] if self.has_last else []
                    self._ce_sums[before:] = real
                else:
                    self.phase = "forward"
                    ce = cross_entropy_sum(self.pmodel.parts[0](inputs), labels)
                    self.phase = "backward"
                    (ce * self._loss_scale).backward()
                    self._ce_sums.append(ce.detach())
        for ce in self._ce_sums:
            ce_total += ce.full_tensor() if isinstance(ce, DTensor) else ce
        pp_group = self.meshes.pp.get_group() if self.dims.pp_enabled else None
        grad_norm = float(clip_grad_norm(self.params, r.train.max_norm, pp_group))
        # every last-stage rank holds its dp slice's sum; tp ranks hold copies of it. A stop
        # request (SIGTERM) rides along in the same all-reduce, so all ranks stop together.
        packed = torch.stack([ce_total, torch.tensor(float(self._stop_requested), device=env.device)])
        if dist.is_initialized():
            dist.all_reduce(packed)
            packed[0] /= self.dims.tp
        loss, stop = float(packed[0] / n_tokens), bool(packed[1] > 0)
        lr = self.schedulers[0].get_last_lr()[0]
        # loss and norm are reduced over all ranks, so every rank takes the same branch
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        self.phase = "optimizer"
        if finite:
            for opt, sched in zip(self.optimizers, self.schedulers):
                opt.step()
                sched.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": int(n_tokens.item()), "finite": finite,
                "stop": stop}

    # --- the run --------------------------------------------------------------------

    def run(self) -> RunState:
        r, env, st = self.recipe, self.env, self.state
        run_dir = self.run_dir
        console = RunConsole(enabled=env.is_main and r.logging.progress)
        loggers, run_info = None, {}
        if env.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            run_info = self._run_info(run_dir)
            if self.resumed is not None:
                # the record continues: steps after the checkpoint will be logged again
                truncate_metrics(run_dir / "metrics.jsonl", self.start_step)
            write_json_atomic(run_dir / "run.json", run_info)
            # flat mesh keys let the W&B UI group and plot runs by layout
            config = {**recipe_to_dict(r), **self.dims.degrees, "world_size": env.world_size, "layout": self.dims.label()}
            loggers = Loggers(r.logging, run_dir, r.run_name, run_info["run_id"], config, console.console)
            console.start(self, run_dir)
            if self.schedule is not None:
                self._draw_pipeline(run_dir, run_info, loggers)
        run_id = self._broadcast_run_id(run_info.get("run_id"))
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        status, bad_steps = "failed", 0
        try:
            for step in range(self.start_step + 1, r.train.steps + 1):
                t0 = time.perf_counter()
                tracked = step == r.logging.memory_breakdown_step and self._breakdown_blocked is None
                if step == r.logging.memory_breakdown_step and self._breakdown_blocked:
                    console.note(self._breakdown_blocked)
                out = self._tracked_step(step, loggers) if tracked else self.train_step()
                if env.device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                st.step = step
                st.losses.append(out["loss"])
                st.tokens_per_sec.append(out["tokens"] / dt)
                if step % r.logging.log_every == 0 or step == r.train.steps or not out["finite"] or tracked:
                    metrics = self._metrics(step, out, dt)
                    if loggers is not None:
                        loggers.log(metrics)
                    console.update(step, metrics)
                if not out["finite"]:
                    bad_steps += 1
                    if bad_steps > r.train.max_bad_steps:
                        raise FloatingPointError(
                            f"non-finite loss ({out['loss']}) or grad norm ({out['grad_norm']}) at step {step}; the "
                            f"update was not applied. Lower optimizer.lr, check the data, or allow skipping with "
                            f"train.max_bad_steps (now {r.train.max_bad_steps})")
                    console.note(f"step {step}: non-finite loss or grad norm, update skipped "
                                 f"({bad_steps}/{r.train.max_bad_steps} allowed)")
                c = r.checkpoint
                if c.enabled and (step % c.interval == 0 or (c.save_at_end and step == r.train.steps)):
                    self.save_checkpoint(step, run_id)
                if out["stop"]:
                    if c.enabled and step % c.interval != 0 and step != r.train.steps:
                        self.save_checkpoint(step, run_id)
                    status = "preempted"
                    raise Preempted(f"stopped by a signal after step {step}"
                                    + ("; checkpoint saved, resume with checkpoint.load=latest" if c.enabled else ""))
            self.checkpointer.wait()
            status = "finished"
        except torch.OutOfMemoryError as e:
            status = "oom"
            report = self._report_oom(e, st.step + 1)
            run_info["error"] = report["message"]
            raise OutOfMemory(report["message"]) from e
        except BaseException as e:
            run_info["error"] = f"{type(e).__name__}: {e}"
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if env.is_main:
                summary = self.summary()
                run_info.update(status=status, end_time=time.time(), summary=summary)
                write_json_atomic(run_dir / "run.json", run_info)
                loggers.close(summary)
                console.finish(self, run_dir, loggers, status)
        return st

    def _draw_pipeline(self, run_dir: Path, run_info: dict, loggers: Loggers) -> None:
        """The schedule that runs, per rank, as a picture (run folder and W&B) and a bubble figure."""
        from meshforge.pp_schedule import bubble_fraction, pipeline_order, timeline

        order = pipeline_order(self.schedule)
        run_info["pp_bubble_fraction"] = bubble_fraction(order)
        fig = timeline(order, f"{self.recipe.pp.schedule}, {self.recipe.pp.microbatches} microbatches")
        fig.savefig(run_dir / "pp_schedule.png", dpi=100, bbox_inches="tight")
        loggers.log_figure("pp_schedule", fig, self.start_step)
        fig.clf()

    def _tracked_step(self, step: int, loggers: Loggers | None) -> dict:
        """A training step under torch's memory tracker: every rank's peak by category,
        logged (max/min over ranks), tabled at the end and drawn as a stacked bar per rank."""
        from meshforge.memtrace import make_tracker, peak_categories, save_breakdown

        tracker = make_tracker(self.pmodel.parts, self.optimizers)
        # torch.compile cannot run under a dispatch mode: this one step runs eagerly (as the
        # estimator traces it), so under compile the figures are the eager step's
        eager = torch.compiler.set_stance("force_eager") if self.recipe.compile.enabled else contextlib.nullcontext()
        with eager, tracker:
            out = self.train_step()
        reduced, per_rank = reduce_across_ranks(peak_categories(tracker), self.env.device, prefix="mem_breakdown/")
        self.state.memory_breakdown, self.state.memory_breakdown_step = per_rank, step
        out["memory_breakdown"] = reduced
        if loggers is not None:
            fig = save_breakdown(per_rank, self.run_dir / "memory_breakdown.png",
                                 f"{self.recipe.run_name}: memory by category at step {step}")
            loggers.log_figure("memory_breakdown", fig, step)
            fig.clf()
        return out

    def _report_oom(self, error: BaseException, step: int) -> dict:
        """Which rank, what phase, the estimate, and (CUDA) the allocator's snapshot, written
        beside the run's records (`oom-rank<r>.json`, `.pickle` for pytorch.org/memory_viz)."""
        from meshforge.memory import dump_oom
        from meshforge.plan import make_plan

        estimate = make_plan(self.recipe).bytes_per_rank
        return dump_oom(self.run_dir, self.env.rank, self.env.device, step, self.phase, estimate, error)

    def _request_stop(self, signum, frame) -> None:
        self._stop_requested = True  # acted on at the end of the step, on every rank together

    def _broadcast_run_id(self, run_id: str | None) -> str | None:
        if not dist.is_initialized():
            return run_id
        box = [run_id]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _metrics(self, step: int, out: dict, dt: float) -> dict:
        state = state_bytes(model_state_tensors(self.pmodel.parts, self.optimizers))
        mem, per_rank = reduce_across_ranks(rank_memory(self.env.device, state), self.env.device)
        self.state.last_memory, self.state.per_rank_memory = mem, per_rank
        tokens_per_sec = out["tokens"] / dt
        flops_per_device = self.flops_per_token * tokens_per_sec / self.env.world_size
        perf = {"tflops_per_device": flops_per_device / 1e12}
        if self.peak_flops:
            perf["mfu"] = flops_per_device / self.peak_flops
        return {"step": step, "loss": out["loss"], "grad_norm": out["grad_norm"], "lr": out["lr"],
                "tokens_per_sec": tokens_per_sec, "step_time": dt, **perf, **mem, **out.get("memory_breakdown", {})}

    def summary(self) -> dict:
        st = self.state
        steady = st.tokens_per_sec[1:] or st.tokens_per_sec  # the first step pays for warm-up
        out = {"steps": st.step}
        if st.losses:
            tps = sum(steady) / len(steady)
            out.update(final_loss=st.losses[-1], best_loss=min(st.losses), tokens_per_sec=tps,
                       tflops_per_device=self.flops_per_token * tps / self.env.world_size / 1e12)
            if self.peak_flops:
                out["mfu"] = out["tflops_per_device"] * 1e12 / self.peak_flops
                out["peak_tflops_per_device"] = self.peak_flops / 1e12
        floor = loss_floor(self.source)
        if floor is not None:
            out["loss_floor"] = floor
        if st.per_rank_memory:
            out["per_rank_memory"] = st.per_rank_memory
        if st.memory_breakdown:
            out["memory_breakdown"] = {"step": st.memory_breakdown_step, "per_rank": st.memory_breakdown}
        peak_key = "mem/cuda_peak_active_max" if self.env.device.type == "cuda" else "mem/rss_peak_max"
        if peak_key in st.last_memory:
            out["peak_memory_bytes"] = st.last_memory[peak_key]
        return out

    def _run_info(self, run_dir: Path) -> dict:
        resumed = self.resumed or {}
        return {
            "run_id": resumed.get("run_id") or f"{self.recipe.run_name}-{uuid.uuid4().hex[:8]}",
            "resumed_from": resumed.get("path"),
            "run_name": self.recipe.run_name,
            "status": "running",
            "start_time": time.time(),
            "recipe": recipe_to_dict(self.recipe),
            "mesh": self.dims.degrees,
            "world_size": self.env.world_size,
            "device": str(self.env.device.type),
            "n_params": self.n_params,
            "pipeline_layout": self.pmodel.layout if self.dims.pp_enabled else None,
            "versions": {"meshforge": meshforge.__version__, "torch": torch.__version__},
            "records": {"metrics": str(run_dir / "metrics.jsonl")},
        }


class OutOfMemory(RuntimeError):
    """A rank ran out of device memory; the report says where and what to change."""


class Preempted(RuntimeError):
    """The run was stopped by SIGTERM/SIGINT (after saving a checkpoint when enabled)."""


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only records up to `last_step`, so a resumed run logs every step exactly once."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)


def train(recipe: Recipe) -> RunState:
    """Train `recipe` in this process (one rank of the job); used by the launcher."""
    try:
        return Trainer(recipe).run()
    finally:
        mfdist.teardown()
