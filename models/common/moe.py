"""Mixture-of-experts pieces a family composes (TorchTitan's `models/common/moe` shape): a top-k
router (softmax, or DeepSeek-V3's sigmoid within expert groups), grouped experts (one 3-D weight
per projection), optional shared experts, and the MoE feed-forward that routes, dispatches,
computes and combines.

Dropless: every token reaches each of its top-k experts (no capacity factor). Expert parallelism
(parallelisms/ep.py) sets `MoE.dispatcher`, which sends each token to the rank that holds its
expert and back; without it every expert is local.

The load-balancing loss is transformers' (Switch Transformer's): E * sum_e f_e P_e, f_e the
expert's picks over the tokens (summing to k over the experts), P_e its mean router probability:
a perfectly balanced router gives k (2.0 at top-2), so `moe/aux_loss` is read against k. transformers pools f
and P over a forward's whole batch (the micro-batch of one device) and over every layer at once,
so its value depends on how a batch is split over devices and microbatches. Here it is taken per
sequence and per MoE layer and averaged over both: a property of the weights and the data, equal on
every mesh (a pipeline stage cannot see later layers' choices before its backward; a cp rank adds
the other ranks' counts of its sequence, `sequence_group`). On one sequence and one MoE layer it is
transformers' number exactly. Its gradient enters backward through the block's output
(`_AuxGradient`), so a pipeline stage needs no second output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from meshforge.core.tensors import local_tensor

from .decoder import FeedForward

LOAD_BALANCE = ("aux_loss", "aux_free")


@dataclass(frozen=True)
class Balancing:
    """How an MoE model balances its experts (`model.load_balance`), asked by every reader rather
    than compared by name: `aux_loss` adds the loss term above, weighted by router_aux_loss_coef;
    `aux_free` (DeepSeek-V3's) routes with a selection bias moved toward under-loaded experts and
    adds no loss."""

    mode: str

    @property
    def adds_loss(self) -> bool:
        return self.mode == "aux_loss"

    @property
    def routes_with_bias(self) -> bool:
        return self.mode == "aux_free"

    def unread_setting(self) -> tuple[str, str] | None:
        """The [model] setting this mode does not read, and why (None for an unknown mode)."""
        if self.adds_loss:
            return "bias_update_rate", "moves no bias"
        if self.routes_with_bias:
            return "router_aux_loss_coef", "has no loss term"
        return None


_counted = [True]  # False while a forward is not a step's (a pipeline stage's shape inference)


@contextlib.contextmanager
def uncounted():
    """Forwards that are not a training step's (torch's pipeline stages run one on their first step
    to learn shapes): no statistics kept, no aux gradient attached."""
    before, _counted[0] = _counted[0], False
    try:
        yield
    finally:
        _counted[0] = before


def _step_forward() -> bool:
    """A training step's own forward: grad on, not activation checkpointing's recompute in
    backward, not a pipeline's shape inference."""
    return torch.is_grad_enabled() and _counted[0] and torch._C._current_graph_task_id() == -1


