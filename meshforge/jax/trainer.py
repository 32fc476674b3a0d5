"""`run_recipe RECIPE backend=jax`: the same recipe trained in JAX, for side-by-side runs.

One controller process drives the recipe's mesh as JAX devices (on CPU,
--xla_force_host_platform_device_count=<world> is set before JAX starts). The weights
start from the torch model's own mesh-independent init, and every parameter is placed
with the PartitionSpec derived from the placements the torch run gives it (FSDP rows,
TP columns/rows), so XLA partitions the step the way the recipe says. Same data stream
(the global batch of every step), same loss (token sum / global token count), same
clipping rule and AdamW, same metric keys into the same records, so `meshforge compare`
reads both runs. Data and tensor parallel only: pipeline parallelism is refused at
validation.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from jax.sharding import NamedSharding, PartitionSpec

from meshforge.configs import Recipe, recipe_to_dict
from meshforge.core.errors import MachineError, NonFiniteLoss
from meshforge.core.topology import DP_DIMS, ParallelDims
from meshforge.jax.bridge import check_even, jax_mesh, jax_twin, placements_to_spec, state_to_pytree
from meshforge.jax.checkpoint import (
    Deferred,
    read_torch_checkpoint,
    scheduler_state,
    torch_mirror,
    with_adam_moments,
)
from meshforge.models import args_from_config, count_params, get_model_spec
from meshforge.run.checkpoint.dcp import Checkpointer, checkpoint_folder, resolve_load
from meshforge.run.checkpoint.state import ModelState, OptimizerState, say_optimizer_changes
from meshforge.run.data.global_batch import global_batch_loader
from meshforge.run.observe.describe import run_info
from meshforge.run.observe.flops import cpu_share, flops_per_token, peak_matmul_flops, usable_cores
from meshforge.run.observe.memory import memory_metrics, rank_memory
from meshforge.run.observe.record import RunState, Throughput
from meshforge.run.rank.distributed import DistEnv
from meshforge.run.train.evaluate import Evaluator, held_out_recipe
from meshforge.run.train.lifecycle import StepResult, TrainingRun
from meshforge.run.train.optim import lr_multiplier
from meshforge.run.train.step import IGNORE_INDEX
from meshforge.simulate.fake_rank import trace_pool
from meshforge.simulate.sharding import rank_slices


def torch_param_specs(recipe: Recipe) -> dict[str, PartitionSpec]:
    """Parameter name -> the PartitionSpec of the placements a torch run of the recipe uses
    (read off a simulated rank 0, in a fresh worker process)."""
    if ParallelDims.from_config(recipe.mesh).world_size == 1:
        return {}
    with trace_pool(1) as pool:
        slices = pool.submit(rank_slices, recipe, 0).result()
    return {
        fqn: placements_to_spec(s["placements"], s["mesh_dims"], len(s["shape"])) for fqn, s in slices.items()
    }


class JaxTrainer(TrainingRun):
    """The recipe's steps in JAX; the run around them (records, timing, summary) is the
    torch trainer's `TrainingRun`."""

    def __init__(self, recipe: Recipe):
        super().__init__()
        self.recipe = r = recipe
        self.dims = ParallelDims.from_config(r.mesh)
        world = self.dims.world_size
        if len(jax.devices()) < world:
            raise MachineError(
                [
                    f"the mesh ({self.dims.spelled()}) needs {world} JAX devices, JAX sees "
                    f"{len(jax.devices())}; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
                    f"{world} before JAX starts (run_recipe does), or use a smaller mesh"
                ]
            )
        self.env = DistEnv(0, 0, world, world, torch.device("cpu"))  # one controller, `world` devices
        self.mesh = jax_mesh(self.dims.degrees)
        self.model_args = args = args_from_config(r.model)
        model = get_model_spec(r.model.name).build(args)
        model.init_weights(r.seed)  # the torch run's init: bit-identical on every mesh
        self.n_params = count_params(model)
        state = {
            k: v for k, v in model.state_dict().items() if not (args.tie_embeddings and k == "output.weight")
        }
        specs = torch_param_specs(r)
        self.shardings = {}
        for name, t in state.items():
            spec = specs.get(name, PartitionSpec())
            check_even(tuple(t.shape), spec, self.mesh)
            self.shardings[name] = NamedSharding(self.mesh, spec)
        self.params = {k: jax.device_put(v, self.shardings[k]) for k, v in state_to_pytree(state).items()}
        del model, state
        o = r.optimizer
        self.tx = optax.inject_hyperparams(optax.adamw)(
            learning_rate=o.lr, b1=o.betas[0], b2=o.betas[1], eps=o.eps, weight_decay=o.weight_decay
        )
        self.opt_state = self.tx.init(self.params)
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec(DP_DIMS))
        # the whole global batch each step: every dp rank's data as the torch run's ranks read it
        self.loader = global_batch_loader(r, args.vocab_size, self.dims.dp)
        held_out = (
            global_batch_loader(held_out_recipe(r), args.vocab_size, self.dims.dp) if r.eval.every else None
        )
        self.evaluator = Evaluator(r, args.vocab_size, 0, 1, None, torch.device("cpu"), held_out)
        # bf16 as FSDP's MixedPrecisionPolicy does it: fp32 master weights, cast for the step's compute
        self.compute_dtype = jnp.bfloat16 if r.fsdp.param_dtype == "bfloat16" else None
        peak = None
        if jax.default_backend() == "cpu":  # the world's devices share this process's cores
            rate = _jax_matmul_flops(self.compute_dtype or jnp.float32)
            peak = rate * cpu_share(world, torch.get_num_threads(), usable_cores())
        self.throughput = Throughput(
            flops_per_token(args, r.train.seq_len, self.n_params), world, peak, "cpu"
        )
        self.run_dir = Path(r.output_dir) / r.run_name
        self._mirror = None  # (torch model, AdamW): what a save writes, made at the save (_checkpoint_meta)
        self.checkpointer = Checkpointer(
            r.checkpoint,
            checkpoint_folder(r.checkpoint, self.run_dir),
            model=Deferred(lambda: ModelState([self._mirror[0]])),
            optim=Deferred(lambda: OptimizerState([self._mirror[0]], [self._mirror[1]])),
            is_main=True,
            need_bytes=12 * self.n_params,
        )
        self._restore()
        self.state = RunState(step=self.start_step)
        self._token_ce_sum = jax_twin(args).token_ce_sum
        self._step = jax.jit(self._train_step, donate_argnums=(0, 1))
        self._eval_ce = jax.jit(lambda p, tokens, labels: self._ce_sum(p, tokens, labels)[0])

    def _ce_sum(self, params, tokens, labels):
        """The batch's token cross-entropy sum and token count, computed in the recipe's dtype."""
        if self.compute_dtype is not None:  # the gradient flows back to the fp32 masters through the cast
            params = jax.tree.map(lambda x: x.astype(self.compute_dtype), params)
        return self._token_ce_sum(params, tokens, labels, self.model_args, IGNORE_INDEX)

    def evaluate(self, batches) -> torch.Tensor:
        """The held-out batches' cross-entropy sum (Evaluator's forward)."""
        total = 0.0
        for b in batches:
            tokens, labels = (self._on_mesh(t) for t in (b.inputs, b.labels))
            total += float(self._eval_ce(self.params, tokens, labels))
        return torch.tensor(total)

    def _on_mesh(self, t: torch.Tensor) -> jax.Array:
        return jax.device_put(t.numpy().astype(np.int32), self.batch_sharding)

    def close_sources(self) -> None:
        self.loader.close()
        self.evaluator.close()

    def _restore(self) -> None:
        """`checkpoint.load`: a torch run's checkpoint continued here, optimizer and data position
        included (jax/checkpoint.py); else `checkpoint.init_from`: its weights only (as the torch
        trainer: also under `load=auto` before the run's first checkpoint)."""
        c = self.recipe.checkpoint
        shapes = {k: tuple(v.shape) for k, v in self.params.items()}
        path = resolve_load(c.load, checkpoint_folder(c, self.run_dir)) if c.load else None
        if c.load == "auto" and path is None:  # a fresh start that continues this run's records
            self.resumed = {"path": None, "step": 0, "run_id": None}
        if path is not None:
            saved = read_torch_checkpoint(path, self.recipe, self.model_args, shapes)
            say_optimizer_changes(saved.optimizer_changes)
            self.opt_state = with_adam_moments(
                self.opt_state, saved.mu, saved.nu, saved.adam_step, self.shardings
            )
            self.loader.restore_from(saved.meta)
            self.start_step = saved.meta["step"]
            self.resumed = {"path": str(path), "step": self.start_step, "run_id": saved.meta.get("run_id")}
        elif c.init_from:
            path = resolve_load(c.init_from, Path(c.init_from), "checkpoint.init_from")
            saved = read_torch_checkpoint(path, self.recipe, self.model_args, shapes, weights_only=True)
        else:
            return
        self.params = {k: jax.device_put(v, self.shardings[k]) for k, v in saved.params.items()}

    def _checkpoint_meta(self, step: int) -> dict:
        """The torch trainer's meta.json for `step`; makes the torch mirror the save then writes."""
        r = self.recipe
        # the next step's lr: what torch's scheduler leaves in the optimizer after `step` steps
        lr = r.optimizer.lr * lr_multiplier(step, r.train.steps, r.lr_scheduler)
        adam = self.opt_state.inner_state[0]
        params, mu, nu = jax.device_get((self.params, adam.mu, adam.nu))
        self._mirror = torch_mirror(r, self.model_args, params, mu, nu, int(adam.count), lr)
        return {
            "step": step,
            **self.loader.checkpoint_state(),
            "lr_scheduler": scheduler_state(r, step, lr),
            "loss_scale": None,
            "run_id": self.run_id,
            "mesh": self.dims.degrees,
            "recipe": recipe_to_dict(r),
            "model_args": dataclasses.asdict(self.model_args),
            "backend": "jax",
        }

    def after_step(self, step: int, result: StepResult) -> float | None:
        """Evaluation when due, then the torch trainer's checkpoint policy (interval, the end, a
        stop signal)."""
        if self.evaluator.due(step):
            result.eval = self.evaluator(self)
        seconds = self.checkpointer.maybe_save(
            step, last=self.is_last(step), stopping=result.stop, meta=lambda: self._checkpoint_meta(step)
        )
        self._mirror = None
        return seconds

    def latest_checkpoint(self) -> Path | None:
        return self.checkpointer.latest()

    def _train_step(self, params, opt_state, tokens, labels):
        max_norm = self.recipe.train.max_norm
        ce_sum = functools.partial(self._ce_sum, tokens=tokens, labels=labels)
        (total, n_tokens), grads = jax.value_and_grad(ce_sum, has_aux=True)(params)
        grads = jax.tree.map(lambda g: g / n_tokens, grads)
        norm = optax.global_norm(grads)
        if max_norm > 0:  # the torch trainer's rule: scale by max_norm / (norm + 1e-6) when that is < 1
            grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, max_norm / (norm + 1e-6)), grads)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, total / n_tokens, norm, n_tokens

    def train_step(self, step: int) -> StepResult:
        r = self.recipe
        (batch,) = self.loader.next_step()
        lr = r.optimizer.lr * lr_multiplier(step - 1, r.train.steps, r.lr_scheduler)
        self.opt_state.hyperparams["learning_rate"] = jnp.asarray(lr, dtype=jnp.float32)
        tokens, labels = self._on_mesh(batch.inputs), self._on_mesh(batch.labels)
        self.params, self.opt_state, loss, norm, _ = self._step(self.params, self.opt_state, tokens, labels)
        # The one host read a step makes: the non-finite guard. It also waits for the step, which
        # JAX dispatches asynchronously, so the step's time ends where the step does.
        if not bool(jnp.isfinite(loss) & jnp.isfinite(norm)):
            raise NonFiniteLoss(f"non-finite loss ({float(loss)}) at step {step} (backend=jax)")
        n_tokens = int((batch.labels != IGNORE_INDEX).sum())  # the step's count, read off the host batch
        # one controller: a stop signal (SIGTERM, Ctrl-C) ends the run after this step
        return StepResult(loss=loss, grad_norm=norm, lr=lr, tokens=n_tokens, stop=self.stop.requested)

    def run_info(self) -> dict:
        specs = {k: str(s.spec) for k, s in self.shardings.items()}
        versions = {"jax": jax.__version__, "optax": optax.__version__}
        r, backend = self.recipe, jax.default_backend()
        info = run_info(r, self.dims, backend, self.n_params, backend="jax", param_specs=specs)
        return {**info, "versions": versions}

    def memory(self) -> tuple[dict, list]:
        """One controller process: its memory, no per-rank rows."""
        params, moments = (
            sum(x.nbytes for x in jax.tree.leaves(t) if hasattr(x, "nbytes"))
            for t in (self.params, self.opt_state)
        )
        state_bytes = 2 * params + moments  # a gradient per parameter, of its size: freed after the update
        mem, _ = memory_metrics(rank_memory(self.env.device, state_bytes), self.env.device)
        return mem, []


def train_jax(recipe: Recipe) -> RunState:
    """Train `recipe` with backend=jax in this process."""
    return JaxTrainer(recipe).run()


def _jax_matmul_flops(dtype) -> float:
    """XLA's own peak matmul rate in the compute dtype on one device: the MFU peak of a JAX run
    (XLA's CPU bf16 dot ran ~5x torch's fastest bf16 kernel here, so torch's rate was exceeded)."""

    def product_of(n: int, layout: tuple[bool, bool]):
        a, b = (jnp.ones((n, n), dtype) for _ in range(2))
        dot = jax.jit(lambda a, b: (a.T if layout[0] else a) @ (b.T if layout[1] else b))
        dot(a, b).block_until_ready()  # compiled before it is timed
        return lambda: dot(a, b).block_until_ready()

    return peak_matmul_flops(product_of)
