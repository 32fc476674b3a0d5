"""What a recipe will do, computed without training: the dry-run plan and the check that
this machine has what the recipe needs (devices, processes, memory) before starting."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from meshforge.configs import Recipe
from meshforge.core.topology import ParallelDims
from meshforge.core.units import GiB
from meshforge.models import args_from_config, count_params, get_model_spec
from meshforge.models.common.moe import expert_params, has_experts, unpicked_params
from meshforge.parallelisms.pp import stage_layout
from meshforge.run.rank.analytic import activation_bytes, optimizer_states, placed_state_bytes
from meshforge.run.rank.env import host_memory_bytes


@dataclass
class Plan:
    n_params: int
    args: object  # the model family's resolved args
    dims: ParallelDims
    global_batch: int
    micro_batch: int
    grad_accum: int
    tokens_per_step: int
    layout: list[list[int]] | None
    state_bytes_per_rank: float  # analytic, on the device: fp32 params + grads + AdamW moments, sharded
    activation_bytes_per_rank: float  # rough: see activation_bytes()
    host_state_bytes_per_rank: float = 0.0  # the model states fsdp.cpu_offload keeps on the host

    @property
    def bytes_per_rank(self) -> float:
        """Device memory per rank: model states not offloaded, and activations."""
        return self.state_bytes_per_rank + self.activation_bytes_per_rank

    @property
    def active(self) -> str:
        """A mixture of experts' active parameters per token (empty for a dense model)."""
        unpicked = unpicked_params(self.args)
        return f", {self.n_params - unpicked:,} active per token" if unpicked else ""

    def rows(self, r: Recipe) -> list[tuple[str, str]]:
        d = self.dims
        rows = [
            ("model", f"{model_source(r)}: {self.n_params:,} parameters{self.active}"),
            ("shape", describe_shape(self.args)),
            ("mesh", ", ".join(f"{k}={v}" for k, v in d.degrees.items()) + f"  (world size {d.world_size})"),
            (
                "batch",
                f"global {self.global_batch} = micro {self.micro_batch} x accum {self.grad_accum} "
                f"x dp {d.dp}",
            ),
            ("tokens/step", f"{self.tokens_per_step:,} (seq_len {r.train.seq_len})"),
            ("steps", str(r.train.steps)),
            (
                "model states/rank",
                f"{(self.state_bytes_per_rank + self.host_state_bytes_per_rank) / GiB:.2f} GiB (fp32 "
                f"params+grads+AdamW, sharded over dp_shard x cp x tp x pp = {d.fsdp_shard * d.tp * d.pp}"
                + (
                    "; experts over dp_shard x cp x pp: tp ranks hold them whole)"
                    if expert_params(self.args)
                    else ")"
                )
                + ", on the host (fsdp.cpu_offload)" * bool(self.host_state_bytes_per_rank),
            ),
            (
                "activations/rank",
                f"~{self.activation_bytes_per_rank / GiB:.2f} GiB (rough; incl. fp32 logits)",
            ),
        ]
        if self.layout is not None:
            rows.append(
                (
                    "pipeline",
                    f"{r.pp.schedule}, {r.pp.microbatches} microbatches, stages -> layers: "
                    + "; ".join(
                        f"{s}: {ids[0]}-{ids[-1]}" if ids else f"{s}: -" for s, ids in enumerate(self.layout)
                    ),
                )
            )
        return rows


def model_source(r: Recipe) -> str:
    """Where the model's shape comes from: its registry flavor or an HF folder."""
    return f"{r.model.name} from {r.model.hf}" if r.model.hf else f"{r.model.name}/{r.model.flavor}"