class Router(nn.Module):
    """Scores over experts (softmax, or DeepSeek-V3's sigmoid), top-k of them (selected with
    `expert_bias` added when balancing without a loss, and within the `topk_group` best of `n_group`
    expert groups when grouped, DeepSeek-V3; weighted by the scores alone), renormalised when
    `norm_topk_prob`, times `scaling` (DeepSeek-V3's routed_scaling_factor)."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        score_func: str = "softmax",
        n_group: int = 1,
        topk_group: int = 1,
        scaling: float = 1.0,
    ):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.score_func, self.n_group, self.topk_group, self.scaling = (
            score_func,
            n_group,
            topk_group,
            scaling,
        )

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None):
        """x (T, D) -> weights (T, k) in x's dtype, expert ids (T, k), probabilities (T, E) fp32
        (sigmoid scores normalised to sum to one: what the aux loss reads)."""
        logits = self.gate(x)
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(logits.float())
            probs = scores / scores.sum(dim=-1, keepdim=True)
        else:
            scores = probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        chooser = scores if expert_bias is None else scores + expert_bias
        if self.n_group > 1:
            chooser = self._within_best_groups(chooser)
        experts = torch.topk(chooser, self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return weights.to(logits.dtype), experts, probs

    def _within_best_groups(self, chooser: torch.Tensor) -> torch.Tensor:
        """`chooser` with the experts outside each token's `topk_group` best groups at -inf; a
        group's score is the sum of its two best experts' (transformers' DeepseekV3TopkRouter)."""
        tokens, num_experts = chooser.shape
        grouped = chooser.view(tokens, self.n_group, num_experts // self.n_group)  # (T, G, E/G)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (T, G)
        best = torch.topk(group_scores, self.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(tokens, num_experts)


def balanced(rows: int, parts: int) -> list[int]:
    """`rows` split as evenly as can be: a fake tensor's counts (the estimator's trace) have no values,
    and the estimate assumes balanced routing."""
    share, extra = divmod(rows, parts)
    return [share + (i < extra) for i in range(parts)]


def grouped_mm_runs(x: torch.Tensor) -> bool:
    """Where torch 2.13 has a grouped matmul for `x`: on CPU in any float dtype, on CUDA in bfloat16
    (its kernel's only dtype; its meta function, which fake tensors run, says so too)."""
    return (x.device.type == "cpu" and not isinstance(x, FakeTensor)) or x.dtype == torch.bfloat16


class GroupedExperts(nn.Module):
    """E SwiGLU experts as three (E, out, in) weights: w2(silu(w1 x) * w3 x) per expert, on tokens
    sorted by expert. `grouped_mm`: one `F.grouped_mm` per projection where torch has one
    (`grouped_mm_runs`); else a loop over experts (the same products, one matmul each)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, grouped_mm: bool = True):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.grouped_mm = grouped_mm
        self.rows = 0

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (N, D) sorted by local expert, `counts` (E_local,) tokens per local expert -> (N, D)."""
        if _step_forward():
            self.rows += x.shape[0]  # the rows computed (the step's check that none was dropped)
        # this rank's experts: on an ep mesh the weights are DTensors sharded by expert
        w1, w2, w3 = (local_tensor(w) for w in (self.w1, self.w2, self.w3))
        if self.grouped_mm and grouped_mm_runs(x):
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)

            def mm(a, w):
                return F.grouped_mm(a, w.transpose(-2, -1), offs=offsets)

            return mm(F.silu(mm(x, w1)) * mm(x, w3), w2)
        outs = []
        sizes = balanced(x.shape[0], len(counts)) if isinstance(counts, FakeTensor) else counts.tolist()
        for e, part in enumerate(torch.split(x, sizes)):
            outs.append(F.linear(F.silu(F.linear(part, w1[e])) * F.linear(part, w3[e]), w2[e]))
        return torch.cat(outs)


class LocalExperts:
    """The dispatcher without expert parallelism: every expert is on this rank."""

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        return experts(x, counts)


class _AuxGradient(torch.autograd.Function):
    """Identity on `out`; in backward, `aux` gets the gradient `scale` (its weight in the loss):
    the aux loss trains the router without being a second output of the block (Megatron's
    MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, device=grad.device), None


class MoE(nn.Module):
    """Route, dispatch, compute, combine; keeps the step's per-expert loads and aux-loss sum."""

    # set by parallelisms: ep's token dispatcher, cp's group of ranks holding one sequence
    dispatcher: Callable = LocalExperts()
    sequence_group: dist.ProcessGroup | None = None

    def __init__(self, args):
        super().__init__()
        self.num_experts, self.top_k = args.num_experts, args.num_experts_per_tok
        # DeepSeek-V3's router options and shared experts; a family whose args lack them has neither
        self.router = Router(
            args.dim,
            args.num_experts,
            args.num_experts_per_tok,
            args.norm_topk_prob,
            score_func=getattr(args, "score_func", "softmax"),
            n_group=getattr(args, "n_group", 1),
            topk_group=getattr(args, "topk_group", 1),
            scaling=getattr(args, "routed_scaling_factor", 1.0),
        )
        self.experts = GroupedExperts(args.dim, args.moe_dim, args.num_experts, args.grouped_mm)
        n_shared = getattr(args, "n_shared_experts", 0)
        # the shared experts, one SwiGLU as wide as all of them, see every token (not split over ep)
        self.shared_experts = FeedForward(args.dim, args.moe_dim * n_shared) if n_shared else None
        self.aux_free = Balancing(args.load_balance).routes_with_bias
        # DeepSeek-V3's selection bias (read under aux_free only; moved by `update_expert_bias`). Saved
        # whatever the balancing, so a checkpoint loads under either and a trained bias is never dropped
        self.register_buffer("expert_bias", torch.zeros(args.num_experts))
        self.aux_grad_scale = 0.0  # the aux loss's weight in this step's loss (set by the step)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.load: torch.Tensor | None = None  # (E,) tokens routed to each expert this step
        self.aux_sum: torch.Tensor | None = None  # sum over this step's sequences of the aux loss
        self.experts.rows = 0  # rows the experts computed (on whichever rank: ep moves them)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, dim = x.shape
        tokens = x.reshape(-1, dim)
        weights, experts, probs = self.router(tokens, self.expert_bias if self.aux_free else None)
        flat = experts.flatten()  # (T k,): token t's choices at t k .. t k + k - 1
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.num_experts, dtype=flat.dtype, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )  # bincount's shape depends on the values: a fake tensor (the estimator) has none
        source = order // self.top_k  # the token each sorted row is a copy of
        out = self.dispatcher(tokens[source], counts, self.experts)
        out = out * weights.flatten()[order, None]
        combined = torch.zeros_like(tokens).index_add_(0, source, out.to(tokens.dtype))
        combined = combined.view(bsz, seqlen, dim)
        if self.shared_experts is not None:
            combined = combined + self.shared_experts(x)
        if torch.is_grad_enabled() and self.training and _counted[0]:
            aux = self._aux_loss(experts.view(bsz, seqlen, -1), probs.view(bsz, seqlen, -1))
            if _step_forward():  # not activation checkpointing's recompute (which keeps the gradient)
                self._keep_stats(counts, aux)
            combined = _AuxGradient.apply(combined, aux, self.aux_grad_scale)
        return combined

    def _aux_loss(self, experts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Sum over this rank's sequences of E * sum_e f_e P_e (its part, under cp: the counts of
        the whole sequence, its own tokens' probabilities; the cp ranks' parts add up)."""
        with torch.no_grad():
            picks = F.one_hot(experts, self.num_experts).sum(dim=(1, 2)).float()  # (B, E)
            length = experts.shape[1]
            if self.sequence_group is not None:
                dist.all_reduce(picks, group=self.sequence_group)
                length *= dist.get_world_size(self.sequence_group)
        f = picks / length
        p = probs.sum(dim=1) / length  # (B, E), this rank's tokens
        return self.num_experts * (f * p).sum()

    @torch.no_grad()
    def _keep_stats(self, counts: torch.Tensor, aux: torch.Tensor) -> None:
        self.load = counts.float() if self.load is None else self.load + counts
        self.aux_sum = aux.detach() if self.aux_sum is None else self.aux_sum + aux.detach()


def is_moe_layer(args, layer_id: int) -> bool:
    """transformers' rule: sparse unless in `mlp_only_layers`, every `decoder_sparse_step`-th layer."""
    return (
        layer_id not in args.mlp_only_layers
        and args.num_experts > 0
        and (layer_id + 1) % args.decoder_sparse_step == 0
    )


def has_experts(args) -> bool:
    """The model of `args` (any family's) has sparse layers: the one test of "is this a MoE"."""
    return getattr(args, "num_experts", 0) > 0 and args.n_moe_layers > 0


def expert_params(args) -> int:
    """Every expert weight of the model (0 for a dense one): what expert parallel splits."""
    return args.n_moe_layers * args.num_experts * 3 * args.dim * args.moe_dim if has_experts(args) else 0


def unpicked_params(args) -> int:
    """Expert weights a token does not compute with: the E - k experts its router did not pick, in
    every sparse layer (0 for a dense model). Active parameters = all of them minus these."""
    if not has_experts(args):
        return 0
    return expert_params(args) // args.num_experts * (args.num_experts - args.num_experts_per_tok)


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """Layer id -> its MoE, for the layers of `model` (a whole model or a pipeline stage)."""
    return {
        int(i): block.moe for i, block in model.layers.items() if isinstance(getattr(block, "moe", None), MoE)
    }


@torch.no_grad()
def update_expert_bias(moe: MoE, load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: after a step, raise the selection bias of
    experts that got fewer tokens than the mean and lower it for those that got more (`load`:
    the step's global per-expert counts)."""
    moe.expert_bias.add_(rate * torch.sign(load.mean() - load).to(moe.expert_bias.dtype))