def describe_shape(a) -> str:
    """The resolved shape on one line: what the model really is, overrides applied (a family whose
    attention is not this shape's, e.g. DeepSeek-V3's MLA, describes itself)."""
    if hasattr(a, "describe"):
        return a.describe()
    rope = f"RoPE theta {a.rope_theta:g}"
    if a.rope_scaling_factor is not None:
        rope += f" x{a.rope_scaling_factor:g} (llama3, from {a.rope_original_max_seq_len})"
    ffn = f"FFN {a.ffn_hidden_dim}"
    if has_experts(a):
        dense = a.n_layers - a.n_moe_layers
        dense_ffn = f"dense FFN {a.ffn_hidden_dim} in {dense}" if dense else "no dense FFN"
        ffn = (
            f"MoE in {a.n_moe_layers} layers: {a.num_experts} experts of {a.moe_dim}, "
            f"top-{a.num_experts_per_tok} ({a.load_balance}), {dense_ffn}"
        )
    return (
        f"dim {a.dim}, {a.n_layers} layers, {a.n_heads} heads / {a.kv_heads} kv of {a.head_dim}, "
        f"{ffn}, vocab {a.vocab_size}, eps {a.norm_eps:g}, {rope}, "
        f"{'tied' if a.tie_embeddings else 'untied'} embeddings, max_seq_len {a.max_seq_len}"
    )


def make_plan(r: Recipe) -> Plan:
    args = args_from_config(r.model)
    with torch.device("meta"):
        n_params = count_params(get_model_spec(r.model.name).build(args))
    dims = ParallelDims.from_config(r.mesh)
    layout = stage_layout(args.n_layers, dims.pp * r.pp.stages_per_rank, r.pp) if dims.pp_enabled else None
    states = optimizer_states(r.optimizer, args, n_params)
    device_states, host_states = placed_state_bytes(
        n_params, dims, r.fsdp.cpu_offload, expert_params(args), states
    )
    return Plan(
        n_params=n_params,
        args=args,
        dims=dims,
        global_batch=r.train.global_batch_size,
        micro_batch=r.train.micro_batch_size,
        grad_accum=r.train.grad_accum_steps,
        tokens_per_step=r.train.global_batch_size * r.train.seq_len,
        layout=layout,
        state_bytes_per_rank=device_states,
        activation_bytes_per_rank=activation_bytes(r, args, dims),
        host_state_bytes_per_rank=host_states,
    )


def check_machine(plan: Plan, device_type: str, launching_locally: bool) -> list[str]:
    """What this machine lacks for the recipe; empty if it can start."""
    problems = []
    world = plan.dims.world_size
    if device_type == "cuda" and not torch.cuda.is_available():
        problems.append(
            "the recipe asks for CUDA (train.device='cuda') but no GPU is visible here; "
            "override train.device=cpu to run on CPU processes"
        )
    if (
        device_type == "cuda"
        and torch.cuda.is_available()
        and launching_locally
        and world > torch.cuda.device_count()
    ):
        problems.append(
            f"the mesh needs {world} GPUs on this node but {torch.cuda.device_count()} are visible; "
            "use torchrun across nodes, or shrink the mesh (e.g. mesh.dp_shard=-1 --nproc "
            f"{torch.cuda.device_count()})"
        )
    local = world if launching_locally else int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if device_type == "cuda" and torch.cuda.is_available():
        have = torch.cuda.get_device_properties(0).total_memory
        need = plan.bytes_per_rank
        if need > have:
            problems.append(
                f"model states and activations need about {need / GiB:.1f} GiB per GPU but a GPU has "
                f"{have / GiB:.1f} GiB; shard more (mesh.dp_shard, mesh.tp, mesh.pp; mesh.cp splits the "
                "sequence), lower train.micro_batch_size or train.seq_len, or use "
                "activation_checkpoint.mode=full"
            )
        offloaded, host = plan.host_state_bytes_per_rank * local, host_memory_bytes()
        if offloaded > 0.7 * host:
            problems.append(
                f"{local} process(es) keep about {offloaded / GiB:.1f} GiB of model states on the host "
                f"(fsdp.cpu_offload) but this machine has {host / GiB:.1f} GiB; shard over more nodes "
                "(mesh.dp_shard) or turn fsdp.cpu_offload off"
            )
    elif device_type == "cpu":  # the device is the host: offloaded states count as well
        need = (plan.bytes_per_rank + plan.host_state_bytes_per_rank) * local
        have = host_memory_bytes()
        if need > 0.7 * have:
            problems.append(
                f"{local} process(es) need about {need / GiB:.1f} GiB (model states + activations) but "
                f"this machine has {have / GiB:.1f} GiB; shrink the model for a CPU run, e.g. "
                "model.n_layers=2 model.dim=256 model.n_heads=8 model.n_kv_heads=2 model.vocab_size=4096 "
                "train.seq_len=128 train.micro_batch_size=2 (the recipe's header has the full command)"
            )
    return problems
